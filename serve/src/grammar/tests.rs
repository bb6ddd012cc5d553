//! Grammars on the demo pair through the models crate's engine: every greedy output matches
//! its grammar (JSON that parses to the schema's shape, a regex checked by hand, an EBNF), and
//! chain and DDTree speculation with the trained demo drafter give the same tokens as plain
//! decoding.

use std::path::PathBuf;

use candle_core::{DType, Device};
use dflash_common::tokenizer::Tokenizer;
use dflash_models::speculative::{
    Algorithm, DFlashProposer, Engine, EngineConfig, FinishReason, GenerationRequest,
    SamplingParams,
};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model};
use serde_json::json;

use super::*;

const EOS: u32 = 8188;

fn demo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-coder-demo")
}

fn backend() -> GrammarBackend {
    GrammarBackend::load(&demo(), 8192, EOS).expect("the demo vocabulary")
}

fn engine(t: &Qwen3Model, speculate: bool) -> Engine {
    let proposer = speculate.then(|| {
        let dir = demo().with_file_name("tiny-coder-demo-dflash");
        let drafter = DFlashDrafter::load(&dir, t, OpsMode::Fused).expect("demo drafter");
        Box::new(DFlashProposer::new(drafter)) as Box<dyn dflash_models::speculative::Proposer>
    });
    Engine::new(
        t.clone(),
        proposer,
        EngineConfig {
            max_context: 256,
            max_ddtree_budget: 16,
            eos_token_ids: vec![EOS, 8186],
            seed: 0,
        },
    )
}

/// Greedy tokens (EOS dropped) and whether the grammar finished them with EOS.
fn run(e: &mut Engine, prompt: &[u32], g: CompiledGrammar, alg: Algorithm) -> (Vec<u32>, bool) {
    let id = e
        .add(GenerationRequest {
            prompt: prompt.to_vec(),
            max_new_tokens: 64,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: false,
            algorithm: alg,
        })
        .unwrap();
    e.set_constraint(id, Box::new(g)).unwrap();
    let mut out = Vec::new();
    loop {
        for ev in e.step().unwrap() {
            out.extend(ev.tokens);
            if let Some(f) = ev.finished {
                let ended = f == FinishReason::Stop(EOS);
                if ended {
                    out.pop();
                }
                return (out, ended);
            }
        }
    }
}

fn is_assignment(s: &str) -> bool {
    // [a-z]+ = [0-9]{1,4};
    let Some((name, rest)) = s.split_once(" = ") else {
        return false;
    };
    let Some(num) = rest.strip_suffix(';') else {
        return false;
    };
    !name.is_empty()
        && name.chars().all(|c| c.is_ascii_lowercase())
        && (1..=4).contains(&num.len())
        && num.chars().all(|c| c.is_ascii_digit())
}

#[test]
fn grammar_outputs_match_and_are_the_same_with_and_without_speculation() {
    let tok = Tokenizer::from_dir(&demo()).unwrap();
    let t = Qwen3Model::load(&demo(), DType::F32, &Device::Cpu, 512, OpsMode::Fused).unwrap();
    let b = backend();
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
        "required": ["name", "size", "tags"], "additionalProperties": false});
    let specs = [
        GrammarSpec::JsonSchema {
            field: "json_schema",
            schema,
        },
        GrammarSpec::Regex("[a-z]{1,10} = [0-9]{1,4};".into()),
        GrammarSpec::Ebnf("root ::= \"def \" name \"(\" name \"):\"\nname ::= [a-z]{1,10}".into()),
    ];
    let prompts = ["def fibonacci(n):", "import os\n", "x = "];
    let mut plain = engine(&t, false);
    let mut spec = engine(&t, true);
    let mut accepted = 0;
    for (k, s) in specs.iter().enumerate() {
        for p in prompts {
            let prompt = tok.encode(p, false).unwrap();
            let (want, ended) = run(&mut plain, &prompt, b.compile(s).unwrap(), Algorithm::Plain);
            assert!(ended, "{s:?} on {p:?} completes: {want:?}");
            let text = tok.decode(&want, false).unwrap();
            match k {
                0 => {
                    let v: serde_json::Value = serde_json::from_str(&text)
                        .unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
                    assert!(v["name"].is_string() && v["size"].is_u64(), "{v}");
                    assert!(v["tags"].as_array().is_some_and(|a| a.len() <= 2), "{v}");
                }
                1 => assert!(is_assignment(&text), "{text:?}"),
                _ => {
                    let inner = text.strip_prefix("def ").and_then(|r| r.strip_suffix("):"));
                    let ok = inner.and_then(|r| r.split_once('(')).is_some_and(|(a, b)| {
                        [a, b]
                            .iter()
                            .all(|x| !x.is_empty() && x.chars().all(|c| c.is_ascii_lowercase()))
                    });
                    assert!(ok, "{text:?}");
                }
            }
            for alg in [Algorithm::Chain, Algorithm::DDTree { budget: 16 }] {
                let (got, _) = run(&mut spec, &prompt, b.compile(s).unwrap(), alg);
                assert_eq!(got, want, "{alg:?} {s:?} on {p:?}");
            }
        }
    }
    // The drafter's drafts still get accepted under the grammar (its rows are masked, not
    // replaced).
    let prompt = tok.encode("def fibonacci(n):", false).unwrap();
    let id = spec
        .add(GenerationRequest {
            prompt,
            max_new_tokens: 24,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: true,
            algorithm: Algorithm::DDTree { budget: 16 },
        })
        .unwrap();
    let rx = GrammarSpec::Regex("(.|\n)*".into());
    spec.set_constraint(id, Box::new(b.compile(&rx).unwrap()))
        .unwrap();
    while spec.num_active() > 0 {
        for ev in spec.step().unwrap() {
            if let Some(r) = ev.round {
                accepted += r.accepted_drafts;
            }
        }
    }
    assert!(accepted > 0, "drafts accepted under a grammar");
}

#[test]
fn bad_grammars_are_refused_and_none_disables_the_backend() {
    let b = backend();
    let err = b
        .compile(&GrammarSpec::Regex("(unclosed".into()))
        .unwrap_err();
    assert!(
        matches!(err, GrammarError::Invalid { field: "regex", .. }),
        "{err}"
    );
    let err = b
        .compile(&GrammarSpec::Ebnf("root ::= missing-rule".into()))
        .unwrap_err();
    assert!(err.to_string().contains("ebnf"), "{err}");
    let off = GrammarBackend::disabled();
    let err = off.compile(&GrammarSpec::Regex("a".into())).unwrap_err();
    assert!(err.to_string().contains("--grammar-backend"), "{err}");
}

#[test]
fn a_node_whose_path_leaves_the_grammar_is_left_alone_and_state_rolls_back() {
    let tok = Tokenizer::from_dir(&demo()).unwrap();
    let b = backend();
    let mut g = b.compile(&GrammarSpec::Regex("ab+".into())).unwrap();
    let a = tok.encode("a", false).unwrap();
    let bb = tok.encode("b", false).unwrap();
    let z = tok.encode("z", false).unwrap();
    assert_eq!((a.len(), bb.len(), z.len()), (1, 1, 1));
    let row = || vec![0.0f32; 8192];
    // At the root only `a...` tokens are allowed.
    let mut r = row();
    g.mask(&[], &mut r);
    assert!(r[a[0] as usize].is_finite() && r[z[0] as usize] == f32::NEG_INFINITY);
    // A path outside the grammar: untouched.
    let mut r = row();
    g.mask(&z, &mut r);
    assert!(r.iter().all(|x| *x == 0.0));
    // After `a`, `b` is allowed and `a` is not; the state rolled back to the root between.
    let mut r = row();
    g.mask(&a, &mut r);
    assert!(r[bb[0] as usize].is_finite() && r[a[0] as usize] == f32::NEG_INFINITY);
    g.commit(&a);
    let mut r = row();
    g.mask(&[], &mut r);
    assert!(r[bb[0] as usize].is_finite() && r[EOS as usize] == f32::NEG_INFINITY);
    g.commit(&bb);
    assert!(g.is_accepting());
}

#[test]
fn a_tokenizer_llguidance_cannot_read_leaves_grammars_refused_naming_why() {
    let dir = std::env::temp_dir().join(format!("dflash-grammar-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A tokenizer.json with no decoder: llguidance cannot tell how tokens map to bytes.
    std::fs::write(
        dir.join("tokenizer.json"),
        r#"{"model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}, "decoder": null}"#,
    )
    .unwrap();
    let err = GrammarBackend::load(&dir, 1, 0).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    let off = GrammarBackend::unavailable(err.to_string());
    assert!(!off.is_enabled());
    let refused = off.compile(&GrammarSpec::Regex("a".into())).unwrap_err();
    assert!(
        matches!(refused, GrammarError::Unavailable { field: "regex", .. })
            && refused.to_string().contains("tokenizer.json"),
        "{refused}"
    );
}
