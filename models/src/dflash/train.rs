//! The DFlash training forward: every anchor's block of a sequence in one pass (SpecForge
//! `OnlineDFlashModel`, DFLASH.md §3.3-3.4).
//!
//! For a sequence of `S` positions with target features `[S, taps * hidden]` and anchors
//! `a_1..a_N`, the keys and values are the context rows (positions `0..S`, built exactly as the
//! inference cache builds them: `fc` -> `hidden_norm` -> each layer's `k_proj`/`k_norm`/RoPE and
//! `v_proj`) followed by all `N * B` block rows `[x_a, mask x (B-1)]` at positions
//! `a..a+B-1`; the queries are the block rows. Query `(b, k)` sees context `j < a_b` (strictly:
//! at inference the anchor's own target features do not exist yet) and its own block, and
//! nothing of other blocks. Sliding layers additionally window the context
//! (`j >= a_b + k - (W-1)`) and are causal inside the block, as [`AttnPattern::Sliding`] is at
//! inference. So a block's output here equals [`DFlashDrafter::draft_logits`] with a cache
//! holding exactly the context before its anchor, which the tests check.
//!
//! The layers are the inference layers ([`DecoderLayer::kv`], `qkv`, `finish`) and attention is
//! [`attend`]; build the drafter with [`OpsMode::Differentiable`] to train through it. Rather
//! than one `[N*B, S + N*B]` score matrix (almost all of it masked), anchors are attended in
//! groups of about `S / B` blocks, each against the context plus its own group's block rows:
//! the same result, with memory near `N*B * 2S` instead of `N*B * (S + N*B)`. That grouped
//! composition is [`TrainAttention::Composed`] (the CPU's path and the reference);
//! [`TrainAttention::Fused`] runs the flash-style custom op of
//! [`crate::training::attn_dflash`] over all blocks at once instead (nothing of score size
//! kept; the CUDA trainer's default), with the same visibility.
//!
//! [`AttnPattern::Sliding`]: crate::layers::attention::AttnPattern::Sliding
//! [`DecoderLayer::kv`]: crate::layers::decoder_layer::DecoderLayer::kv
//! [`OpsMode::Differentiable`]: crate::layers::ops::OpsMode::Differentiable

use candle_core::{Device, Tensor};
use dflash_common::LayerType;

use crate::dflash::DFlashDrafter;
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::attend;
use crate::layers::ops::OpsMode;
use crate::training::attn_dflash::{dflash_attention, BlockSpan};

/// Upper bound on the blocks attended together, so that one group's scores stay small.
const MAX_GROUP_BLOCKS: usize = 64;

/// How [`DFlashDrafter::train_hidden_with`] runs the drafter's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrainAttention {
    /// candle's `attend` under [`training_mask`], groups of blocks against their context.
    #[default]
    Composed,
    /// The DFlash attention custom op: online softmax, log-sum-exp saved, the backward's
    /// kernels recompute the scores (the f32 reference on the CPU).
    Fused,
}

/// Window of a sliding layer for the fused op: `W`, or no limit on the context (the block
/// stays causal) when the config has none, as `training_mask` with `usize::MAX`.
pub(crate) const NO_WINDOW: usize = 1 << 30;

/// One sequence of a training batch.
#[derive(Debug, Clone, Copy)]
pub struct TrainSequence<'a> {
    /// Target features `[S, taps * hidden]` of every position (any float dtype).
    pub features: &'a Tensor,
    /// The sequence's `S` token ids.
    pub tokens: &'a [u32],
    /// Anchor positions, each in `1..S`; one block per anchor. Ascending order lets each group
    /// of blocks read only the context it can see.
    pub anchors: &'a [usize],
}

/// Additive mask (0 visible, -inf hidden) for one group of blocks: rows are (anchor, slot),
/// columns are context positions `0..context_len` followed by the group's block rows.
/// `window` is `Some(W)` for a sliding layer.
pub fn training_mask(
    anchors: &[usize],
    context_len: usize,
    block_size: usize,
    window: Option<usize>,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let b = block_size;
    let cols = context_len + anchors.len() * b;
    let mut m = vec![f32::NEG_INFINITY; anchors.len() * b * cols];
    for (i, &a) in anchors.iter().enumerate() {
        for k in 0..b {
            let row = &mut m[(i * b + k) * cols..(i * b + k + 1) * cols];
            let first_ctx = match window {
                Some(w) => (a + k + 1).saturating_sub(w),
                None => 0,
            };
            for v in row.iter_mut().take(a.min(context_len)).skip(first_ctx) {
                *v = 0.0;
            }
            let last_block = if window.is_some() { k } else { b - 1 };
            for v in &mut row[context_len + i * b..=context_len + i * b + last_block] {
                *v = 0.0;
            }
        }
    }
    Tensor::from_vec(m, (anchors.len() * b, cols), device)
}

/// [`dflash_attention`] as candle's composition, grouped as [`DFlashDrafter::train_hidden`]
/// groups it (the reference the op is checked against): per run of blocks with one context
/// offset (a sequence), groups of at most [`MAX_GROUP_BLOCKS`] blocks, each attending over
/// its context up to its largest anchor and its own block rows under [`training_mask`], in
/// f32 probabilities (`OpsMode::Differentiable`).
#[allow(clippy::too_many_arguments)]
pub fn composed_attention(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    kb: &Tensor,
    vb: &Tensor,
    blocks: &[BlockSpan],
    block_size: usize,
    window: Option<usize>,
) -> candle_core::Result<Tensor> {
    let b = block_size;
    let mut outs = Vec::new();
    let mut first = 0;
    while first < blocks.len() {
        let off = blocks[first].ctx_offset;
        let end = first
            + blocks[first..]
                .iter()
                .take_while(|s| s.ctx_offset == off)
                .count();
        let seq_ctx = blocks[first..end].iter().map(|s| s.anchor).max();
        let per_group = (seq_ctx.unwrap_or(0) as usize)
            .div_ceil(b)
            .clamp(1, MAX_GROUP_BLOCKS);
        for (g, chunk) in blocks[first..end].chunks(per_group).enumerate() {
            let anchors: Vec<usize> = chunk.iter().map(|s| s.anchor as usize).collect();
            let ctx_len = anchors.iter().copied().max().unwrap_or(0);
            let (rows, row_off) = (chunk.len() * b, (first + g * per_group) * b);
            let (kbg, vbg) = (kb.narrow(1, row_off, rows)?, vb.narrow(1, row_off, rows)?);
            let (keys, values) = if ctx_len == 0 {
                (kbg, vbg)
            } else {
                let (o, n) = (off as usize, ctx_len);
                (
                    Tensor::cat(&[&kc.narrow(1, o, n)?, &kbg], 1)?,
                    Tensor::cat(&[&vc.narrow(1, o, n)?, &vbg], 1)?,
                )
            };
            let mask = training_mask(&anchors, ctx_len, b, window, q.device())?;
            outs.push(attend(
                &q.narrow(1, row_off, rows)?,
                &keys,
                &values,
                Some(&mask),
                OpsMode::Differentiable,
            )?);
        }
        first = end;
    }
    Tensor::cat(&outs, 0)
}

impl DFlashDrafter {
    pub(crate) fn check_train(&self, batch: &[TrainSequence<'_>]) -> ModelResult<()> {
        let b = self.block_size();
        let width = self.target_layer_ids().len() * self.config().layers.hidden_size;
        let max_pos = self.rotary().max_positions();
        if batch.is_empty() {
            return Err(ModelError::BadInput("empty training batch".into()));
        }
        for (s, seq) in batch.iter().enumerate() {
            let (n, w) = seq.features.dims2()?;
            if w != width {
                return Err(ModelError::BadInput(format!(
                    "sequence {s}: features are {w} wide, expected {width}"
                )));
            }
            if n != seq.tokens.len() {
                return Err(ModelError::BadInput(format!(
                    "sequence {s}: {n} feature rows but {} tokens",
                    seq.tokens.len()
                )));
            }
            if seq.anchors.is_empty() {
                return Err(ModelError::BadInput(format!("sequence {s} has no anchors")));
            }
            if let Some(&a) = seq.anchors.iter().find(|&&a| a == 0 || a >= n) {
                return Err(ModelError::BadInput(format!(
                    "sequence {s}: anchor {a} is outside 1..{n} (a block needs context before it)"
                )));
            }
            let last = seq.anchors.iter().max().copied().unwrap_or(0) + b - 1;
            if last >= max_pos {
                return Err(ModelError::PositionOutOfRange {
                    position: last,
                    max: max_pos,
                });
            }
        }
        Ok(())
    }

    /// The drafter's final normed hidden states for every block slot of every anchor,
    /// `[Σ anchors * block_size, hidden]`, in batch and anchor order (composed attention).
    pub fn train_hidden(&self, batch: &[TrainSequence<'_>]) -> ModelResult<Tensor> {
        self.train_hidden_with(batch, TrainAttention::Composed)
    }

    /// [`Self::train_hidden`] with the attention run as `attention` says.
    pub fn train_hidden_with(
        &self,
        batch: &[TrainSequence<'_>],
        attention: TrainAttention,
    ) -> ModelResult<Tensor> {
        self.check_train(batch)?;
        let b = self.block_size();
        let mask_id = self.mask_token_id();
        let dev = self.device().clone();

        // Block rows of every anchor, and the context each sequence needs (up to its last anchor).
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut ctx_positions = Vec::new();
        let mut ctx_parts = Vec::with_capacity(batch.len());
        for seq in batch {
            for &a in seq.anchors {
                tokens.push(seq.tokens[a]);
                tokens.extend(std::iter::repeat_n(mask_id, b - 1));
                positions.extend((a..a + b).map(|p| p as u32));
            }
            let c = *seq.anchors.iter().max().expect("checked non-empty");
            ctx_parts.push(seq.features.narrow(0, 0, c)?);
            ctx_positions.extend((0..c).map(|p| p as u32));
        }
        let ctx = self.context_features(&Tensor::cat(&ctx_parts, 0)?)?;
        let (cos_c, sin_c) = self
            .rotary()
            .gather(&Tensor::new(ctx_positions.as_slice(), &dev)?)?;
        let (cos_b, sin_b) = self
            .rotary()
            .gather(&Tensor::new(positions.as_slice(), &dev)?)?;

        // Groups of consecutive anchors: (sequence context offset, rows, context length, masks).
        struct Group {
            ctx_off: usize,
            ctx_len: usize,
            row_off: usize,
            rows: usize,
            full: Option<Tensor>,
            sliding: Option<Tensor>,
        }
        let types = &self.config().layers.layer_types;
        let window = self.config().layers.sliding_window;
        let (has_full, has_sliding) = (
            types.contains(&LayerType::FullAttention),
            types.contains(&LayerType::SlidingAttention),
        );
        let mut groups = Vec::new();
        let mut spans = Vec::new();
        let (mut ctx_off, mut row_off) = (0, 0);
        for seq in batch {
            spans.extend(seq.anchors.iter().map(|&a| BlockSpan {
                ctx_offset: ctx_off as u32,
                anchor: a as u32,
            }));
            if attention == TrainAttention::Fused {
                ctx_off += *seq.anchors.iter().max().expect("checked non-empty");
                continue;
            }
            let c = *seq.anchors.iter().max().expect("checked non-empty");
            let per_group = c.div_ceil(b).clamp(1, MAX_GROUP_BLOCKS);
            for chunk in seq.anchors.chunks(per_group) {
                let ctx_len = *chunk.iter().max().expect("non-empty chunk");
                let mask = |w| training_mask(chunk, ctx_len, b, w, &dev);
                groups.push(Group {
                    ctx_off,
                    ctx_len,
                    row_off,
                    rows: chunk.len() * b,
                    full: has_full.then(|| mask(None)).transpose()?,
                    sliding: has_sliding
                        .then(|| mask(Some(window.unwrap_or(usize::MAX))))
                        .transpose()?,
                });
                row_off += chunk.len() * b;
            }
            ctx_off += c;
        }

        let mut h = self.embed(&tokens)?;
        for (li, layer) in self.layers().iter().enumerate() {
            let (kc, vc) = layer.kv(&ctx, &cos_c, &sin_c)?;
            let x = layer.input_norm(&h)?;
            let (q, k, v) = layer.qkv(&x, &cos_b, &sin_b)?;
            if attention == TrainAttention::Fused {
                let w = match types[li] {
                    LayerType::FullAttention => None,
                    LayerType::SlidingAttention => Some(window.unwrap_or(NO_WINDOW).min(NO_WINDOW)),
                };
                let attn = dflash_attention(&q, &kc, &vc, &k, &v, &spans, b, w)?;
                h = layer.finish(&h, &attn)?;
                continue;
            }
            let mut outs = Vec::with_capacity(groups.len());
            for g in &groups {
                let keys = Tensor::cat(
                    &[
                        &kc.narrow(1, g.ctx_off, g.ctx_len)?,
                        &k.narrow(1, g.row_off, g.rows)?,
                    ],
                    1,
                )?;
                let values = Tensor::cat(
                    &[
                        &vc.narrow(1, g.ctx_off, g.ctx_len)?,
                        &v.narrow(1, g.row_off, g.rows)?,
                    ],
                    1,
                )?;
                let mask = match types[li] {
                    LayerType::FullAttention => g.full.as_ref(),
                    LayerType::SlidingAttention => g.sliding.as_ref(),
                };
                outs.push(attend(
                    &q.narrow(1, g.row_off, g.rows)?,
                    &keys,
                    &values,
                    mask,
                    self.mode(),
                )?);
            }
            let attn = if outs.len() == 1 {
                outs.pop().expect("one group")
            } else {
                Tensor::cat(&outs, 0)?
            };
            h = layer.finish(&h, &attn)?;
        }
        self.final_norm(&h)
    }

    /// Draft logits for block slots `1..block_size` of every anchor,
    /// `[Σ anchors * (block_size - 1), vocab]`, f32: the rows [`Self::draft_logits`] returns.
    pub fn train_draft_logits(&self, batch: &[TrainSequence<'_>]) -> ModelResult<Tensor> {
        let b = self.block_size();
        let hidden = self.train_hidden(batch)?;
        let blocks: usize = batch.iter().map(|s| s.anchors.len()).sum();
        let rows: Vec<u32> = (0..blocks)
            .flat_map(|n| (1..b).map(move |k| (n * b + k) as u32))
            .collect();
        let rows = Tensor::new(rows.as_slice(), self.device())?;
        self.lm_head(&hidden.index_select(&rows, 0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visible(m: &Tensor) -> Vec<Vec<bool>> {
        m.to_vec2::<f32>()
            .unwrap()
            .into_iter()
            .map(|r| r.into_iter().map(|x| x == 0.0).collect())
            .collect()
    }

    #[test]
    fn block_sees_strictly_earlier_context_and_only_its_own_block() {
        // anchors 2 and 4, block 2, context 0..4
        let v = visible(&training_mask(&[2, 4], 4, 2, None, &Device::Cpu).unwrap());
        let t = true;
        let f = false;
        assert_eq!(v[0], vec![t, t, f, f, t, t, f, f]);
        assert_eq!(v[1], vec![t, t, f, f, t, t, f, f]);
        assert_eq!(v[2], vec![t, t, t, t, f, f, t, t]);
        assert_eq!(v[3], vec![t, t, t, t, f, f, t, t]);
    }

    #[test]
    fn sliding_rows_window_the_context_and_are_causal_in_block() {
        // anchor 5, block 3, window 3: slot k sees context j >= 5 + k - 2, j < 5
        let v = visible(&training_mask(&[5], 5, 3, Some(3), &Device::Cpu).unwrap());
        let t = true;
        let f = false;
        assert_eq!(v[0], vec![f, f, f, t, t, t, f, f]);
        assert_eq!(v[1], vec![f, f, f, f, t, t, t, f]);
        assert_eq!(v[2], vec![f, f, f, f, f, t, t, t]);
    }
}
