//! Request rules shared by `/generate`, `/v1/completions` and `/v1/chat/completions`. One variant
//! per rule; each message names the field as the client spelled it, the bound and the value
//! given, so it says what to change. Context-length messages keep SGLang's exact wording because
//! clients match on it.

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValidationError {
    /// serde's `unknown_field` text, which SGLang 0.5.23's contract check answers with.
    #[error("unknown field `{key}`, expected one of {}", expected.iter().map(|f| format!("`{f}`")).collect::<Vec<_>>().join(", "))]
    UnknownField {
        key: String,
        expected: &'static [&'static str],
    },
    #[error("Either text, input_ids or input_embeds should be provided.")]
    NoPrompt,
    #[error("Only one of text, input_ids or input_embeds may be provided; got {given}.")]
    SeveralPrompts { given: String },
    #[error("Prompt cannot be empty")]
    EmptyPrompt,
    #[error("`messages` must be a non-empty list of {{\"role\", \"content\"}} objects")]
    EmptyMessages,
    #[error("`messages[{index}]`: {problem}")]
    BadMessage { index: usize, problem: String },
    #[error("`{field}` must be a finite number >= 0. Given: {value}")]
    Temperature { field: &'static str, value: f64 },
    #[error("`{field}` must be a finite number within ±3.4e38 (it is used as a 32-bit float). Given: {value:e}")]
    NotF32 { field: &'static str, value: f64 },
    #[error("The request asks for {requested} sequences (prompts x n); at most {max} are allowed per request (--max-sequences-per-request); split it into smaller requests")]
    TooManySequences { requested: usize, max: usize },
    #[error(
        "The input (at least {at_least} tokens) is longer than the model's context length ({context} tokens)."
    )]
    PromptTooLongAtLeast { at_least: usize, context: usize },
    #[error("`{field}` must be in (0, 1]. Given: {value}")]
    TopP { field: &'static str, value: f64 },
    #[error("`{field}` must be -1 (disable) or at least 1. Given: {value}")]
    TopK { field: &'static str, value: i64 },
    #[error("`{field}` must be in [0, 1]. Given: {value}")]
    MinP { field: &'static str, value: f64 },
    #[error("`{field}` must be in [-2, 2]. Given: {value}")]
    Penalty { field: &'static str, value: f64 },
    #[error("`{field}` must be in (0, 2]. Given: {value}")]
    RepetitionPenalty { field: &'static str, value: f64 },
    #[error("`{field}` must be >= {min}. Given: {value}")]
    TooSmall {
        field: &'static str,
        min: i64,
        value: i64,
    },
    #[error("`{field}` must be <= {max}. Given: {value}")]
    TooLarge {
        field: &'static str,
        max: i64,
        value: i64,
    },
    #[error("`{min_field}` ({min}) must be <= `{max_field}` ({max})")]
    MinAboveMax {
        min_field: &'static str,
        min: i64,
        max_field: &'static str,
        max: i64,
    },
    #[error("`{field}` has {count} entries; at most {max} are allowed")]
    TooManyStops {
        field: &'static str,
        count: usize,
        max: usize,
    },
    #[error("`{field}` contains token id {value}, outside the vocabulary [0, {vocab_size})")]
    TokenOutOfRange {
        field: &'static str,
        value: i64,
        vocab_size: usize,
    },
    #[error("`{field}` has {got} entries but the batch has {batch} prompts; give one per prompt or a single one")]
    BatchMismatch {
        field: &'static str,
        got: usize,
        batch: usize,
    },
    #[error("`{field}` is not supported by dflash-serve; remove it from the request")]
    Unsupported { field: &'static str },
    #[error("`{field}` keys must be token ids (decimal strings) inside the vocabulary [0, {vocab_size}) and values finite numbers; got key {key:?} with value {value}")]
    BadLogitBias {
        field: &'static str,
        key: String,
        value: String,
        vocab_size: usize,
    },
    #[error(transparent)]
    GrammarSpec(#[from] crate::grammar::SpecError),
    #[error(transparent)]
    Grammar(#[from] crate::grammar::GrammarError),
    #[error("`{field}` must be {expected}")]
    BadJsonType {
        field: &'static str,
        expected: &'static str,
    },
    #[error("`logprob_start_len` must be -1 (output tokens only) or a prompt position >= 0. Given: {given}")]
    InputLogprobs { given: i64 },
    #[error("`tool_choice` {given} constrains the answer to a tool call in the Qwen2.5/Qwen3 format, which needs the server started with --tool-call-parser qwen25 (or hermes){configured}")]
    ToolChoiceNeedsParser { given: String, configured: String },
    #[error("`tool_choice` {given} and `{other}` both constrain the answer; send one")]
    ToolChoiceAndGrammar { given: String, other: &'static str },
    #[error(transparent)]
    ToolGrammar(#[from] crate::grammar::tools::ToolGrammarError),
    #[error("`tool_choice` must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}. Given: {given}")]
    BadToolChoice { given: String },
    #[error(
        "The input ({input} tokens) is longer than the model's context length ({context} tokens)."
    )]
    PromptTooLong { input: usize, context: usize },
    #[error("Requested token count exceeds the model's maximum context length of {context} tokens. You requested a total of {total} tokens: {input} tokens from the input messages and {completion} tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.")]
    TotalTooLong {
        context: usize,
        total: usize,
        input: usize,
        completion: usize,
    },
}

/// The most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 32;
/// The most parallel samples (`n`) one request may ask for.
pub const MAX_N: i64 = 64;

/// Sampling values travel to the engine as `f32`: a finite `f64` beyond its range (1e39)
/// would silently become infinity there, so it is refused here with the value as given.
pub fn check_f32(field: &'static str, v: Option<f64>) -> Result<(), ValidationError> {
    match v {
        Some(value) if !value.is_finite() || !(value as f32).is_finite() => {
            Err(ValidationError::NotF32 { field, value })
        }
        _ => Ok(()),
    }
}

/// A request's sequences (prompts x n) against the per-request cap.
pub fn check_sequences(requested: usize, max: usize) -> Result<(), ValidationError> {
    if requested > max {
        return Err(ValidationError::TooManySequences { requested, max });
    }
    Ok(())
}

pub fn check_temperature(field: &'static str, v: Option<f64>) -> Result<(), ValidationError> {
    match v {
        Some(value) if !value.is_finite() || value < 0.0 => {
            Err(ValidationError::Temperature { field, value })
        }
        _ => Ok(()),
    }
}

pub fn check_top_p(field: &'static str, v: Option<f64>) -> Result<(), ValidationError> {
    match v {
        Some(value) if !(value > 0.0 && value <= 1.0) => {
            Err(ValidationError::TopP { field, value })
        }
        _ => Ok(()),
    }
}

pub fn check_top_k(field: &'static str, v: Option<i64>) -> Result<(), ValidationError> {
    match v {
        Some(value) if value != -1 && value < 1 => Err(ValidationError::TopK { field, value }),
        _ => Ok(()),
    }
}

pub fn check_min_p(field: &'static str, v: Option<f64>) -> Result<(), ValidationError> {
    match v {
        Some(value) if !(0.0..=1.0).contains(&value) => Err(ValidationError::MinP { field, value }),
        _ => Ok(()),
    }
}

pub fn check_penalty(field: &'static str, v: Option<f64>) -> Result<(), ValidationError> {
    match v {
        Some(value) if !(-2.0..=2.0).contains(&value) => {
            Err(ValidationError::Penalty { field, value })
        }
        _ => Ok(()),
    }
}

pub fn check_repetition_penalty(
    field: &'static str,
    v: Option<f64>,
) -> Result<(), ValidationError> {
    match v {
        Some(value) if !(value > 0.0 && value <= 2.0) => {
            Err(ValidationError::RepetitionPenalty { field, value })
        }
        _ => Ok(()),
    }
}

pub fn check_at_least(
    field: &'static str,
    min: i64,
    v: Option<i64>,
) -> Result<(), ValidationError> {
    match v {
        Some(value) if value < min => Err(ValidationError::TooSmall { field, min, value }),
        _ => Ok(()),
    }
}

pub fn check_n(field: &'static str, v: Option<i64>) -> Result<(), ValidationError> {
    check_at_least(field, 1, v)?;
    match v {
        Some(value) if value > MAX_N => Err(ValidationError::TooLarge {
            field,
            max: MAX_N,
            value,
        }),
        _ => Ok(()),
    }
}

pub fn check_stop_count(field: &'static str, stops: &[String]) -> Result<(), ValidationError> {
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ValidationError::TooManyStops {
            field,
            count: stops.len(),
            max: MAX_STOP_STRINGS,
        });
    }
    Ok(())
}

/// Checks ids against the vocabulary and narrows them to `u32`.
pub fn check_token_ids(
    field: &'static str,
    ids: &[i64],
    vocab_size: usize,
) -> Result<Vec<u32>, ValidationError> {
    ids.iter()
        .map(|&value| {
            if value < 0 || value as u64 >= vocab_size as u64 {
                Err(ValidationError::TokenOutOfRange {
                    field,
                    value,
                    vocab_size,
                })
            } else {
                Ok(value as u32)
            }
        })
        .collect()
}

/// `logit_bias` as OpenAI and SGLang take it: `{"token id": bias}`, null or `{}` for none.
/// Biases travel as `f32`, so a value beyond its range is refused like any other.
pub fn check_logit_bias(
    field: &'static str,
    v: Option<&serde_json::Value>,
    vocab_size: usize,
) -> Result<Vec<(u32, f32)>, ValidationError> {
    use serde_json::Value;
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(ValidationError::BadJsonType {
                field,
                expected: "an object mapping token ids to biases",
            })
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let token = key
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < vocab_size);
        let bias = value.as_f64().filter(|b| (*b as f32).is_finite());
        match (token, bias) {
            (Some(t), Some(b)) => out.push((t, b as f32)),
            _ => {
                return Err(ValidationError::BadLogitBias {
                    field,
                    key: key.clone(),
                    value: value.to_string(),
                    vocab_size,
                })
            }
        }
    }
    out.sort_by_key(|&(t, _)| t);
    Ok(out)
}

pub fn check_unsupported(field: &'static str, present: bool) -> Result<(), ValidationError> {
    if present {
        Err(ValidationError::Unsupported { field })
    } else {
        Ok(())
    }
}
