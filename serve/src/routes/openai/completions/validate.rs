//! `/v1/completions` rules.

use super::types::{CompletionRequest, PromptField};
use crate::routes::generate::validate::PromptInput;
use crate::validation::{self as v, ValidationError};

/// Limits checked before any tokenization (see `generate::validate::check_limits`).
pub fn check_limits(
    prompts: &[PromptInput],
    n: usize,
    limits: &crate::state::RequestLimits,
) -> Result<(), ValidationError> {
    v::check_sequences(prompts.len().saturating_mul(n), limits.max_sequences)?;
    for p in prompts {
        if let PromptInput::Text(text) = p {
            limits.prompt.check_bytes(text.len())?;
        }
    }
    Ok(())
}

/// OpenAI's `logprobs`: how many alternatives to report per token (0 for the chosen token
/// only); absent or null for none.
pub fn logprobs_top(req: &CompletionRequest) -> Result<Option<usize>, ValidationError> {
    match &req.logprobs {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(n) => {
                crate::validation::check_at_least("logprobs", 0, Some(n))?;
                Ok(Some(n as usize))
            }
            None => Err(ValidationError::BadJsonType {
                field: "logprobs",
                expected: "an integer (alternatives per token, 0 for none)",
            }),
        },
    }
}

pub fn validate(
    req: &CompletionRequest,
    vocab_size: usize,
) -> Result<Vec<PromptInput>, ValidationError> {
    logprobs_top(req)?;
    v::check_unsupported(
        "suffix",
        req.suffix.as_deref().is_some_and(|s| !s.is_empty()),
    )?;
    v::check_unsupported("best_of", matches!(req.best_of, Some(b) if b > 1))?;
    req.common.grammar(req.response_format.as_ref())?;
    v::check_at_least("max_tokens", 1, req.max_tokens)?;
    req.common.check(req.max_tokens, "max_tokens")?;
    let prompts = match &req.prompt {
        None => return Err(ValidationError::EmptyPrompt),
        Some(PromptField::Text(t)) => vec![PromptInput::Text(t.clone())],
        Some(PromptField::Texts(ts)) => ts.iter().cloned().map(PromptInput::Text).collect(),
        Some(PromptField::Ids(ids)) => vec![PromptInput::Ids(v::check_token_ids(
            "prompt", ids, vocab_size,
        )?)],
        Some(PromptField::IdsBatch(list)) => list
            .iter()
            .map(|ids| v::check_token_ids("prompt", ids, vocab_size).map(PromptInput::Ids))
            .collect::<Result<_, _>>()?,
    };
    let empty = |p: &PromptInput| match p {
        PromptInput::Text(t) => t.is_empty(),
        PromptInput::Ids(ids) => ids.is_empty(),
    };
    if prompts.is_empty() || prompts.iter().any(empty) {
        return Err(ValidationError::EmptyPrompt);
    }
    Ok(prompts)
}
