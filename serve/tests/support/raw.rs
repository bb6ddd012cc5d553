//! Raw TCP exchanges for tests that must send what no HTTP client library would (a header that
//! never ends, a lying `Content-Length`, a broken chunk size), and the server's memory figures
//! from `/proc/PID/status`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What became of one raw exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The server answered with this status (and then closed, or the read ended).
    Status(u16),
    /// The server closed the connection without a response.
    Closed,
    /// Nothing happened within the deadline.
    Hung,
}

/// Sends `bytes`, then reads until the server closes or `deadline` passes; returns the outcome
/// and how long it took. Write errors count as a close (the server may cut a request short).
pub async fn exchange(addr: SocketAddr, bytes: &[u8], deadline: Duration) -> (Outcome, Duration) {
    let started = Instant::now();
    let run = async {
        let mut s = match TcpStream::connect(addr).await {
            Ok(s) => s,
            Err(_) => return Outcome::Closed,
        };
        let _ = s.write_all(bytes).await;
        read_outcome(&mut s).await
    };
    let outcome = tokio::time::timeout(deadline, run)
        .await
        .unwrap_or(Outcome::Hung);
    (outcome, started.elapsed())
}

/// Reads a response head (status) or the close, whichever comes first; then drains until EOF
/// so that the exchange ends when the server ends it.
pub async fn read_outcome(s: &mut TcpStream) -> Outcome {
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    status_of(&raw).map_or(Outcome::Closed, Outcome::Status)
}

/// The status code of the first final (non-1xx) response in `raw`.
pub fn status_of(raw: &[u8]) -> Option<u16> {
    let mut rest = raw;
    loop {
        let head = std::str::from_utf8(rest.get(..12)?).ok()?;
        let status: u16 = head.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
        if !(100..200).contains(&status) {
            return Some(status);
        }
        let end = rest.windows(4).position(|w| w == b"\r\n\r\n")?;
        rest = &rest[end + 4..];
        if rest.len() < 12 {
            // Only an interim response arrived before the close.
            return Some(status);
        }
    }
}

/// `VmRSS` and `VmHWM` (peak RSS) of `pid`, in MiB.
pub fn rss_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}
