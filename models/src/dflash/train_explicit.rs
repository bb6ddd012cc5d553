//! The DFlash training step without autograd (issue 18's explicit engine): the forward of
//! [`DFlashDrafter::train_hidden_with`] with the fused attention (all blocks at once), keeping
//! what the backward reads ([`ExplicitTape`]), and the backward written out from the gradient
//! of the final normed hidden states to every drafter-owned tensor, named as
//! [`DFlashDrafter::named_tensors`]. candle's autograd makes a zero tensor and an add for every
//! gradient edge (and a strided add per weight used through `w.t()`); here each gradient is
//! produced once. The pieces are `training::explicit_{attn,mlp,proj}`; the test checks the
//! whole step against the autograd path on the CPU.

use candle_core::Tensor;
use dflash_common::LayerType;

use crate::dflash::train::{TrainSequence, NO_WINDOW};
use crate::dflash::DFlashDrafter;
use crate::error::{ModelError, ModelResult};
use crate::training::attn_dflash::DFlashAttention;
use crate::training::attn_dflash_ref::BlockSpan;
use crate::training::explicit_attn::{self, AttnSaved, Rotations};
use crate::training::explicit_mlp::{self, MlpSaved};
use crate::training::explicit_proj::{rms_backward, rms_forward, RmsSaved};

/// What [`DFlashDrafter::train_backward_explicit`] reads from the forward.
pub struct ExplicitTape {
    features: Tensor,
    ctx_norm: RmsSaved,
    ctx: Tensor,
    rot: [Tensor; 4],
    attns: Vec<DFlashAttention>,
    layers: Vec<(AttnSaved, MlpSaved)>,
    last_norm: RmsSaved,
}

impl ExplicitTape {
    fn rotations(&self) -> Rotations<'_> {
        let [cb, sb, cc, sc] = &self.rot;
        Rotations {
            block: (cb, sb),
            ctx: (cc, sc),
        }
    }
}

fn dense_only() -> ModelError {
    ModelError::Unsupported("the explicit training step runs dense drafter layers only".into())
}

impl DFlashDrafter {
    /// The final normed hidden states of every block row, `[Σ anchors * block_size, hidden]`
    /// (as [`Self::train_hidden_with`] with the fused attention), and the tape of the step.
    pub fn train_forward_explicit(
        &self,
        batch: &[TrainSequence<'_>],
    ) -> ModelResult<(Tensor, ExplicitTape)> {
        self.check_train(batch)?;
        let (b, mask_id, dev) = (
            self.block_size(),
            self.mask_token_id(),
            self.device().clone(),
        );
        let eps = self.config().layers.rms_norm_eps;
        let (mut tokens, mut positions, mut ctx_positions) = (Vec::new(), Vec::new(), Vec::new());
        let (mut parts, mut spans, mut ctx_off) = (Vec::new(), Vec::new(), 0usize);
        for seq in batch {
            for &a in seq.anchors {
                tokens.push(seq.tokens[a]);
                tokens.extend(std::iter::repeat_n(mask_id, b - 1));
                positions.extend((a..a + b).map(|p| p as u32));
                spans.push(BlockSpan {
                    ctx_offset: ctx_off as u32,
                    anchor: a as u32,
                });
            }
            let c = seq.anchors.iter().copied().max().unwrap_or(0);
            parts.push(seq.features.narrow(0, 0, c)?);
            ctx_positions.extend((0..c).map(|p| p as u32));
            ctx_off += c;
        }
        let features = Tensor::cat(&parts, 0)?.to_dtype(self.dtype())?;
        let fc_out = features.matmul(&self.fc.t()?)?;
        let (ctx, ctx_norm) = rms_forward(&fc_out, &self.hidden_norm, eps)?;
        let (cb, sb) = self
            .rotary()
            .gather(&Tensor::new(positions.as_slice(), &dev)?)?;
        let (cc, sc) = self
            .rotary()
            .gather(&Tensor::new(ctx_positions.as_slice(), &dev)?)?;
        let rot = [cb, sb, cc, sc];
        let rotations = Rotations {
            block: (&rot[0], &rot[1]),
            ctx: (&rot[2], &rot[3]),
        };
        let types = &self.config().layers.layer_types;
        let window = self.config().layers.sliding_window;
        let mut h = self.embed(&tokens)?;
        let (mut attns, mut layers) = (Vec::new(), Vec::new());
        for (li, layer) in self.layers().iter().enumerate() {
            let (aw, mw) = layer.train_weights().ok_or_else(dense_only)?;
            let w = match types[li] {
                LayerType::FullAttention => None,
                LayerType::SlidingAttention => Some(window.unwrap_or(NO_WINDOW).min(NO_WINDOW)),
            };
            let attn = DFlashAttention::new(&spans, ctx_off, b, w, &dev)?;
            let (h1, a_saved) = explicit_attn::forward(&h, &ctx, &aw, rotations, &attn)?;
            let (h2, m_saved) = explicit_mlp::forward(&h1, &mw)?;
            attns.push(attn);
            layers.push((a_saved, m_saved));
            h = h2;
        }
        let (out, last_norm) = rms_forward(&h, self.final_norm_weight(), eps)?;
        Ok((
            out,
            ExplicitTape {
                features,
                ctx_norm,
                ctx,
                rot,
                attns,
                layers,
                last_norm,
            },
        ))
    }

    /// Every drafter-owned tensor's gradient (the order and names of [`Self::named_tensors`])
    /// from `d_out`, the gradient of [`Self::train_forward_explicit`]'s output.
    pub fn train_backward_explicit(
        &self,
        tape: &ExplicitTape,
        d_out: &Tensor,
    ) -> ModelResult<Vec<(String, Tensor)>> {
        let rot = tape.rotations();
        let (mut dh, d_norm) = rms_backward(&tape.last_norm, self.final_norm_weight(), d_out)?;
        let mut dctx = tape.ctx.zeros_like()?;
        let mut per_layer = Vec::with_capacity(tape.layers.len());
        for (li, layer) in self.layers().iter().enumerate().rev() {
            let (aw, mw) = layer.train_weights().ok_or_else(dense_only)?;
            let (a_saved, m_saved) = &tape.layers[li];
            let (dh1, mg) = explicit_mlp::backward(m_saved, &dh, &mw)?;
            let (dh0, dc, ag) = explicit_attn::backward(a_saved, &dh1, &aw, rot, &tape.attns[li])?;
            dctx = (dctx + dc)?;
            dh = dh0;
            per_layer.push((li, ag, mg));
        }
        let (d_fc_out, d_hidden_norm) = rms_backward(&tape.ctx_norm, &self.hidden_norm, &dctx)?;
        let d_fc = d_fc_out.t()?.matmul(&tape.features)?;
        let mut out = vec![
            ("fc.weight".to_string(), d_fc),
            ("hidden_norm.weight".to_string(), d_hidden_norm),
        ];
        per_layer.sort_by_key(|(li, _, _)| *li);
        for (li, ag, mg) in per_layer {
            let p = |n: &str| format!("layers.{li}.{n}");
            out.extend([
                (p("input_layernorm.weight"), ag.input_norm),
                (p("post_attention_layernorm.weight"), mg.norm),
                (p("self_attn.q_proj.weight"), ag.q),
                (p("self_attn.k_proj.weight"), ag.k),
                (p("self_attn.v_proj.weight"), ag.v),
                (p("self_attn.o_proj.weight"), ag.o),
                (p("self_attn.q_norm.weight"), ag.q_norm),
                (p("self_attn.k_norm.weight"), ag.k_norm),
                (p("mlp.gate_proj.weight"), mg.gate),
                (p("mlp.up_proj.weight"), mg.up),
                (p("mlp.down_proj.weight"), mg.down),
            ]);
        }
        out.push(("norm.weight".to_string(), d_norm));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use crate::training::max_rel;
    use std::collections::HashMap;

    use candle_core::{DType, Device, Tensor, Var};
    use dflash_common::DFlashConfig;

    use crate::dflash::train::{TrainAttention, TrainSequence};
    use crate::dflash::{DFlashDrafter, TargetEmbeddingsAndHead};
    use crate::layers::ops::OpsMode;
    use crate::random::WeightRng;

    fn tiny_config() -> DFlashConfig {
        DFlashConfig::from_file(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/dflash-tiny-random/config.json"
        ))
        .unwrap()
    }

    /// The whole explicit step (context path, two layers, final norm) against candle's
    /// autograd through `train_hidden_with` (fused attention on its CPU reference), f32, two
    /// sequences of different lengths with several anchors each: the output and every
    /// drafter-owned tensor's gradient within 1e-4.
    #[test]
    fn the_explicit_step_equals_autograd_for_every_tensor() {
        check_step(tiny_config());
    }

    /// As above with the first layer a sliding-window layer (window 5: anchors 9 and 14 see
    /// only part of their context).
    #[test]
    fn the_explicit_step_equals_autograd_with_a_sliding_layer() {
        let mut cfg = tiny_config();
        cfg.layers.layer_types[0] = dflash_common::LayerType::SlidingAttention;
        cfg.layers.sliding_window = Some(5);
        check_step(cfg);
    }

    fn check_step(cfg: DFlashConfig) {
        let dev = Device::Cpu;
        let (h, v) = (cfg.layers.hidden_size, cfg.layers.vocab_size);
        let width = cfg.target_layer_ids.len() * h;
        let mut rng = WeightRng::new(21);
        let target = TargetEmbeddingsAndHead {
            embed_tokens: rng.normal(&[v, h], 0.0, 1.0, DType::F32, &dev).unwrap(),
            lm_head: rng.normal(&[v, h], 0.0, 0.1, DType::F32, &dev).unwrap(),
            max_positions: 256,
        };
        let mut vars: HashMap<String, Var> = HashMap::new();
        for (name, shape) in DFlashDrafter::parameter_shapes(&cfg) {
            let t = if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
                rng.normal(&shape, 1.0, 0.1, DType::F32, &dev).unwrap()
            } else {
                let fan_in = *shape.last().unwrap() as f32;
                rng.normal(&shape, 0.0, 1.0 / fan_in.sqrt(), DType::F32, &dev)
                    .unwrap()
            };
            vars.insert(name, Var::from_tensor(&t).unwrap());
        }
        let tensors: HashMap<String, Tensor> = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let drafter =
            DFlashDrafter::from_tensors(cfg, &tensors, &target, OpsMode::Differentiable).unwrap();
        let feats: Vec<Tensor> = [20usize, 13]
            .iter()
            .map(|&n| rng.normal(&[n, width], 0.0, 1.0, DType::F32, &dev).unwrap())
            .collect();
        let toks: Vec<Vec<u32>> = [20usize, 13]
            .iter()
            .map(|&n| (0..n as u32).map(|i| (i * 37 + 5) % 8000).collect())
            .collect();
        let anchors = [vec![3usize, 9, 14], vec![2usize, 8]];
        let batch: Vec<TrainSequence<'_>> = (0..2)
            .map(|s| TrainSequence {
                features: &feats[s],
                tokens: &toks[s],
                anchors: &anchors[s],
            })
            .collect();

        let want = drafter
            .train_hidden_with(&batch, TrainAttention::Fused)
            .unwrap();
        let probe = rng.normal(want.dims(), 0.0, 1.0, DType::F32, &dev).unwrap();
        let grads = (&want * &probe)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();

        let (got, tape) = drafter.train_forward_explicit(&batch).unwrap();
        assert!(max_rel(&got, &want) < 1e-5);
        let named = drafter.train_backward_explicit(&tape, &probe).unwrap();
        assert_eq!(named.len(), vars.len());
        for (name, g) in &named {
            let var = &vars[name];
            let e = max_rel(g, grads.get(var.as_tensor()).unwrap());
            assert!(e < 1e-4, "d{name}: rel err {e}");
        }
    }
}
