//! Logprobs from the real binary on the bundled demo pair (f32, CPU): with DFLASH speculation
//! (DDTree and chain verify) every committed token's logprob equals plain decoding's
//! log-softmax at that token, streamed and not, and greedy tokens are their rows' top choice.

mod support;

use serde_json::{json, Value};
use support::binary::ServerProcess;

const PROMPTS: [&str; 3] = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:",
];
/// f32 on the CPU: the verify forward batches rows differently from decode, so logits differ
/// in the last bits; 1e-4 in log space is far below any real disagreement.
const TOLERANCE: f64 = 1e-4;

async fn logprobs(
    p: &ServerProcess,
    prompt: &str,
    stream: bool,
) -> (Vec<u64>, Vec<f64>, Vec<Value>) {
    let body = json!({"text": prompt, "stream": stream, "return_logprob": true, "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": true}});
    let r = p.server.post("/generate", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = if stream {
        let events = r.events();
        let last = events
            .iter()
            .rev()
            .find(|e| *e != "[DONE]")
            .expect("a chunk");
        serde_json::from_str(last).expect("json")
    } else {
        r.json()
    };
    let ids: Vec<u64> = v["output_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    let meta = &v["meta_info"];
    let lps: Vec<f64> = meta["output_token_logprobs"]
        .as_array()
        .expect("output_token_logprobs")
        .iter()
        .map(|t| t[0].as_f64().expect("logprob"))
        .collect();
    let tops = meta["output_top_logprobs"]
        .as_array()
        .expect("tops")
        .clone();
    (ids, lps, tops)
}

#[tokio::test]
async fn speculative_logprobs_equal_plain_decodings_streamed_and_not() {
    let plain =
        ServerProcess::start(&["--speculative-algorithm", "NONE", "--skip-server-warmup"]).await;
    let ddtree = ServerProcess::start(&["--skip-server-warmup"]).await;
    let chain =
        ServerProcess::start(&["--speculative-verify", "chain", "--skip-server-warmup"]).await;
    for prompt in PROMPTS {
        let (want_ids, want, tops) = logprobs(&plain, prompt, false).await;
        assert_eq!(want.len(), 24);
        for (k, (id, top)) in want_ids.iter().zip(&tops).enumerate() {
            // Greedy: the committed token is its row's most likely, with the same logprob.
            assert_eq!(top[0][1].as_u64(), Some(*id), "{prompt} token {k}: {top}");
            assert!((top[0][0].as_f64().unwrap_or(f64::NAN) - want[k]).abs() < 1e-9);
            assert!(want[k] <= 0.0);
        }
        for (name, server) in [("ddtree", &ddtree), ("chain", &chain)] {
            for stream in [false, true] {
                let (ids, got, _) = logprobs(server, prompt, stream).await;
                assert_eq!(
                    ids, want_ids,
                    "{name} (stream {stream}) {prompt}: output differs"
                );
                for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() < TOLERANCE,
                        "{name} (stream {stream}) {prompt} token {k}: {a} vs plain {b}"
                    );
                }
            }
        }
    }
}
