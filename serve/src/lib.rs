//! `dflash-serve`: an SGLang- and OpenAI-compatible HTTP server for DFlash speculative decoding.
//!
//! Owns the HTTP surface (routes, wire types, validation, SSE, auth, metrics), the command line,
//! and the engine thread that owns the model. It never touches a tensor: requests are lowered to
//! token ids and sampling values (`generation::PreparedRequest`) and sent over channels to one
//! engine thread (`engine`); model math and decoding live in `dflash-models`, tokenizers and chat
//! templates in `dflash-common`. Structured output (`grammar`) compiles a request's grammar with
//! llguidance into a `dflash_models::speculative::Constraint` the engine applies at every tree
//! node.

pub mod cli;
pub mod config;
pub mod engine;
pub mod error;
pub mod generation;
pub mod grammar;
pub mod memory;
pub mod metrics;
pub mod routes;
pub mod server;
pub mod state;
pub mod validation;

pub use config::ServeConfig;
pub use state::AppState;
