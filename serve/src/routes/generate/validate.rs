//! `/generate` rules: exactly one prompt form, batch shapes that agree, and the shared sampling
//! rules on every `sampling_params` entry.

use serde_json::Value;

use super::types::{GenerateRequest, InputIds, SamplingParams};
use crate::generation::{check_sampling, SamplingInput};
use crate::grammar::{spec, GrammarFields, GrammarSpec};
use crate::validation::{self as v, ValidationError};

/// A prompt before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

/// One prompt of the batch with its checked sampling values.
#[derive(Debug, Clone)]
pub struct ValidPrompt {
    pub prompt: PromptInput,
    pub sampling: SamplingInput,
    pub n: usize,
    pub rid: Option<String>,
    /// `return_logprob`: `Some(top_logprobs_num)`.
    pub logprobs: Option<usize>,
    /// `return_logprob` with `logprob_start_len` >= 0: `Some((logprob_start_len, top))`.
    pub prompt_logprobs: Option<(usize, usize)>,
    /// `json_schema` / `regex` / `ebnf`.
    pub grammar: Option<GrammarSpec>,
}

#[derive(Debug, Clone)]
pub struct ValidGenerate {
    pub prompts: Vec<ValidPrompt>,
    /// A list was sent (or n > 1): the response is a list, and stream chunks carry `index`.
    pub batch: bool,
    pub stream: bool,
    /// `return_text_in_logprobs`: token texts in the logprob triples.
    pub text_in_logprobs: bool,
}

fn present(v: &Option<Value>) -> bool {
    !matches!(v, None | Some(Value::Null))
}

fn sampling_input(p: &SamplingParams) -> SamplingInput {
    SamplingInput {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k,
        min_p: p.min_p,
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        repetition_penalty: p.repetition_penalty,
        seed: p.sampling_seed,
        max_new_tokens: p.max_new_tokens,
        max_field: "max_new_tokens",
        min_new_tokens: p.min_new_tokens,
        stop: p.stop.as_ref().map(|s| s.to_vec()).unwrap_or_default(),
        stop_token_ids: p.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: p.ignore_eos.unwrap_or(false),
        no_stop_trim: p.no_stop_trim.unwrap_or(false),
        skip_special_tokens: p.skip_special_tokens.unwrap_or(true),
        logit_bias: p.logit_bias.clone(),
    }
}

fn check_params(p: &SamplingParams) -> Result<(), ValidationError> {
    if let Some(key) = p.unknown.keys().next() {
        return Err(ValidationError::UnknownField {
            key: key.clone(),
            expected: super::types::SAMPLING_PARAMS_FIELDS,
        });
    }
    v::check_unsupported("sampling_params.beam_width", present(&p.beam_width))?;
    v::check_unsupported("sampling_params.watermark", present(&p.watermark))?;
    v::check_unsupported("sampling_params.choice", present(&p.choice))?;
    v::check_unsupported("sampling_params.structural_tag", present(&p.structural_tag))?;
    v::check_unsupported("sampling_params.stop_regex", present(&p.stop_regex))?;
    v::check_n("n", p.n)?;
    check_sampling(&sampling_input(p))
}

pub fn validate(
    req: &GenerateRequest,
    vocab_size: usize,
) -> Result<ValidGenerate, ValidationError> {
    let given: Vec<&str> = [
        ("text", req.text.is_some()),
        ("input_ids", req.input_ids.is_some()),
        ("input_embeds", present(&req.input_embeds)),
    ]
    .iter()
    .filter(|(_, p)| *p)
    .map(|(n, _)| *n)
    .collect();
    if given.len() > 1 {
        return Err(ValidationError::SeveralPrompts {
            given: given.join(" and "),
        });
    }
    v::check_unsupported("input_embeds", present(&req.input_embeds))?;
    v::check_unsupported("lora_path", present(&req.lora_path))?;
    v::check_unsupported("image_data", present(&req.image_data))?;
    let wants_hidden = req
        .return_hidden_states
        .as_ref()
        .is_some_and(|r| r.to_vec().iter().any(|b| *b));
    v::check_unsupported("return_hidden_states", wants_hidden)?;

    let (prompts, mut batch) = match (&req.text, &req.input_ids) {
        (Some(t), None) => (
            t.to_vec()
                .into_iter()
                .map(PromptInput::Text)
                .collect::<Vec<_>>(),
            matches!(t, super::types::OneOrMany::Many(_)),
        ),
        (None, Some(InputIds::One(ids))) => (
            vec![PromptInput::Ids(v::check_token_ids(
                "input_ids",
                ids,
                vocab_size,
            )?)],
            false,
        ),
        (None, Some(InputIds::Batch(list))) => (
            list.iter()
                .map(|ids| v::check_token_ids("input_ids", ids, vocab_size).map(PromptInput::Ids))
                .collect::<Result<Vec<_>, _>>()?,
            true,
        ),
        _ => return Err(ValidationError::NoPrompt),
    };
    if prompts.is_empty() {
        return Err(ValidationError::EmptyPrompt);
    }
    let params = per_prompt(
        "sampling_params",
        req.sampling_params.as_ref().map(|s| s.to_vec()),
        prompts.len(),
    )?
    .unwrap_or_else(|| vec![SamplingParams::default(); prompts.len()]);
    let rids = per_prompt("rid", req.rid.as_ref().map(|r| r.to_vec()), prompts.len())?;
    let logprobs = logprob_requests(req, prompts.len())?;
    let mut out = Vec::with_capacity(prompts.len());
    for (i, (prompt, p)) in prompts.into_iter().zip(params).enumerate() {
        check_params(&p)?;
        let n = p.n.unwrap_or(1).max(1) as usize;
        batch |= n > 1;
        out.push(ValidPrompt {
            prompt,
            sampling: sampling_input(&p),
            n,
            rid: rids.as_ref().and_then(|r| r.get(i).cloned()),
            logprobs: logprobs.get(i).copied().flatten().map(|(top, _)| top),
            prompt_logprobs: logprobs
                .get(i)
                .copied()
                .flatten()
                .and_then(|(top, start)| Some((start?, top))),
            grammar: spec::from_fields(&GrammarFields {
                json_schema: p.json_schema.as_ref(),
                regex: p.regex.as_ref(),
                ebnf: p.ebnf.as_ref(),
                ..Default::default()
            })?,
        });
    }
    Ok(ValidGenerate {
        prompts: out,
        batch,
        stream: req.stream,
        text_in_logprobs: req.return_text_in_logprobs,
    })
}

/// `return_logprob` / `top_logprobs_num` / `logprob_start_len` per prompt: `Some((top,
/// start))` where logprobs are asked; `start` None (-1) for output tokens only.
fn logprob_requests(
    req: &GenerateRequest,
    batch: usize,
) -> Result<Vec<Option<(usize, Option<usize>)>>, ValidationError> {
    let want = per_prompt(
        "return_logprob",
        req.return_logprob.as_ref().map(|r| r.to_vec()),
        batch,
    )?
    .unwrap_or_else(|| vec![false; batch]);
    let tops = per_prompt(
        "top_logprobs_num",
        req.top_logprobs_num.as_ref().map(|r| r.to_vec()),
        batch,
    )?
    .unwrap_or_else(|| vec![0; batch]);
    let starts = per_prompt(
        "logprob_start_len",
        req.logprob_start_len.as_ref().map(|r| r.to_vec()),
        batch,
    )?
    .unwrap_or_else(|| vec![-1; batch]);
    let mut out = Vec::with_capacity(batch);
    for ((want, top), start) in want.into_iter().zip(tops).zip(starts) {
        if !want {
            out.push(None);
            continue;
        }
        v::check_unsupported("token_ids_logprob", present(&req.token_ids_logprob))?;
        v::check_at_least("top_logprobs_num", 0, Some(top))?;
        if start < -1 {
            return Err(ValidationError::InputLogprobs { given: start });
        }
        out.push(Some((top as usize, usize::try_from(start).ok())));
    }
    Ok(out)
}

/// Limits checked before any tokenization: the request's sequences (prompts x n) against
/// `--max-sequences-per-request`, and each text prompt's bytes against what the context holds.
pub fn check_limits(
    valid: &ValidGenerate,
    limits: &crate::state::RequestLimits,
) -> Result<(), ValidationError> {
    let sequences = valid.prompts.iter().map(|p| p.n).sum();
    v::check_sequences(sequences, limits.max_sequences)?;
    for p in &valid.prompts {
        if let PromptInput::Text(text) = &p.prompt {
            limits.prompt.check_bytes(text.len())?;
        }
    }
    Ok(())
}

/// A per-prompt list: one entry for every prompt, or one shared by all.
fn per_prompt<T: Clone>(
    field: &'static str,
    given: Option<Vec<T>>,
    batch: usize,
) -> Result<Option<Vec<T>>, ValidationError> {
    match given {
        None => Ok(None),
        Some(list) if list.len() == batch => Ok(Some(list)),
        Some(list) if list.len() == 1 => Ok(Some(vec![list[0].clone(); batch])),
        Some(list) => Err(ValidationError::BatchMismatch {
            field,
            got: list.len(),
            batch,
        }),
    }
}
