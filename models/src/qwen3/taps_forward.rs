//! The trainer's target forward: the tapped hidden states ([`crate::taps`]) of every token of a
//! batch of whole sequences, with nothing else. It stops after the deepest tapped layer, writes
//! no K/V cache (each sequence attends causally over its own rows, which are all present), and
//! on CUDA runs each layer's attention for the whole batch in one launch of the varlen causal
//! kernel (`cuda/attn_varlen.cu`). [`Qwen3Model::forward`] with a fresh cache per sequence and
//! the causal pattern computes the same taps; it stays the reference this path is checked
//! against (`tests/tests/taps_forward.rs` on the CPU, `gpu_check --train` on the GPU).

use candle_core::Tensor;

use super::Qwen3Model;
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::{attend, AttnPattern};
use crate::layers::ops::OpsMode;
use crate::taps::TapCollector;

/// What [`Qwen3Model::forward_taps`] returns.
#[derive(Debug)]
pub struct TapsOutput {
    /// `[Σ len, taps.len() * hidden]` in the model's dtype, on its device, sequences in order.
    pub features: Tensor,
    /// Start of each sequence's rows (`len = seqs + 1`).
    pub offsets: Vec<usize>,
}

impl Qwen3Model {
    /// The taps of `layers` (HF `hidden_states[i + 1]`, in the order asked) for every token of
    /// each of `seqs`, each sequence forwarded alone from position 0 (causal, no cache).
    pub fn forward_taps(&self, seqs: &[&[u32]], layers: &[usize]) -> ModelResult<TapsOutput> {
        let Some(&deepest) = layers.iter().max() else {
            return Err(ModelError::BadInput(
                "forward_taps needs at least one tap".into(),
            ));
        };
        if deepest >= self.layers.len() {
            return Err(ModelError::BadInput(format!(
                "tap on layer {deepest}: this target runs {} layers",
                self.layers.len()
            )));
        }
        let mut offsets = Vec::with_capacity(seqs.len() + 1);
        offsets.push(0usize);
        let (mut tokens, mut positions) = (Vec::new(), Vec::new());
        for (s, seq) in seqs.iter().enumerate() {
            if seq.is_empty() || seq.len() > self.rope.max_positions() {
                return Err(ModelError::BadInput(format!(
                    "sequence {s} has {} tokens (1..={} allowed)",
                    seq.len(),
                    self.rope.max_positions()
                )));
            }
            if let Some(&t) = seq.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
                return Err(ModelError::BadInput(format!(
                    "sequence {s}: token {t} is outside the vocabulary of {}",
                    self.cfg.vocab_size
                )));
            }
            tokens.extend_from_slice(seq);
            positions.extend(0..seq.len() as u32);
            offsets.push(tokens.len());
        }
        let attention = BatchAttention::new(self, &offsets)?;
        let positions = Tensor::new(positions.as_slice(), &self.device)?;
        let (cos, sin) = self.rope.gather(&positions)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        let mut x = self.embed(&tokens)?;
        let mut tapped = TapCollector::new(layers, self.cfg.num_hidden_layers);
        // On CUDA the q/k norm + RoPE and the SiLU gate run as the trainer's one-kernel ops
        // (`layers::train_ops`, chosen by the `Differentiable` mode; no gradient flows, the
        // target is frozen) in place of candle's norm, rope, transpose, silu and multiply;
        // elsewhere (or with the train ops switched to their compositions) the model's own
        // mode, unchanged.
        let fused_ops = if self.device.is_cuda() && crate::layers::train_ops::fused_train_ops() {
            OpsMode::Differentiable
        } else {
            self.mode
        };
        for (li, layer) in self.layers[..=deepest].iter().enumerate() {
            let h = layer.input_norm(&x)?;
            let (q, k, v) = layer.qkv_with(&h, &cos, &sin, fused_ops)?;
            let attn = attention.run(&q, &k, &v)?;
            x = layer.finish_with(&x, &attn, fused_ops)?;
            tapped.layer_output(li, &x);
        }
        let normed = tapped
            .wants_final_norm()
            .then(|| self.final_norm(&x))
            .transpose()?;
        let features = tapped
            .finish(normed.as_ref())?
            .ok_or_else(|| ModelError::BadInput("forward_taps needs at least one tap".into()))?;
        Ok(TapsOutput { features, offsets })
    }
}

/// One layer's causal attention over the packed batch: the varlen kernel where it applies
/// (CUDA, bf16, head_dim 64 or 128), else per sequence through [`attend`] under the causal
/// mask (the CPU reference). What both need from the batch is built once per forward.
enum BatchAttention {
    #[cfg(feature = "cuda")]
    Varlen { offsets: Tensor, tiles: Tensor },
    PerSequence {
        offsets: Vec<usize>,
        masks: Vec<Option<Tensor>>,
        mode: crate::layers::ops::OpsMode,
    },
}

impl BatchAttention {
    fn new(model: &Qwen3Model, offsets: &[usize]) -> ModelResult<Self> {
        #[cfg(feature = "cuda")]
        if model.device.is_cuda()
            && model.dtype == candle_core::DType::BF16
            && crate::cuda::varlen_head_dim_supported(model.cfg.head_dim)
        {
            let lens: Vec<usize> = offsets.windows(2).map(|w| w[1] - w[0]).collect();
            let groups = model.cfg.num_attention_heads / model.cfg.num_key_value_heads.max(1);
            let tiles = crate::cuda::varlen_tiles(&lens, groups);
            let offs: Vec<u32> = offsets.iter().map(|&o| o as u32).collect();
            return Ok(Self::Varlen {
                offsets: Tensor::new(offs.as_slice(), &model.device)?,
                tiles: Tensor::new(tiles.as_slice(), &model.device)?,
            });
        }
        let masks = offsets
            .windows(2)
            .map(|w| AttnPattern::Causal.mask(0, w[1] - w[0], &model.device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self::PerSequence {
            offsets: offsets.to_vec(),
            masks,
            mode: model.mode,
        })
    }

    /// q `[nh, total, d]`, k and v `[nkv, total, d]` -> `[total, nh * d]`.
    fn run(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> ModelResult<Tensor> {
        match self {
            #[cfg(feature = "cuda")]
            Self::Varlen { offsets, tiles } => Ok(crate::cuda::attention_varlen_causal(
                q, k, v, offsets, tiles,
            )?),
            Self::PerSequence {
                offsets,
                masks,
                mode,
            } => {
                let outs = offsets
                    .windows(2)
                    .zip(masks)
                    .map(|(w, mask)| {
                        let (off, t) = (w[0], w[1] - w[0]);
                        attend(
                            &q.narrow(1, off, t)?,
                            &k.narrow(1, off, t)?,
                            &v.narrow(1, off, t)?,
                            mask.as_ref(),
                            *mode,
                        )
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok(Tensor::cat(&outs, 0)?)
            }
        }
    }
}
