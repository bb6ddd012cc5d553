//! What both binaries need and neither owns: parsing Hugging Face / z-lab `config.json` files
//! (dense and MoE Qwen3, the hybrids, the drafters),
//! opening safetensors checkpoints (single file or sharded, memory-mapped) with errors that name
//! the file and the tensor, and locating a model either in a local directory or in the Hugging
//! Face cache; the tokenizer, chat-template rendering and incremental detokenization with stop
//! strings, so prompts are built identically by the server and the trainer. No model math lives
//! here (that is `dflash-models`), and no HTTP (that is `dflash-serve`).

pub mod chat;
pub mod config;
pub mod config_hybrid;
pub mod config_moe;
pub mod detokenize;
pub mod error;
pub mod hub;
pub mod tokenizer;
pub mod weights;

pub use config::{DFlashConfig, LayerType, Qwen3Config, RopeScaling};
pub use config_hybrid::{HybridConfig, HybridLayerType};
pub use config_moe::{MoeConfig, MoeLayers};
pub use error::{ConfigError, HubError, WeightError};
pub use hub::{resolve_model, ModelLocation};
pub use weights::WeightFiles;
