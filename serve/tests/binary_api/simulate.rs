//! `SGLANG_SIMULATE_ACC_LEN`: the server's verify walk accepts that many tokens per round
//! (drafts plus the bonus) instead of checking the drafts, says so loudly in its log, and
//! refuses a value that is not an acceptance length.

use std::process::{Command, Stdio};

use serde_json::{json, Value};

use crate::support::binary::ServerProcess;

#[tokio::test]
async fn every_round_commits_the_simulated_acceptance_length() {
    // The demo drafter proposes 15 drafts a round: 4 accepted tokens is 3 drafts + the bonus.
    let p = ServerProcess::start_with_env(
        &["--speculative-verify", "chain"],
        &[("SGLANG_SIMULATE_ACC_LEN", "4")],
    )
    .await;
    assert!(
        p.log().contains("BENCHMARK MODE") && p.log().contains("NOT the target model's"),
        "the log must say loudly that output is not the target's:\n{}",
        p.log()
    );
    let body = json!({"text": "def f(x):", "sampling_params":
        {"max_new_tokens": 41, "temperature": 0, "ignore_eos": true}});
    let v: Value = p.server.post("/generate", &body).await.json();
    let meta = &v["meta_info"];
    assert_eq!(meta["completion_tokens"], 41, "{v}");
    // The prefill gives the first token; every round after it commits exactly 3 drafts + 1.
    assert_eq!(meta["spec_verify_ct"], 10, "{v}");
    assert_eq!(meta["spec_num_correct_drafts"], 30, "{v}");
}

#[test]
fn a_value_below_one_is_refused_at_start_up_naming_the_variable() {
    let out = Command::new(env!("CARGO_BIN_EXE_dflash-serve"))
        .args(["--port", "0"])
        .env("SGLANG_SIMULATE_ACC_LEN", "0.5")
        .stdin(Stdio::null())
        .output()
        .expect("run dflash-serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("SGLANG_SIMULATE_ACC_LEN=0.5") && err.contains("at least 1"),
        "{err}"
    );
}
