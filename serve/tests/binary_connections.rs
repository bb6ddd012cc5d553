//! Connection hygiene against the real binary with short timeout flags: a slowloris header, a
//! body that never completes, an idle keep-alive connection and broken chunk framing are each
//! cut off or refused within their timeout; and SIGTERM with a half-open connection still
//! drains the running request and exits 0 within the grace period.

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::binary::ServerProcess;
use support::raw::{exchange, read_outcome, Outcome};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const TIMEOUT_S: &str = "1";
/// Timeout plus scheduling slack on a loaded 2-core CI machine.
const CUT_OFF: Duration = Duration::from_secs(4);

#[tokio::test]
async fn slow_or_lying_clients_are_cut_off_within_the_timeouts() {
    let p = ServerProcess::start(&[
        "--header-read-timeout",
        TIMEOUT_S,
        "--body-read-timeout",
        TIMEOUT_S,
        "--keep-alive-timeout",
        TIMEOUT_S,
        "--skip-server-warmup",
    ])
    .await;
    let addr = p.server.addr;

    // Slowloris: one header byte every 200 ms, never finishing.
    let started = Instant::now();
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"POST /generate HTTP/1.1\r\nHost: t\r\n")
        .await
        .expect("write");
    let drip = async {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if s.write_all(b"X-Slow: y\r\n").await.is_err() {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(CUT_OFF * 2, drip).await;
    let took = started.elapsed();
    assert!(took < CUT_OFF, "slowloris connection held for {took:?}");

    // A Content-Length that promises more than is sent: 408 after the body timeout.
    let lying = "POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{}";
    let (outcome, took) = exchange(addr, lying.as_bytes(), CUT_OFF * 2).await;
    assert_eq!(outcome, Outcome::Status(408), "after {took:?}");
    assert!(took < CUT_OFF, "lying Content-Length held for {took:?}");

    // A Content-Length far over the limit: 413 at once, without waiting for the body.
    let huge = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 2147483648\r\n\r\n{}";
    let (outcome, took) = exchange(addr, huge.as_bytes(), CUT_OFF * 2).await;
    assert_eq!(outcome, Outcome::Status(413), "after {took:?}");

    // A malformed chunk size is a framing error: 400, not 413.
    let chunked = "POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n";
    let (outcome, _) = exchange(addr, chunked.as_bytes(), CUT_OFF * 2).await;
    assert_eq!(outcome, Outcome::Status(400));

    // An idle keep-alive connection is closed after --keep-alive-timeout.
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .expect("write");
    let started = Instant::now();
    let outcome = tokio::time::timeout(CUT_OFF * 2, read_outcome(&mut s)).await;
    let took = started.elapsed();
    assert_eq!(outcome, Ok(Outcome::Status(200)));
    assert!(
        took >= Duration::from_millis(900) && took < CUT_OFF,
        "idle keep-alive connection closed after {took:?}"
    );

    // None of that disturbed the server.
    let r = p
        .server
        .post(
            "/generate",
            &json!({"text": "def f():", "sampling_params": {"max_new_tokens": 4}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test]
async fn sigterm_with_a_half_open_connection_drains_and_exits_within_the_grace_period() {
    let mut p = ServerProcess::start(&[
        // No header timeout: only the shutdown may close the half-open connection.
        "--header-read-timeout",
        "0",
        "--keep-alive-timeout",
        "0",
        "--shutdown-grace-period",
        "1",
        "--skip-server-warmup",
    ])
    .await;
    let addr = p.server.addr;
    let mut half_header = TcpStream::connect(addr).await.expect("connect");
    half_header
        .write_all(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-")
        .await
        .expect("write");
    let mut half_body = TcpStream::connect(addr).await.expect("connect");
    half_body
        .write_all(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 50\r\n\r\n{\"te")
        .await
        .expect("write");

    let long = json!({"text": "def main():", "stream": true,
        "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": true}});
    let s = p.server.clone();
    let running = tokio::spawn(async move { s.post("/generate", &long).await });
    for _ in 0..500 {
        if p.server.get("/server_info").await.json()["num_running_reqs"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    p.sigterm();
    let r = running.await.expect("running request");
    let drained = Instant::now();
    assert_eq!(r.status, 200);
    let events = r.events();
    let last: serde_json::Value =
        serde_json::from_str(&events[events.len() - 2]).expect("last chunk");
    assert_eq!(
        last["meta_info"]["completion_tokens"], 200,
        "the running request finished"
    );
    let status = p
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("the server exits despite the half-open connections");
    let after_drain = drained.elapsed();
    assert!(status.success(), "exit status {status}");
    assert!(
        after_drain < Duration::from_secs(4),
        "exited {after_drain:?} after the drain (grace period 1 s)"
    );
    assert!(p.log().contains("grace period"), "{}", p.log());
}
