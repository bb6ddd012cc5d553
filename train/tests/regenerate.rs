//! `dflash-train regenerate` on the bundled demo target: the rewritten assistant turns are the
//! engine's greedy output for each prompt, an interrupted run (with a half-written batch left
//! behind) resumes to the same file byte for byte, speculative decoding with the demo drafter
//! writes the same file, and a rerun with other settings is refused naming the progress file.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use dflash_common::chat::{ChatRenderInput, ChatTemplate};
use dflash_common::tokenizer::Tokenizer;
use dflash_models::speculative::{
    Algorithm, Engine, EngineConfig, GenerationRequest, SamplingParams,
};
use dflash_models::{OpsMode, Qwen3Model};
use dflash_train::regenerate::{regenerate, RegenerateArgs};
use serde_json::{json, Value};

fn assets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../serve/assets")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dflash-regen-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const MAX_NEW: usize = 32;

fn args(input: &Path, output: &Path, extra: &[&str]) -> RegenerateArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: RegenerateArgs,
    }
    let mut argv: Vec<String> = vec![
        "regenerate".into(),
        "--target-model".into(),
        assets().join("tiny-coder-demo").display().to_string(),
        "--input".into(),
        input.display().to_string(),
        "--output".into(),
        output.display().to_string(),
        "--max-new-tokens".into(),
        MAX_NEW.to_string(),
        "--batch-size".into(),
        "2".into(),
        "--context-length".into(),
        "512".into(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    Cli::try_parse_from(argv).unwrap().a
}

fn write_input(dir: &Path) -> PathBuf {
    let rec = |id: &str, q: &str| {
        json!({"id": id, "source": "test", "messages": [
            {"role": "user", "content": q},
            {"role": "assistant", "content": "written by someone else"}]})
        .to_string()
    };
    let lines = [
        rec("a", "Write a Python function that adds two numbers."),
        // The demo target answers this one in ~20 tokens and stops at its end-of-turn token.
        rec("b", "Please implement a Python module named `__hello__`."),
        "{not json".to_string(),
        rec("c", "Sort a list of integers in Python."),
        json!({"id": "d", "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Print hello world in C."},
            {"role": "assistant", "content": "x"}]})
        .to_string(),
    ];
    let path = dir.join("in.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

#[test]
fn regenerated_turns_are_greedy_outputs_and_resume_is_byte_identical() {
    let dir = scratch("main");
    let input = write_input(&dir);
    let (a, b, c) = (
        dir.join("a.jsonl"),
        dir.join("b.jsonl"),
        dir.join("c.jsonl"),
    );

    let whole = regenerate(&args(&input, &a, &[])).unwrap();
    assert!(whole.complete);
    assert_eq!((whole.lines, whole.written, whole.skipped), (5, 4, 1));

    // Interrupted after one batch, then a crash in the middle of writing the next one.
    let first = regenerate(&args(&input, &b, &["--stop-after-batches", "1"])).unwrap();
    assert!(!first.complete);
    assert_eq!(first.written, 2);
    let mut f = std::fs::OpenOptions::new().append(true).open(&b).unwrap();
    std::io::Write::write_all(&mut f, b"{\"id\": \"half-writ").unwrap();
    drop(f);
    let rest = regenerate(&args(&input, &b, &[])).unwrap();
    assert!(rest.complete);
    assert_eq!(rest.written, 4);
    let (ta, tb) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert!(
        ta == tb,
        "resumed output differs from the uninterrupted one"
    );
    // A finished run is a no-op when run again.
    let again = regenerate(&args(&input, &b, &[])).unwrap();
    assert_eq!(again.written, 4);
    assert_eq!(std::fs::read(&b).unwrap(), tb);

    // Each assistant turn is the engine's greedy continuation of that prompt, decoded alone.
    let target_dir = assets().join("tiny-coder-demo");
    let tok = Tokenizer::from_dir(&target_dir).unwrap();
    let template = ChatTemplate::from_model(&target_dir, tok.config(), None).unwrap();
    let target =
        Qwen3Model::load(&target_dir, DType::F32, &Device::Cpu, 512, OpsMode::Fused).unwrap();
    let eos = tok.eos_token_ids().to_vec();
    let mut engine = Engine::new(
        target,
        None,
        EngineConfig {
            max_context: 512,
            max_ddtree_budget: 1,
            eos_token_ids: eos.clone(),
            seed: 0,
        },
    );
    let out: Vec<Value> = String::from_utf8(ta.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        out.iter()
            .map(|r| r["id"].as_str().unwrap())
            .collect::<Vec<_>>(),
        vec!["a", "b", "c", "d"]
    );
    let mut stopped_by_eos = 0;
    for r in &out {
        assert_eq!(r["source"].as_str().unwrap_or("test"), "test");
        let msgs = r["messages"].as_array().unwrap();
        let prompt = template
            .render(&ChatRenderInput {
                messages: &msgs[..msgs.len() - 1],
                add_generation_prompt: true,
                ..Default::default()
            })
            .unwrap();
        let (mut ids, _) = engine
            .generate(GenerationRequest {
                prompt: tok.encode(&prompt, false).unwrap(),
                max_new_tokens: MAX_NEW,
                sampling: SamplingParams::greedy(),
                stop_token_ids: Vec::new(),
                ignore_eos: false,
                algorithm: Algorithm::Plain,
            })
            .unwrap();
        if ids.last().is_some_and(|t| eos.contains(t)) {
            ids.pop();
            stopped_by_eos += 1;
        } else {
            assert_eq!(ids.len(), MAX_NEW);
        }
        let expect = tok.decode(&ids, false).unwrap();
        assert_eq!(msgs.last().unwrap()["content"].as_str().unwrap(), expect);
        assert_ne!(expect, "written by someone else");
    }
    assert!(stopped_by_eos >= 1, "no record ended at EOS; raise MAX_NEW");

    // Speculative decoding with the demo drafter (T=0, lossless) writes the same file.
    let spec = regenerate(&args(
        &input,
        &c,
        &[
            "--drafter",
            assets().join("tiny-coder-demo-dflash").to_str().unwrap(),
            "--ddtree-budget",
            "8",
        ],
    ))
    .unwrap();
    assert_eq!(spec.written, 4);
    assert!(
        std::fs::read(&c).unwrap() == ta,
        "speculative output differs from plain"
    );

    // Sampling (T > 0) is seeded per line: a resumed run still writes the same bytes.
    let (s1, s2) = (dir.join("s1.jsonl"), dir.join("s2.jsonl"));
    let t = ["--temperature", "0.9", "--seed", "7"];
    regenerate(&args(&input, &s1, &t)).unwrap();
    regenerate(&args(
        &input,
        &s2,
        &[&t[..], &["--stop-after-batches", "1"]].concat(),
    ))
    .unwrap();
    regenerate(&args(&input, &s2, &t)).unwrap();
    let sampled = std::fs::read(&s1).unwrap();
    assert!(
        sampled == std::fs::read(&s2).unwrap(),
        "resumed sampled output differs"
    );
    assert!(sampled != ta, "sampling at T=0.9 gave the greedy outputs");

    // Other settings on top of an existing progress file: refused, naming it.
    let e = regenerate(&args(&input, &b, &["--seed", "5"]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("b.jsonl.progress.json") && e.contains("another run"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unreadable_input_and_bad_target_name_the_file() {
    let dir = scratch("errors");
    let missing = dir.join("nope.jsonl");
    let e = regenerate(&args(&missing, &dir.join("o.jsonl"), &[]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.jsonl"), "{e}");
    let input = write_input(&dir);
    let e = regenerate(&args(
        &input,
        &dir.join("o.jsonl"),
        &["--max-bad-lines", "0"],
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("in.jsonl:3") && e.contains("--max-bad-lines"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
