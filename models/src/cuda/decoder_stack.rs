//! The decoder-layer stack through the fused kernels, shared by the target's forward
//! (`qwen3/cuda.rs`) and the drafter's block (`dflash/cuda.rs`). Two forms of one layer:
//!
//! - up to the model's `gemv_rows` (at most [`cuda::GEMV_MAX_ROWS`]) rows (decode,
//!   verification, draft blocks): four skinny
//!   GEMMs with everything else fused around them — input norm + q/k/v, o-projection +
//!   residual add (+ the sums of squares the next norm needs), post-attention norm + gate/up +
//!   the SiLU product, down + residual add — plus q/k norm + RoPE + cache write and the
//!   split-K attention (one launch for a decode step, [`cuda::fused_attention`]; three for
//!   more tokens): 5 launches per layer for one row (the norms are applied as the input
//!   streams in), 9 for 2 to 64 rows (the norms as their own launches);
//! - wider (prefill chunks, wide trees): cuBLAS GEMMs, the SiLU product and residual add +
//!   RMSNorm kernels around the same attention: 10 launches per layer.
//!
//! A sparse-MoE layer (`qwen3_moe`) runs its block on the device instead of gate/up and down
//! ([`cuda::moe_block`]: router, routing, the selected experts only): 4 launches for one row
//! (the norm, the weighted combine and the residual add fused around them), 5-6 for up to 64,
//! and for wider forwards (prefills) the routing in tiles of up to 64 pairs per expert
//! ([`cuda::moe_route_wide`]), every used expert read once per tile, or past 512 rows (wider than
//! any captured step) two cuBLAS grouped GEMMs over every used expert (`moe_grouped.rs`).
//!
//! Up to 64 rows both make no host-device copies, so a CUDA graph can capture them.

use candle_core::{DType, Tensor};

use crate::cache::SequenceCache;
use crate::cuda::{self, RowNorm};
use crate::error::{ModelError, ModelResult};
use crate::layers::decoder_layer::{DecoderLayer, FusedWeights};
use crate::layers::moe::StackedExperts;
use crate::layers::ops::{rms_norm, OpsMode};
use crate::layers::rope::RotaryEmbedding;
use crate::taps::TapCollector;

/// Leading bytes of a layer's gate/up weights that its o-projection pulls into L2 (one-row
/// steps). Measured on the H200, Qwen3-8B shape, 1K decode in a CUDA graph: 8 MB took 4.81 to
/// 4.77 ms, and 4.78 to 4.75 in a second sweep (4 / 16 / 24 MB: 4.76 / 4.75 / 4.76); elsewhere
/// it lost: all of o_proj from the q/k/v GEMM (over the attention) +0.08 ms, 16 MB of down
/// from gate/up +0.03, 16 MB of the next q/k/v from down +0.03, 4 MB of either +-0.015
/// (deploy/bench/results/h200-2026-11-30-decode).
const GATE_UP_PREFETCH: usize = 8 << 20;

/// Most rows of a batched sparse-MoE step that a CUDA graph captures: the bound from when wider
/// steps routed on the host, kept until graphs of wider steps (now on the device block, routed
/// by [`cuda::moe_route_wide`] past [`cuda::MOE_MAX_ROWS`] rows) are measured; wider batches
/// of a `qwen3_moe` target run eagerly, on the same device block.
pub(crate) const MOE_GRAPH_MAX_ROWS: usize = 512;
// A captured step and its eager warm-up take the same expert kernels: the grouped GEMMs start
// past the widest captured step.
const _: () = assert!(MOE_GRAPH_MAX_ROWS < super::moe_grouped::GROUPED_MIN_ROWS);

/// One sequence's rows in a fused layer pass.
pub(crate) struct AttnSeq<'a> {
    pub cache: &'a SequenceCache,
    /// First row of this sequence in the stacked rows.
    pub offset: usize,
    pub tokens: usize,
    /// `[1]` u32: committed cache rows before these tokens.
    pub cache_len: &'a Tensor,
    /// Ancestor bit rows (tree or full-block patterns); None: causal.
    pub tree: Option<&'a Tensor>,
    /// The cache's page table (u32 `[1, pages]`; None: rows in order in its own buffers).
    pub pages: Option<&'a Tensor>,
}

/// Consecutive sequences of a step (`first..first + seqs` of its [`AttnSeq`]s) in one shared
/// pool with the same number of new tokens each, whose attention runs as one set of launches
/// per layer for all of them: every sequence's committed length (u32 `[seqs]`), page table
/// (u32 `[seqs, stride]`) and, for trees, the ancestor bits stacked (i64 `[seqs t, words]`),
/// in batch order.
pub(crate) struct PooledBatch<'a> {
    pub first: usize,
    pub seqs: usize,
    pub cache_len: &'a Tensor,
    pub pages: &'a Tensor,
    pub tree: Option<&'a Tensor>,
}

/// The weights a fused stack reads.
pub(crate) struct Stack<'a> {
    pub layers: &'a [DecoderLayer],
    /// Runs of sequences that share one pool and their token count (see [`PooledBatch`]);
    /// the others attend one by one.
    pub pooled: &'a [PooledBatch<'a>],
    pub final_norm: &'a Tensor,
    pub rope: &'a RotaryEmbedding,
    pub eps: f64,
    pub mode: OpsMode,
    /// Most rows that take the skinny GEMMs.
    pub gemv_rows: usize,
    /// Most rows whose wide-path GEMMs take the timed cuBLASLt choice ([`cuda::linear_lt`]);
    /// wider ones cuBLAS's default.
    pub tuned_rows: usize,
    /// Most rows whose wide-path GEMMs take the split-K kernels ([`cuda::splitk_gemm`],
    /// ahead of the cuBLASLt choice).
    pub splitk_rows: usize,
}

impl Stack<'_> {
    /// Runs every layer over the embedded rows `x`, writing K/V into each sequence's cache at
    /// its `cache_len` (caches are not advanced). Returns the final-normed rows (every row:
    /// the kernels norm as they go) and offers each layer's raw output to `taps`.
    pub fn run(
        &self,
        x: Tensor,
        positions: &Tensor,
        seqs: &[AttnSeq<'_>],
        taps: &mut TapCollector<'_>,
    ) -> ModelResult<Tensor> {
        if x.dim(0)? <= self.gemv_rows && self.skinny_shapes()? {
            self.run_skinny(x, positions, seqs, taps)
        } else {
            self.run_wide(x, positions, seqs, taps)
        }
    }

    /// Whether every projection fits the skinny kernels (`k % 256 == 0`, `n % 16 == 0`); true
    /// for every published Qwen3 shape. Other shapes take the cuBLAS form.
    fn skinny_shapes(&self) -> ModelResult<bool> {
        for layer in self.layers {
            let f = fused(layer)?;
            let mut ws = vec![&f.qkv, layer.o_proj()];
            if f.experts.is_none() {
                ws.extend([dense_gate_up(f)?, dense_down(layer)?]);
            }
            for w in ws {
                let (n, k) = w.dims2()?;
                if k % 256 != 0 || n % 32 != 0 {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    fn run_skinny(
        &self,
        mut x: Tensor,
        positions: &Tensor,
        seqs: &[AttnSeq<'_>],
        taps: &mut TapCollector<'_>,
    ) -> ModelResult<Tensor> {
        let eps = self.eps;
        // o_proj's sums of squares feed gate/up's norm (its kernel is held to 40 registers and
        // reads them). One row: q/k/v's blocks sum their input row themselves, so down makes
        // none. More rows: the tensor-core residual kernel always makes them (it needs the
        // counter), and they feed the next layer's q/k/v norm.
        let one_row = x.dim(0)? == 1;
        let counter = Tensor::zeros(1, DType::U32, x.device())?;
        let mut ss: Option<Tensor> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let fused = fused(layer)?;
            let (in_norm, post_norm, _, _) = layer.norm_weights();
            let norm = RowNorm {
                ss: ss.as_ref(),
                weight: in_norm,
                eps,
            };
            let qkv = cuda::gemv(&x, &fused.qkv, Some(norm))?;
            let attn = self.attention(li, layer, &qkv, positions, seqs)?;
            // The o-projection is short and leaves bandwidth unused; its blocks start the
            // gate/up weights (a sparse layer: the router, read next) into L2 as they finish.
            let warm = match &fused.experts {
                Some(ex) => cuda::Prefetch {
                    weight: &ex.router,
                    bytes: ex.router.elem_count() * 2,
                },
                None => cuda::Prefetch {
                    weight: dense_gate_up(fused)?,
                    bytes: GATE_UP_PREFETCH,
                },
            };
            let (x1, ss1) =
                cuda::gemv_resid(&attn, layer.o_proj(), &x, Some(&counter), Some(warm))?;
            let norm = RowNorm {
                ss: ss1.as_ref(),
                weight: post_norm,
                eps,
            };
            let (x2, ss2) = match &fused.experts {
                // One row: the next layer's q/k/v blocks sum their input themselves.
                Some(ex) => {
                    cuda::moe_block(&x1, Some(norm), &moe_weights(ex), Some(&x1), !one_row)?
                }
                None => {
                    let act = cuda::gemv_silu(&x1, dense_gate_up(fused)?, Some(norm))?;
                    let down_counter = (!one_row).then_some(&counter);
                    cuda::gemv_resid(&act, dense_down(layer)?, &x1, down_counter, None)?
                }
            };
            x = x2;
            ss = ss2;
            taps.layer_output(li, &x);
        }
        let h = cuda::rms_apply(
            &x,
            RowNorm {
                ss: ss.as_ref(),
                weight: self.final_norm,
                eps,
            },
        )?;
        Ok(h)
    }

    fn run_wide(
        &self,
        mut x: Tensor,
        positions: &Tensor,
        seqs: &[AttnSeq<'_>],
        taps: &mut TapCollector<'_>,
    ) -> ModelResult<Tensor> {
        let eps = self.eps;
        // Phase marks for the benches' prefill profile (`cuda::phases`; a no-op unless open).
        let dev = x.device().clone();
        let mark = |label| cuda::phases::mark(&dev, label);
        mark("input_norm");
        let mut h = rms_norm(&x, self.layers[0].norm_weights().0, eps, self.mode)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let fused = fused(layer)?;
            let post_norm = layer.norm_weights().1;
            mark("attn.qkv");
            let qkv = self.linear(&h, &fused.qkv)?;
            mark("attn.mix");
            let attn = self.attention(li, layer, &qkv, positions, seqs)?;
            mark("attn.out");
            let o = self.linear(&attn, layer.o_proj())?;
            let (x1, h1) = cuda::add_rmsnorm(&x, &o, post_norm, eps)?;
            mark("mlp");
            let down = match &fused.experts {
                Some(ex) => cuda::moe_block(&h1, None, &moe_weights(ex), None, false)?.0,
                None => {
                    let act = self.gate_up_silu(&h1, dense_gate_up(fused)?)?;
                    self.linear(&act, dense_down(layer)?)?
                }
            };
            // The next layer's input norm, or the final norm after the last layer.
            let next_norm = match self.layers.get(li + 1) {
                Some(next) => next.norm_weights().0,
                None => self.final_norm,
            };
            mark("residual_norm");
            let (x2, h2) = cuda::add_rmsnorm(&x1, &down, next_norm, eps)?;
            x = x2;
            h = h2;
            taps.layer_output(li, &x);
        }
        mark("end");
        Ok(h)
    }

    fn splitk_fits(&self, x: &Tensor, w: &Tensor, outputs: usize) -> ModelResult<bool> {
        let (rows, k) = x.dims2()?;
        Ok(rows <= self.splitk_rows.min(cuda::TUNED_MAX_ROWS)
            && x.is_contiguous()
            && w.is_contiguous()
            && k.is_multiple_of(32)
            && outputs.is_multiple_of(64))
    }

    /// `silu(gate) * up` of the stacked gate/up product: fused into the split-K kernel, else
    /// the product then `silu_mul`.
    fn gate_up_silu(&self, x: &Tensor, w: &Tensor) -> ModelResult<Tensor> {
        if self.splitk_fits(x, w, w.dim(0)? / 2)? {
            return Ok(cuda::splitk_gemm(x, w, cuda::SplitkEpi::Silu, None)?);
        }
        Ok(cuda::silu_mul(&self.linear(x, w)?)?)
    }

    /// `x @ wᵀ` of the wide path: the split-K kernel up to `splitk_rows` rows, the timed
    /// cuBLASLt choice up to `tuned_rows`, cuBLAS's default beyond.
    fn linear(&self, x: &Tensor, w: &Tensor) -> ModelResult<Tensor> {
        let rows = x.dim(0)?;
        if self.splitk_fits(x, w, w.dim(0)?)? {
            return Ok(cuda::splitk_gemm(x, w, cuda::SplitkEpi::Store, None)?);
        }
        if rows <= self.tuned_rows.min(cuda::TUNED_MAX_ROWS) && x.is_contiguous() {
            Ok(cuda::linear_lt(x, w, None, cuda::LtMode::Tuned)?)
        } else {
            Ok(cuda::linear(x, w)?)
        }
    }

    /// q/k norm + RoPE + cache write, then attention, per sequence; `[rows, heads * d]`: one
    /// fused launch for a decode step (see [`cuda::fused_attention_fits`]), two otherwise.
    fn attention(
        &self,
        li: usize,
        layer: &DecoderLayer,
        qkv: &Tensor,
        positions: &Tensor,
        seqs: &[AttnSeq<'_>],
    ) -> ModelResult<Tensor> {
        let (cos, sin) = self.rope.tables();
        let (nh, nkv, d) = layer.heads();
        let (_, _, q_norm, k_norm) = layer.norm_weights();
        let mut outs = Vec::with_capacity(seqs.len());
        let mut s = 0;
        while s < seqs.len() {
            let first = &seqs[s];
            let kv = first.cache.layer(li).attention()?;
            let (kc, vc) = kv.buffers();
            // Every sequence of a run has its K/V in the same pool buffers: one set of
            // launches for the run.
            let run = self.pooled.iter().find(|g| g.first == s && g.seqs > 0);
            let (n, cache_len, pages, tree) = match run {
                Some(g) => (g.seqs, g.cache_len, Some(g.pages), g.tree),
                None => (1, first.cache_len, first.pages, first.tree),
            };
            let rows = n * first.tokens;
            let whole = first.offset == 0 && rows == qkv.dim(0)?;
            let (q_rows, pos) = if whole {
                (qkv.clone(), positions.clone())
            } else {
                (
                    qkv.narrow(0, first.offset, rows)?,
                    positions.narrow(0, first.offset, rows)?,
                )
            };
            let new = cuda::QkvRows {
                qkv: &q_rows,
                q_norm,
                k_norm,
                cos,
                sin,
                positions: &pos,
                cache_len,
                kc,
                vc,
                pages,
                heads: (nh, nkv, d),
                eps: self.eps,
            };
            // Host-side: the caches advance only after the forward.
            let committed = seqs[s..s + n].iter().map(|a| a.cache.len()).max();
            outs.push(attend(&new, first.tokens, tree, committed.unwrap_or(0))?);
            s += n;
        }
        Ok(match outs.len() {
            1 => outs.swap_remove(0),
            _ => Tensor::cat(&outs, 0)?,
        })
    }
}

/// The attention of `new`'s rows (one sequence, or a pooled batch of `tokens` rows each):
/// one fused launch for a decode step (norm, RoPE, cache write, attention and merge, its key
/// splits set on the device from the live length, the same for an eager step and a graph
/// replay whatever the cache's capacity), else q/k norm + RoPE + cache write and then the
/// attention (its kernel chosen knowing the longest committed context, `committed`).
fn attend(
    new: &cuda::QkvRows<'_>,
    tokens: usize,
    tree: Option<&Tensor>,
    committed: usize,
) -> ModelResult<Tensor> {
    let (nh, nkv, _) = new.heads;
    if cuda::fused_attention_fits(tokens, nh, nkv) {
        return Ok(cuda::fused_attention(new, tree, None)?);
    }
    let q = cuda::qk_norm_rope_cache(new)?;
    Ok(cuda::attention_for_context(
        &q,
        new.kc,
        new.vc,
        new.pages,
        new.cache_len,
        tree,
        committed,
    )?)
}

/// A dense layer's down projection (sparse layers take the MoE kernels before asking).
fn dense_down(layer: &DecoderLayer) -> ModelResult<&Tensor> {
    layer
        .down_proj()
        .ok_or_else(|| ModelError::Unsupported("a sparse-MoE layer has no dense down".into()))
}

/// A dense layer's stacked `[gate; up]`.
fn dense_gate_up(f: &FusedWeights) -> ModelResult<&Tensor> {
    f.gate_up
        .as_ref()
        .ok_or_else(|| ModelError::Unsupported("a sparse-MoE layer has no dense gate/up".into()))
}

fn moe_weights(ex: &StackedExperts) -> cuda::MoeWeights<'_> {
    cuda::MoeWeights {
        router: &ex.router,
        gate_up: &ex.gate_up,
        down: &ex.down,
        top_k: ex.top_k,
        norm_topk_prob: ex.norm_topk_prob,
        shared: None,
    }
}

fn fused(layer: &DecoderLayer) -> ModelResult<&FusedWeights> {
    layer
        .fused()
        .ok_or_else(|| ModelError::BadInput("fused forward on unfused weights".into()))
}

/// Runs `body` once uncaptured — loading modules, letting cuBLAS pick and allocate its
/// workspaces and filling candle's parameter cache for anything it would upload — then
/// captures a second run as a CUDA graph on the device's stream.
pub(crate) fn capture_graph(
    device: &candle_core::Device,
    body: impl Fn() -> ModelResult<()>,
) -> ModelResult<candle_core::cuda_backend::cudarc::driver::CudaGraph> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let candle_core::Device::Cuda(cd) = device else {
        return Err(ModelError::Unsupported(
            "CUDA graphs need a CUDA device".into(),
        ));
    };
    let _cache_guard = cd.enable_cuda_graph_htod_cache();
    body()?;
    device.synchronize()?;
    let stream = cd.cuda_stream();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| ModelError::Unsupported(format!("begin graph capture: {e}")))?;
    let captured = body();
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    captured?;
    ended
        .map_err(|e| ModelError::Unsupported(format!("end graph capture: {e}")))?
        .ok_or_else(|| ModelError::Unsupported("graph capture produced no graph".into()))
}

/// A cache's identity for a captured graph, which bakes in the address of every layer's K
/// and V buffer: a hash of all of them, the capacity and the page count (a new cache at the
/// same addresses with the same layout is the same memory, so a graph stays valid for it).
pub(crate) fn cache_key(cache: &SequenceCache) -> ModelResult<u64> {
    let mut h = crate::cuda::graphs::Fnv1a::new();
    // Caches of one pool share its buffers, and a graph reads the page table as an input
    // (padded to a fixed width), so one graph serves every cache of the pool whatever its
    // capacity; a cache in buffers of its own is known by them and its capacity.
    if cache.page_table().is_contiguous() {
        h.eat(cache.capacity() as u64);
    } else {
        h.eat(u64::MAX);
    }
    for i in 0..cache.num_layers() {
        let (k, v) = cache.layer(i).attention()?.buffers();
        h.eat(cuda::device_address(k)?);
        h.eat(cuda::device_address(v)?);
    }
    Ok(h.finish())
}

/// The page tables of `caches` (one pool's) as one upload for a pooled batch: u32
/// `[caches, stride]`, each row padded with zeros to the longest table.
pub(crate) fn stacked_page_tables(
    caches: &[&SequenceCache],
    dev: &candle_core::Device,
) -> ModelResult<Tensor> {
    let stride = caches
        .iter()
        .map(|c| c.page_table().pages().len())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut table = vec![0u32; caches.len() * stride];
    for (row, c) in table.chunks_mut(stride).zip(caches) {
        c.page_table().copy_into(row);
    }
    Ok(Tensor::from_vec(table, (caches.len(), stride), dev)?)
}

/// Page-table entries a graph captured on `cache` reads: none for a cache of its own; for a
/// pooled one, enough for `rows` rows (a model passes the most any of its caches can hold,
/// so every graph of the pool has one width whatever the capacity of the cache it was
/// captured on).
pub(crate) fn graph_page_width(cache: &SequenceCache, rows: usize) -> ModelResult<usize> {
    if cache.page_table().is_contiguous() {
        return Ok(0);
    }
    let width = crate::cache::pages_for(rows);
    if cache.page_table().pages().len() > width {
        return Err(ModelError::Unsupported(format!(
            "a cache of {} pages is beyond the graphs' {width}",
            cache.page_table().pages().len()
        )));
    }
    Ok(width)
}
