//! The plain forward of [`Qwen35Model`] (candle ops; every device, batch, tree and prefill):
//! the reference the fused CUDA forward (`cuda.rs`) is checked against, and what takes
//! everything that forward does not.

use candle_core::Tensor;

use crate::batch::{check_batch, ForwardOutput, SeqForward, StackedBatch};
use crate::cache::StagedState;
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::{attend, AttnPattern};
use crate::layers::ops::rms_norm;
use crate::qwen3_5::delta_rule::Forest;
use crate::qwen3_5::{GatedDeltaNet, Mixer, Qwen35Model};
use crate::taps::TapCollector;

impl Qwen35Model {
    /// Runs the new tokens of every sequence; on error no cache changes what is live.
    pub fn forward(
        &self,
        batch: &mut [SeqForward<'_>],
        taps: &[usize],
    ) -> ModelResult<ForwardOutput> {
        check_batch(
            batch,
            taps,
            self.layers.len(),
            self.cfg.vocab_size,
            self.rope.max_positions(),
        )?;
        #[cfg(feature = "cuda")]
        if self.takes_fused(batch) {
            if let Some(out) = self.forward_decode_graph(batch, taps)? {
                return Ok(out);
            }
            return self.forward_fused(&mut batch[0], taps);
        }
        let StackedBatch {
            tokens: all_tokens,
            positions: all_positions,
            logit_rows,
            token_offsets,
            logit_offsets,
        } = StackedBatch::new(batch);
        let mut forests: Vec<Vec<Option<usize>>> = Vec::with_capacity(batch.len());
        let mut keep_rows = Vec::with_capacity(batch.len());
        for seq in batch.iter() {
            let t = seq.tokens.len();
            let tracker = seq.cache.row_tracker().ok_or_else(|| {
                ModelError::BadInput(
                    "a hybrid model needs a cache from Qwen35Model::new_cache".into(),
                )
            })?;
            tracker.check_extendable(seq.cache.len())?;
            let keep = t <= tracker.rollback;
            let forest = match seq.pattern {
                AttnPattern::Tree { parents } => {
                    if !keep {
                        return Err(ModelError::BadInput(format!(
                            "a tree of {t} nodes exceeds the cache's rollback window of {} rows; create the cache with new_cache_with_rollback",
                            tracker.rollback
                        )));
                    }
                    parents.clone()
                }
                _ => (0..t).map(|i| i.checked_sub(1)).collect(),
            };
            forests.push(forest);
            keep_rows.push(keep);
        }
        // GDN plans, shared by every GDN layer: one forest over all sequences that take the
        // recurrence (their tokens of one depth step together), one per chunked sequence.
        let kernel = self.cfg.linear_conv_kernel_dim;
        let chunked: Vec<bool> = forests
            .iter()
            .zip(&keep_rows)
            .map(|(f, &keep)| GatedDeltaNet::use_chunked(f.len(), keep, self.form))
            .collect();
        // Rollback-able forwards take the tree form one sequence at a time (`mix_staged`).
        let members: Vec<usize> = (0..batch.len())
            .filter(|&s| !chunked[s] && !keep_rows[s])
            .collect();
        let plan = if members.is_empty() {
            None
        } else {
            let segs: Vec<&[Option<usize>]> =
                members.iter().map(|&s| forests[s].as_slice()).collect();
            let forest = Forest::new(&segs, kernel, &self.device)?;
            // The members' proj rows, unless they are the whole batch in order.
            let rows = if members.len() == batch.len() {
                None
            } else {
                let r: Vec<u32> = members
                    .iter()
                    .flat_map(|&s| (token_offsets[s]..token_offsets[s + 1]).map(|i| i as u32))
                    .collect();
                Some(Tensor::new(r.as_slice(), &self.device)?)
            };
            Some((forest, rows))
        };
        let single: Vec<Option<Forest>> = (0..batch.len())
            .map(|s| {
                (chunked[s] || keep_rows[s])
                    .then(|| Forest::new(&[forests[s].as_slice()], kernel, &self.device))
                    .transpose()
            })
            .collect::<candle_core::Result<_>>()?;
        let masks = batch
            .iter()
            .map(|s| s.pattern.mask(s.cache.len(), s.tokens.len(), &self.device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let positions = Tensor::new(all_positions.as_slice(), &self.device)?;
        let (cos, sin) = self.rope.gather(&positions)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        self.phase("embed");
        let mut x = self.embed(&all_tokens)?;
        let mut tapped = TapCollector::new(taps, self.layers.len());
        let mut staged: Vec<Vec<(usize, StagedState)>> = batch.iter().map(|_| Vec::new()).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            self.phase("input_norm");
            let h = rms_norm(&x, &layer.input_norm, self.cfg.rms_norm_eps, self.mode)?;
            let mixed = match &layer.mixer {
                Mixer::Full(attn) => {
                    self.phase("attn.qkv");
                    let (q, k, v, gate) = attn.qkv_gate(&h, &cos, &sin)?;
                    self.phase("attn.mix");
                    let mut outs = Vec::with_capacity(batch.len());
                    for (s, seq) in batch.iter().enumerate() {
                        let (off, t) = (token_offsets[s], seq.tokens.len());
                        let len = seq.cache.len();
                        seq.cache.write_kv(
                            li,
                            len,
                            &k.narrow(1, off, t)?,
                            &v.narrow(1, off, t)?,
                        )?;
                        #[cfg(feature = "cuda")]
                        if let Some(o) =
                            self.fresh_causal_attention((&q, &k, &v), (off, t), len, seq.pattern)?
                        {
                            outs.push(o);
                            continue;
                        }
                        let (kc, vc) = seq.cache.view_kv(li, len + t)?;
                        outs.push(attend(
                            &q.narrow(1, off, t)?,
                            &kc,
                            &vc,
                            masks[s].as_ref(),
                            self.mode,
                        )?);
                    }
                    self.phase("attn.out");
                    attn.out(&cat_rows(outs)?, &gate)?
                }
                Mixer::Linear(gdn) => {
                    self.phase("gdn.project");
                    let proj = gdn.project(&h)?;
                    self.phase("gdn.mix");
                    let mut pieces: Vec<Option<Tensor>> = vec![None; batch.len()];
                    if let Some((forest, rows)) = &plan {
                        let p = match rows {
                            Some(r) => proj.index_select(r, 0)?,
                            None => proj.clone(),
                        };
                        let states = members
                            .iter()
                            .map(|&s| batch[s].cache.layer(li).recurrent()?.last())
                            .collect::<ModelResult<Vec<_>>>()?;
                        let keep = vec![false; members.len()];
                        let (y, st) = gdn.mix(&p, forest, &states, &keep, false)?;
                        for ((&s, &(off, len)), st) in members.iter().zip(&forest.segments).zip(st)
                        {
                            pieces[s] = Some(y.narrow(0, off, len)?);
                            staged[s].push((li, st));
                        }
                    }
                    for (s, seq) in batch.iter().enumerate() {
                        let Some(forest) = &single[s] else { continue };
                        let (off, t) = (token_offsets[s], seq.tokens.len());
                        let state = seq.cache.layer(li).recurrent()?.last()?;
                        let p = proj.narrow(0, off, t)?;
                        #[cfg(feature = "cuda")]
                        if let Some((y, st)) =
                            self.gdn_kernels(gdn, &p, forest, &forests[s], state, keep_rows[s])?
                        {
                            pieces[s] = Some(y);
                            staged[s].push((li, st));
                            continue;
                        }
                        let (y, st) = if keep_rows[s] {
                            gdn.mix_staged(&p, forest, &forests[s], state)?
                        } else {
                            let (y, mut st) = gdn.mix(&p, forest, &[state], &[false], true)?;
                            (y, st.remove(0))
                        };
                        pieces[s] = Some(y);
                        staged[s].push((li, st));
                    }
                    let pieces = pieces
                        .into_iter()
                        .map(|p| {
                            p.ok_or_else(|| {
                                ModelError::BadInput("a sequence missed its GDN output".into())
                            })
                        })
                        .collect::<ModelResult<Vec<_>>>()?;
                    self.phase("gdn.out");
                    gdn.out(&cat_rows(pieces)?)?
                }
            };
            self.phase("mlp");
            let x1 = (x + mixed)?;
            let h2 = rms_norm(&x1, &layer.post_norm, self.cfg.rms_norm_eps, self.mode)?;
            // A sparse layer on the fast path: the block on the device (no host routing, so
            // trees and prefill pieces stay sync-free); a dense one's verify rows on cuBLASLt
            // where that switch is on; else the plain block.
            let on_device = match self.fast {
                true => layer.mlp_on_device(&x1, &h2)?,
                false => None,
            };
            x = match on_device {
                Some(x2) => x2,
                None => (&x1 + layer.mlp.forward(&h2)?)?,
            };
            tapped.layer_output(li, &x);
        }
        self.phase("commit_and_head");
        for (s, seq) in batch.iter_mut().enumerate() {
            let t = seq.tokens.len();
            let parents = keep_rows[s].then_some(forests[s].as_slice());
            seq.cache
                .commit_recurrent(t, parents, std::mem::take(&mut staged[s]))?;
        }
        // As in the dense forward: a last-layer tap norms every row, the logit rows reuse it.
        let normed = tapped
            .wants_final_norm()
            .then(|| self.final_norm(&x))
            .transpose()?;
        let taps = tapped.finish(normed.as_ref())?;
        let logits = if logit_rows.is_empty() {
            None
        } else {
            let rows = Tensor::new(logit_rows.as_slice(), &self.device)?;
            let h = match &normed {
                Some(n) => n.index_select(&rows, 0)?,
                None => self.final_norm(&x.index_select(&rows, 0)?)?,
            };
            Some(self.lm_head(&h)?)
        };
        self.phase("end");
        Ok(ForwardOutput {
            logits,
            taps,
            token_offsets,
            logit_offsets,
        })
    }

    /// Marks the start of a phase of the plain forward for a bench's GPU-timeline profile
    /// (`cuda::phases`: one relaxed atomic load when no profile is open; nothing on the CPU).
    fn phase(&self, _label: &'static str) {
        #[cfg(feature = "cuda")]
        crate::cuda::phases::mark(&self.device, _label);
    }
}

fn cat_rows(mut outs: Vec<Tensor>) -> candle_core::Result<Tensor> {
    if outs.len() == 1 {
        Ok(outs.pop().expect("one output"))
    } else {
        Tensor::cat(&outs, 0)
    }
}
