//! `/generate` lowering: tokenize text prompts (no chat template on this route, as in SGLang)
//! and expand `n` into separate `PreparedRequest`s, in output order.

use super::validate::{PromptInput, ValidGenerate};
use crate::error::ApiError;
use crate::generation::{lower, new_rid, DefaultBudget, PreparedRequest};
use crate::state::AppState;

/// SGLang's default `max_new_tokens`.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// Runs on a blocking worker: tokenization is CPU work.
pub fn lower_generate(
    state: &AppState,
    valid: ValidGenerate,
) -> Result<Vec<PreparedRequest>, ApiError> {
    let mut out = Vec::new();
    for p in valid.prompts {
        let ids = match p.prompt {
            PromptInput::Ids(ids) => ids,
            PromptInput::Text(text) => {
                state
                    .limits
                    .prompt
                    .encode(&state.model.tokenizer, &text, true)?
            }
        };
        let rid = p.rid.unwrap_or_else(new_rid);
        let mut prepared = lower(
            rid,
            ids,
            &p.sampling,
            DefaultBudget::Fixed(DEFAULT_MAX_NEW_TOKENS),
            &state.model.lower,
        )?;
        prepared.logprobs = p.logprobs;
        prepared.prompt_logprobs = p.prompt_logprobs;
        prepared.grammar = crate::routes::openai::compile_grammar(state, p.grammar)?;
        for i in 0..p.n {
            out.push(prepared.sample(i, p.n));
        }
    }
    Ok(out)
}
