//! One test per request rule: each bad value is refused with a message naming the field, the
//! bound and the value given.

use dflash_serve::generation::{
    check_sampling, lower, DefaultBudget, LowerContext, SamplingDefaults, SamplingInput,
};
use dflash_serve::routes::generate::types::GenerateRequest;
use dflash_serve::routes::generate::validate::validate;
use dflash_serve::validation::ValidationError;
use serde_json::json;

const VOCAB: usize = 8192;

fn generate_err(body: serde_json::Value) -> String {
    let req: GenerateRequest = serde_json::from_value(body).expect("wire type");
    match validate(&req, VOCAB) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    }
}

fn sampling_err(p: serde_json::Value) -> String {
    generate_err(json!({"text": "x", "sampling_params": p}))
}

fn ctx() -> LowerContext {
    LowerContext {
        context_length: 10,
        vocab_size: VOCAB,
        eos_token_ids: vec![8188],
        defaults: SamplingDefaults::default(),
    }
}

fn input(max: Option<i64>) -> SamplingInput {
    SamplingInput {
        max_new_tokens: max,
        max_field: "max_tokens",
        skip_special_tokens: true,
        ..Default::default()
    }
}

#[test]
fn test_validation_no_prompt() {
    assert_eq!(
        generate_err(json!({})),
        "Either text, input_ids or input_embeds should be provided."
    );
}

#[test]
fn test_validation_several_prompts() {
    assert_eq!(
        generate_err(json!({"text": "a", "input_ids": [1]})),
        "Only one of text, input_ids or input_embeds may be provided; got text and input_ids."
    );
}

#[test]
fn test_validation_empty_batch() {
    assert_eq!(generate_err(json!({"text": []})), "Prompt cannot be empty");
}

#[test]
fn test_validation_temperature() {
    assert_eq!(
        sampling_err(json!({"temperature": -0.5})),
        "`temperature` must be a finite number >= 0. Given: -0.5"
    );
}

#[test]
fn test_validation_top_p() {
    assert_eq!(
        sampling_err(json!({"top_p": 1.5})),
        "`top_p` must be in (0, 1]. Given: 1.5"
    );
}

#[test]
fn test_validation_top_k() {
    assert_eq!(
        sampling_err(json!({"top_k": 0})),
        "`top_k` must be -1 (disable) or at least 1. Given: 0"
    );
}

#[test]
fn test_validation_min_p() {
    assert_eq!(
        sampling_err(json!({"min_p": 2.0})),
        "`min_p` must be in [0, 1]. Given: 2"
    );
}

#[test]
fn test_validation_frequency_penalty() {
    assert_eq!(
        sampling_err(json!({"frequency_penalty": 3.0})),
        "`frequency_penalty` must be in [-2, 2]. Given: 3"
    );
}

#[test]
fn test_validation_presence_penalty() {
    assert_eq!(
        sampling_err(json!({"presence_penalty": -3.0})),
        "`presence_penalty` must be in [-2, 2]. Given: -3"
    );
}

#[test]
fn test_validation_repetition_penalty() {
    assert_eq!(
        sampling_err(json!({"repetition_penalty": 0})),
        "`repetition_penalty` must be in (0, 2]. Given: 0"
    );
}

#[test]
fn test_validation_max_new_tokens_negative() {
    assert_eq!(
        sampling_err(json!({"max_new_tokens": -1})),
        "`max_new_tokens` must be >= 0. Given: -1"
    );
}

#[test]
fn test_validation_min_new_tokens_above_max() {
    assert_eq!(
        sampling_err(json!({"max_new_tokens": 2, "min_new_tokens": 3})),
        "`min_new_tokens` (3) must be <= `max_new_tokens` (2)"
    );
}

#[test]
fn test_validation_n() {
    assert_eq!(sampling_err(json!({"n": 0})), "`n` must be >= 1. Given: 0");
    assert_eq!(
        sampling_err(json!({"n": 65})),
        "`n` must be <= 64. Given: 65"
    );
}

#[test]
fn test_validation_too_many_stops() {
    let stops: Vec<String> = (0..33).map(|i| i.to_string()).collect();
    assert_eq!(
        sampling_err(json!({"stop": stops})),
        "`stop` has 33 entries; at most 32 are allowed"
    );
}

#[test]
fn test_validation_token_out_of_range() {
    assert_eq!(
        generate_err(json!({"input_ids": [1, 9000]})),
        "`input_ids` contains token id 9000, outside the vocabulary [0, 8192)"
    );
}

#[test]
fn test_validation_batch_mismatch() {
    assert_eq!(
        generate_err(json!({"text": ["a", "b", "c"], "sampling_params": [{}, {}]})),
        "`sampling_params` has 2 entries but the batch has 3 prompts; give one per prompt or a single one"
    );
}

#[test]
fn test_validation_unsupported_field() {
    assert_eq!(
        sampling_err(json!({"structural_tag": "{}"})),
        "`sampling_params.structural_tag` is not supported by dflash-serve; remove it from the request"
    );
    assert_eq!(
        sampling_err(json!({"regex": "a+", "json_schema": "{}"})),
        "Only one of json_schema, regex, ebnf, or structural_tag can be set; got json_schema, regex."
    );
    assert_eq!(
        generate_err(json!({"text": "x", "return_logprob": true, "token_ids_logprob": [3]})),
        "`token_ids_logprob` is not supported by dflash-serve; remove it from the request"
    );
    assert_eq!(
        generate_err(json!({"text": "x", "return_logprob": true, "logprob_start_len": -2})),
        "`logprob_start_len` must be -1 (output tokens only) or a prompt position >= 0. Given: -2"
    );
}

#[test]
fn test_validation_prompt_too_long() {
    let err = lower(
        "r".into(),
        vec![1; 10],
        &input(None),
        DefaultBudget::Fixed(16),
        &ctx(),
    )
    .expect_err("too long");
    assert_eq!(
        err,
        ValidationError::PromptTooLong {
            input: 10,
            context: 10
        }
    );
    assert_eq!(
        err.to_string(),
        "The input (10 tokens) is longer than the model's context length (10 tokens)."
    );
}

#[test]
fn test_validation_total_too_long() {
    let err = lower(
        "r".into(),
        vec![1; 4],
        &input(Some(7)),
        DefaultBudget::Fixed(16),
        &ctx(),
    )
    .expect_err("too long");
    assert_eq!(
        err,
        ValidationError::TotalTooLong {
            context: 10,
            total: 11,
            input: 4,
            completion: 7
        }
    );
}

#[test]
fn unset_budget_is_clamped_to_the_context_and_eos_joins_the_stop_ids() {
    let p = lower(
        "r".into(),
        vec![1; 4],
        &input(None),
        DefaultBudget::Fixed(16),
        &ctx(),
    )
    .expect("fits");
    assert_eq!(p.max_new_tokens, 6);
    assert_eq!(p.engine_stop_ids, vec![8188]);
    let mut ignore = input(None);
    ignore.ignore_eos = true;
    let p = lower(
        "r".into(),
        vec![1; 4],
        &ignore,
        DefaultBudget::RestOfContext,
        &ctx(),
    )
    .expect("fits");
    assert!(p.engine_stop_ids.is_empty());
}

#[test]
fn tiny_temperature_is_greedy() {
    let mut s = input(None);
    s.temperature = Some(1e-9);
    check_sampling(&s).expect("valid");
    let p = lower("r".into(), vec![1], &s, DefaultBudget::Fixed(1), &ctx()).expect("fits");
    assert!(p.sampling.is_greedy());
    assert_eq!(p.sampling.temperature, 0.0);
}
