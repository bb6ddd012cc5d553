//! The real binary under load and through shutdown: 64 concurrent streaming clients for a
//! minute on the demo pair, and SIGTERM while requests run (they finish; new ones get 503; the
//! process then exits cleanly).

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::binary::{metric, ServerProcess};

const CLIENTS: usize = 64;
const LOAD_SECS: u64 = 60;

/// Checks one SSE body: no error event, `[DONE]` last, and returns the final data payload.
fn finished_stream(body: &str) -> Result<Value, String> {
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    if events.last() != Some(&"data: [DONE]") {
        return Err(format!("stream does not end with [DONE]: {body:?}"));
    }
    let mut last = Value::Null;
    for e in &events[..events.len() - 1] {
        let payload = e
            .strip_prefix("data: ")
            .ok_or_else(|| format!("not an SSE data line: {e:?}"))?;
        let v: Value = serde_json::from_str(payload).map_err(|err| format!("{err}: {payload}"))?;
        if v.get("error").is_some() {
            return Err(format!("error event: {payload}"));
        }
        last = v;
    }
    Ok(last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_streaming_clients_for_a_minute() {
    let p = Arc::new(ServerProcess::start(&["--enable-metrics"]).await);
    let done = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs(LOAD_SECS);
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (p, done) = (p.clone(), done.clone());
        clients.push(tokio::spawn(async move {
            let mut i = 0usize;
            while Instant::now() < deadline {
                // A mix of routes, lengths and greedy / sampled requests.
                let max = 8 + (c * 7 + i * 13) % 56;
                let temperature = if (c + i).is_multiple_of(3) { 0.8 } else { 0.0 };
                let (path, body) = match (c + i) % 3 {
                    0 => ("/generate", json!({"text": format!("def f{c}_{i}(x):"), "stream": true,
                        "sampling_params": {"max_new_tokens": max, "temperature": temperature, "ignore_eos": true}})),
                    1 => ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": format!("Write helper number {i}.")}],
                        "max_tokens": max, "temperature": temperature, "stream": true, "ignore_eos": true,
                        "stream_options": {"include_usage": true}})),
                    _ => ("/v1/completions", json!({"prompt": format!("# task {c}.{i}\nimport os\n"), "max_tokens": max,
                        "temperature": temperature, "stream": true, "ignore_eos": true,
                        "stream_options": {"include_usage": true}})),
                };
                let r = p.server.post(path, &body).await;
                if r.status != 200 {
                    return Err(format!("client {c} request {i}: HTTP {}: {}", r.status, r.body));
                }
                let last = finished_stream(&r.body).map_err(|e| format!("client {c} request {i} ({path}): {e}"))?;
                let tokens = match path {
                    "/generate" => last["meta_info"]["completion_tokens"].as_u64(),
                    _ => last["usage"]["completion_tokens"].as_u64(),
                };
                if tokens != Some(max as u64) {
                    return Err(format!("client {c} request {i} ({path}): {tokens:?} tokens, asked {max}"));
                }
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok(())
        }));
    }
    let started = Instant::now();
    for c in clients {
        c.await
            .expect("client task")
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let elapsed = started.elapsed();
    let total = done.load(Ordering::Relaxed);
    eprintln!(
        "{total} streamed requests from {CLIENTS} clients in {:.1} s",
        elapsed.as_secs_f64()
    );
    assert!(elapsed >= Duration::from_secs(LOAD_SECS));
    assert!(
        total >= CLIENTS,
        "every client finished at least one request ({total})"
    );
    let m = p.server.get("/metrics").await.body;
    let label = "model_name=\"tiny-coder-demo\"";
    assert_eq!(
        metric(&m, "sglang:num_running_reqs", label),
        Some(0.0),
        "{m}"
    );
    assert_eq!(metric(&m, "sglang:num_queue_reqs", label), Some(0.0));
    assert_eq!(
        metric(&m, "sglang:num_used_tokens", label),
        Some(0.0),
        "KV reservations returned"
    );
    assert_eq!(
        metric(&m, "sglang:num_requests_total", "is_streaming=\"true\""),
        Some(total as f64)
    );
    assert_eq!(p.server.get("/health").await.status, 200);
}

#[tokio::test]
async fn sigterm_finishes_running_requests_and_refuses_new_ones() {
    let mut p = ServerProcess::start(&[]).await;
    let long = json!({"text": "def main():", "stream": true,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": true}});
    let s = p.server.clone();
    let running = tokio::spawn(async move { s.post("/generate", &long).await });
    for _ in 0..500 {
        if p.server.get("/server_info").await.json()["num_running_reqs"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    p.sigterm();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = p
        .server
        .post(
            "/generate",
            &json!({"text": "x", "sampling_params": {"max_new_tokens": 2}}),
        )
        .await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(refused.body.contains("shutting down"), "{}", refused.body);
    assert_eq!(p.server.try_get("/health").await, Some(503));

    let r = running.await.expect("running request");
    assert_eq!(r.status, 200);
    let last = finished_stream(&r.body).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        last["meta_info"]["completion_tokens"], 400,
        "the running request finished"
    );
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
    let status = p
        .wait_exit(Duration::from_secs(30))
        .await
        .expect("the server exits after draining");
    assert!(status.success(), "exit status {status}");
    assert!(p.log().contains("all requests finished; exiting"));
}
