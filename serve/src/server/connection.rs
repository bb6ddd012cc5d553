//! One HTTP/1.1 connection, driven by hyper directly so it can have the timeouts axum::serve
//! lacks: hyper's header-read timeout (slowloris: headers must arrive within
//! `--header-read-timeout` of the connection waiting for them), an idle keep-alive timeout
//! (no request in flight for `--keep-alive-timeout`), and a close signal for shutdown. The body
//! timeout lives in `routes::body`, where the body is read.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use axum::Router;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tower::ServiceExt;

use crate::config::HttpTimeouts;

/// Requests in flight on one connection, and since when it has had none.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    /// Requests this connection has started; one that never got a request owes no response.
    started: AtomicUsize,
    idle_since: Mutex<Instant>,
}

impl Activity {
    fn new() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            started: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
        }
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.started.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// How long the connection has been without a request, or `None` while one is in flight.
    fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let since = match self.idle_since.lock() {
            Ok(g) => *g,
            Err(p) => *p.into_inner(),
        };
        Some(since.elapsed())
    }
}

/// Held by a response body until hyper has written (or dropped) it.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        match self.0.idle_since.lock() {
            Ok(mut g) => *g = Instant::now(),
            Err(p) => *p.into_inner() = Instant::now(),
        }
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request counted as in flight until it is done.
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for TrackedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// How long a closing connection keeps reading (and discarding) what the client still sends.
const LINGER: Duration = Duration::from_secs(2);

/// Closes `tcp` the way nginx's lingering close does: send FIN, then read and discard what the
/// client is still sending for a moment. Closing a socket with unread input makes the kernel
/// send RST, which can destroy a response (an early 413 or 408) before the client reads it.
async fn linger_close(mut tcp: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if tcp.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = tcp.read(&mut buf).await {
            if n == 0 {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

type BoxedResponse = Pin<
    Box<dyn std::future::Future<Output = Result<hyper::Response<TrackedBody>, Infallible>> + Send>,
>;

/// Serves `tcp` until the client leaves, a timeout fires, or `close` turns true (then the
/// connection finishes its in-flight response and closes; an idle or half-read one closes now).
pub async fn serve_connection(
    tcp: TcpStream,
    app: Router,
    timeouts: HttpTimeouts,
    mut close: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new());
    let tracker = activity.clone();
    // Boxed so the connection is `Unpin`, which `poll_without_shutdown` needs to hand the
    // socket back for the lingering close.
    let service =
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| -> BoxedResponse {
            let app = app.clone();
            let in_flight = tracker.begin();
            Box::pin(async move {
                let response: Response = match app.oneshot(req.map(Body::new)).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
                Ok::<_, Infallible>(response.map(|inner| TrackedBody {
                    inner,
                    _in_flight: in_flight,
                }))
            })
        });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(timeouts.header_read)
        .keep_alive(true);
    let mut conn = builder.serve_connection(TokioIo::new(tcp), service);
    let mut closing = *close.borrow();
    if closing {
        Pin::new(&mut conn).graceful_shutdown();
    }
    loop {
        let idle_check = match (closing, timeouts.keep_alive) {
            (false, Some(limit)) => {
                let wait = activity
                    .idle_for()
                    .map_or(limit, |idle| limit.saturating_sub(idle));
                Some(wait.max(Duration::from_millis(10)))
            }
            _ => None,
        };
        tokio::select! {
            result = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)) => {
                match result {
                    Ok(()) => break,
                    // A header timeout or a protocol error: no response is owed, just close.
                    Err(e) => {
                        tracing::debug!("connection ended: {e}");
                        return;
                    }
                }
            }
            changed = close.changed(), if !closing => {
                if changed.is_err() || *close.borrow() {
                    closing = true;
                    Pin::new(&mut conn).graceful_shutdown();
                }
            }
            _ = tokio::time::sleep(idle_check.unwrap_or(Duration::MAX)), if idle_check.is_some() => {
                let limit = timeouts.keep_alive.unwrap_or(Duration::MAX);
                if activity.idle_for().is_some_and(|idle| idle >= limit) {
                    tracing::debug!("closing a keep-alive connection idle for {limit:?}");
                    closing = true;
                    Pin::new(&mut conn).graceful_shutdown();
                }
            }
        }
    }
    let tcp = conn.into_parts().io.into_inner();
    // A connection that never got a whole request head (slowloris, or idle from the start)
    // is owed nothing: drop it at once.
    if activity.started.load(Ordering::SeqCst) > 0 {
        linger_close(tcp).await;
    }
}
