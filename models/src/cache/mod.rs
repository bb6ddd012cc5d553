//! Per-sequence caches: [`SequenceCache`] holds a sequence's committed rows for every layer,
//! K/V buffers for attention layers (`kv.rs`) and per-row recurrent states for the Gated
//! DeltaNet layers of the hybrid targets (`recurrent.rs`), with one truncate/compact contract
//! so a verify's accepted rows can be kept and its rejected rows dropped.

pub mod kv;
pub mod recurrent;

pub use kv::{KvBuffer, LayerCache, SequenceCache};
pub use recurrent::{GdnState, RecurrentLayer, RowTracker, StagedState};
