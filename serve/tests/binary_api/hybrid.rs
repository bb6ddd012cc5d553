//! The real `dflash-serve` binary on a tiny Qwen3.5 hybrid target (Gated DeltaNet + gated
//! attention; see support/hybrid.rs for how the checkpoint is made): greedy output over HTTP
//! with the built-in MTP head (NEXTN / MTP, chain and tree) and with a DFlash drafter tapping
//! recurrent layers (DDTree and chain) equals plain greedy (`--speculative-algorithm NONE`)
//! token for token; /server_info, /model_info and /metrics report the algorithm and acceptance;
//! NEXTN on a checkpoint without `mtp.*` weights stops startup with a message naming the flag.
//! (A module of the binary_api test binary, so CI links no extra test executable.)

use crate::support::binary::{metric, ServerProcess};
use crate::support::hybrid::hybrid_fixture;
use crate::support::{self, TestServer};
use dflash_common::tokenizer::Tokenizer;
use dflash_serve::cli::Args;
use dflash_serve::config::ServeConfig;
use dflash_serve::engine::real::RealEngine;
use serde_json::{json, Value};

const PROMPTS: [&str; 3] = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "# read a file and count the words\n",
];
const MAX_NEW: usize = 24;

async fn generate_ids(s: &TestServer, prompt: &[u32]) -> Vec<u32> {
    let r = s
        .post(
            "/generate",
            &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": true}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["output_ids"]
        .as_array()
        .expect("output_ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

async fn start(base: &[&str], extra: &[&str]) -> ServerProcess {
    let mut args = base.to_vec();
    args.extend_from_slice(extra);
    ServerProcess::start(&args).await
}

#[tokio::test]
async fn hybrid_greedy_with_nextn_and_dflash_equals_plain_greedy_over_http() {
    let fx = hybrid_fixture("greedy");
    let target = fx.target.display().to_string();
    let drafter = fx.drafter.display().to_string();
    let tok = Tokenizer::from_dir(&fx.target).expect("tokenizer");
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| tok.encode(p, false).expect("encode"))
        .collect();
    let base = [
        "--model-path",
        target.as_str(),
        "--context-length",
        "256",
        "--enable-metrics",
    ];
    let plain = start(&base, &["--speculative-algorithm", "NONE"]).await;
    let mut want = Vec::new();
    for p in &prompts {
        want.push(generate_ids(&plain.server, p).await);
    }
    let info = plain.server.get("/model_info").await.json();
    assert_eq!(info["model_type"], "qwen3_5");
    assert_eq!(info["speculative_algorithm"], Value::Null);
    drop(plain);

    // (flags, algorithm reported, steps, verify width, least average accept length)
    let cases: [(&[&str], &str, u64, u64, f64); 4] = [
        // SGLang's Qwen3.5 launch line; the fixture's head often predicts the target
        // (accept length 1.46 when written).
        (
            &[
                "--speculative-algorithm",
                "NEXTN",
                "--speculative-num-steps",
                "3",
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                "4",
            ],
            "NEXTN",
            3,
            4,
            1.2,
        ),
        // A tree over the head's per-depth top-k: 7 nodes (accept length 1.73).
        (
            &[
                "--speculative-algorithm",
                "mtp",
                "--speculative-num-steps",
                "2",
                "--speculative-eagle-topk",
                "4",
                "--speculative-num-draft-tokens",
                "8",
            ],
            "NEXTN",
            2,
            8,
            1.2,
        ),
        // Random DFlash drafter (taps on GDN layers): mostly rejected, so states roll back.
        (
            &[
                "--speculative-algorithm",
                "DFLASH",
                "--speculative-draft-model-path",
                drafter.as_str(),
                "--speculative-ddtree-budget",
                "8",
            ],
            "DFLASH",
            1,
            4,
            1.0,
        ),
        (
            &[
                "--speculative-draft-model-path",
                drafter.as_str(),
                "--speculative-verify",
                "chain",
            ],
            "DFLASH",
            1,
            4,
            1.0,
        ),
    ];
    for (flags, algorithm, steps, width, least_accept) in cases {
        let p = start(&base, flags).await;
        let s = &p.server;
        for (prompt, want) in prompts.iter().zip(&want) {
            let got = generate_ids(s, prompt).await;
            assert_eq!(
                &got, want,
                "{flags:?}: greedy output differs from plain greedy"
            );
        }
        assert!(
            p.log()
                .contains("hybrid target: 4 of 6 layers are Gated DeltaNet; a verify stages"),
            "{}",
            p.log()
        );
        let info = s.get("/server_info").await.json();
        assert_eq!(info["speculative_algorithm"], algorithm, "{flags:?}");
        assert_eq!(info["speculative_num_steps"], steps, "{flags:?}");
        assert_eq!(info["speculative_num_draft_tokens"], width, "{flags:?}");
        let accept = info["internal_states"][0]["avg_spec_accept_length"]
            .as_f64()
            .expect("avg_spec_accept_length");
        eprintln!("{flags:?}: avg_spec_accept_length {accept}");
        assert!(accept >= least_accept, "{flags:?}: accept length {accept}");
        assert_eq!(
            s.get("/model_info").await.json()["speculative_algorithm"],
            algorithm
        );
        let m = s.get("/metrics").await.body;
        let label = format!("model_name=\"{target}\"");
        assert_eq!(
            metric(&m, "sglang:spec_num_steps", &label),
            Some(steps as f64)
        );
        let verify_calls = metric(&m, "sglang:spec_verify_calls_total", &label)
            .unwrap_or_else(|| panic!("spec_verify_calls_total missing:\n{m}"));
        assert!(verify_calls > 0.0, "{flags:?}");
        assert!(metric(&m, "sglang:spec_accept_length", &label).is_some());
    }
}

fn config(argv: &[&str]) -> ServeConfig {
    let mut full = vec!["dflash-serve"];
    full.extend_from_slice(argv);
    ServeConfig::from_args(&Args::try_parse_sglang_from(full).expect("args")).expect("config")
}

#[test]
fn nextn_needs_a_checkpoint_with_an_mtp_head() {
    let fx = hybrid_fixture("load");
    let demo = support::demo_dir();
    for (dir, expect) in [
        (
            &fx.target_no_mtp,
            "no built-in MTP head (no `mtp.fc.weight`",
        ),
        (&demo, "is a Qwen3 (dense) checkpoint"),
    ] {
        let dir_s = dir.display().to_string();
        let c = config(&["--model-path", &dir_s, "--speculative-algorithm", "NEXTN"]);
        let e = RealEngine::load(&c, dir, 64, vec![])
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.starts_with("--speculative-algorithm NEXTN: ") && e.contains(expect),
            "{e}"
        );
    }
    // The same target with its head loads.
    let t = fx.target.display().to_string();
    let c = config(&["--model-path", &t, "--speculative-algorithm", "NEXTN"]);
    RealEngine::load(&c, &fx.target, 64, vec![]).expect("the head loads");

    // The binary stops before serving and says why.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-serve"))
        .args(["--model-path", &fx.target_no_mtp.display().to_string()])
        .args(["--speculative-algorithm", "NEXTN", "--port", "0"])
        .output()
        .expect("run dflash-serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--speculative-algorithm NEXTN: ") && stderr.contains("mtp.fc.weight"),
        "{stderr}"
    );
}

/// A config.json whose layer_types disagree with the weights stops loading with the directory
/// and the layer named (the check itself is the models crate's; this is what serving says).
#[test]
fn an_inconsistent_hybrid_checkpoint_is_refused_naming_the_directory_and_layer() {
    let fx = hybrid_fixture("inconsistent");
    let dir = fx.target_no_mtp.with_file_name("inconsistent");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::copy(
        fx.target_no_mtp.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .expect("copy weights");
    let path = fx.target_no_mtp.join("config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
    let text = &mut cfg["text_config"];
    text["layer_types"][0] = json!("full_attention");
    text.as_object_mut()
        .expect("object")
        .remove("full_attention_interval");
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("write");
    let d = dir.display().to_string();
    let c = config(&["--model-path", &d, "--speculative-algorithm", "NONE"]);
    let e = RealEngine::load(&c, &dir, 64, vec![])
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.starts_with(&format!("loading the target model from {d}: "))
            && e.contains("layer 0 is full_attention")
            && e.contains("layer_types does not match the weights"),
        "{e}"
    );
}
