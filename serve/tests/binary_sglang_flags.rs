//! The real binary started with SGLang launch lines: z-lab's README line (its paths pointed at
//! the bundled demo pair) serves, with one start-up warning naming the flags that have no effect;
//! `--log-level warning` keeps warnings and drops info lines (a level tracing does not know
//! would silence everything); flags a user relies on and we lack stop start-up naming the flag.

mod support;

use std::process::Command;

use serde_json::json;
use support::binary::{metric, ServerProcess};
use support::demo_dir;

const WARNING: &str = "SGLang flags with no effect in dflash-serve, accepted so launch lines work";

#[tokio::test]
async fn the_zlab_readme_line_serves_with_one_warning_naming_the_ignored_flags() {
    let target = demo_dir();
    let drafter = target.with_file_name("tiny-coder-demo-dflash");
    let (target, drafter) = (target.display().to_string(), drafter.display().to_string());
    // z-lab/dflash README's SGLang quick start, word for word but the two paths.
    let line = [
        "--model-path",
        &target,
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        &drafter,
        "--speculative-num-draft-tokens",
        "16",
        "--tp-size",
        "1",
        "--attention-backend",
        "trtllm_mha",
        "--speculative-draft-attention-backend",
        "fa4",
        "--mem-fraction-static",
        "0.75",
        "--mamba-scheduler-strategy",
        "extra_buffer",
        "--trust-remote-code",
        "--enable-metrics",
        "--skip-server-warmup",
    ];
    let p = ServerProcess::start(&line).await;
    let log = p.log();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains(WARNING)).collect();
    assert_eq!(warnings.len(), 1, "{log}");
    for flag in [
        "--attention-backend trtllm_mha",
        "--speculative-draft-attention-backend fa4",
        "--mamba-scheduler-strategy extra_buffer",
        "--trust-remote-code",
    ] {
        assert!(
            warnings[0].contains(flag),
            "{flag} not named: {}",
            warnings[0]
        );
    }
    assert!(warnings[0].contains("WARN"), "{}", warnings[0]);
    let s = &p.server;
    let r = s
        .post(
            "/generate",
            &json!({"text": "def fib(n):", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let info = s.get("/server_info").await.json();
    assert_eq!(info["speculative_algorithm"], "DFLASH");
    assert_eq!(info["speculative_num_draft_tokens"], 16);
    assert_eq!(info["mem_fraction_static"], 0.75);
    let launch = info["launch_command"].as_str().expect("launch_command");
    assert!(launch.starts_with("--model-path "), "{launch}");
    assert!(
        launch.contains("--mamba-scheduler-strategy extra_buffer"),
        "{launch}"
    );
    // The gauge reads what /server_info says: 16, not the 15 drafts.
    let m = s.get("/metrics").await.body;
    assert_eq!(
        metric(&m, "sglang:spec_num_draft_tokens", "tp_rank=\"0\""),
        Some(16.0),
        "{m}"
    );
}

#[tokio::test]
async fn log_level_warning_keeps_warnings_and_drops_info_lines() {
    let p = ServerProcess::start_without_rust_log(&[
        "--log-level",
        "warning",
        "--trust-remote-code",
        "--skip-server-warmup",
    ])
    .await;
    let r = p
        .server
        .post(
            "/generate",
            &json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let log = p.log();
    assert!(log.contains(WARNING), "the warning is kept:\n{log}");
    assert!(
        !log.contains("server_args="),
        "info lines are dropped:\n{log}"
    );
    assert!(!log.contains(" INFO "), "info lines are dropped:\n{log}");
}

#[test]
fn flags_whose_behaviour_is_missing_stop_startup_naming_the_flag() {
    for (args, flag) in [
        (&["--enable-lora"][..], "--enable-lora"),
        (
            &["--ssl-certfile", "cert.pem", "--ssl-keyfile", "key.pem"][..],
            "--ssl-certfile",
        ),
        (&["--nnodes", "2"][..], "--nnodes"),
        (&["--log-level", "loud"][..], "--log-level"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_dflash-serve"))
            .args(args)
            .env_remove("RUST_LOG")
            .output()
            .expect("run dflash-serve");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
}
