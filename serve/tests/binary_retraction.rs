//! Admission by SGLang's new-token ratio and retraction, through the real binary on the
//! bundled demo pair (f32, CPU): with a deliberately small K/V pool (`--max-total-tokens`),
//! 16 concurrent requests are admitted on an estimate of the tokens they will generate, run
//! out of pages mid-generation, are retracted and resumed (`num_retractions` in meta_info),
//! and every one returns exactly what it returns alone on a large pool, plain and DDTree.

mod support;

use serde_json::{json, Value};
use support::binary::ServerProcess;

const MAX_NEW: u64 = 128;

fn prompt(k: usize) -> String {
    format!(
        "# Task {k}: write a function number {k} that sorts a list of {k} items.\ndef sort_{k}(items):\n"
    )
}

async fn generate(p: &ServerProcess, k: usize) -> (Vec<u64>, u64) {
    let body = json!({"text": prompt(k), "sampling_params": {"max_new_tokens": MAX_NEW,
        "temperature": 0, "ignore_eos": true}});
    let r = p.server.post("/generate", &body).await;
    assert_eq!(r.status, 200, "request {k}: {}", r.body);
    let v: Value = r.json();
    let ids = v["output_ids"]
        .as_array()
        .expect("output_ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    let retractions = v["meta_info"]["num_retractions"]
        .as_u64()
        .expect("num_retractions");
    (ids, retractions)
}

#[tokio::test]
async fn sixteen_requests_in_a_small_pool_are_retracted_and_answer_as_alone() {
    for mode in [&["--speculative-algorithm", "NONE"][..], &[][..]] {
        let mut small_args = mode.to_vec();
        small_args.extend_from_slice(&["--max-total-tokens", "640", "--skip-server-warmup"]);
        let mut big_args = mode.to_vec();
        big_args.push("--skip-server-warmup");
        let small = ServerProcess::start(&small_args).await;
        let big = ServerProcess::start(&big_args).await;
        let mut want = Vec::new();
        for k in 0..16 {
            want.push(generate(&big, k).await.0);
        }
        let got = futures_util::future::join_all((0..16).map(|k| generate(&small, k))).await;
        let mut retractions = 0;
        for (k, (ids, r)) in got.into_iter().enumerate() {
            assert_eq!(ids.len() as u64, MAX_NEW);
            assert_eq!(ids, want[k], "{mode:?}: request {k} differs from alone");
            retractions += r;
        }
        assert!(
            retractions > 0,
            "{mode:?}: the small pool retracted nothing"
        );
    }
}
