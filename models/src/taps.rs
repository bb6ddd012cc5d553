//! What a tap on a target layer is: the one definition every forward (the plain Qwen3 and
//! hybrid forwards, the fused CUDA stack, the CUDA step graphs) and so serve, train and eval
//! use.
//!
//! A tap on layer `i` of an `L`-layer target is transformers' `output_hidden_states[i + 1]`,
//! which z-lab's `extract_context_feature` reads for DFlash (`hidden_states[layer_id + 1]`):
//! - `i < L - 1`: the raw residual-stream output of decoder layer `i` (after both residual adds);
//! - `i = L - 1`: the output after the model's final norm, because transformers appends the
//!   last entry of `hidden_states` only after `norm` (`Qwen3Model.forward`,
//!   `Qwen3_5TextModel.forward`, `Qwen3NextModel.forward`: max |hidden_states[-1] -
//!   norm(raw last layer)| = 0).
//!
//! So a drafter trained here on the last layer sees the same features under transformers and
//! z-lab's `dflash_generate`. Engines that capture inside the layer loop (SGLang, vLLM) do not
//! produce the normed tensor there; `dflash-train` warns about such drafters
//! (`dflash_train::tap_compat`), and its default taps stay below the last layer.

use std::collections::HashMap;

use candle_core::Tensor;

use crate::error::{ModelError, ModelResult};

/// Whether a tap on `layer` of a `num_layers`-layer target is the final-normed output (the
/// last layer) rather than the raw output of that decoder layer.
pub fn tap_is_final_normed(layer: usize, num_layers: usize) -> bool {
    layer + 1 == num_layers
}

/// Gathers the taps of one forward: every decoder layer's raw output is offered as it is
/// made, and the final-normed rows once the stack is done.
pub(crate) struct TapCollector<'a> {
    layers: &'a [usize],
    num_layers: usize,
    raw: HashMap<usize, Tensor>,
}

impl<'a> TapCollector<'a> {
    /// Collects the taps of `layers` (in that order, repeats allowed) of a `num_layers`-layer
    /// stack; `check_batch` has already refused layers that do not exist.
    pub fn new(layers: &'a [usize], num_layers: usize) -> Self {
        Self {
            layers,
            num_layers,
            raw: HashMap::new(),
        }
    }

    /// Offers decoder layer `layer`'s raw output; kept when a tap takes it raw. Cloning a
    /// candle tensor shares its storage, so nothing is copied.
    pub fn layer_output(&mut self, layer: usize, x: &Tensor) {
        if self.layers.contains(&layer) && !tap_is_final_normed(layer, self.num_layers) {
            self.raw.insert(layer, x.clone());
        }
    }

    /// Whether a tap takes the final-normed rows, so the forward must norm every row (not only
    /// the logit rows).
    pub fn wants_final_norm(&self) -> bool {
        self.layers
            .iter()
            .any(|&l| tap_is_final_normed(l, self.num_layers))
    }

    /// The tapped tensors in the order asked. `normed` is the final norm of every row, needed
    /// when [`wants_final_norm`](Self::wants_final_norm).
    pub fn parts(&self, normed: Option<&Tensor>) -> ModelResult<Vec<Tensor>> {
        self.layers
            .iter()
            .map(|&l| {
                let t = if tap_is_final_normed(l, self.num_layers) {
                    normed
                } else {
                    self.raw.get(&l)
                };
                t.cloned().ok_or_else(|| {
                    ModelError::BadInput(format!("layer {l} was not tapped by this forward"))
                })
            })
            .collect()
    }

    /// `[rows, taps * hidden]`, the layout DFlash's `fc` expects; None without taps.
    pub fn finish(&self, normed: Option<&Tensor>) -> ModelResult<Option<Tensor>> {
        if self.layers.is_empty() {
            return Ok(None);
        }
        let parts = self.parts(normed)?;
        Ok(Some(Tensor::cat(&parts, 1)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn only_the_last_layer_is_final_normed() {
        assert!(!tap_is_final_normed(0, 4));
        assert!(!tap_is_final_normed(2, 4));
        assert!(tap_is_final_normed(3, 4));
        assert!(tap_is_final_normed(0, 1));
    }

    #[test]
    fn taps_come_back_in_the_order_asked_with_the_normed_rows_for_the_last_layer() {
        let dev = Device::Cpu;
        let raw = |v: f32| Tensor::full(v, (2, 1), &dev).unwrap();
        let mut c = TapCollector::new(&[2, 0, 2], 3);
        assert!(c.wants_final_norm());
        for l in 0..3 {
            c.layer_output(l, &raw(l as f32));
        }
        let normed = raw(9.0);
        let out = c.finish(Some(&normed)).unwrap().unwrap();
        assert_eq!(
            out.to_vec2::<f32>().unwrap(),
            vec![vec![9.0, 0.0, 9.0], vec![9.0, 0.0, 9.0]]
        );
        assert!(
            c.finish(None).is_err(),
            "the last layer needs the normed rows"
        );
    }

    #[test]
    fn raw_taps_need_no_norm() {
        let dev = Device::Cpu;
        let mut c = TapCollector::new(&[1], 3);
        assert!(!c.wants_final_norm());
        c.layer_output(
            1,
            &Tensor::ones((1, 2), candle_core::DType::F32, &dev).unwrap(),
        );
        assert_eq!(c.finish(None).unwrap().unwrap().dims(), &[1, 2]);
        assert!(TapCollector::new(&[], 3).finish(None).unwrap().is_none());
    }
}
