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

/// `/generate` with `input_ids` and `logprob_start_len`: the input logprobs.
async fn input_logprobs(p: &ServerProcess, ids: &[u64], start: usize) -> Vec<Value> {
    let body = json!({"input_ids": ids, "return_logprob": true, "logprob_start_len": start,
        "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 1, "temperature": 0}});
    let r = p.server.post("/generate", &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let tops = v["meta_info"]["input_top_logprobs"]
        .as_array()
        .expect("tops")
        .clone();
    let lps = v["meta_info"]["input_token_logprobs"]
        .as_array()
        .expect("lps")
        .clone();
    assert_eq!(tops.len(), lps.len());
    lps
}

#[tokio::test]
async fn prompt_logprobs_equal_the_logprobs_decoding_gave_those_tokens_and_echo_returns_them() {
    let plain =
        ServerProcess::start(&["--speculative-algorithm", "NONE", "--skip-server-warmup"]).await;
    let ddtree = ServerProcess::start(&["--skip-server-warmup"]).await;
    let prompt = PROMPTS[0];
    let ids: Vec<u64> = plain
        .server
        .post("/tokenize", &json!({"prompt": prompt}))
        .await
        .json()["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert!(ids.len() > 2);
    let (out_ids, out_lps, _) = logprobs(&plain, prompt, false).await;
    // The prompt followed by the greedy continuation, teacher-forced: the input logprobs of
    // the continuation are the logprobs decoding reported for it (prefill rows = decode rows).
    let mut forced = ids.clone();
    forced.extend(&out_ids[..12]);
    for server in [&plain, &ddtree] {
        let lps = input_logprobs(server, &forced, 0).await;
        assert_eq!(lps.len(), forced.len(), "one per prompt token from 0");
        assert!(
            lps[0][0].is_null() && lps[0][1] == json!(ids[0]),
            "{}",
            lps[0]
        );
        for (k, want) in out_lps[..12].iter().enumerate() {
            let e = &lps[ids.len() + k];
            assert_eq!(e[1], json!(out_ids[k]));
            let got = e[0].as_f64().expect("a logprob");
            assert!(
                (got - want).abs() < TOLERANCE,
                "token {k}: {got} vs decode {want}"
            );
        }
        let tail = input_logprobs(server, &forced, ids.len()).await;
        assert_eq!(tail.len(), 12, "from logprob_start_len on");
        assert_eq!(tail[0][1], json!(out_ids[0]));
    }
    // Completions `echo` with `logprobs`: the prompt's tokens first (the first one null).
    for server in [&plain, &ddtree] {
        let body = json!({"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "logprobs": 1, "echo": true, "ignore_eos": true});
        let v = server.server.post("/v1/completions", &body).await.json();
        let c = &v["choices"][0];
        let text = c["text"].as_str().expect("text");
        assert!(text.starts_with(prompt), "{text:?}");
        let lp = &c["logprobs"];
        let tokens = lp["tokens"].as_array().expect("tokens");
        assert_eq!(tokens.len(), ids.len() + 6, "{lp}");
        assert!(
            lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(),
            "{lp}"
        );
        let joined: String = tokens.iter().filter_map(Value::as_str).collect();
        assert_eq!(joined, text);
        // Streamed: the prompt comes first.
        let mut body = body.clone();
        body["stream"] = json!(true);
        let r = server.server.post("/v1/completions", &body).await;
        let streamed: String = r
            .events()
            .iter()
            .filter(|e| *e != "[DONE]")
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
            .collect();
        assert_eq!(streamed, text, "streamed echo");
    }
}
