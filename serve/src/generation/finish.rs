//! Why a generation ended, and how each API spells it.

use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// `max_new_tokens` reached.
    Length { length: usize },
    /// EOS or a `stop_token_ids` entry.
    StopToken(u32),
    /// A stop string matched.
    StopString(String),
    /// Cut short (engine failure, shutdown).
    Abort { message: String, status: u16 },
}

impl Finish {
    /// `meta_info.finish_reason` of `/generate`.
    pub fn native(&self) -> Value {
        match self {
            Finish::Length { length } => json!({"type": "length", "length": length}),
            Finish::StopToken(id) => json!({"type": "stop", "matched": id}),
            Finish::StopString(s) => json!({"type": "stop", "matched": s}),
            Finish::Abort { message, status } => json!({
                "type": "abort", "message": message, "status_code": status, "err_type": null
            }),
        }
    }

    /// OpenAI `finish_reason`.
    pub fn openai_reason(&self) -> &'static str {
        match self {
            Finish::Length { .. } => "length",
            Finish::StopToken(_) | Finish::StopString(_) => "stop",
            Finish::Abort { .. } => "abort",
        }
    }

    /// SGLang's `matched_stop`: the token id, the stop string, or null.
    pub fn matched_stop(&self) -> Value {
        match self {
            Finish::StopToken(id) => json!(id),
            Finish::StopString(s) => json!(s),
            _ => Value::Null,
        }
    }
}
