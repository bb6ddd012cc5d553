//! `/v1/completions` lowering: tokenize each prompt, default `max_tokens` to 16 (OpenAI's), and
//! expand `n` so that choice `i * n + k` is sample `k` of prompt `i`.

use super::types::CompletionRequest;
use crate::error::ApiError;
use crate::generation::{lower, DefaultBudget, PreparedRequest};
use crate::routes::generate::validate::PromptInput;
use crate::state::AppState;

pub const DEFAULT_MAX_TOKENS: usize = 16;

pub fn lower_completion(
    state: &AppState,
    req: &CompletionRequest,
    prompts: Vec<PromptInput>,
    rid: &str,
) -> Result<Vec<PreparedRequest>, ApiError> {
    let sampling = req.common.sampling(req.max_tokens, "max_tokens");
    let n = req.common.n();
    let mut out = Vec::new();
    for (i, p) in prompts.into_iter().enumerate() {
        let ids = match p {
            PromptInput::Ids(ids) => ids,
            PromptInput::Text(t) => state
                .limits
                .prompt
                .encode(&state.model.tokenizer, &t, true)?,
        };
        let mut prepared = lower(
            format!("{rid}-{i}"),
            ids,
            &sampling,
            DefaultBudget::Fixed(DEFAULT_MAX_TOKENS),
            &state.model.lower,
        )?;
        prepared.logprobs = super::validate::logprobs_top(req)?;
        // `echo` with logprobs reports the prompt's tokens too.
        if req.echo == Some(true) {
            prepared.prompt_logprobs = prepared.logprobs.map(|top| (0, top));
        }
        prepared.grammar = crate::routes::openai::compile_grammar(
            state,
            req.common.grammar(req.response_format.as_ref())?,
        )?;
        for k in 0..n {
            out.push(prepared.sample(k, n));
        }
    }
    Ok(out)
}
