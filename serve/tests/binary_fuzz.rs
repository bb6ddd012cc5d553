//! Seeded fuzzing of the real binary: 5,000 malformed requests across every route (mutated JSON
//! bytes, wrong types and values in known fields, bad content types, methods and framing,
//! garbage headers) must get no 5xx and never hang, and a greedy generation gives the same
//! tokens before and after.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use support::binary::ServerProcess;
use support::raw::{exchange, Outcome};

const REQUESTS: usize = 5000;
const WORKERS: usize = 8;
const SEED: u64 = 19;
/// A request that has neither an answer nor a close within this has hung.
const HANG: Duration = Duration::from_secs(30);

const ROUTES: &[(&str, &str)] = &[
    ("POST", "/generate"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
    ("POST", "/v1/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/abort_request"),
    ("POST", "/separate_reasoning"),
    ("GET", "/flush_cache"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/tiny-coder-demo"),
    ("GET", "/health"),
    ("GET", "/server_info"),
    ("GET", "/model_info"),
    ("GET", "/get_load"),
    ("GET", "/metrics"),
];

/// A valid body for `path`, kept small so mutations that stay valid finish quickly.
fn seed_body(path: &str) -> Value {
    match path {
        "/generate" => {
            json!({"text": "def f(x):", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        }
        "/v1/chat/completions" => {
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        }
        "/v1/completions" => json!({"prompt": "import os", "max_tokens": 2}),
        "/tokenize" | "/v1/tokenize" => json!({"prompt": "hello world"}),
        "/detokenize" => json!({"tokens": [1, 2, 3]}),
        "/abort_request" => json!({"rid": "nothing"}),
        "/separate_reasoning" => json!({"text": "<think>a</think>b", "reasoning_parser": "qwen3"}),
        _ => Value::Null,
    }
}

fn weird_value(rng: &mut StdRng) -> Value {
    match rng.random_range(0..12) {
        0 => json!(null),
        1 => json!(-1),
        2 => json!(1e39),
        3 => json!(i64::MAX),
        4 => json!("x".repeat(rng.random_range(0..64))),
        5 => json!([]),
        6 => json!({}),
        7 => json!(true),
        8 => json!([[-5, 1], [9999999]]),
        9 => json!(0.5),
        10 => json!(rng.random_range(-3..5)),
        _ => json!([{"role": 5}]),
    }
}

/// Sets a random known (or unknown) field, possibly nested, to a weird value.
fn mutate_fields(rng: &mut StdRng, body: &mut Value) {
    const FIELDS: &[&str] = &[
        "text",
        "input_ids",
        "sampling_params",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stop",
        "stream",
        "messages",
        "prompt",
        "max_tokens",
        "tokens",
        "rid",
        "stop_token_ids",
        "min_p",
        "seed",
        "logit_bias",
        "stream_options",
        "model",
        "zzz",
    ];
    for _ in 0..rng.random_range(1..4) {
        let field = FIELDS[rng.random_range(0..FIELDS.len())];
        let v = weird_value(rng);
        let nested = rng.random_bool(0.4) && body["sampling_params"].is_object();
        if nested {
            body["sampling_params"][field] = v;
        } else if let Some(obj) = body.as_object_mut() {
            obj.insert(field.to_string(), v);
        } else {
            *body = json!({ field: v });
        }
    }
    // Valid mutations must stay quick: never ask for long generations.
    for key in ["max_new_tokens", "max_tokens"] {
        if body[key].as_i64().is_some_and(|n| n > 4) {
            body[key] = json!(4);
        }
        if body["sampling_params"][key].as_i64().is_some_and(|n| n > 4) {
            body["sampling_params"][key] = json!(4);
        }
    }
}

fn mutate_bytes(rng: &mut StdRng, bytes: &mut Vec<u8>) {
    for _ in 0..rng.random_range(1..6) {
        if bytes.is_empty() {
            bytes.push(rng.random());
            continue;
        }
        let i = rng.random_range(0..bytes.len());
        match rng.random_range(0..4) {
            0 => bytes[i] = rng.random(),
            1 => bytes.truncate(i),
            2 => bytes.insert(
                i,
                *b"{}[]\",:\\\x00\xff9e"
                    .get(rng.random_range(0..14))
                    .unwrap_or(&b'x'),
            ),
            _ => bytes.extend_from_slice(b"}garbage"),
        }
    }
}

/// One malformed request, as raw bytes.
fn malformed(rng: &mut StdRng) -> Vec<u8> {
    let (mut method, path) = ROUTES[rng.random_range(0..ROUTES.len())];
    let mut body = seed_body(path);
    let mut bytes = body.to_string().into_bytes();
    let mut content_type = "application/json".to_string();
    let mut extra = String::new();
    let mut framing = "length";
    match rng.random_range(0..8) {
        0 | 1 => {
            mutate_fields(rng, &mut body);
            bytes = body.to_string().into_bytes();
        }
        2 | 3 => mutate_bytes(rng, &mut bytes),
        4 => {
            content_type = [
                "text/plain",
                "application/jsonx",
                "",
                "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x",
                "application/vnd.api+json",
            ][rng.random_range(0..6)]
            .to_string();
        }
        5 => method = ["PUT", "DELETE", "PATCH", "GET", "POST", "OPTIONS"][rng.random_range(0..6)],
        6 => {
            framing = ["chunked-bad", "chunked-ok", "short", "two-lengths"][rng.random_range(0..4)];
        }
        _ => {
            extra = [
                "X-A: \x01\r\n",
                "Content-Length: abc\r\n",
                "Transfer-Encoding: gzip\r\n",
                "Authorization: Bearer x\r\n",
                ": empty\r\n",
                "Expect: 100-continue\r\n",
            ][rng.random_range(0..6)]
            .to_string();
        }
    }
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n");
    if !content_type.is_empty() {
        head.push_str(&format!("Content-Type: {content_type}\r\n"));
    }
    head.push_str(&extra);
    let mut out = Vec::new();
    match framing {
        "chunked-bad" | "chunked-ok" => {
            head.push_str("Transfer-Encoding: chunked\r\n\r\n");
            out.extend_from_slice(head.as_bytes());
            let size = if framing == "chunked-bad" {
                "1x".to_string()
            } else {
                format!("{:x}", bytes.len())
            };
            out.extend_from_slice(format!("{size}\r\n").as_bytes());
            out.extend_from_slice(&bytes);
            out.extend_from_slice(b"\r\n0\r\n\r\n");
        }
        "short" => {
            // Claims one byte more than it sends, then closes its write side.
            head.push_str(&format!("Content-Length: {}\r\n\r\n", bytes.len() + 1));
            out.extend_from_slice(head.as_bytes());
            out.extend_from_slice(&bytes);
        }
        "two-lengths" => {
            head.push_str(&format!(
                "Content-Length: {}\r\nContent-Length: 3\r\n\r\n",
                bytes.len()
            ));
            out.extend_from_slice(head.as_bytes());
            out.extend_from_slice(&bytes);
        }
        _ => {
            head.push_str(&format!("Content-Length: {}\r\n\r\n", bytes.len()));
            out.extend_from_slice(head.as_bytes());
            out.extend_from_slice(&bytes);
        }
    }
    out
}

async fn greedy(p: &ServerProcess) -> Value {
    let r = p
        .server
        .post(
            "/generate",
            &json!({"text": "def quicksort(items):",
                "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": true}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["output_ids"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_thousand_malformed_requests_get_no_5xx_and_change_nothing() {
    let p = Arc::new(
        ServerProcess::start(&[
            "--context-length",
            "256",
            "--body-read-timeout",
            "1",
            "--skip-server-warmup",
        ])
        .await,
    );
    let before = greedy(&p).await;
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let (p, next) = (p.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut tally = std::collections::BTreeMap::<String, usize>::new();
            let mut rng = StdRng::seed_from_u64(SEED + w as u64);
            while next.fetch_add(1, Ordering::Relaxed) < REQUESTS {
                let req = malformed(&mut rng);
                let (outcome, _) = exchange(p.server.addr, &req, HANG).await;
                match outcome {
                    Outcome::Status(s) if s >= 500 => {
                        return Err(format!("HTTP {s} for {:?}", String::from_utf8_lossy(&req)))
                    }
                    Outcome::Hung => {
                        return Err(format!("hung: {:?}", String::from_utf8_lossy(&req)))
                    }
                    o => *tally.entry(format!("{o:?}")).or_default() += 1,
                }
            }
            Ok(tally)
        }));
    }
    let mut tally = std::collections::BTreeMap::<String, usize>::new();
    for w in workers {
        for (k, v) in w
            .await
            .expect("fuzz worker")
            .unwrap_or_else(|e| panic!("{e}"))
        {
            *tally.entry(k).or_default() += v;
        }
    }
    eprintln!(
        "{REQUESTS} malformed requests in {:.1} s: {tally:?}",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(tally.values().sum::<usize>(), REQUESTS);
    assert_eq!(greedy(&p).await, before, "greedy output changed");
    assert_eq!(p.server.get("/health").await.status, 200);
}
