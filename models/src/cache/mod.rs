//! Per-sequence caches: [`SequenceCache`] holds a sequence's committed rows for every layer,
//! K/V buffers for attention layers (`kv.rs`) and per-row recurrent states for the Gated
//! DeltaNet layers of the hybrid targets (`recurrent.rs`), with one truncate/compact contract
//! so a verify's accepted rows can be kept and its rejected rows dropped; the attention rows
//! live in pages of a shared pool (`pool.rs`) or, for a cache made on its own, in buffers of
//! its own; a prefix cache (`radix.rs`) shares full pages of common prefixes.

pub mod kv;
pub mod pool;
pub mod radix;
pub mod recurrent;

pub use kv::{KvBuffer, LayerCache, SequenceCache};
pub use pool::{pages_for, KvPool, PageRef, PageTable, PAGE_SIZE};
pub use radix::{PrefixCache, PrefixMatch};
pub use recurrent::{GdnState, RecurrentLayer, RowInputs, RowTracker, StagedState};
