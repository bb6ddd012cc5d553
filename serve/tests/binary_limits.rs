//! Memory per request is bounded: over-long texts are refused from their size before they are
//! tokenized (or even read, when `Content-Length` says so), with the server's peak RSS read
//! from /proc; and after a burst of requests the RSS returns near its idle level (malloc_trim).

mod support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::binary::ServerProcess;
use support::raw::{exchange, rss_mib, Outcome};

/// Peak RSS the oversized requests may add on top of the idle server. A 30 MB body is held as
/// bytes and once as the parsed string (~60 MB); tokenizing it in full would take gigabytes.
const PEAK_GROWTH_MIB: f64 = 200.0;
/// "Quickly": refusals arrive within this even on a loaded CI machine.
const QUICK: Duration = Duration::from_secs(5);

fn message(body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    v["message"]
        .as_str()
        .or(v["error"]["message"].as_str())
        .unwrap_or(body)
        .to_string()
}

#[tokio::test]
async fn oversized_texts_are_refused_before_tokenizing_and_rss_stays_bounded() {
    // A limit above 30 MB so the big bodies are read and refused by the prompt-length bound.
    let p = ServerProcess::start(&["--max-request-body-bytes", "40000000"]).await;
    let s = &p.server;
    let (idle, _) = rss_mib(p.pid());

    let big = "a ".repeat(15_000_000);
    let started = Instant::now();
    let r = s.post("/tokenize", &json!({"prompt": big})).await;
    let took = started.elapsed();
    eprintln!(
        "30 MB /tokenize: HTTP {} in {:.2} s: {}",
        r.status,
        took.as_secs_f64(),
        message(&r.body)
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(message(&r.body).contains("longer than the model's context length"));
    assert!(took < QUICK, "took {took:?}");

    let eight_mib = "word ".repeat(8 * 1024 * 1024 / 5);
    let started = Instant::now();
    let r = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": eight_mib}], "max_tokens": 4}),
        )
        .await;
    let took = started.elapsed();
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(message(&r.body).contains("context length"), "{}", r.body);
    assert!(took < QUICK, "took {took:?}");

    // Under the byte bound but over the context: the windowed pre-count refuses it.
    let r = s
        .post(
            "/generate",
            &json!({"text": "x y ".repeat(60_000), "sampling_params": {"max_new_tokens": 1}}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(message(&r.body).contains("context length"), "{}", r.body);

    // A Content-Length over the limit is refused before the body is read.
    let head = "POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 2147483648\r\n\r\n{}";
    let (outcome, took) = exchange(s.addr, head.as_bytes(), QUICK).await;
    assert_eq!(outcome, Outcome::Status(413), "lying Content-Length");
    assert!(took < QUICK);

    let (rss, peak) = rss_mib(p.pid());
    eprintln!("RSS idle {idle:.0} MiB, after {rss:.0} MiB, peak {peak:.0} MiB");
    assert!(
        peak - idle < PEAK_GROWTH_MIB,
        "peak RSS {peak:.0} MiB grew more than {PEAK_GROWTH_MIB} MiB over idle {idle:.0} MiB"
    );
    assert_eq!(s.get("/health").await.status, 200);
}

#[tokio::test]
async fn the_default_body_limit_fits_the_context() {
    let p = ServerProcess::start(&[]).await;
    let s = &p.server;
    let limit = s.get("/server_info").await.json()["max_request_body_bytes"]
        .as_u64()
        .unwrap_or(0);
    // 4096 tokens of the demo vocabulary (longest token 46 bytes) x 3 for normalization x 2.
    assert!(
        (1 << 20..=4 << 20).contains(&limit),
        "default limit {limit}"
    );
    let (idle, _) = rss_mib(p.pid());
    let started = Instant::now();
    let r = s
        .request(
            "POST",
            "/tokenize",
            &[("Content-Type", "application/json")],
            json!({"prompt": "a".repeat(30_000_000)})
                .to_string()
                .as_bytes(),
        )
        .await;
    assert_eq!(r.status, 413, "{}", r.body);
    assert!(r.body.contains("--max-request-body-bytes"), "{}", r.body);
    assert!(started.elapsed() < QUICK);
    let (_, peak) = rss_mib(p.pid());
    assert!(
        peak - idle < 50.0,
        "an early 413 buffered the body: {idle:.0} -> {peak:.0} MiB"
    );
}

/// One burst: `clients` concurrent streaming generations plus a few 1 MiB bodies.
async fn burst(p: &ServerProcess, clients: usize) {
    let mut tasks = Vec::new();
    for i in 0..clients {
        let s = p.server.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({"text": format!("def f{i}(x):"), "stream": true,
                "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": true}});
            let r = s.post("/generate", &body).await;
            assert_eq!(r.status, 200, "burst request {i}: {}", r.body);
            if i % 8 == 0 {
                let r = s
                    .post("/tokenize", &json!({"prompt": "z ".repeat(300_000)}))
                    .await;
                assert_eq!(r.status, 200, "burst tokenize {i}: {}", r.body);
            }
        }));
    }
    for t in tasks {
        t.await.expect("burst client");
    }
}

/// The lowest RSS over `window` (the engine trims on going idle; tokio's blocking threads, each
/// with its own malloc arena, exit after 10 s idle), returning early once at or below `target`.
async fn settled_rss(p: &ServerProcess, window: Duration, target: f64) -> f64 {
    let started = Instant::now();
    let mut low = f64::MAX;
    while started.elapsed() < window {
        tokio::time::sleep(Duration::from_millis(250)).await;
        low = low.min(rss_mib(p.pid()).0);
        if low <= target {
            break;
        }
    }
    low
}

#[tokio::test]
async fn rss_returns_near_idle_after_a_burst() {
    // Without the prefix cache: it keeps finished requests' K/V pages, so each burst touches
    // pages of the preallocated pool it had not touched before (bounded by the pool, not a
    // leak); this test is about the heap.
    let p = ServerProcess::start(&["--disable-radix-cache"]).await;
    // A first burst of the same shape sizes the thread pools and lazily built tables; the
    // level it settles to (its blocking threads gone after their 10 s keep-alive, then the
    // engine's late idle trim at 12 s) is "idle".
    burst(&p, 64).await;
    let idle = settled_rss(&p, Duration::from_secs(15), 0.0).await;
    for _ in 0..2 {
        burst(&p, 64).await;
    }
    // Returns as soon as RSS is back under the bound; the long window is for loaded CI
    // machines, where the bursts' threads exit late.
    let bound = idle * 1.5;
    let after = settled_rss(&p, Duration::from_secs(40), bound).await;
    eprintln!("RSS idle {idle:.0} MiB, after two 64-request bursts {after:.0} MiB");
    // Without malloc_trim this was 661 -> 1,828 MiB (2.8x) on the same machine; without the
    // late idle trim 160 -> 323 MiB (2.0x). With both, settled levels still vary run to run
    // (1.0-1.3x seen on a loaded 2-core machine), hence 1.5x.
    assert!(
        after <= bound,
        "RSS {after:.0} MiB is more than 50% above its idle level {idle:.0} MiB"
    );
}
