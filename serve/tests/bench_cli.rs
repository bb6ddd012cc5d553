//! `dflash-serve bench` end to end on CPU with the bundled demo shape (random weights, so no
//! checkpoint is read): every section of the report is there, and the end-to-end runs show the
//! simulated acceptance exactly.

use std::process::Command;

#[test]
fn bench_on_cpu_reports_every_figure_and_the_simulated_acceptance() {
    let dir = std::env::temp_dir().join(format!("dflash-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("bench.json");
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/tiny-coder-demo");
    let args = [
        "bench",
        "--model",
        model,
        "--device",
        "cpu",
        "--dtype",
        "f32",
        "--contexts",
        "64",
        "--sizes",
        "1,4",
        "--prefill",
        "64",
        "--e2e-prompt",
        "32",
        "--e2e-tokens",
        "25",
        "--reps",
        "1",
        "--decode-steps",
        "2",
        "--budgets",
        "8",
        "--tau",
        "4",
        "--drafter-layers",
        "1",
    ];
    let run = Command::new(env!("CARGO_BIN_EXE_dflash-serve"))
        .args(args)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert!(report["probes"]["copy_bandwidth_GBps"].as_f64().unwrap() > 0.0);
    let plain = &report["variants"]["plain"];
    assert!(
        plain["decode"]["ctx_64"]["fraction_of_roofline"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    for kind in ["forward_chain", "forward_tree"] {
        for n in ["1", "4"] {
            assert!(
                plain[kind][n]["ratio_to_decode_step"].as_f64().unwrap() > 0.0,
                "{kind} {n}"
            );
        }
    }
    assert!(plain["prefill_64"]["tok_per_s"].as_f64().unwrap() > 0.0);
    // 25 tokens = 1 from the prefill + 6 rounds of exactly tau = 4 (3 accepted drafts + 1).
    let e2e = &plain["e2e"];
    for algo in ["chain", "ddtree_8"] {
        assert_eq!(
            e2e[algo]["engine"]["tau"].as_f64(),
            Some(4.0),
            "{algo}: {}",
            e2e[algo]
        );
        assert_eq!(e2e[algo]["engine"]["rounds"].as_u64(), Some(6), "{algo}");
        assert!(e2e[algo]["speedup_vs_plain"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(e2e["plain"]["engine"]["tau"].as_f64(), Some(1.0));
    // No CUDA here: the fused variant says why it was skipped instead of reporting numbers.
    assert!(report["variants"]["fast"]["skipped"].is_string());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The hybrid (dense and MoE) and `qwen3_moe` families by their `config.json` (random weights of
/// the tiny fixtures' shapes): prefill, decode through the engine against its roofline, the
/// end-to-end runs at the simulated acceptance exactly, and several requests in one engine.
#[test]
fn bench_runs_the_hybrid_and_moe_families_end_to_end() {
    let dir = std::env::temp_dir().join(format!("dflash-bench-family-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for fixture in [
        "qwen3_5-tiny-random",
        "qwen3_5_moe-tiny-random",
        "qwen3_moe-tiny-random",
    ] {
        let model = format!("{}/../tests/fixtures/{fixture}", env!("CARGO_MANIFEST_DIR"));
        let out = dir.join(format!("{fixture}.json"));
        let run = Command::new(env!("CARGO_BIN_EXE_dflash-serve"))
            .args([
                "bench", "--model", &model, "--device", "cpu", "--dtype", "f32",
            ])
            .args([
                "--prefill",
                "64",
                "--e2e-prompt",
                "32",
                "--e2e-tokens",
                "25",
            ])
            .args(["--reps", "1", "--budgets", "8", "--tau", "4"])
            .args(["--drafter-layers", "1", "--e2e-batch", "3"])
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{fixture}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let positive = |v: &serde_json::Value| v.as_f64().is_some_and(|x| x > 0.0);
        assert!(positive(&r["prefill_64"]["tok_per_s"]), "{fixture}: {r}");
        assert!(
            positive(&r["decode_through_engine"]["fraction_of_roofline"]),
            "{fixture}"
        );
        let (total, active) = (
            r["model"]["params_B"].as_f64().unwrap(),
            r["model"]["active_params_per_token_B"].as_f64().unwrap(),
        );
        // The MoE shapes read only their routed experts per token.
        assert_eq!(
            fixture == "qwen3_5-tiny-random",
            active == total,
            "{fixture}"
        );
        for algo in ["chain", "ddtree_8"] {
            let e = &r["e2e"][algo];
            assert_eq!(
                e["engine"]["tau"].as_f64(),
                Some(4.0),
                "{fixture} {algo}: {e}"
            );
            assert_eq!(e["engine"]["rounds"].as_u64(), Some(6), "{fixture} {algo}");
            assert!(positive(&e["speedup_vs_plain"]), "{fixture} {algo}");
        }
        assert!(
            positive(&r["e2e_batched"]["chain"]["tok_per_s"]),
            "{fixture}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
