# Emulates models/src/cuda/gdn_chunk.cu's two kernels lane by lane (the m16n8k8 TF32 and
# m16n8k16 bf16 fragment index math, the shared-memory strides, the per-chunk buffer layouts,
# the partial last chunk) and compares their outputs and last state with the token-by-token
# delta rule: a CPU check of the kernels' indexing for whoever changes them without a GPU at
# hand (the GPU check is `cuda::check::gdn_chunked_errors`, in the family bench's
# kernel_checks). Needs numpy. `python3 tools/emulate_gdn_chunk.py` runs twice: in float64
# (errors ~1e-15 when the indexing is right) and with the kernels' TF32 / bf16 roundings (the
# errors the GPU check should see, ~1e-3 of the scale); each for a causal run of 150 tokens and
# for a 40-node verify tree (the ancestor-bit form, `cuda::gdn_tree_chunked`).
import numpy as np
C, D, BV = 64, 128, 64
LD, LDP, LDH, LDT = 132, 68, 136, 72
ROUND = False

def tf32(x):
    if not ROUND: return float(x)
    u = np.array([x], np.float32).view(np.uint32)[0].item()
    u = (u + 0x1000) & 0xffffe000
    return float(np.array([u], np.uint32).view(np.float32)[0])
def bf16(x):
    if not ROUND: return float(x)
    u = np.array([x], np.float32).view(np.uint32)[0].item()
    u = ((u + 0x7fff + ((u >> 16) & 1)) >> 16) << 16
    return float(np.array([u & 0xffffffff], np.uint32).view(np.float32)[0])
def f32(x):
    return float(np.float32(x)) if ROUND else float(x)

# TF32 m16n8k8 fragments (lane = 4g + t), as gc_a / gc_b / gc_b_t read them.
def frag_a(x, ld, m0, k0):
    A = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, t], A[g+8, t] = tf32(x[(m0+g)*ld + k0+t]), tf32(x[(m0+g+8)*ld + k0+t])
        A[g, t+4], A[g+8, t+4] = tf32(x[(m0+g)*ld + k0+t+4]), tf32(x[(m0+g+8)*ld + k0+t+4])
    return A
def frag_b(x, ld, k0, n0):
    B = np.zeros((8, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        B[t, g] = tf32(x[(k0+t)*ld + n0+g]); B[t+4, g] = tf32(x[(k0+t+4)*ld + n0+g])
    return B
def frag_b_t(x, ld, k0, n0):
    B = np.zeros((8, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        B[t, g] = tf32(x[(n0+g)*ld + k0+t]); B[t+4, g] = tf32(x[(n0+g)*ld + k0+t+4])
    return B
# bf16 m16n8k16 (gc_mma16): A (m, k) at a[m*lda + k], B (k, n) at b[n*ldb + k]; pairs.
def mma16(a, lda, m0, b, ldb, n0, k0):
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for (r, cc) in [(g, 2*t), (g+8, 2*t), (g, 2*t+8), (g+8, 2*t+8)]:
            A[r, cc] = a[(m0+r)*lda + k0+cc]; A[r, cc+1] = a[(m0+r)*lda + k0+cc+1]
        for kk in [2*t, 2*t+8]:
            B[kk, g] = b[(n0+g)*ldb + k0+kk]; B[kk+1, g] = b[(n0+g)*ldb + k0+kk+1]
    return A @ B
# C fragment element e of lane (g, t): row g + 8(e>>1), column 2t + (e&1).

def solve_kernel(q, k, v, g, beta, t, hk, hv, c, h, nc, out, anc=None):
    U, PU, W, Qp, KT, Gc = out
    ks = np.zeros(C*LD); qs = np.zeros(C*LD); as_ = np.zeros(C*C); ps = np.zeros(C*LDP)
    kh = h // (hv // hk); row0 = c*C; n = min(C, t-row0); blk = (h*nc + c)*C
    for i in range(n):
        for d in range(D):
            ks[i*LD+d] = k[((row0+i)*hk+kh)*D+d]; qs[i*LD+d] = q[((row0+i)*hk+kh)*D+d]
    graw = [g[(row0+i)*hv+h] if i < n else 0. for i in range(C)]
    if anc is None:
        gs = np.cumsum(graw)
    else:  # a tree: G along each node's root path, its ancestors' bits in ascending order
        ancs = [anc[i] if i < n else 0 for i in range(C)]
        gs = np.array([sum(graw[j] for j in range(C) if ancs[i] >> j & 1) for i in range(C)])
    bs = np.array([beta[(row0+i)*hv+h] if i < n else 0. for i in range(C)])
    for warp in range(8):
        lhs = ks if warp < 4 else qs
        m0 = (warp & 3)*16
        acc = [np.zeros((16, 8)) for _ in range(8)]
        for k0 in range(0, D, 8):
            a = frag_a(lhs, LD, m0, k0)
            for nt in range(8): acc[nt] += a @ frag_b_t(ks, LD, k0, nt*8)
        for nt in range(8):
            for lane in range(32):
                fg, ft = lane >> 2, lane & 3
                for e in range(4):
                    i = m0 + fg + (e >> 1)*8; j = nt*8 + 2*ft + (e & 1)
                    val = acc[nt][fg + 8*(e >> 1), 2*ft + (e & 1)]
                    dec = np.exp(gs[i]-gs[j])
                    seen = j <= i if anc is None else (ancs[i] >> j & 1) == 1
                    if warp < 4: as_[i*C+j] = f32(bs[i]*dec*val) if seen and j != i else 0.
                    else: ps[i*LDP+j] = f32(dec*val) if seen else 0.
    glast = gs[C-1]
    xs_cols = {}
    for tid in range(256):
        is_u = tid < 128; d = tid & (D-1)
        if is_u:
            x = [bs[i]*v[((row0+i)*hv+h)*D+d] if i < n else 0. for i in range(C)]
        else:
            x = [bs[i]*np.exp(gs[i])*ks[i*LD+d] for i in range(C)]
            for i in range(C):
                KT[((h*nc + c)*D + d)*C + i] = bf16(ks[i*LD+d]*np.exp(glast-gs[i]))
        for i in range(1, C):
            s = 0.
            for j in range(0, i, 4):
                for u in range(4): s += as_[i*C+j+u]*x[j+u]
            x[i] = f32(x[i] - s)
        xs_cols[tid] = x
        for i in range(C):
            if is_u: U[(blk+i)*D + d] = x[i]
            else: W[(blk+i)*D + d] = bf16(x[i])
    for tid, x in xs_cols.items():   # U into the queries' tile, W into the keys' (after the solve)
        for i in range(C): (qs if tid < 128 else ks)[i*LD + (tid & (D-1))] = x[i]
    for i in range(C): Gc[blk + i] = gs[i]
    for warp in range(8):
        m0 = (warp & 3)*16; is_u = warp < 4; rhs = qs if is_u else ks
        acc = [np.zeros((16, 8)) for _ in range(16)]
        for k0 in range(0, C, 8):
            a = frag_a(ps, LDP, m0, k0)
            for nt in range(16): acc[nt] += a @ frag_b(rhs, LD, k0, nt*8)
        for nt in range(16):
            for lane in range(32):
                fg, ft = lane >> 2, lane & 3
                for r in range(2):
                    i = m0 + fg + r*8; j = nt*8 + 2*ft; at = (blk+i)*D + j
                    v0, v1 = acc[nt][fg + 8*r, 2*ft], acc[nt][fg + 8*r, 2*ft+1]
                    if is_u: PU[at], PU[at+1] = f32(v0), f32(v1)
                    else:
                        qv = [q[((row0+i)*hk+kh)*D + j + u] if i < n else 0. for u in range(2)]
                        e = np.exp(gs[i])
                        Qp[at], Qp[at+1] = bf16(qv[0]*e - v0), bf16(qv[1]*e - v1)

def scan_kernel(s0, U, PU, W, Qp, KT, Gc, o, s_out, t, hv, h, cb, vn_out=None):
    col0 = cb*BV; nc = (t + C - 1)//C; head = h*D*D
    st_t = np.zeros(BV*LDH); vn_t = np.zeros(BV*LDT)
    st = np.zeros((8, 8, 16, 8))   # [warp][nt] 16x8 C tiles, f32 in the kernel
    for warp in range(8):
        for nt in range(8):
            for lane in range(32):
                fg, ft = lane >> 2, lane & 3
                for e in range(4):
                    r = 16*warp + fg + 8*(e >> 1); cc = 8*nt + 2*ft + (e & 1)
                    st[warp, nt, fg + 8*(e >> 1), 2*ft + (e & 1)] = s0[head + r*D + col0 + cc]
                    st_t[cc*LDH + r] = bf16(s0[head + r*D + col0 + cc])
    for c in range(nc):
        row0 = c*C; n = min(C, t-row0); blk = (h*nc + c)*C
        sw = np.zeros(C*LDH); sq = np.zeros(C*LDH); sk = np.zeros(D*LDT)
        for i in range(C):
            sw[i*LDH:i*LDH+D] = W[(blk+i)*D:(blk+i+1)*D]; sq[i*LDH:i*LDH+D] = Qp[(blk+i)*D:(blk+i+1)*D]
        kt0 = (h*nc + c)*D*C
        for r in range(D): sk[r*LDT:r*LDT+C] = KT[kt0 + r*C: kt0 + (r+1)*C]
        glast = Gc[blk + C-1]
        for warp in range(8):
            m0 = 16*(warp & 3); n0 = 32*(warp >> 2)
            av = [np.zeros((16, 8)) for _ in range(4)]; ao = [np.zeros((16, 8)) for _ in range(4)]
            for k0 in range(0, D, 16):
                for nt in range(4):
                    av[nt] += mma16(sw, LDH, m0, st_t, LDH, n0 + 8*nt, k0)
                    ao[nt] += mma16(sq, LDH, m0, st_t, LDH, n0 + 8*nt, k0)
            for nt in range(4):
                for lane in range(32):
                    fg, ft = lane >> 2, lane & 3
                    for r in range(2):
                        i = m0 + fg + 8*r; j = n0 + 8*nt + 2*ft; at = (blk+i)*D + col0 + j
                        vn_t[j*LDT + i] = bf16(U[at] - av[nt][fg+8*r, 2*ft])
                        vn_t[(j+1)*LDT + i] = bf16(U[at+1] - av[nt][fg+8*r, 2*ft+1])
                        if i < n:
                            oo = ((row0+i)*hv+h)*D + col0 + j
                            o[oo] = PU[at] + ao[nt][fg+8*r, 2*ft]; o[oo+1] = PU[at+1] + ao[nt][fg+8*r, 2*ft+1]
                            if vn_out is not None:
                                vn_out[oo] = f32(U[at] - av[nt][fg+8*r, 2*ft])
                                vn_out[oo+1] = f32(U[at+1] - av[nt][fg+8*r, 2*ft+1])
        if s_out is None and c + 1 == nc: return  # no state wanted after the last chunk
        st *= np.exp(glast)
        for warp in range(8):
            for k0 in range(0, C, 16):
                for nt in range(8): st[warp, nt] += mma16(sk, LDT, 16*warp, vn_t, LDT, 8*nt, k0)
        for warp in range(8):
            for nt in range(8):
                for rr in range(16):
                    for cc in range(8):
                        st_t[(8*nt + cc)*LDH + 16*warp + rr] = bf16(st[warp, nt, rr, cc])
    for warp in range(8):
        for nt in range(8):
            for rr in range(16):
                for cc in range(8):
                    s_out[head + (16*warp + rr)*D + col0 + 8*nt + cc] = st[warp, nt, rr, cc]

def run(t=150, hk=1, hv=2, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(t, hk, D)); k = rng.normal(size=(t, hk, D))
    q /= np.linalg.norm(q, axis=-1, keepdims=True); k /= np.linalg.norm(k, axis=-1, keepdims=True); q *= D**-0.5
    v = rng.normal(size=(t, hv, D)); g = -rng.uniform(0.01, 0.5, size=(t, hv)); beta = rng.uniform(0, 1, size=(t, hv))
    s0 = rng.normal(size=(hv, D, D))*0.1
    S = s0.copy(); oref = np.zeros((t, hv, D))
    for i in range(t):
        for h in range(hv):
            kk = k[i, h // (hv//hk)]; qq = q[i, h // (hv//hk)]
            S[h] *= np.exp(g[i, h])
            S[h] += np.outer(kk, beta[i, h]*(v[i, h] - S[h].T @ kk))
            oref[i, h] = S[h].T @ qq
    nc = (t + C - 1)//C
    bufs = [np.zeros(hv*nc*C*D) for _ in range(5)] + [np.zeros(hv*nc*C)]
    for c in range(nc):
        for h in range(hv):
            solve_kernel(q.ravel(), k.ravel(), v.ravel(), g.ravel(), beta.ravel(), t, hk, hv, c, h, nc, bufs)
    o = np.zeros(t*hv*D); s_out = np.zeros(hv*D*D)
    for h in range(hv):
        for cb in range(D//BV):
            scan_kernel(s0.ravel(), *bufs, o, s_out, t, hv, h, cb)
    label = "with the kernels' roundings" if ROUND else "float64"
    print(f"{label}: o max err {np.abs(o - oref.ravel()).max():.3g} (scale {np.abs(oref).max():.3g}), "
          f"state max err {np.abs(s_out - S.ravel()).max():.3g} (scale {np.abs(S).max():.3g})")

def run_tree(t=40, hk=1, hv=2, seed=1):
    # A verify tree (parents before children) in one chunk: gdn_chunk_solve with the ancestor
    # bits, gdn_chunk_scan writing every node's v_new and no state (cuda::tree_delta_rule),
    # against the delta rule walked node by node from each node's parent state.
    rng = np.random.default_rng(seed)
    parents = [None] + [int(rng.integers(0, i)) for i in range(1, t)]
    anc = [0]*t
    for i in range(t): anc[i] = (anc[parents[i]] if parents[i] is not None else 0) | (1 << i)
    q = rng.normal(size=(t, hk, D)); k = rng.normal(size=(t, hk, D))
    q /= np.linalg.norm(q, axis=-1, keepdims=True); k /= np.linalg.norm(k, axis=-1, keepdims=True); q *= D**-0.5
    v = rng.normal(size=(t, hv, D)); g = -rng.uniform(0.01, 0.5, size=(t, hv)); beta = rng.uniform(0, 1, size=(t, hv))
    s0 = rng.normal(size=(hv, D, D))*0.1
    oref = np.zeros((t, hv, D)); vref = np.zeros((t, hv, D)); states = {}
    for i in range(t):
        for h in range(hv):
            kk = k[i, h // (hv//hk)]; qq = q[i, h // (hv//hk)]
            S = (s0[h] if parents[i] is None else states[parents[i], h]) * np.exp(g[i, h])
            vref[i, h] = beta[i, h]*(v[i, h] - S.T @ kk)
            states[i, h] = S + np.outer(kk, vref[i, h])
            oref[i, h] = states[i, h].T @ qq
    bufs = [np.zeros(hv*C*D) for _ in range(5)] + [np.zeros(hv*C)]
    for h in range(hv):
        solve_kernel(q.ravel(), k.ravel(), v.ravel(), g.ravel(), beta.ravel(), t, hk, hv, 0, h, 1, bufs, anc)
    o = np.zeros(t*hv*D); vn = np.zeros(t*hv*D)
    for h in range(hv):
        for cb in range(D//BV):
            scan_kernel(s0.ravel(), *bufs, o, None, t, hv, h, cb, vn)
    label = "tree, with the kernels' roundings" if ROUND else "tree, float64"
    print(f"{label}: o max err {np.abs(o - oref.ravel()).max():.3g} (scale {np.abs(oref).max():.3g}), "
          f"v_new max err {np.abs(vn - vref.ravel()).max():.3g} (scale {np.abs(vref).max():.3g})")

run()
run_tree()
ROUND = True
run()
run_tree()
