//! The f32 constants of one AdamW update, shared by the device kernel and the host reference.

/// Rounded to f32 as the reference optimizer (`dflash-train`'s `AdamW`, candle ops in f32)
/// rounds them: `1 - beta` and `lr * weight_decay` are formed in f64 first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConsts {
    pub lr: f32,
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub eps: f32,
    pub lr_wd: f32,
    /// Global-norm clip (0: none).
    pub clip: f32,
}
