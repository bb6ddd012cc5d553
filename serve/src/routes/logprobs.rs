//! Output-token logprobs in each API's shape, from the engine's [`TokenLogprob`]s (the
//! target's log-softmax at every committed token):
//! - SGLang `/generate` `meta_info`: `output_token_logprobs` `[[logprob, id, text|null], ...]`
//!   and `output_top_logprobs` (per position a list of such triples, or null without
//!   `top_logprobs_num`); `input_token_logprobs` / `input_top_logprobs` likewise for the prompt
//!   from `logprob_start_len` (the first prompt token's logprob is null), empty with -1.
//! - OpenAI chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
//! - OpenAI completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
//!   "text_offset"}`.

use dflash_common::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

use crate::engine::TokenLogprob;

/// How many of each streamed choice's logprobs went out: a step's tokens can be held back (a
/// possible stop string) and sent with a later chunk, so chunks carry what is new since.
#[derive(Debug, Default)]
pub struct StreamedLogprobs {
    sent: std::sync::Mutex<std::collections::HashMap<usize, usize>>,
}

impl StreamedLogprobs {
    /// The logprobs of choice `index` not sent yet (marked sent).
    pub fn take<'a>(&self, index: usize, all: &'a [TokenLogprob]) -> &'a [TokenLogprob] {
        let mut sent = self
            .sent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let done = sent.entry(index).or_insert(0);
        let from = (*done).min(all.len());
        *done = all.len();
        &all[from..]
    }
}

fn text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

fn triple(tokenizer: &Tokenizer, id: u32, logprob: f32, with_text: bool) -> Value {
    let t = with_text.then(|| text(tokenizer, id));
    json!([logprob, id, t])
}

/// The SGLang `meta_info` fields; `top` is the request's `top_logprobs_num`.
pub fn sglang_meta(
    meta: &mut Map<String, Value>,
    lps: &[TokenLogprob],
    top: usize,
    tokenizer: &Tokenizer,
    with_text: bool,
) {
    let tokens: Vec<Value> = lps
        .iter()
        .map(|l| triple(tokenizer, l.token, l.logprob, with_text))
        .collect();
    let tops: Vec<Value> = lps
        .iter()
        .map(|l| {
            if top == 0 {
                Value::Null
            } else {
                Value::Array(
                    l.top
                        .iter()
                        .map(|&(id, lp)| triple(tokenizer, id, lp, with_text))
                        .collect(),
                )
            }
        })
        .collect();
    meta.insert("input_token_logprobs".into(), json!([]));
    meta.insert("input_top_logprobs".into(), json!([]));
    meta.insert("output_token_logprobs".into(), Value::Array(tokens));
    meta.insert("output_top_logprobs".into(), Value::Array(tops));
}

/// SGLang's `input_token_logprobs` / `input_top_logprobs` from prompt position `start`.
pub fn sglang_input(
    meta: &mut Map<String, Value>,
    g: &crate::generation::Generation,
    start: usize,
    top: usize,
    with_text: bool,
) {
    let tok = g.tokenizer();
    let (mut tokens, mut tops) = (Vec::new(), Vec::new());
    if let (0, Some(&first)) = (start, g.prompt_ids().first()) {
        let t = with_text.then(|| text(tok, first));
        tokens.push(json!([null, first, t]));
        tops.push(Value::Null);
    }
    for l in g.prompt_logprobs() {
        tokens.push(triple(tok, l.token, l.logprob, with_text));
        tops.push(if top == 0 {
            Value::Null
        } else {
            Value::Array(
                l.top
                    .iter()
                    .map(|&(id, lp)| triple(tok, id, lp, with_text))
                    .collect(),
            )
        });
    }
    meta.insert("input_token_logprobs".into(), Value::Array(tokens));
    meta.insert("input_top_logprobs".into(), Value::Array(tops));
}

fn chat_entry(tokenizer: &Tokenizer, id: u32, logprob: f32) -> Map<String, Value> {
    let t = text(tokenizer, id);
    let mut m = Map::new();
    m.insert("token".into(), json!(t));
    m.insert("logprob".into(), json!(logprob));
    m.insert("bytes".into(), json!(t.as_bytes()));
    m
}

/// OpenAI chat's `logprobs` object.
pub fn openai_chat(lps: &[TokenLogprob], tokenizer: &Tokenizer) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = chat_entry(tokenizer, l.token, l.logprob);
            let top: Vec<Value> = l
                .top
                .iter()
                .map(|&(id, lp)| Value::Object(chat_entry(tokenizer, id, lp)))
                .collect();
            e.insert("top_logprobs".into(), Value::Array(top));
            Value::Object(e)
        })
        .collect();
    json!({ "content": content })
}

/// OpenAI completions' `logprobs` object; `offset` is the text length before these tokens.
pub fn openai_completions(lps: &[TokenLogprob], tokenizer: &Tokenizer, offset: usize) -> Value {
    completions_entries(lps.iter().map(|l| (l.token, Some(l))), tokenizer, offset)
}

/// With `echo`: the prompt's tokens first (the first one with null logprobs, as OpenAI
/// answers), then the output's.
pub fn openai_completions_echo(
    g: &crate::generation::Generation,
    lps: &[TokenLogprob],
    offset: usize,
) -> Value {
    let first = g.prompt_ids().first().map(|&t| (t, None));
    let prompt = g.prompt_logprobs().iter().map(|l| (l.token, Some(l)));
    let output = lps.iter().map(|l| (l.token, Some(l)));
    completions_entries(
        first.into_iter().chain(prompt).chain(output),
        g.tokenizer(),
        offset,
    )
}

fn completions_entries<'a>(
    entries: impl Iterator<Item = (u32, Option<&'a TokenLogprob>)>,
    tokenizer: &Tokenizer,
    offset: usize,
) -> Value {
    let mut at = offset;
    let (mut tokens, mut logprobs, mut tops, mut offsets) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (token, l) in entries {
        let t = text(tokenizer, token);
        offsets.push(json!(at));
        at += t.len();
        tokens.push(json!(t));
        logprobs.push(l.map_or(Value::Null, |l| json!(l.logprob)));
        tops.push(l.map_or(Value::Null, |l| {
            let top: Map<String, Value> = l
                .top
                .iter()
                .map(|&(id, lp)| (text(tokenizer, id), json!(lp)))
                .collect();
            Value::Object(top)
        }));
    }
    json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets})
}
