//! Penalties keep speculative decoding lossless: with frequency, presence and repetition
//! penalties, `min_new_tokens` and `logit_bias`, greedy plain decoding equals a reference that
//! re-forwards the whole context and penalises the last row from scratch, and chain and DDTree
//! decoding (the greedy oracle, a noisy oracle and the trained demo drafter, whose drafts the
//! penalties often reject) equal plain decoding token for token.

use candle_core::{DType, Device};
use dflash_models::speculative::{
    argmax, Algorithm, DFlashProposer, Engine, EngineConfig, GenerationRequest, Noise,
    OracleProposer, Penalties, Proposer, SamplingParams,
};
use dflash_models::{AttnPattern, DFlashDrafter, OpsMode, Qwen3Model, SeqForward};
use dflash_tests::{demo_model, greedy_cases};

const EOS: [u32; 2] = [8188, 8186];
const NEW_TOKENS: usize = 40;

fn target() -> Qwen3Model {
    Qwen3Model::load(&demo_model(), DType::F32, &Device::Cpu, 512, OpsMode::Fused).unwrap()
}

fn config() -> EngineConfig {
    EngineConfig {
        max_context: 256,
        max_ddtree_budget: 32,
        eos_token_ids: EOS.to_vec(),
        seed: 0,
    }
}

/// Settings that each change the demo model's greedy output (checked below).
fn settings() -> Vec<(&'static str, Penalties)> {
    vec![
        (
            "frequency",
            Penalties {
                frequency: 1.5,
                ..Default::default()
            },
        ),
        (
            "presence+repetition",
            Penalties {
                presence: 0.8,
                repetition: 1.6,
                ..Default::default()
            },
        ),
        (
            "min_new_tokens+logit_bias",
            Penalties {
                min_new_tokens: 30,
                logit_bias: vec![(13, 3.0), (220, -5.0)],
                frequency: 0.2,
                ..Default::default()
            },
        ),
    ]
}

fn request(prompt: &[u32], algorithm: Algorithm) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: NEW_TOKENS,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        ignore_eos: false,
        algorithm,
    }
}

/// Runs one request with penalties to the end; returns its tokens and its tau.
fn generate(e: &mut Engine, req: GenerationRequest, p: &Penalties) -> (Vec<u32>, f64) {
    let id = e.add(req).unwrap();
    e.set_penalties(id, p.clone()).unwrap();
    let mut out = Vec::new();
    loop {
        for ev in e.step().unwrap() {
            if ev.id == id {
                out.extend(ev.tokens);
                if ev.finished.is_some() {
                    return (out, ev.stats.tau());
                }
            }
        }
    }
}

/// The penalised greedy continuation by full re-forwards, penalties computed here from the
/// whole output so far (no engine code, no incremental state).
fn reference(t: &Qwen3Model, prompt: &[u32], p: &Penalties) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    let mut out: Vec<u32> = Vec::new();
    while out.len() < NEW_TOKENS {
        let mut cache = t.new_cache(ctx.len()).unwrap();
        let positions: Vec<u32> = (0..ctx.len() as u32).collect();
        let logits = t
            .forward(
                &mut [SeqForward {
                    cache: &mut cache,
                    tokens: &ctx,
                    positions: &positions,
                    pattern: &AttnPattern::Causal,
                    logit_rows: &[ctx.len() - 1],
                }],
                &[],
            )
            .unwrap()
            .logits
            .unwrap();
        let mut row = logits.to_vec2::<f32>().unwrap().remove(0);
        for (tok, x) in row.iter_mut().enumerate() {
            let tok = tok as u32;
            let count = out.iter().filter(|&&o| o == tok).count() as f32;
            if count > 0.0 || prompt.contains(&tok) {
                *x = if *x > 0.0 {
                    *x / p.repetition
                } else {
                    *x * p.repetition
                };
            }
            if count > 0.0 {
                *x -= p.frequency * count + p.presence;
            }
            if out.len() < p.min_new_tokens && EOS.contains(&tok) {
                *x = f32::NEG_INFINITY;
            }
            if let Some((_, b)) = p.logit_bias.iter().find(|(t, _)| *t == tok) {
                *x += b;
            }
        }
        let next = argmax(&row);
        out.push(next);
        ctx.push(next);
        if EOS.contains(&next) {
            break;
        }
    }
    out
}

fn prompts() -> Vec<Vec<u32>> {
    greedy_cases("tiny-coder-demo")
        .into_iter()
        .take(3)
        .map(|c| c.input_ids)
        .collect()
}

#[test]
fn penalised_plain_greedy_equals_a_full_reforward_reference_and_penalties_bite() {
    let t = target();
    let mut plain = Engine::new(t.clone(), None, config());
    for prompt in prompts() {
        let (unpenalised, _) = generate(
            &mut plain,
            request(&prompt, Algorithm::Plain),
            &Penalties::default(),
        );
        for (name, p) in settings() {
            let (got, _) = generate(&mut plain, request(&prompt, Algorithm::Plain), &p);
            assert_eq!(got, reference(&t, &prompt, &p), "{name}");
            assert_ne!(got, unpenalised, "{name} changes the output");
        }
    }
}

fn proposer(t: &Qwen3Model, which: &str) -> Box<dyn Proposer> {
    match which {
        "oracle" => Box::new(OracleProposer::new(t.clone(), 15, None)),
        "noisy oracle" => Box::new(OracleProposer::new(
            t.clone(),
            15,
            Some(Noise {
                corrupt_prob: 0.3,
                seed: 5,
            }),
        )),
        _ => {
            let dir = demo_model().with_file_name("tiny-coder-demo-dflash");
            let drafter = DFlashDrafter::load(&dir, t, OpsMode::Fused).unwrap();
            Box::new(DFlashProposer::new(drafter))
        }
    }
}

#[test]
fn penalised_chain_and_ddtree_equal_penalised_plain_greedy() {
    let t = target();
    let mut plain = Engine::new(t.clone(), None, config());
    let mut accepted_some = false;
    for which in ["oracle", "noisy oracle", "demo drafter"] {
        let mut e = Engine::new(t.clone(), Some(proposer(&t, which)), config());
        e.use_kv_pool(8 * 256).unwrap();
        for prompt in prompts() {
            for (name, p) in settings() {
                let (want, _) = generate(&mut plain, request(&prompt, Algorithm::Plain), &p);
                for alg in [
                    Algorithm::Chain,
                    Algorithm::DDTree { budget: 4 },
                    Algorithm::DDTree { budget: 32 },
                ] {
                    let (got, tau) = generate(&mut e, request(&prompt, alg), &p);
                    assert_eq!(got, want, "{which} {alg:?} {name}");
                    accepted_some |= tau > 1.5;
                }
            }
        }
    }
    assert!(accepted_some, "drafts were accepted under penalties");
}
