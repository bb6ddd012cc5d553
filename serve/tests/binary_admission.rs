//! Admission against the real binary: /health answers within a second while 48 requests run
//! and 150 wait; one request cannot take the queue (a batch over the per-request cap is a 400
//! naming the limit, and an admitted large batch does not starve another client); a request
//! aborted or timed out while queued gets the same body shape as an aborted running one.

mod support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::binary::ServerProcess;
use support::TestServer;

async fn wait_for(s: &TestServer, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let info = s.get("/server_info").await.json();
        if ok(&info) {
            return info;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "timed out waiting for {what}: {info}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn health_stays_up_while_48_requests_run_and_150_wait() {
    // Plain decoding keeps a 48-sequence CPU step well under the 1 s the probe may take.
    let p = ServerProcess::start(&[
        "--speculative-algorithm",
        "NONE",
        "--max-running-requests",
        "48",
        "--context-length",
        "512",
        "--skip-server-warmup",
    ])
    .await;
    let s = p.server.clone();
    let mut load = Vec::new();
    for i in 0..198 {
        let s = s.clone();
        load.push(tokio::spawn(async move {
            let body = json!({"text": format!("def g{i}(x):"),
                "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": true}});
            s.post("/generate", &body).await.status
        }));
    }
    let info = wait_for(&s, "48 running and 150 waiting", |i| {
        i["num_running_reqs"] == 48 && i["num_queue_reqs"].as_u64().unwrap_or(0) >= 140
    })
    .await;
    eprintln!(
        "running {}, waiting {}",
        info["num_running_reqs"], info["num_queue_reqs"]
    );
    let mut worst = Duration::ZERO;
    for path in ["/health", "/health_generate", "/health"] {
        let started = Instant::now();
        let r = s.get(path).await;
        let took = started.elapsed();
        worst = worst.max(took);
        assert_eq!(r.status, 200, "{path} under load");
        assert!(took < Duration::from_secs(1), "{path} took {took:?}");
    }
    let busy = s.get("/server_info").await.json();
    eprintln!(
        "slowest health answer {:.0} ms; still waiting afterwards: {}",
        worst.as_secs_f64() * 1e3,
        busy["num_queue_reqs"]
    );
    assert!(
        busy["num_queue_reqs"].as_u64().unwrap_or(0) > 0,
        "the probes ran while requests were still waiting: {busy}"
    );
    for t in load {
        assert_eq!(t.await.expect("load client"), 200);
    }
    // An idle engine answers with its own probe step.
    let started = Instant::now();
    assert_eq!(s.get("/health").await.status, 200);
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn one_request_cannot_take_the_queue_or_starve_another_client() {
    let p = ServerProcess::start(&[
        "--speculative-algorithm",
        "NONE",
        "--max-running-requests",
        "16",
        "--context-length",
        "512",
        "--skip-server-warmup",
    ])
    .await;
    let s = p.server.clone();
    let prompts: Vec<String> = (0..1000).map(|i| format!("def h{i}():")).collect();
    let r = s
        .post(
            "/generate",
            &json!({"text": prompts, "sampling_params": {"max_new_tokens": 4}}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("1000 sequences"), "{}", r.body);
    assert!(r.body.contains("--max-sequences-per-request"), "{}", r.body);

    let r = s
        .post(
            "/generate",
            &json!({"text": vec!["x"; 64], "sampling_params": {"max_new_tokens": 4, "n": 64}}),
        )
        .await;
    assert_eq!(r.status, 400, "64 x n=64 can never be admitted: {}", r.body);
    assert!(r.body.contains("4096 sequences"), "{}", r.body);

    // A batch within the cap is admitted, and another client's prompt sent after it does not
    // wait for the whole batch: it gets the next free slot.
    let batch: Vec<String> = (0..160).map(|i| format!("def k{i}():")).collect();
    let b = s.clone();
    let started = Instant::now();
    let big = tokio::spawn(async move {
        let r = b
            .post(
                "/generate",
                &json!({"text": batch,
                    "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": true}}),
            )
            .await;
        (r.status, started.elapsed())
    });
    wait_for(&s, "the batch queued", |i| {
        i["num_queue_reqs"].as_u64().unwrap_or(0) > 100
    })
    .await;
    let r = s
        .post(
            "/generate",
            &json!({"text": "def other():",
                "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": true}}),
        )
        .await;
    let other_done = started.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    let (status, big_done) = big.await.expect("batch client");
    assert_eq!(status, 200);
    eprintln!(
        "160-prompt batch done after {:.1} s; the other client's request after {:.1} s",
        big_done.as_secs_f64(),
        other_done.as_secs_f64()
    );
    assert!(
        other_done.as_secs_f64() < big_done.as_secs_f64() * 0.5,
        "the other client waited behind the batch"
    );
}

fn finish(body: &Value) -> &Value {
    &body["meta_info"]["finish_reason"]
}

#[tokio::test]
async fn a_request_aborted_while_queued_gets_the_abort_body_shape() {
    let p = ServerProcess::start(&[
        "--max-running-requests",
        "1",
        // Room for the long request's K/V reservation (rounded up, plus drafting headroom).
        "--max-total-tokens",
        "65536",
        "--queued-request-timeout",
        "2",
        "--skip-server-warmup",
    ])
    .await;
    let s = p.server.clone();
    let long = |rid: &str| {
        json!({"text": "def main():", "rid": rid,
            "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": true}})
    };
    let (a, b) = (s.clone(), s.clone());
    let running = tokio::spawn(async move { a.post("/generate", &long("running-a")).await });
    wait_for(&s, "a running", |i| i["num_running_reqs"] == 1).await;
    let queued = tokio::spawn(async move { b.post("/generate", &long("queued-b")).await });
    wait_for(&s, "b queued", |i| i["num_queue_reqs"] == 1).await;

    let abort = |rid: &str| json!({"rid": rid});
    assert_eq!(
        s.post("/abort_request", &abort("queued-b")).await.status,
        200
    );
    let queued = queued.await.expect("queued client");
    assert_eq!(queued.status, 200, "{}", queued.body);
    let queued = queued.json();
    assert_eq!(
        s.post("/abort_request", &abort("running-a")).await.status,
        200
    );
    let running = running.await.expect("running client").json();

    assert!(queued.get("error").is_none(), "not an error body: {queued}");
    assert_eq!(finish(&queued)["type"], "abort", "{queued}");
    assert_eq!(queued["text"], "");
    let keys = |v: &Value| {
        let mut k: Vec<String> = v
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        k.sort();
        k
    };
    assert_eq!(keys(&queued), keys(&running), "{queued} vs {running}");
    assert_eq!(keys(finish(&queued)), keys(finish(&running)));
    assert_eq!(finish(&running)["type"], "abort");

    // Streaming: the queued abort still ends with a finish chunk, then [DONE].
    let a = s.clone();
    let running = tokio::spawn(async move { a.post("/generate", &long("running-c")).await });
    wait_for(&s, "c running", |i| i["num_running_reqs"] == 1).await;
    let mut stream = long("queued-d");
    stream["stream"] = json!(true);
    let b = s.clone();
    let queued = tokio::spawn(async move { b.post("/generate", &stream).await });
    wait_for(&s, "d queued", |i| i["num_queue_reqs"] == 1).await;
    s.post("/abort_request", &abort("queued-d")).await;
    let events = queued.await.expect("stream client").events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&events[events.len() - 2]).expect("finish chunk");
    assert_eq!(finish(&last)["type"], "abort", "{last}");

    // The queue timeout (2 s here) ends a waiting request the same way.
    let b = s.clone();
    let started = Instant::now();
    let timed_out = b.post("/generate", &long("queued-e")).await;
    assert_eq!(timed_out.status, 200, "{}", timed_out.body);
    let timed_out = timed_out.json();
    assert_eq!(finish(&timed_out)["type"], "abort", "{timed_out}");
    assert!(finish(&timed_out)["message"]
        .as_str()
        .unwrap_or("")
        .contains("--queued-request-timeout"));
    assert!(started.elapsed() < Duration::from_secs(10));
    s.post("/abort_request", &json!({"abort_all": true})).await;
    let _ = running.await;
}
