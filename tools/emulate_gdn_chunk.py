# Emulates models/src/cuda/gdn_chunk.cu's two kernels lane by lane in float64 (the m16n8k8
# fragment index math, the shared-memory strides, the per-chunk buffer layouts, the partial last
# chunk) and compares their outputs and last state with the token-by-token delta rule: a CPU
# check of the kernels' indexing for whoever changes them without a GPU at hand (the GPU check
# is `cuda::check::gdn_chunked_errors`, in the family bench's kernel_checks). Needs numpy;
# `python3 tools/emulate_gdn_chunk.py` prints errors ~1e-16 when the indexing is right.
import numpy as np
C, D, BV = 64, 128, 32
LD, LDX, LDK, LDS, LDP = 132, 264, 136, 40, 68
rng = np.random.default_rng(0)

def frag_a(x, ld, m0, k0):
    A = np.zeros((16, 8)); 
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = [x[(m0+g)*ld + k0+t], x[(m0+g+8)*ld + k0+t], x[(m0+g)*ld + k0+t+4], x[(m0+g+8)*ld + k0+t+4]]
        A[g, t], A[g+8, t], A[g, t+4], A[g+8, t+4] = a
    return A
def frag_a_t(x, ld, m0, k0):
    A = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = [x[(k0+t)*ld + m0+g], x[(k0+t)*ld + m0+g+8], x[(k0+t+4)*ld + m0+g], x[(k0+t+4)*ld + m0+g+8]]
        A[g, t], A[g+8, t], A[g, t+4], A[g+8, t+4] = a
    return A
def frag_b(x, ld, k0, n0):
    B = np.zeros((8, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        B[t, g] = x[(k0+t)*ld + n0+g]; B[t+4, g] = x[(k0+t+4)*ld + n0+g]
    return B
def frag_b_t(x, ld, k0, n0):
    B = np.zeros((8, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        B[t, g] = x[(n0+g)*ld + k0+t]; B[t+4, g] = x[(n0+g)*ld + k0+t+4]
    return B
# C fragment as a 16x8 tile; element e of lane (g, t) at row g + 8(e>>1), col 2t + (e&1)
def c_elems(tile):
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for e in range(4):
            r, c = g + 8*(e >> 1), 2*t + (e & 1)
            yield lane, e, r, c, tile[r, c]

def solve_kernel(q, k, v, g, beta, t, hk, hv, c, h, nc, out):
    U, W, Qp, PU, Gc = out
    ks = np.zeros(C*LD); qs = np.zeros(C*LD); xs = np.zeros(C*LDX); as_ = np.zeros(C*C); ps = np.zeros(C*LDP)
    gs = np.zeros(C); bs = np.zeros(C)
    kh = h // (hv // hk); row0 = c*C; n = min(C, t-row0)
    for i in range(C):
        for d in range(D):
            if i < n:
                ks[i*LD+d] = k[((row0+i)*hk+kh)*D+d]; qs[i*LD+d] = q[((row0+i)*hk+kh)*D+d]
    gg = np.array([g[(row0+i)*hv+h] if i < n else 0. for i in range(C)])
    gs[:] = np.cumsum(gg)
    bs[:] = [beta[(row0+i)*hv+h] if i < n else 0. for i in range(C)]
    for warp in range(8):
        lhs = ks if warp < 4 else qs
        m0 = (warp & 3)*16
        acc = [np.zeros((16, 8)) for _ in range(8)]
        for k0 in range(0, D, 8):
            a = frag_a(lhs, LD, m0, k0)
            for nt in range(8):
                acc[nt] += a @ frag_b_t(ks, LD, k0, nt*8)
        for nt in range(8):
            for lane, e, r, cc, val in c_elems(acc[nt]):
                fg, ft = lane >> 2, lane & 3
                i = m0 + fg + (e >> 1)*8; j = nt*8 + 2*ft + (e & 1)
                assert (i, j) == (m0 + r, nt*8 + cc)
                dec = np.exp(gs[i]-gs[j])
                if warp < 4: as_[i*C+j] = bs[i]*dec*val if j < i else 0.
                else: ps[i*LDP+j] = dec*val if j <= i else 0.
    for col in range(256):
        x = np.zeros(C)
        for i in range(C):
            if col < D: b = bs[i]*v[((row0+i)*hv+h)*D+col] if i < n else 0.
            else: b = bs[i]*np.exp(gs[i])*ks[i*LD+col-D]
            s = sum(as_[i*C+j]*x[j] for j in range(i))
            x[i] = b - s
        dst = U if col < D else W
        base = ((h*nc+c)*C)*D + (col & (D-1))
        for i in range(C):
            xs[i*LDX+col] = x[i]; dst[base + i*D] = x[i]
    for i in range(C): Gc[(h*nc+c)*C+i] = gs[i]
    for warp in range(8):
        m0 = (warp & 3)*16; half = warp >> 2
        acc = [np.zeros((16, 8)) for _ in range(16)]
        for k0 in range(0, C, 8):
            a = frag_a(ps, LDP, m0, k0)
            for nt in range(16):
                acc[nt] += a @ frag_b(xs, LDX, k0, half*D + nt*8)
        dst = PU if half == 0 else Qp
        base = ((h*nc+c)*C)*D
        for nt in range(16):
            for lane in range(32):
                fg, ft = lane >> 2, lane & 3
                for r in range(2):
                    i = m0 + fg + r*8; j = nt*8 + 2*ft
                    v0, v1 = acc[nt][fg + 8*r, 2*ft], acc[nt][fg + 8*r, 2*ft+1]
                    if half == 0: o = (v0, v1)
                    else:
                        e = np.exp(gs[i]); o = (qs[i*LD+j]*e - v0, qs[i*LD+j+1]*e - v1)
                    dst[base + i*D + j], dst[base + i*D + j + 1] = o

def scan_kernel(s0, k, U, W, Qp, PU, Gc, o, s_out, t, hk, hv, h, cb):
    col0 = cb*BV; kh = h // (hv // hk); nc = (t + C - 1)//C; head = h*D*D
    ws = np.zeros(C*LD); qs = np.zeros(C*LD); kd = np.zeros(C*LDK); ss = np.zeros(D*LDS); vn = np.zeros(C*LDS)
    # state kept as full per-warp tiles: stt[warp][mt][nt] 16x8
    stt = [[[np.zeros((16, 8)) for _ in range(4)] for _ in range(2)] for _ in range(4)]
    for warp in range(4):
        for mt in range(2):
            for nt in range(4):
                for lane in range(32):
                    fg, ft = lane >> 2, lane & 3
                    for e in range(4):
                        r = 32*warp + 16*mt + fg + 8*(e >> 1); cc = 8*nt + 2*ft + (e & 1)
                        stt[warp][mt][nt][fg + 8*(e >> 1), 2*ft + (e & 1)] = s0[head + r*D + col0 + cc]
                        ss[r*LDS+cc] = s0[head + r*D + col0 + cc]
    for c in range(nc):
        row0 = c*C; n = min(C, t-row0); blk = (h*nc+c)*C
        glast = Gc[blk + C-1]
        for i in range(C):
            for d in range(D):
                ws[i*LD+d] = W[(blk+i)*D+d]; qs[i*LD+d] = Qp[(blk+i)*D+d]
                kd[i*LDK+d] = k[((row0+i)*hk+kh)*D+d]*np.exp(glast-Gc[blk+i]) if i < n else 0.
        for warp in range(4):
            m0 = 16*warp
            av = [np.zeros((16, 8)) for _ in range(4)]; ao = [np.zeros((16, 8)) for _ in range(4)]
            for k0 in range(0, D, 8):
                aw = frag_a(ws, LD, m0, k0); aq = frag_a(qs, LD, m0, k0)
                for nt in range(4):
                    b = frag_b(ss, LDS, k0, nt*8); av[nt] += aw @ b; ao[nt] += aq @ b
            for nt in range(4):
                for lane in range(32):
                    fg, ft = lane >> 2, lane & 3
                    for r in range(2):
                        i = m0 + fg + 8*r; j = 8*nt + 2*ft
                        at = (blk + i)*D + col0 + j
                        vn[i*LDS+j] = U[at] - av[nt][fg+8*r, 2*ft]
                        vn[i*LDS+j+1] = U[at+1] - av[nt][fg+8*r, 2*ft+1]
                        if i < n:
                            oo = ((row0+i)*hv+h)*D + col0 + j
                            o[oo] = PU[at] + ao[nt][fg+8*r, 2*ft]; o[oo+1] = PU[at+1] + ao[nt][fg+8*r, 2*ft+1]
        dec = np.exp(glast)
        for warp in range(4):
            for mt in range(2):
                for nt in range(4): stt[warp][mt][nt] *= dec
            for k0 in range(0, C, 8):
                bb = [frag_b(vn, LDS, k0, nt*8) for nt in range(4)]
                for mt in range(2):
                    a = frag_a_t(kd, LDK, 32*warp + 16*mt, k0)
                    for nt in range(4): stt[warp][mt][nt] += a @ bb[nt]
        for warp in range(4):
            for mt in range(2):
                for nt in range(4):
                    for rr in range(16):
                        for cc in range(8):
                            ss[(32*warp + 16*mt + rr)*LDS + 8*nt + cc] = stt[warp][mt][nt][rr, cc]
    for warp in range(4):
        for mt in range(2):
            for nt in range(4):
                for rr in range(16):
                    for cc in range(8):
                        s_out[head + (32*warp+16*mt+rr)*D + col0 + 8*nt + cc] = stt[warp][mt][nt][rr, cc]

# small problem: hk=1, hv=2, t=150 (3 chunks, the last partial)
t, hk, hv = 150, 1, 2
q = rng.normal(size=(t, hk, D)); k = rng.normal(size=(t, hk, D))
q /= np.linalg.norm(q, axis=-1, keepdims=True); k /= np.linalg.norm(k, axis=-1, keepdims=True); q *= D**-0.5
v = rng.normal(size=(t, hv, D)); g = -rng.uniform(0.01, 0.5, size=(t, hv)); beta = rng.uniform(0, 1, size=(t, hv))
s0 = rng.normal(size=(hv, D, D))*0.1
# reference
S = s0.copy(); oref = np.zeros((t, hv, D))
for i in range(t):
    for h in range(hv):
        kk = k[i, h // (hv//hk)]; qq = q[i, h // (hv//hk)]
        S[h] *= np.exp(g[i, h])
        delta = beta[i, h]*(v[i, h] - S[h].T @ kk)
        S[h] += np.outer(kk, delta)
        oref[i, h] = S[h].T @ qq
nc = (t + C - 1)//C
bufs = [np.zeros(hv*nc*C*D) for _ in range(4)] + [np.zeros(hv*nc*C)]
qf, kf, vf, gf, bf = q.ravel(), k.ravel(), v.ravel(), g.ravel(), beta.ravel()
for c in range(nc):
    for h in range(hv):
        solve_kernel(qf, kf, vf, gf, bf, t, hk, hv, c, h, nc, bufs)
o = np.zeros(t*hv*D); s_out = np.zeros(hv*D*D)
for h in range(hv):
    for cb in range(D//BV):
        scan_kernel(s0.ravel(), kf, bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], o, s_out, t, hk, hv, h, cb)
print("o max err", np.abs(o - oref.ravel()).max(), "scale", np.abs(oref).max())
print("state max err", np.abs(s_out - S.ravel()).max(), "scale", np.abs(S).max())
