//! The cost model against the H200's measured mixed steps, the piece sizing over a whole long
//! prompt (shrinks with position, never zero, finishes the prompt, caps respected), the
//! calibration, and the engine's steps with cost-sized pieces (same tokens as alone).

use super::*;
use crate::speculative::engine::{Algorithm, Engine, EngineConfig, GenerationRequest};
use crate::speculative::sampling::SamplingParams;
use dflash_common::{LayerType, RopeScaling};

fn qwen3_8b() -> Qwen3Config {
    Qwen3Config {
        vocab_size: 151_936,
        hidden_size: 4096,
        intermediate_size: 12_288,
        num_hidden_layers: 36,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 128,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: 40_960,
        tie_word_embeddings: false,
        eos_token_ids: vec![],
        bos_token_id: None,
        layer_types: vec![LayerType::FullAttention; 36],
        sliding_window: None,
        moe: None,
    }
}

fn h200_8b() -> StepCost {
    StepCost {
        shape: CostShape::qwen3(&qwen3_8b(), 2),
        rates: Rates::default(),
    }
}

#[test]
fn the_shape_of_qwen3_8b() {
    let s = CostShape::qwen3(&qwen3_8b(), 2);
    // 6.95B linear parameters + a 0.62B LM head, bf16.
    assert!(
        (s.weight_bytes / 1e9 - 15.15).abs() < 0.05,
        "{}",
        s.weight_bytes
    );
    assert!((s.row_flops / 1e9 - 13.9).abs() < 0.05, "{}", s.row_flops);
    assert_eq!(s.pair_flops, 4.0 * 128.0 * 32.0 * 36.0);
    assert_eq!(s.kv_bytes, 2.0 * 8.0 * 128.0 * 36.0 * 2.0);
}

#[test]
fn the_default_rates_give_the_h200_mixed_steps() {
    // h200-2026-12-03-scale2: 16 streams at 640 positions (6.42 ms alone) + one piece.
    let measured = [
        (8192, 64, 12.65),
        (8192, 128, 16.23),
        (8192, 256, 24.10),
        (16384, 64, 15.50),
        (16384, 128, 21.56),
        (16384, 256, 34.82),
        (32256, 64, 20.23),
        (32256, 128, 31.79),
        (32256, 256, 55.55),
    ];
    let c = h200_8b();
    let decode = c.decode(16, 16 * 640) * 1e3;
    assert!((decode - 6.42).abs() < 0.3, "decode step {decode} ms");
    for (at, n, ms) in measured {
        let model = 6.42 + (c.mixed_fixed() + c.piece(n, at)) * 1e3;
        assert!((model - ms).abs() < 0.5, "{n} @ {at}: {model:.2} vs {ms}");
    }
}

/// The pieces a prompt of `len` tokens is prefilled in beside a batch of `rows` rows over
/// `cached` positions, each step within `budget` decode steps (pieces capped at `cap`).
fn pieces(
    c: &StepCost,
    budget: f64,
    rows: usize,
    cached: usize,
    cap: usize,
    len: usize,
) -> Vec<usize> {
    let left = (budget - 1.0) * c.decode(rows, cached) - c.mixed_fixed();
    let mut out = Vec::new();
    let mut from = 0;
    while from < len {
        let n = tokens_within(|k| c.piece(k, from), cap.min(len - from), left, MIN_PIECE);
        assert!(n > 0, "a piece of 0 tokens at {from}");
        out.push(n);
        from += n;
    }
    out
}

#[test]
fn pieces_shrink_with_position_never_vanish_and_finish_the_prompt() {
    let c = h200_8b();
    let (rows, cached) = (16, 16 * 1024);
    let p = pieces(&c, 2.0, rows, cached, 256, 32_768);
    assert_eq!(p.iter().sum::<usize>(), 32_768);
    assert!(p.windows(2).all(|w| w[1] <= w[0]), "non-increasing: {p:?}");
    // The start of a prompt costs its rows alone: ~230 tokens fit in one decode step.
    assert!((200..=256).contains(&p[0]), "{}", p[0]);
    assert_eq!(
        pieces(&c, 3.0, rows, cached, 256, 32_768)[0],
        256,
        "the cap binds"
    );
    // (The last piece is what was left.)
    let last = p[p.len() - 2];
    assert!(
        (16..=32).contains(&last),
        "~20 tokens at 32K positions, got {last}"
    );
    // Every step within the bound (no piece needed the floor here).
    let bound = 2.0 * c.decode(rows, cached);
    let mut from = 0;
    for &n in &p {
        let step = c.decode(rows, cached) + c.mixed_fixed() + c.piece(n, from);
        assert!(step <= bound * 1.000_001, "{n} @ {from}: {step} > {bound}");
        from += n;
    }
    // A looser budget takes bigger pieces, fewer steps; the cap still holds.
    let loose = pieces(&c, 3.0, rows, cached, 256, 32_768);
    assert!(loose.len() < p.len());
    assert!(pieces(&c, 3.0, rows, cached, 64, 32_768)
        .iter()
        .all(|&n| n <= 64));
    // A budget nothing fits in still moves MIN_PIECE tokens a step; a short rest goes whole.
    let tight = pieces(&c, 1.01, rows, cached, 256, 1000);
    assert!(
        tight[..tight.len() - 1].iter().all(|&n| n == MIN_PIECE),
        "{tight:?}"
    );
    assert_eq!(tight.iter().sum::<usize>(), 1000);
    assert_eq!(pieces(&c, 1.01, rows, cached, 256, 5), vec![5]);
}

#[test]
fn tokens_within_is_the_largest_count_that_fits() {
    let cost = |n: usize| n as f64;
    assert_eq!(tokens_within(cost, 100, 37.5, 0), 37);
    assert_eq!(tokens_within(cost, 30, 37.5, 0), 30);
    assert_eq!(tokens_within(cost, 100, -1.0, 0), 0);
    assert_eq!(tokens_within(cost, 100, -1.0, 16), 16);
    assert_eq!(tokens_within(cost, 10, -1.0, 16), 10);
    assert_eq!(tokens_within(cost, 0, 5.0, 16), 0);
}

#[test]
fn pieces_are_cut_to_whole_row_quanta_unless_that_leaves_too_few() {
    assert_eq!(aligned(100, 16, MIN_PIECE), 96);
    assert_eq!(aligned(256, 16, MIN_PIECE), 256, "272 rows already");
    assert_eq!(aligned(20, 16, MIN_PIECE), 16);
    assert_eq!(
        aligned(16, 17, MIN_PIECE),
        16,
        "15 would be under the floor"
    );
    assert_eq!(aligned(5, 20, 0), 5, "nothing to cut down to");
    assert_eq!(aligned(40, 20, 0), 28);
    for n in 1..300 {
        let a = aligned(n, 3, MIN_PIECE);
        assert!(
            a <= n && (a == n || (3 + a).is_multiple_of(ROW_QUANTUM)),
            "{n} -> {a}"
        );
        assert!(a >= aligned(n - 1, 3, MIN_PIECE).min(a), "monotone");
    }
}

#[test]
fn calibration_follows_measured_steps_and_ignores_one_off_stalls() {
    let mut cal = Calibration::default();
    assert_eq!((cal.decode, cal.piece), (1.0, 1.0));
    cal.observe_decode(0.012, 0.006);
    assert_eq!(cal.decode, 2.0, "the first measurement sets the scale");
    for _ in 0..100 {
        cal.observe_decode(0.009, 0.006);
    }
    assert!((cal.decode - 1.5).abs() < 1e-3, "{}", cal.decode);
    // A graph capture (0.5 s) moves it by at most a tenth of 3x.
    let before = cal.decode;
    cal.observe_decode(0.5, 0.006);
    assert!(
        cal.decode <= before + 0.1 * (3.0 * before - before) + 1e-12,
        "{}",
        cal.decode
    );
    // Mixed steps: the time past the decode reference over the pieces' estimate.
    let mut cal = Calibration::default();
    cal.observe_decode(0.006, 0.006);
    cal.observe_mixed(0.006 + 0.010, 0.006, 0.005);
    assert!((cal.piece - 2.0).abs() < 1e-9, "{}", cal.piece);
    cal.observe_mixed(f64::NAN, 0.006, 0.005);
    cal.observe_mixed(0.004, 0.006, 0.005);
    assert!(
        cal.piece > 1.0,
        "a step faster than its decode part says little: {}",
        cal.piece
    );
}

fn request(prompt: Vec<u32>, n: usize) -> GenerationRequest {
    GenerationRequest {
        prompt,
        max_new_tokens: n,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        ignore_eos: true,
        algorithm: Algorithm::Plain,
    }
}

fn engine() -> Engine {
    let mut e = Engine::new(
        crate::speculative::tiny_test_target(1100, 5),
        None,
        EngineConfig {
            max_context: 1000,
            max_ddtree_budget: 0,
            eos_token_ids: vec![],
            seed: 0,
        },
    );
    e.set_mixed_step_budget(Some(2.0));
    // Rates for the tiny target (f32: 81,920 weight bytes, 36,864 FLOPs a token, 256 a pair)
    // under which a decode step is ~87K "seconds" and a piece token 1,000 + 10 per position
    // before it: pieces of the cap at the start, down to the floor by ~400 positions.
    e.set_cost_rates(Rates {
        bandwidth: 1.0,
        gemm_flops: 36.864,
        attn_flops: 25.6,
        layer_s: 0.0,
        mix_layer_s: 0.0,
    });
    e
}

#[test]
fn an_engine_sizes_pieces_by_cost_and_the_tokens_stay_those_of_each_request_alone() {
    let short: Vec<u32> = (0..20).map(|i| (i * 5 % 60) as u32 + 1).collect();
    let long: Vec<u32> = (0..450).map(|i| (i * 7 % 61) as u32 + 1).collect();
    let alone = |p: &[u32], n| engine().generate(request(p.to_vec(), n)).unwrap().0;
    let (want_short, want_long) = (alone(&short, 120), alone(&long, 4));
    for (mixed, chunk, cap) in [(true, None, 64), (false, None, 64), (true, Some(40), 1000)] {
        let mut e = engine();
        e.set_mixed_prefill(mixed);
        e.set_chunked_prefill(chunk);
        e.set_prefill_while_decoding(Some(cap));
        let a = e.add(request(short.clone(), 120)).unwrap();
        let mut got = (Vec::new(), Vec::new());
        let mut b = None;
        let mut sizes = Vec::new();
        while e.num_active() > 0 {
            if b.is_none() && got.0.len() >= 3 {
                b = Some(e.add(request(long.clone(), 4)).unwrap());
            }
            for ev in e.step().unwrap() {
                if ev.id == a {
                    got.0.extend(&ev.tokens);
                } else {
                    got.1.extend(&ev.tokens);
                }
            }
            let r = e.last_step();
            if r.decode_rows > 0 {
                assert!(r.chunks.len() <= 1);
                sizes.extend(r.chunks.iter().map(|c| c.0));
                assert_eq!(r.mixed, mixed && !r.chunks.is_empty());
            }
        }
        let case = format!("mixed {mixed}, chunk {chunk:?}, cap {cap}: {sizes:?}");
        assert_eq!(got, (want_short.clone(), want_long.clone()), "{case}");
        assert_eq!(sizes.iter().sum::<usize>(), long.len(), "{case}");
        assert!(
            sizes
                .iter()
                .all(|&n| n > 0 && n <= cap.min(chunk.unwrap_or(cap))),
            "{case}"
        );
        assert!(sizes.windows(2).all(|w| w[1] <= w[0]), "{case}");
        // One decoding row: a piece that is not the prompt's last fills whole row quanta
        // unless it is near the floor.
        let head = &sizes[..sizes.len() - 1];
        assert!(
            head.iter()
                .all(|&n| (1 + n).is_multiple_of(ROW_QUANTUM) || n < 2 * ROW_QUANTUM - 1),
            "{case}"
        );
        assert!(
            sizes[0] > MIN_PIECE && *sizes.last().unwrap() < sizes[0],
            "{case}"
        );
    }
}

#[test]
fn without_a_budget_pieces_are_the_fixed_bound() {
    let mut e = engine();
    e.set_mixed_step_budget(None);
    e.set_prefill_while_decoding(Some(30));
    e.add(request(vec![3; 10], 50)).unwrap();
    e.step().unwrap();
    e.add(request(vec![4; 100], 2)).unwrap();
    let mut sizes = Vec::new();
    for _ in 0..4 {
        e.step().unwrap();
        sizes.extend(e.last_step().chunks.iter().map(|c| c.0));
    }
    assert_eq!(sizes, vec![30, 30, 30, 10]);
}

#[test]
fn a_burst_of_waiting_prompts_goes_at_the_chunk_size_in_fixed_pieces() {
    use crate::speculative::engine::prefill::is_burst;
    // One long prompt among many streams keeps the budget; two or more, at least half as many
    // as decode, are a burst.
    assert!(!is_burst(1, 16) && !is_burst(1, 1) && !is_burst(7, 16));
    assert!(is_burst(2, 4) && is_burst(8, 16) && is_burst(16, 16) && is_burst(2, 0));
    let mut e = engine();
    e.set_prefill_while_decoding(Some(30));
    e.add(request(vec![3; 10], 50)).unwrap();
    e.step().unwrap();
    // Deep into a prompt the budget leaves only the floor: a burst still gets its full pieces.
    e.add(request(vec![4; 100], 2)).unwrap();
    e.add(request(vec![5; 100], 2)).unwrap();
    let mut steps = Vec::new();
    for _ in 0..4 {
        e.step().unwrap();
        steps.push(e.last_step().chunks.iter().map(|c| c.0).collect::<Vec<_>>());
    }
    assert_eq!(
        steps,
        vec![vec![30, 30], vec![30, 30], vec![30, 30], vec![10, 10]]
    );
}
