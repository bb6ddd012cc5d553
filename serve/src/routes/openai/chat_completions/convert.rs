//! `/v1/chat/completions` lowering: render the chat template (server defaults from
//! `--default-chat-template-kwargs`, overridden by the request's `chat_template_kwargs`;
//! `reasoning_effort` sets `enable_thinking` when neither did), tokenize without adding special
//! tokens (the template has them), and budget up to the context when no max is given.

use dflash_common::chat::ChatRenderInput;
use serde_json::{Map, Value};

use super::types::ChatRequest;
use super::validate::ToolChoice;
use super::validate::ValidChat;
use crate::error::ApiError;
use crate::generation::{lower, DefaultBudget, PreparedRequest, ToolParserKind};
use crate::grammar::tools::tool_call_grammar;
use crate::grammar::GrammarSpec;
use crate::state::AppState;
use crate::validation::ValidationError;

pub fn template_kwargs(state: &AppState, req: &ChatRequest) -> Map<String, Value> {
    let mut kwargs = state.config.default_chat_template_kwargs.clone();
    if let Some(k) = &req.chat_template_kwargs {
        for (key, value) in k {
            kwargs.insert(key.clone(), value.clone());
        }
    }
    if let Some(effort) = &req.reasoning_effort {
        let on = effort.as_str() != Some("none");
        kwargs.entry("enable_thinking").or_insert(Value::Bool(on));
        kwargs.entry("thinking").or_insert(Value::Bool(on));
    }
    kwargs
}

/// The chat template rendered over the messages (and `tools`), tokenized without adding
/// special tokens: the prompt a chat completion would decode from (`/v1/tokenize` with
/// `messages` answers the same ids).
pub fn prompt_ids(
    state: &AppState,
    req: &ChatRequest,
    valid: &ValidChat,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let template = state
        .model
        .template
        .as_ref()
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let kwargs = template_kwargs(state, req);
    let prompt = template.render(&ChatRenderInput {
        messages: &valid.messages,
        tools: super::tools::template_tools(req),
        add_generation_prompt,
        kwargs: Some(&kwargs),
    })?;
    state
        .limits
        .prompt
        .encode(&state.model.tokenizer, &prompt, false)
}

/// The call grammar `tool_choice` `required` or a named function constrains the answer to
/// (SGLang constrains it too), in the format `--tool-call-parser qwen25` parses back.
fn tool_choice_grammar(
    state: &AppState,
    req: &ChatRequest,
    valid: &ValidChat,
) -> Result<Option<GrammarSpec>, ValidationError> {
    let (given, named) = match &valid.tool_choice {
        ToolChoice::Free => return Ok(None),
        ToolChoice::Required => ("\"required\"".to_string(), None),
        ToolChoice::Named(name) => (
            format!("{{\"function\": {{\"name\": {name:?}}}}}"),
            Some(name.as_str()),
        ),
    };
    match state.config.tool_call_parser {
        Some(ToolParserKind::Qwen25) => {}
        other => {
            return Err(ValidationError::ToolChoiceNeedsParser {
                given,
                configured: other
                    .map(|k| format!("; it runs with --tool-call-parser {}", k.name()))
                    .unwrap_or_default(),
            })
        }
    }
    if let Some(other) = &valid.grammar {
        return Err(ValidationError::ToolChoiceAndGrammar {
            given,
            other: other.field(),
        });
    }
    let tools = req.tools.as_deref().unwrap_or_default();
    Ok(Some(tool_call_grammar(tools, named)?))
}

pub fn lower_chat(
    state: &AppState,
    req: &ChatRequest,
    valid: ValidChat,
    rid: &str,
) -> Result<Vec<PreparedRequest>, ApiError> {
    let ids = prompt_ids(state, req, &valid, true)?;
    let (max, field) = req.max();
    let mut sampling = req.common.sampling(max, field);
    // Tool-call tags may be special tokens; the parser needs them in the text (SGLang too).
    if super::tools::tool_parsing(state, req).is_some() {
        sampling.skip_special_tokens = false;
    }
    let mut prepared = lower(
        rid.to_string(),
        ids,
        &sampling,
        DefaultBudget::RestOfContext,
        &state.model.lower,
    )?;
    prepared.logprobs =
        (req.logprobs == Some(true)).then(|| req.top_logprobs.unwrap_or(0).max(0) as usize);
    let grammar = match tool_choice_grammar(state, req, &valid)? {
        Some(g) => Some(g),
        None => valid.grammar.clone(),
    };
    prepared.grammar = crate::routes::openai::compile_grammar(state, grammar)?;
    let n = req.common.n();
    Ok((0..n).map(|k| prepared.sample(k, n)).collect())
}
