//! A CUDA graph of the hybrid's fused decode step (`qwen3_5/cuda.rs`, one token, bf16): the
//! ~450 launches of a step replayed with one host call. The eager fused forward stays the
//! reference; a replay equals it bit for bit (checked by `gpu_check --hybrid`).
//!
//! What varies per step lives in device memory written before each replay: the token, its
//! position and the committed cache length (u32 `[3]`). The gated-attention layers read the
//! length from there and split the keys over a split count fixed for the whole capacity
//! (`cuda::GraphSplit`: the splits past the live keys are empty). The K/V rows go into the
//! cache's own buffers, whose addresses the graph bakes in (checked by the graph's cache key).
//!
//! The recurrent (Gated DeltaNet) states are not at fixed addresses in the cache: each commit
//! stores new tensors. So the graph owns one state buffer and one conv-window buffer per GDN
//! layer, which the step's kernels advance in place (`cuda::ChainOut::InPlace`). Before a
//! replay the cache's current state is copied in unless it is what the previous replay handed
//! to the cache (a truncate, a rollback or an eager forward in between makes it another
//! tensor); after a replay the cache commits the buffers themselves (no copy: the next replay
//! advances them only after the cache is done with this state), or, where the step is staged
//! for rollback, copies of them. Only decode is captured: a verify (t > 1) stages its rows'
//! inputs, not states (`cache::RowInputs`), so it could be, but its launches are long (a 16-row
//! 27B verify takes ~20 ms, the decode step ~16) and even the one-row step measured no faster from
//! graphs once launches overlap by PDL (`cuda::hybrid_decode_graphs`).
//!
//! The model's forward replays it ([`Qwen35Model::forward_decode_graph`], in the model's
//! [`crate::cuda::graphs::GraphCache`], where `cuda::hybrid_decode_graphs` or the model's
//! `with_step_graphs` turns it on): a sparse-MoE
//! layer's device block (`cuda::moe_block`) has no host round trip, so the MoE hybrids' decode
//! step, ~15 small launches a layer, is one host call too.

use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::{DType, Tensor};

use crate::batch::{ForwardOutput, SeqForward};
use crate::cache::{GdnState, LayerCache, SequenceCache, StagedState};
use crate::cuda::decoder_stack::capture_graph;
use crate::cuda::graphs::{Fnv1a, GraphObject, Key};
use crate::cuda::{self, ChainOut, GraphSplit, RowNorm};
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::AttnPattern;
use crate::qwen3_5::{GdnPath, Mixer, Qwen35Model};

/// One GDN layer's state buffers owned by the graph.
struct GraphState {
    layer: usize,
    /// f32, the cache's state shape.
    ssm: Tensor,
    /// bf16 `[K-1, conv_dim]`.
    conv: Tensor,
    /// The state the last replay handed to the cache (it is also in the buffers then).
    handed: Option<GdnState>,
}

/// A captured fused decode step over one [`SequenceCache`] (see the module doc).
pub struct HybridDecodeGraph {
    graph: CudaGraph,
    /// u32 `[token, position, cache length]`.
    inputs: Tensor,
    /// f32 `[1, vocab]`, rewritten by every replay.
    logits: Tensor,
    states: Vec<GraphState>,
    cache_key: u64,
    keys_per_split: usize,
    /// `(query heads, KV heads)` of the attention layers (None: no attention layers).
    heads: Option<(usize, usize)>,
    /// Whether the step stages its state as a rollback-able row (the cache's rollback >= 1).
    keep: bool,
}

impl Qwen35Model {
    /// Captures the fused decode step for `cache` (contiguous, with room for a token). Fails
    /// where the eager fused path would not run every layer through the fused kernels.
    pub fn capture_decode_graph(&self, cache: &SequenceCache) -> ModelResult<HybridDecodeGraph> {
        let unsupported = |why: &str| Err(ModelError::Unsupported(format!("hybrid graph: {why}")));
        if !self.fast {
            return unsupported("needs the fused path (CUDA, bf16)");
        }
        if !cache.page_table().is_contiguous() {
            return unsupported("needs a cache in buffers of its own");
        }
        let tracker = cache.row_tracker().ok_or_else(|| {
            ModelError::BadInput("a hybrid model needs a cache from Qwen35Model::new_cache".into())
        })?;
        let keep = tracker.rollback >= 1;
        let len = cache.len();
        if len + 1 > cache.backed_rows() {
            return Err(ModelError::CacheFull {
                len,
                requested: 1,
                capacity: cache.backed_rows(),
            });
        }
        let dev = self.device.clone();
        let heads = self.attention_heads();
        let mut states = Vec::new();
        for (li, layer) in self.layers.iter().enumerate() {
            match &layer.mixer {
                Mixer::Linear(_) => {
                    let s = cache.layer(li).recurrent()?.last()?;
                    states.push(GraphState {
                        layer: li,
                        ssm: s.ssm.force_contiguous()?,
                        conv: s.conv.force_contiguous()?,
                        handed: None,
                    });
                }
                Mixer::Full(a) => {
                    if a.fused_qkv().is_none() || a.head_dim() != cuda::GATTN_HEAD_DIM {
                        return unsupported("gated attention outside the fused kernels' shape");
                    }
                }
            }
        }
        let keys_per_split = heads.map_or(1, |h| cuda::planned_keys_per_split(len + 1, 1, h));
        let inputs = Tensor::new(&[0u32, len as u32, len as u32], &dev)?;
        let logits = Tensor::zeros((1, self.cfg.vocab_size), DType::F32, &dev)?;
        let body = || self.decode_body(cache, &inputs, &logits, &states, keys_per_split);
        let graph = capture_graph(&dev, body)?;
        Ok(HybridDecodeGraph {
            graph,
            inputs,
            logits,
            states,
            cache_key: attention_key(cache)?,
            keys_per_split,
            heads,
            keep,
        })
    }

    /// The captured work: the eager fused decode step with its varying inputs in `inputs`
    /// and the recurrent states in `states` (read, then overwritten with the new ones). Makes
    /// no host-device copies.
    fn decode_body(
        &self,
        cache: &SequenceCache,
        inputs: &Tensor,
        logits: &Tensor,
        states: &[GraphState],
        keys_per_split: usize,
    ) -> ModelResult<()> {
        let eps = self.cfg.rms_norm_eps;
        let (ids, positions, cache_len) = (
            inputs.narrow(0, 0, 1)?,
            inputs.narrow(0, 1, 1)?,
            inputs.narrow(0, 2, 1)?,
        );
        let (cos, sin) = self.rope.gather(&positions)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        let mut x = self.embed_tokens.index_select(&ids, 0)?;
        let counter = Tensor::zeros(1, DType::U32, &self.device)?;
        let mut ss: Option<Tensor> = None;
        let mut gdn = states.iter();
        for (li, layer) in self.layers.iter().enumerate() {
            let norm = RowNorm {
                ss: ss.as_ref(),
                weight: &layer.input_norm,
                eps,
            };
            let (mixed, o_proj) = match &layer.mixer {
                Mixer::Linear(g) => {
                    let st = gdn.next().filter(|s| s.layer == li).ok_or_else(|| {
                        ModelError::Unsupported("graph states out of step".into())
                    })?;
                    let proj = cuda::gemv(&x, &g.in_proj, Some(norm))?;
                    let from = GdnState {
                        conv: st.conv.clone(),
                        ssm: st.ssm.clone(),
                    };
                    // The new state and window over the graph's own (no copies).
                    let (y, _, _) = g.mix_fused(&proj, &from, ChainOut::InPlace)?;
                    (y, &g.out_proj)
                }
                Mixer::Full(attn) => {
                    let qkv_w = attn.fused_qkv().ok_or_else(|| {
                        ModelError::BadInput("fused forward on unfused weights".into())
                    })?;
                    let qkv = cuda::gemv(&x, qkv_w, Some(norm))?;
                    let kv = cache.layer(li).attention()?.buffers();
                    let split = GraphSplit {
                        cache_len: &cache_len,
                        keys_per_split,
                    };
                    let mixed = attn
                        .attend_chain_fused_graph(&qkv, &cos, &sin, kv, 0, None, Some(split))?
                        .ok_or_else(|| {
                            ModelError::Unsupported("hybrid graph: attention shape".into())
                        })?;
                    (mixed, attn.o_proj())
                }
            };
            let (x1, ss1) = cuda::gemv_resid(&mixed, o_proj, &x, Some(&counter), None)?;
            let norm = RowNorm {
                ss: ss1.as_ref(),
                weight: &layer.post_norm,
                eps,
            };
            let (x2, ss2) = if layer.is_sparse() {
                // As eager: the device MoE block (routing included, no host round trip).
                (layer.moe_block_normed(&x1, norm)?, None)
            } else {
                let (gate_up, down) = layer.fused_mlp()?;
                let act = cuda::gemv_silu(&x1, gate_up, Some(norm))?;
                // One row: down makes no sums (the next in-projection sums its row), as eager.
                cuda::gemv_resid(&act, down, &x1, None, None)?
            };
            x = x2;
            ss = ss2;
        }
        let h = cuda::rms_apply(
            &x,
            RowNorm {
                ss: ss.as_ref(),
                weight: &self.norm,
                eps,
            },
        )?;
        let out = cuda::gemv(&h, &self.lm_head, None)?.to_dtype(DType::F32)?;
        logits.slice_set(&out, 0, 0)?;
        Ok(())
    }
}

// SAFETY: a HybridDecodeGraph holds a CUDA graph and tensors (see `GraphObject`).
unsafe impl GraphObject for HybridDecodeGraph {}

impl Qwen35Model {
    /// Replays a decode step from the model's graph of its cache when it qualifies (graphs
    /// on, one sequence, one causal token, its logits and no taps, a cache in buffers of its
    /// own with room, the `Chain` GDN decode path the graph records), capturing it on the
    /// key's second use (`cuda::graphs`); `None` means "run the eager fused forward". The key
    /// is the cache's attention buffers plus what the step bakes in (the attention's keys per
    /// split, whether the row is staged for rollback), so a replay never meets a graph that
    /// [`HybridDecodeGraph::step`] would call stale.
    pub(crate) fn forward_decode_graph(
        &self,
        batch: &mut [SeqForward<'_>],
        taps: &[usize],
    ) -> ModelResult<Option<ForwardOutput>> {
        let Some(graphs) = self.step_graphs.slots() else {
            return Ok(None);
        };
        let [seq] = batch else { return Ok(None) };
        if seq.tokens.len() != 1
            || !matches!(seq.logit_rows, [0])
            || !taps.is_empty()
            || *seq.pattern != AttnPattern::Causal
            || self.gdn_paths.decode != GdnPath::Chain
            || !seq.cache.page_table().is_contiguous()
            || seq.cache.len() + 1 > seq.cache.backed_rows()
        {
            return Ok(None);
        }
        let Some(tracker) = seq.cache.row_tracker() else {
            return Ok(None);
        };
        let keep = tracker.rollback >= 1;
        let kps = self.attention_heads().map_or(1, |h| {
            cuda::planned_keys_per_split(seq.cache.len() + 1, 1, h)
        });
        let mut hash = attention_hash(seq.cache)?;
        hash.eat(kps as u64);
        hash.eat(keep as u64);
        let key = Key {
            cache: hash.finish(),
            tokens: 1,
            seqs: 1,
            tree: false,
            taps: Vec::new(),
        };
        let (token, position) = (seq.tokens[0], seq.positions[0]);
        let logits = graphs.with_graph(
            key,
            &mut *seq.cache,
            |cache| self.capture_decode_graph(cache),
            |g, cache| g.step(cache, token, position),
        )?;
        Ok(logits.map(|logits| ForwardOutput {
            logits: Some(logits),
            taps: None,
            token_offsets: vec![0, 1],
            logit_offsets: vec![0, 1],
        }))
    }

    /// `(query heads, KV heads)` of the gated-attention layers (None: none), which fix the
    /// decode step's key splits.
    fn attention_heads(&self) -> Option<(usize, usize)> {
        self.layers.iter().find_map(|l| match &l.mixer {
            Mixer::Full(a) => Some(a.heads()),
            Mixer::Linear(_) => None,
        })
    }
}

impl HybridDecodeGraph {
    /// Keys per split the graph's attention uses.
    pub fn keys_per_split(&self) -> usize {
        self.keys_per_split
    }

    /// Runs the captured step for `token` at `position` on `cache` (the one it was captured
    /// for) and commits it. Returns the logits `[1, vocab]` (f32, a copy). An error where the
    /// graph no longer matches the cache (other buffers, a full cache, another rollback
    /// setting, a length where the eager plan splits the keys otherwise): recapture then.
    pub fn step(
        &mut self,
        cache: &mut SequenceCache,
        token: u32,
        position: u32,
    ) -> ModelResult<Tensor> {
        let stale = |why: String| Err(ModelError::BadInput(format!("stale hybrid graph: {why}")));
        if attention_key(cache)? != self.cache_key {
            return stale("captured for another cache".into());
        }
        let tracker = cache
            .row_tracker()
            .ok_or_else(|| ModelError::BadInput("not a hybrid cache".into()))?;
        tracker.check_extendable(cache.len())?;
        if (tracker.rollback >= 1) != self.keep {
            return stale("the cache's rollback setting changed".into());
        }
        let len = cache.len();
        if len + 1 > cache.backed_rows() {
            return Err(ModelError::CacheFull {
                len,
                requested: 1,
                capacity: cache.backed_rows(),
            });
        }
        if let Some(h) = self.heads {
            let plan = cuda::planned_keys_per_split(len + 1, 1, h);
            if plan != self.keys_per_split {
                return stale(format!(
                    "the eager plan splits {} keys by {plan}, the graph by {}",
                    len + 1,
                    self.keys_per_split
                ));
            }
        }
        for st in &mut self.states {
            let last = cache.layer(st.layer).recurrent()?.last()?;
            let same = match &st.handed {
                Some(h) => same_storage(&h.ssm, &last.ssm)? && same_storage(&h.conv, &last.conv)?,
                None => false,
            };
            if !same {
                st.ssm.slice_set(&last.ssm.reshape(st.ssm.shape())?, 0, 0)?;
                st.conv.slice_set(&last.conv.contiguous()?, 0, 0)?;
            }
        }
        cuda::upload_u32(&self.inputs, &[token, position, len as u32])?;
        self.graph
            .launch()
            .map_err(|e| ModelError::Unsupported(format!("graph launch: {e}")))?;
        let mut staged = Vec::with_capacity(self.states.len());
        for st in &mut self.states {
            // A row kept for rollback must survive the next replay: a copy. Otherwise the cache
            // takes the graph's buffers themselves, which the next replay (the only writer,
            // while the cache holds them) advances in place.
            let s = if self.keep {
                GdnState {
                    conv: st.conv.force_contiguous()?,
                    ssm: st.ssm.force_contiguous()?,
                }
            } else {
                GdnState {
                    conv: st.conv.clone(),
                    ssm: st.ssm.clone(),
                }
            };
            st.handed = Some(s.clone());
            let staged_state = if self.keep {
                StagedState::OwnRows(vec![s])
            } else {
                StagedState::Final(s)
            };
            staged.push((st.layer, staged_state));
        }
        let parents = [None];
        cache.commit_recurrent(1, self.keep.then_some(&parents[..]), staged)?;
        Ok(self.logits.force_contiguous()?)
    }
}

/// A hybrid cache's identity for the graph, which bakes in the address of every attention
/// layer's K and V buffer: their addresses and the capacity (FNV-1a), as the dense graphs'
/// `cache_key`, which reads every layer as an attention layer.
fn attention_key(cache: &SequenceCache) -> ModelResult<u64> {
    Ok(attention_hash(cache)?.finish())
}

/// [`attention_key`]'s hash, open for more values.
fn attention_hash(cache: &SequenceCache) -> ModelResult<Fnv1a> {
    let mut h = Fnv1a::new();
    h.eat(cache.capacity() as u64);
    for i in 0..cache.num_layers() {
        if let LayerCache::Attention(a) = cache.layer(i) {
            let (k, v) = a.buffers();
            h.eat(i as u64);
            h.eat(cuda::device_address(k)?);
            h.eat(cuda::device_address(v)?);
        }
    }
    Ok(h)
}

/// Whether two tensors are the same memory (the graph keeps the handed tensors alive, so an
/// equal address cannot be a reused allocation).
fn same_storage(a: &Tensor, b: &Tensor) -> ModelResult<bool> {
    Ok(a.shape() == b.shape()
        && a.is_contiguous()
        && b.is_contiguous()
        && cuda::device_address(a)? == cuda::device_address(b)?)
}
