//! The layers every model is built from, and the one place that chooses between fused
//! kernels and differentiable compositions ([`ops::OpsMode`]): the Qwen3-style decoder layer
//! (q/k-normed attention + an MLP) shared by the dense and MoE targets and the DFlash drafter
//! (`decoder_layer.rs`), the SwiGLU MLP (`mlp.rs`) and the sparse-MoE block every MoE family
//! shares (`moe.rs`), attention under the patterns speculative decoding needs (causal,
//! tree, full block, sliding window; `attention.rs`), the norm / softmax / RoPE primitives
//! (`ops.rs`; their fused trainable CUDA forms in `train_ops.rs`) and the rotary tables
//! (`rope.rs`). Nothing here names a model.

pub mod attention;
pub mod decoder_layer;
pub mod mlp;
pub mod moe;
pub mod ops;
pub mod rope;
pub mod train_ops;
