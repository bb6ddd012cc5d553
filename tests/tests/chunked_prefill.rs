//! Chunked prefill (`Engine::set_chunked_prefill`, SGLang's `--chunked-prefill-size`): a prompt
//! prefilled over several steps gives the same greedy tokens as one prefilled whole (plain
//! decoding against transformers, and a DFlash drafter whose context features arrive in
//! chunks), and running sequences keep decoding while a long prompt is prefilled.

use candle_core::{DType, Device};
use dflash_models::speculative::{
    Algorithm, DFlashProposer, Engine, EngineConfig, GenerationRequest, SamplingParams,
};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model};
use dflash_tests::{demo_model, greedy_cases};

fn target() -> Qwen3Model {
    Qwen3Model::load(
        &demo_model(),
        DType::F32,
        &Device::Cpu,
        1024,
        OpsMode::Fused,
    )
    .unwrap()
}

fn config() -> EngineConfig {
    EngineConfig {
        max_context: 512,
        max_ddtree_budget: 16,
        eos_token_ids: vec![8188, 8186],
        seed: 0,
    }
}

fn request(prompt: &[u32], n: usize, algorithm: Algorithm) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: n,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        ignore_eos: true,
        algorithm,
    }
}

/// The bundled demo drafter: trained, so what it drafts depends on the context it was fed.
fn drafter_engine(t: &Qwen3Model, chunk: Option<usize>) -> Engine {
    let dir = demo_model().with_file_name("tiny-coder-demo-dflash");
    let drafter = DFlashDrafter::load(&dir, t, OpsMode::Fused).unwrap();
    let mut e = Engine::new(
        t.clone(),
        Some(Box::new(DFlashProposer::new(drafter))),
        config(),
    );
    e.set_chunked_prefill(chunk);
    e
}

#[test]
fn prompts_prefilled_in_chunks_decode_to_transformers_greedy_tokens() {
    let t = target();
    let cases = greedy_cases("tiny-coder-demo");
    for chunk in [3, 8, 64] {
        let mut plain = Engine::new(t.clone(), None, config());
        plain.set_chunked_prefill(Some(chunk));
        for c in cases.iter().take(4) {
            let n = c.output_ids.len();
            let (out, _) = plain
                .generate(request(&c.input_ids, n, Algorithm::Plain))
                .unwrap();
            assert_eq!(out, c.output_ids, "plain, chunk {chunk}, {}", c.id);
        }
    }
}

#[test]
fn a_drafter_fed_chunked_context_features_stays_lossless() {
    let t = target();
    let cases = greedy_cases("tiny-coder-demo");
    let mut whole = drafter_engine(&t, None);
    let mut chunked = drafter_engine(&t, Some(5));
    let mut accepted = 0;
    for c in cases.iter().take(3) {
        for alg in [Algorithm::Chain, Algorithm::DDTree { budget: 16 }] {
            let (a, sa) = whole.generate(request(&c.input_ids, 32, alg)).unwrap();
            let (b, sb) = chunked.generate(request(&c.input_ids, 32, alg)).unwrap();
            assert_eq!(a, b, "{alg:?}, {}", c.id);
            assert_eq!(&a[..], &c.output_ids[..32], "{alg:?}, {}", c.id);
            // The same drafts were proposed from the same features: the same rounds and
            // acceptances (a drafter fed only the last chunk's context accepts less).
            assert_eq!(
                (
                    sa.rounds,
                    sa.accepted_drafts,
                    &sa.depth_proposed,
                    &sa.depth_accepted
                ),
                (
                    sb.rounds,
                    sb.accepted_drafts,
                    &sb.depth_proposed,
                    &sb.depth_accepted
                ),
                "{alg:?}, {}",
                c.id
            );
            accepted += sa.accepted_drafts;
        }
    }
    assert!(
        accepted > 0,
        "the trained drafter accepts drafts, so its context matters"
    );
}

#[test]
fn running_sequences_decode_every_step_while_a_long_prompt_is_prefilled() {
    let t = target();
    let cases = greedy_cases("tiny-coder-demo");
    let long: Vec<u32> = cases
        .iter()
        .flat_map(|c| c.input_ids.clone())
        .take(100)
        .collect();
    assert_eq!(long.len(), 100);
    let alone = Engine::new(t.clone(), None, config())
        .generate(request(&long, 8, Algorithm::Plain))
        .unwrap()
        .0;
    let mut e = Engine::new(t.clone(), None, config());
    e.set_chunked_prefill(Some(16));
    let short = e
        .add(request(&cases[0].input_ids[..10], 40, Algorithm::Plain))
        .unwrap();
    // The short prompt fits one chunk: prefilled and decoded in the first step.
    let first = e.step().unwrap();
    assert!(first.iter().any(|ev| ev.id == short));
    let long_id = e.add(request(&long, 8, Algorithm::Plain)).unwrap();
    let mut long_tokens: Vec<u32> = Vec::new();
    let mut first_long_step = None;
    for step in 1..=12 {
        let events = e.step().unwrap();
        assert!(
            events
                .iter()
                .any(|ev| ev.id == short && !ev.tokens.is_empty()),
            "step {step}: the running sequence got no token while the long prompt prefilled"
        );
        for ev in events.iter().filter(|ev| ev.id == long_id) {
            first_long_step.get_or_insert(step);
            long_tokens.extend(&ev.tokens);
        }
    }
    // 100 prompt tokens at 16 per step: the 7th step completes the prompt and samples.
    assert_eq!(first_long_step, Some(7));
    assert_eq!(long_tokens, alone[..long_tokens.len()].to_vec());
    assert!(long_tokens.len() >= 4);
}

/// `Engine::set_prefill_while_decoding` (the server's `--prefill-tokens-while-decoding`): with
/// a sequence decoding, a prompt longer than the bound is prefilled that many tokens per step,
/// though the chunk size would allow it whole; alone (nothing decoding) it takes the whole
/// chunk, and a prompt within the bound goes in whole.
#[test]
fn a_prompt_arriving_while_others_decode_is_prefilled_in_the_smaller_budget() {
    let t = target();
    let cases = greedy_cases("tiny-coder-demo");
    let long: Vec<u32> = cases
        .iter()
        .flat_map(|c| c.input_ids.clone())
        .take(100)
        .collect();
    let alone = Engine::new(t.clone(), None, config())
        .generate(request(&long, 8, Algorithm::Plain))
        .unwrap()
        .0;
    let mut e = Engine::new(t.clone(), None, config());
    e.set_chunked_prefill(Some(4096));
    e.set_prefill_while_decoding(Some(30));
    // Nothing decodes yet: the whole 100-token prompt is prefilled in the first step.
    let first = e.add(request(&long, 40, Algorithm::Plain)).unwrap();
    assert!(e.step().unwrap().iter().any(|ev| ev.id == first));
    let second = e.add(request(&long, 8, Algorithm::Plain)).unwrap();
    let mut tokens: Vec<u32> = Vec::new();
    let mut first_step = None;
    for step in 1..=8 {
        let events = e.step().unwrap();
        assert!(events
            .iter()
            .any(|ev| ev.id == first && !ev.tokens.is_empty()));
        for ev in events.iter().filter(|ev| ev.id == second) {
            first_step.get_or_insert(step);
            tokens.extend(&ev.tokens);
        }
    }
    // 100 tokens at 30 per step: the 4th step completes the prompt.
    assert_eq!(first_step, Some(4));
    assert_eq!(tokens, alone[..tokens.len()].to_vec());
    // A 25-token prompt is within the bound: prefilled and sampled in its first step.
    let short = e.add(request(&long[..25], 4, Algorithm::Plain)).unwrap();
    assert!(e.step().unwrap().iter().any(|ev| ev.id == short));
}
