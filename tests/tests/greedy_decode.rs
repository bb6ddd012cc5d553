//! Greedy decoding of the trained fixture targets reproduces transformers' greedy tokens
//! (`tests/fixtures/greedy/coding-prompts.json`: transformers 5.24.0, fp32 CPU, 48 new tokens)
//! exactly, through three cache paths: one token per forward; chained 16-token causal forwards
//! (what chain verification does); and 16-token tree forwards whose tree is a single path.
//! Exact token equality is the right bar: the fixture records each prompt's smallest top-1
//! margin, and f32 summation-order noise is orders of magnitude below it.

use std::path::Path;

use candle_core::{DType, Device};
use dflash_models::{AttnPattern, OpsMode, Qwen3Model, SeqForward};
use dflash_tests::{argmax_rows, demo_model, greedy_cases, shared_model, GreedyCase};

#[derive(Clone, Copy)]
enum Path16 {
    OneByOne,
    Causal16,
    TreePath16,
}

fn prefill(m: &Qwen3Model, cache: &mut dflash_models::SequenceCache, prompt: &[u32]) -> u32 {
    let pos: Vec<u32> = (0..prompt.len() as u32).collect();
    let out = m
        .forward(
            &mut [SeqForward {
                cache,
                tokens: prompt,
                positions: &pos,
                pattern: &AttnPattern::Causal,
                logit_rows: &[prompt.len() - 1],
            }],
            &[],
        )
        .unwrap();
    argmax_rows(&out.logits.unwrap())[0]
}

fn decode(m: &Qwen3Model, case: &GreedyCase, how: Path16) -> Vec<u32> {
    let n = case.output_ids.len();
    let mut cache = m.new_cache(case.input_ids.len() + n + 16).unwrap();
    let mut out = vec![prefill(m, &mut cache, &case.input_ids)];
    while out.len() < n {
        let start = cache.len();
        // The block starts with the last emitted token; the rest are "drafts" taken from the
        // reference, and are only kept because the model itself predicts them.
        let block: Vec<u32> = match how {
            Path16::OneByOne => vec![*out.last().unwrap()],
            _ => {
                let k = 16.min(n - out.len() + 1);
                let mut b = vec![*out.last().unwrap()];
                b.extend_from_slice(&case.output_ids[out.len()..out.len() + k - 1]);
                b
            }
        };
        let t = block.len();
        let pos: Vec<u32> = (start as u32..(start + t) as u32).collect();
        let pattern = match how {
            Path16::TreePath16 => AttnPattern::Tree {
                parents: (0..t).map(|i| i.checked_sub(1)).collect(),
            },
            _ => AttnPattern::Causal,
        };
        let rows: Vec<usize> = (0..t).collect();
        let res = m
            .forward(
                &mut [SeqForward {
                    cache: &mut cache,
                    tokens: &block,
                    positions: &pos,
                    pattern: &pattern,
                    logit_rows: &rows,
                }],
                &[],
            )
            .unwrap();
        let pred = argmax_rows(&res.logits.unwrap());
        // Accept drafts while the model agrees, then emit its own token (chain verification).
        let mut accepted = 0;
        while accepted + 1 < t && block[accepted + 1] == pred[accepted] {
            accepted += 1;
        }
        out.extend_from_slice(&block[1..=accepted]);
        out.push(pred[accepted]);
        cache.truncate(start + accepted + 1).unwrap();
    }
    out.truncate(n);
    out
}

fn check_model(dir: &Path, name: &str) {
    let m = Qwen3Model::load(dir, DType::F32, &Device::Cpu, 512, OpsMode::Fused).unwrap();
    for case in greedy_cases(name) {
        for (how, label) in [
            (Path16::OneByOne, "one token per forward"),
            (Path16::Causal16, "16-token causal"),
            (Path16::TreePath16, "16-token single-path tree"),
        ] {
            let got = decode(&m, &case, how);
            assert_eq!(
                got, case.output_ids,
                "{name} prompt {} via {label}",
                case.id
            );
        }
    }
}

#[test]
fn tiny_coder_demo_greedy_matches_transformers() {
    check_model(&demo_model(), "tiny-coder-demo");
}

#[test]
#[ignore = "needs the large fixture set: DFLASH_FIXTURES=../shared/fixtures cargo test -- --include-ignored"]
fn tiny_coder_small_sharded_greedy_matches_transformers() {
    check_model(&shared_model("tiny-coder-small"), "tiny-coder-small");
}
