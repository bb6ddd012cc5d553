//! The bundled demo drafter's chain acceptance, per prompt and round by round, equals a replay
//! on transformers' own hidden states: for the first three greedy cases of tiny-coder-demo
//! (`tests/fixtures/greedy/coding-prompts.json`, prompt + 48-token transformers greedy
//! continuation), the engine `dflash-serve` runs (chain verification, temperature 0, f32 CPU)
//! accepts, in every round, exactly the drafts that the offline replay accepts when the
//! drafter reads `hidden_states[i + 1]` of transformers 5.24.0 (f32, CPU, eager) for each of
//! its taps `i` (`tests/fixtures/hidden-states/tiny-coder-demo-greedy.safetensors`, made by
//! `tests/fixtures/scripts/make_hidden_states.py`). The engine's features come from our own
//! prefill and verify forwards, so agreement means serve and transformers feed the drafter the
//! same taps (up to f32 summation order; `tap_parity.rs` bounds that by 1e-4), whichever layers
//! the drafter taps.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use dflash_models::speculative::{
    DFlashProposer, Engine, EngineConfig, GenerationRequest, SamplingParams,
};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model};
use dflash_train::eval::drafters::{demo_drafter_dir, demo_target_dir};
use dflash_train::eval::{replay_prompt, ReplayInput, Verify};
use serde_json::Value;

const MAX_NEW: usize = 48;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// (id, prompt, continuation) of the greedy cases the hidden-state golden covers.
fn cases(golden: &HashMap<String, Tensor>) -> Vec<(String, Vec<u32>, Vec<u32>)> {
    let text = std::fs::read_to_string(fixtures().join("greedy/coding-prompts.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ids = |x: &Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    v["models"]["tiny-coder-demo"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let id = c["id"].as_str().unwrap().to_string();
            (id, ids(&c["input_ids"]), ids(&c["output_ids"]))
        })
        .filter(|(id, _, _)| golden.contains_key(&format!("{id}.tokens")))
        .collect()
}

#[test]
fn demo_drafter_chain_rounds_match_a_replay_on_transformers_hidden_states() {
    let target = Qwen3Model::load(
        &demo_target_dir(),
        DType::F32,
        &Device::Cpu,
        512,
        OpsMode::Fused,
    )
    .unwrap();
    let drafter = DFlashDrafter::load(&demo_drafter_dir(), &target, OpsMode::Fused).unwrap();
    let path = fixtures().join("hidden-states/tiny-coder-demo-greedy.safetensors");
    let golden = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let cases = cases(&golden);
    assert_eq!(cases.len(), 3, "the golden covers three greedy cases");

    let mut total_accepted = 0;
    for (id, prompt, continuation) in &cases {
        let tokens: Vec<u32> = prompt.iter().chain(continuation).copied().collect();
        let stored: Vec<u32> = golden[&format!("{id}.tokens")]
            .to_dtype(DType::I64)
            .unwrap()
            .to_vec1::<i64>()
            .unwrap()
            .into_iter()
            .map(|t| t as u32)
            .collect();
        assert_eq!(
            stored, tokens,
            "{id}: the golden's tokens are the greedy case"
        );
        let parts: Vec<&Tensor> = drafter
            .target_layer_ids()
            .iter()
            .map(|l| &golden[&format!("{id}.layer{l}")])
            .collect();
        let features = Tensor::cat(&parts, 1).unwrap();
        let generated = continuation
            .iter()
            .position(|t| target.config().eos_token_ids.contains(t))
            .map_or(MAX_NEW, |i| i + 1);
        let replay = replay_prompt(
            &mut DFlashProposer::new(drafter.clone()),
            &ReplayInput {
                id,
                tokens: &tokens,
                prompt_len: prompt.len(),
                max_new_tokens: MAX_NEW,
                generated,
                features: Some(&features),
            },
            &[Verify::Chain],
        )
        .unwrap();
        let replayed: Vec<usize> = replay[0].iter().map(|r| r.accepted).collect();

        let mut engine = Engine::new(
            target.clone(),
            Some(Box::new(DFlashProposer::new(drafter.clone()))),
            EngineConfig {
                max_context: 512,
                max_ddtree_budget: 1,
                eos_token_ids: target.config().eos_token_ids.clone(),
                seed: 0,
            },
        );
        let seq = engine
            .add(GenerationRequest {
                prompt: prompt.clone(),
                max_new_tokens: MAX_NEW,
                sampling: SamplingParams::greedy(),
                stop_token_ids: vec![],
                ignore_eos: false,
                algorithm: Verify::Chain.algorithm(),
            })
            .unwrap();
        let (mut rounds, mut emitted) = (Vec::new(), Vec::new());
        'run: loop {
            for e in engine.step().unwrap() {
                assert_eq!(e.id, seq);
                emitted.extend_from_slice(&e.tokens);
                if let Some(r) = e.round {
                    rounds.push(r.accepted_drafts);
                }
                if e.finished.is_some() {
                    break 'run;
                }
            }
        }
        assert_eq!(
            emitted,
            continuation[..generated],
            "{id}: speculative output is transformers' greedy continuation"
        );
        assert_eq!(rounds, replayed, "{id}: accepted drafts per chain round");
        total_accepted += rounds.iter().sum::<usize>();
    }
    // Not vacuous: the demo drafter gets some drafts right.
    assert!(total_accepted > 0, "no draft accepted in any round");
}
