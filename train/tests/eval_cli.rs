//! `dflash-train eval` end to end on tiny-coder-demo: two drafters compared offline and live in
//! one run write eval.json and both PNG plots (also redrawn from the JSON alone); bad drafter
//! specs are clear errors.

mod eval_support;

use clap::Parser;
use dflash_train::eval::{run, DrafterArg, EvalArgs};
use eval_support::*;
use serde_json::Value;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: EvalArgs,
}

fn args(extra: &[&str]) -> EvalArgs {
    let mut argv = vec!["eval"];
    argv.extend_from_slice(extra);
    Cli::try_parse_from(argv).unwrap().args
}

fn is_png(path: &std::path::Path) -> bool {
    std::fs::read(path).is_ok_and(|b| b.starts_with(b"\x89PNG\r\n\x1a\n") && b.len() > 1000)
}

#[test]
fn eval_compares_two_drafters_offline_and_live_and_writes_json_and_pngs() {
    let dir = scratch("cli");
    let prompts = write_prompts(&dir, &PROMPTS[..2]);
    let (cache, out) = (dir.join("cache"), dir.join("out"));
    let argv = [
        "--target",
        "demo",
        "--drafter",
        "random:seed=1,layers=2,target_layer_ids=1+2",
        "--drafter",
        "oracle",
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        "24",
        "--budgets",
        "16,4",
        "--mode",
        "both",
        "--warmup-tokens",
        "4",
        "--cache-dir",
        cache.to_str().unwrap(),
        "--out-dir",
        out.to_str().unwrap(),
    ];
    run(args(&argv)).unwrap();
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("eval.json")).unwrap()).unwrap();
    assert_eq!(report["budgets"], serde_json::json!([4, 16]));
    assert_eq!(report["cache"]["status"], "built");
    assert_eq!(report["plain"]["mode"], "plain");
    let drafters = report["drafters"].as_array().unwrap();
    let names: Vec<&str> = drafters
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["random-1", "oracle"]);
    for d in drafters {
        let modes: Vec<&str> = d["offline"]["modes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["mode"].as_str().unwrap())
            .collect();
        assert_eq!(modes, ["chain", "ddtree-4", "ddtree-16"]);
        let live = d["live"].as_array().unwrap();
        assert_eq!(live.len(), 3);
        for (offline, live) in d["offline"]["modes"].as_array().unwrap().iter().zip(live) {
            // Greedy speculative decoding is lossless and the replay exact: same rounds.
            assert_eq!(live["matches_plain"], 2, "{}", live["mode"]);
            assert_eq!(
                offline["rounds"], live["rounds"],
                "{} {}",
                d["name"], live["mode"]
            );
            assert_eq!(
                offline["accepted"], live["accepted"],
                "{} {}",
                d["name"], live["mode"]
            );
        }
    }
    assert!(is_png(&out.join("tau_vs_budget.png")));
    assert!(is_png(&out.join("acceptance_histogram.png")));

    // The plots can be redrawn from the JSON alone (a run on a machine without fonts).
    let replot = dir.join("replot");
    run(args(&[
        "--replot",
        out.join("eval.json").to_str().unwrap(),
        "--out-dir",
        replot.to_str().unwrap(),
    ]))
    .unwrap();
    assert!(is_png(&replot.join("tau_vs_budget.png")));
    assert!(is_png(&replot.join("acceptance_histogram.png")));

    // A second run reuses the cache.
    run(args(&argv)).unwrap();
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("eval.json")).unwrap()).unwrap();
    assert_eq!(report["cache"]["status"], "reused");
}

#[test]
fn unknown_drafters_are_clear_errors() {
    let dir = scratch("unknown");
    let prompts = write_prompts(&dir, &PROMPTS[..1]);
    let err = run(args(&[
        "--target",
        "demo",
        "--drafter",
        "./no-such-drafter",
        "--prompts",
        prompts.to_str().unwrap(),
        "--cache-dir",
        dir.join("cache").to_str().unwrap(),
        "--out-dir",
        dir.join("out").to_str().unwrap(),
    ]))
    .unwrap_err();
    let message = format!("{err:#}");
    assert!(message.contains("drafter `./no-such-drafter`"), "{message}");
    assert!(
        message.contains("neither an existing directory nor a Hugging Face repo id"),
        "{message}"
    );
    let err = DrafterArg::parse("random:depth=3").unwrap_err();
    assert!(
        err.contains("unknown random drafter option `depth`"),
        "{err}"
    );
    assert!(Cli::try_parse_from([
        "eval",
        "--target",
        "demo",
        "--prompts",
        "p",
        "--drafter",
        "oracle:noise=x"
    ])
    .is_err());
}
