//! The accept loop of the HTTP listener, in place of `axum::serve` (which cannot be configured):
//! it bounds what a client that never finishes a request can hold. Each connection is served
//! by hyper's HTTP/1 server with a header-read timeout (a client trickling its request head —
//! slowloris — is disconnected) and a small read buffer; at most [`MAX_CONNECTIONS`] are served
//! at once, and a connection beyond that is answered `503` and closed at once. A connection
//! handed over by an `Upgrade` (a WebSocket tunnel of the port proxy) keeps its slot: the
//! route that carries it holds [`this_connection`] for as long as it does. Accepted sockets
//! send without delay (`TCP_NODELAY`): a response's last small write (the end of an SSE
//! stream) must not wait for the client's delayed ACK, about 40 ms per tool call otherwise.
//!
//! It knows nothing about routes or MCP: it serves whatever router it is given.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// A client must send a whole request head within this long (and an idle keep-alive
/// connection is closed after it). Real clients send their head in one write; 15 s still
/// covers a stalled link retransmitting several times (1 + 2 + 4 + 8 s of TCP back-off).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(15);
/// Connections served at once. Every MCP session holds one for its SSE stream plus one or two
/// for requests, so this serves a few hundred sessions (the HTTP benchmark runs 200) while
/// keeping the worst case — every connection holding a full read buffer — near 32 MiB, and
/// far below the usual file-descriptor limits.
pub const MAX_CONNECTIONS: usize = 512;
/// hyper's per-connection read buffer, which bounds a request head. MCP heads are well under
/// 4 KiB; the default (~400 KiB) would let [`MAX_CONNECTIONS`] trickling clients pin 200 MiB.
const MAX_READ_BUFFER: usize = 64 * 1024;
/// Answer to a connection beyond [`MAX_CONNECTIONS`].
const BUSY_RESPONSE: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 34\r\nretry-after: 1\r\nconnection: close\r\n\r\nToo many connections; retry later\n";
/// Writing [`BUSY_RESPONSE`] to a client that does not read must not hold a task.
const BUSY_WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// At most one warning per this period about refused connections (an attacker must not grow
/// the log).
const BUSY_WARNING_PERIOD: Duration = Duration::from_secs(60);
/// Pause after an accept error such as `EMFILE`, so the loop does not spin while it lasts
/// (hyper 0.14 and axum do the same).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(200);

/// One connection's place among the [`MAX_CONNECTIONS`], held until the last holder drops it.
#[derive(Clone)]
pub struct ConnectionSlot(
    #[expect(dead_code, reason = "held, never read")] Arc<OwnedSemaphorePermit>,
);

tokio::task_local! {
    /// The slot of the connection whose requests are being served on this task (hyper polls a
    /// connection's service calls on the connection's own task).
    static CONNECTION: ConnectionSlot;
}

/// The slot of the connection the current request came on, to keep it taken beyond the
/// connection's HTTP life (an upgraded connection); `None` outside this listener's tasks.
pub fn this_connection() -> Option<ConnectionSlot> {
    CONNECTION.try_with(ConnectionSlot::clone).ok()
}

/// Serves `app` on `listener` until `stop` is cancelled. Connections in progress then finish
/// their current request (idle ones close); they are cut if the runtime goes away first.
pub async fn serve(listener: TcpListener, app: Router, stop: CancellationToken) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let last_busy_warning: Mutex<Option<Instant>> = Mutex::new(None);
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                warn!(%error, "accept failed");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            let mut last = last_busy_warning
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if last.is_none_or(|at| at.elapsed() >= BUSY_WARNING_PERIOD) {
                *last = Some(Instant::now());
                warn!(
                    limit = MAX_CONNECTIONS,
                    "refusing HTTP connections: too many open"
                );
            }
            tokio::spawn(refuse(stream));
            continue;
        };
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
        let service = TowerToHyperService::new(app.clone());
        let stop = stop.clone();
        let slot = ConnectionSlot(Arc::new(slot));
        tokio::spawn(CONNECTION.scope(slot, async move {
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(MAX_READ_BUFFER);
            let connection = builder
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                () = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        }));
    }
}

/// Answers `503` and closes, without reading the request.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(BUSY_WRITE_TIMEOUT, async {
        stream.write_all(BUSY_RESPONSE).await?;
        stream.shutdown().await
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_response_declares_its_body_length() {
        let text = std::str::from_utf8(BUSY_RESPONSE).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "));
        assert!(head.contains(&format!("content-length: {}", body.len())));
    }
}
