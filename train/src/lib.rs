//! `dflash-train`: data, the drafter training pipeline and drafter evaluation. Model math lives
//! in `dflash-models` (the trainer's differentiable forward shares its layers); this crate owns
//! datasets, the target-worker -> hidden-state queue -> trainer pipeline, checkpoints in the
//! z-lab format, and `dflash-train eval`.

pub mod durable;
pub mod eval;
pub mod observe;
pub mod regenerate;
pub mod tap_compat;
pub mod train;
