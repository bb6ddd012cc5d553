//! The real `dflash-serve` binary on the bundled demo pair (tiny-coder-demo + its DFlash
//! drafter, DDTree-32, CPU), driven over HTTP as clients drive it: OpenAI and native routes,
//! streaming and not, stop strings cut across tokens, speculative statistics in /server_info,
//! /metrics and meta_info, API keys, tokenizer utilities, abort, and greedy outputs compared
//! with the decoding core's plain greedy run in this process.

mod support;

/// The same routes on a tiny Qwen3.5 hybrid target, with NEXTN and DFLASH.
#[path = "binary_api/hybrid.rs"]
mod hybrid;

/// SGLang's SGLANG_SIMULATE_ACC_LEN benchmark mode.
#[path = "binary_api/simulate.rs"]
mod simulate;

use std::path::PathBuf;

use candle_core::{DType, Device};
use dflash_common::tokenizer::Tokenizer;
use dflash_models::speculative::{
    Algorithm, Engine, EngineConfig, GenerationRequest, SamplingParams,
};
use dflash_models::{OpsMode, Qwen3Model};
use serde_json::{json, Value};
use support::binary::{metric, ServerProcess};
use support::TestServer;

const PROMPTS: [&str; 4] = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef normalize(v):",
    "class Stack:\n    def __init__(self):",
    "# read a file and count the words\n",
];

fn demo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-coder-demo")
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&demo_dir()).expect("demo tokenizer")
}

/// The decoding core's plain greedy continuation (f32, CPU), no server involved.
fn core_plain_greedy(prompts: &[Vec<u32>], max_new_tokens: usize) -> Vec<Vec<u32>> {
    let target = Qwen3Model::load(&demo_dir(), DType::F32, &Device::Cpu, 2048, OpsMode::Fused)
        .expect("demo target");
    let mut engine = Engine::new(
        target,
        None,
        EngineConfig {
            max_context: 2048,
            max_ddtree_budget: 0,
            eos_token_ids: Vec::new(),
            seed: 0,
        },
    );
    prompts
        .iter()
        .map(|p| {
            let req = GenerationRequest {
                prompt: p.clone(),
                max_new_tokens,
                sampling: SamplingParams::greedy(),
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                algorithm: Algorithm::Plain,
            };
            engine.generate(req).expect("plain greedy").0
        })
        .collect()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v["output_ids"]
        .as_array()
        .expect("output_ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

async fn generate_ids(s: &TestServer, prompt: &[u32], max_new_tokens: usize) -> Vec<u32> {
    let r = s
        .post(
            "/generate",
            &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": true}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    ids_of(&r.json())
}

#[tokio::test]
async fn greedy_over_http_equals_core_plain_greedy_with_and_without_speculation() {
    const MAX_NEW: usize = 40;
    let tok = tokenizer();
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| tok.encode(p, false).expect("encode"))
        .collect();
    let reference = core_plain_greedy(&prompts, MAX_NEW);
    for args in [
        &[][..],
        &["--speculative-verify", "chain"][..],
        &["--speculative-algorithm", "NONE"][..],
    ] {
        let server = ServerProcess::start(args).await;
        for (prompt, want) in prompts.iter().zip(&reference) {
            let got = generate_ids(&server.server, prompt, MAX_NEW).await;
            assert_eq!(
                &got, want,
                "dflash-serve {args:?}: greedy output differs from the core's plain greedy"
            );
        }
    }
}

/// `data:` payloads parsed as JSON, `[DONE]` last.
fn sse_json(r: &support::Reply) -> Vec<Value> {
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        r.body
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
        .collect()
}

#[tokio::test]
async fn openai_and_native_routes_agree_streaming_and_not() {
    let p = ServerProcess::start(&[]).await;
    let s = &p.server;
    let messages = json!([{"role": "user", "content": "Write a function that reverses a string."}]);

    // Chat: the stream's deltas spell the non-streamed message; SGLang's chunk order.
    let body = json!({"model": "tiny-coder-demo", "messages": messages, "max_tokens": 24, "temperature": 0});
    let whole = s.post("/v1/chat/completions", &body).await;
    assert_eq!(whole.status, 200, "{}", whole.body);
    let whole = whole.json();
    let content = whole["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    assert_eq!(whole["usage"]["completion_tokens"], 24);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = sse_json(&s.post("/v1/chat/completions", &streamed).await);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let finish_at = chunks
        .iter()
        .position(|c| !c["choices"][0]["finish_reason"].is_null())
        .expect("a finish chunk");
    assert_eq!(chunks[finish_at]["choices"][0]["finish_reason"], "length");
    assert_eq!(
        chunks[finish_at]["choices"][0]["delta"],
        json!({"reasoning_content": null})
    );
    let usage = chunks.last().expect("usage chunk");
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 24);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, content);

    // Completions, then /generate single, batch and streamed: one greedy continuation.
    let prompt = PROMPTS[0];
    let c = s
        .post("/v1/completions", &json!({"model": "tiny-coder-demo", "prompt": prompt, "max_tokens": 20, "temperature": 0}))
        .await;
    assert_eq!(c.status, 200, "{}", c.body);
    let completion = c.json()["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    let cs = sse_json(
        &s.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": true}),
        )
        .await,
    );
    let streamed: String = cs
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, completion);

    let params = json!({"max_new_tokens": 20, "temperature": 0});
    let g = s
        .post(
            "/generate",
            &json!({"text": prompt, "sampling_params": params}),
        )
        .await
        .json();
    assert_eq!(g["text"].as_str(), Some(completion.as_str()));
    assert_eq!(g["meta_info"]["completion_tokens"], 20);
    assert!(
        g["meta_info"]["spec_accept_length"]
            .as_f64()
            .expect("spec_accept_length")
            >= 1.0
    );
    assert!(
        g["meta_info"]["spec_accept_token_num"].is_u64(),
        "legacy name missing: {g}"
    );
    let batch = s
        .post(
            "/generate",
            &json!({"text": [prompt, PROMPTS[1]], "sampling_params": params}),
        )
        .await
        .json();
    assert_eq!(batch.as_array().map(Vec::len), Some(2));
    assert_eq!(batch[0]["text"], g["text"]);
    let gs = sse_json(
        &s.post(
            "/generate",
            &json!({"text": prompt, "sampling_params": params, "stream": true}),
        )
        .await,
    );
    let mut last_len = 0;
    for chunk in &gs {
        let n = chunk["meta_info"]["completion_tokens"]
            .as_u64()
            .expect("completion_tokens");
        assert!(n >= last_len, "completion_tokens went backwards");
        last_len = n;
    }
    assert_eq!(
        gs.last().expect("chunks")["text"],
        g["text"],
        "stream text is cumulative"
    );
}

#[tokio::test]
async fn stop_string_across_a_token_boundary_ends_the_output_there() {
    let p = ServerProcess::start(&[]).await;
    let s = &p.server;
    let tok = tokenizer();
    let prompt = tok.encode(PROMPTS[1], false).expect("encode");
    let ids = generate_ids(s, &prompt, 40).await;
    let full = tok.decode(&ids, true).expect("decode");
    // A stop string made of the last character of token k and the first of token k+1, at the
    // first boundary where that pair occurs nowhere earlier in the text.
    let (stop, cut) = (4..ids.len() - 1)
        .find_map(|k| {
            let head = tok.decode(&ids[..=k], true).ok()?;
            let next = tok.decode(&ids[..=k + 1], true).ok()?;
            let a = head.chars().last()?;
            let b = next[head.len()..].chars().next()?;
            let stop = format!("{a}{b}");
            let at = head.len() - a.len_utf8();
            (full.find(&stop) == Some(at) && !a.is_whitespace()).then_some((stop, at))
        })
        .expect("a boundary to cut at");
    for stream in [false, true] {
        let body = json!({"input_ids": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": true, "stop": stop}});
        let r = s.post("/generate", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let last = if stream {
            sse_json(&r).pop().expect("a chunk")
        } else {
            r.json()
        };
        assert_eq!(
            last["text"].as_str(),
            Some(&full[..cut]),
            "stop {stop:?} (stream: {stream})"
        );
        assert_eq!(
            last["meta_info"]["finish_reason"],
            json!({"type": "stop", "matched": stop})
        );
    }
}

#[tokio::test]
async fn server_info_and_metrics_report_speculation() {
    let p = ServerProcess::start(&["--enable-metrics"]).await;
    let s = &p.server;
    for prompt in PROMPTS {
        let r = s
            .post("/generate", &json!({"text": prompt, "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": true}}))
            .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let info = s.get("/server_info").await.json();
    assert_eq!(info["speculative_algorithm"], "DFLASH");
    let accept = info["internal_states"][0]["avg_spec_accept_length"]
        .as_f64()
        .expect("accept length");
    assert!(accept > 1.0, "the bundled drafter accepts drafts: {accept}");
    assert_eq!(
        s.get("/get_server_info").await.json()["internal_states"],
        info["internal_states"]
    );
    let m = s.get("/metrics").await;
    assert_eq!(m.status, 200);
    let label = "model_name=\"tiny-coder-demo\"";
    // The request counters are split by `is_streaming` (these requests were not streamed).
    let unstreamed = "is_streaming=\"false\"";
    for (name, label) in [
        ("sglang:spec_accept_length", label),
        ("sglang:spec_verify_calls_total", label),
        ("sglang:prompt_tokens_total", unstreamed),
        ("sglang:generation_tokens_total", unstreamed),
    ] {
        let v =
            metric(&m.body, name, label).unwrap_or_else(|| panic!("{name} missing:\n{}", m.body));
        assert!(v > 0.0, "{name} = {v}");
    }
    assert_eq!(
        metric(&m.body, "sglang:generation_tokens_total", unstreamed),
        Some(4.0 * 32.0)
    );
    assert_eq!(metric(&m.body, "sglang:num_running_reqs", label), Some(0.0));
}

/// sglang-router's load monitor reads `/get_load` (power-of-two routing, its `/get_loads`): one
/// entry per DP rank, requests running plus waiting, K/V tokens in use plus waiting prompts.
#[tokio::test]
async fn get_load_counts_running_and_waiting_requests_as_sglang_does() {
    let p = ServerProcess::start(&["--enable-metrics", "--max-running-requests", "1"]).await;
    let s = &p.server;
    let idle = s.get("/get_load").await;
    assert_eq!(idle.status, 200, "{}", idle.body);
    assert_eq!(
        idle.json(),
        json!([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])
    );
    let prompt = "def main():";
    let prompt_len = s.post("/tokenize", &json!({"prompt": prompt})).await.json()["count"]
        .as_u64()
        .expect("token count");
    let mut streams = Vec::new();
    for rid in ["load-a", "load-b"] {
        let s = s.clone();
        let body = json!({"text": prompt, "rid": rid, "stream": true,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": true}});
        streams.push(tokio::spawn(
            async move { s.post("/generate", &body).await },
        ));
    }
    let mut busy = Value::Null;
    for _ in 0..1000 {
        busy = s.get("/get_load").await.json();
        if busy[0]["num_reqs"] == 2 && busy[0]["num_waiting_reqs"] == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(busy[0]["num_reqs"], 2, "{busy}");
    assert_eq!(busy[0]["num_waiting_reqs"], 1, "{busy}");
    let used = metric(
        &s.get("/metrics").await.body,
        "sglang:num_used_tokens",
        "model_name=\"tiny-coder-demo\"",
    )
    .expect("sglang:num_used_tokens");
    // Its prompt and the share of max_new_tokens admission expects (SGLang's new-token
    // ratio: 0.7 at start, never below 0.098), in whole pages.
    assert!(
        used >= 0.098 * 1500.0 && used <= 0.7 * 1500.0 + 128.0 + prompt_len as f64,
        "the running request reserves its expected K/V: {used}"
    );
    assert_eq!(
        busy[0]["num_tokens"].as_f64(),
        Some(used + prompt_len as f64),
        "{busy}"
    );
    for rid in ["load-a", "load-b"] {
        let r = s.post("/abort_request", &json!({"rid": rid})).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    for t in streams {
        assert_eq!(t.await.expect("stream task").status, 200);
    }
    assert_eq!(s.get("/get_load").await.json()[0]["num_reqs"], 0);
}

#[tokio::test]
async fn api_key_is_required_except_for_health_and_metrics() {
    let p = ServerProcess::start(&["--api-key", "sk-test", "--enable-metrics"]).await;
    let s = &p.server;
    let body = json!({"text": "x", "sampling_params": {"max_new_tokens": 2}});
    let denied = s.post("/generate", &body).await;
    assert_eq!(denied.status, 401, "{}", denied.body);
    let chat = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(chat.status, 401);
    let allowed = s
        .request(
            "POST",
            "/generate",
            &[
                ("Content-Type", "application/json"),
                ("Authorization", "Bearer sk-test"),
            ],
            body.to_string().as_bytes(),
        )
        .await;
    assert_eq!(allowed.status, 200, "{}", allowed.body);
    let wrong = s
        .request(
            "GET",
            "/v1/models",
            &[("Authorization", "Bearer nope")],
            b"",
        )
        .await;
    assert_eq!(wrong.status, 401);
    for open in ["/health", "/health_generate", "/metrics"] {
        assert_eq!(
            s.get(open).await.status,
            200,
            "{open} must not need the key"
        );
    }
}

#[tokio::test]
async fn tokenizer_routes_and_abort_request() {
    let p = ServerProcess::start(&[]).await;
    let s = &p.server;
    let t = s
        .post("/tokenize", &json!({"prompt": "def add(a, b):"}))
        .await
        .json();
    let tokens = t["tokens"].clone();
    assert_eq!(
        t["count"].as_u64(),
        tokens.as_array().map(|a| a.len() as u64)
    );
    assert_eq!(
        s.post("/v1/detokenize", &json!({"tokens": tokens}))
            .await
            .json()["text"],
        "def add(a, b):"
    );
    let bad = s
        .post("/detokenize", &json!({"tokens": [1, 99999999]}))
        .await;
    assert_eq!(bad.status, 400, "{}", bad.body);

    let long = json!({"text": "def main():", "rid": "to-abort", "stream": true,
        "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": true}});
    let (stream, _) = tokio::join!(s.post("/generate", &long), async {
        // Abort once the request is running.
        for _ in 0..400 {
            let info = s.get("/server_info").await.json();
            if info["num_running_reqs"] == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let r = s.post("/abort_request", &json!({"rid": "to-abort"})).await;
        assert_eq!(r.status, 200);
    });
    let last = sse_json(&stream).pop().expect("a chunk");
    assert_eq!(
        last["meta_info"]["finish_reason"]["type"], "abort",
        "{last}"
    );
    assert!(
        last["meta_info"]["completion_tokens"]
            .as_u64()
            .expect("count")
            < 1500
    );
    assert_eq!(s.get("/health").await.status, 200);
}

#[tokio::test]
async fn request_timeout_ends_a_long_request_with_its_partial_output() {
    let p = ServerProcess::start(&["--request-timeout", "1.5"]).await;
    let s = &p.server;
    let started = std::time::Instant::now();
    let r = s
        .post("/generate", &json!({"text": "def main():", "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": true}}))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "abort", "{v}");
    let message = v["meta_info"]["finish_reason"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.contains("--request-timeout"), "{message}");
    let n = v["meta_info"]["completion_tokens"].as_u64().expect("count");
    assert!(n > 0 && n < 3000, "partial output: {n} tokens");
    assert_eq!(ids_of(&v).len() as u64, n);
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    let quick = s
        .post(
            "/generate",
            &json!({"text": "x", "sampling_params": {"max_new_tokens": 4}}),
        )
        .await;
    assert_eq!(quick.json()["meta_info"]["finish_reason"]["type"], "length");
}
