//! Runs each JSON POST body to `/mcp` through [`crate::transport::screen`] before rmcp reads it,
//! so HTTP clients get the same answers as stdio clients: a lone surrogate escape is repaired
//! instead of failing the whole body with `415`, and a malformed request gets its JSON-RPC
//! error (`-32700`, `-32600`, `-32602`) with the request's id when it can be read.
//!
//! An answer that carries an id goes back as `200` with an `application/json` body, which MCP
//! clients match to the pending request; one with `id: null` goes back as `400`, as rmcp does
//! for the requests it refuses itself. Bodies of any other content type are left to rmcp.
//!
//! This is where request bodies are held in memory, so this is where their total is bounded:
//! every body read here takes room in one [`BodyBudget`], [`MEMORY_PER_BODY_BYTE`] bytes of it
//! per byte, and gives it back once rmcp has taken the message. A declared `Content-Length`
//! takes its room at once. A chunked body takes room as its first [`UNDECLARED_STEP_BYTES`]
//! arrive, then room for the largest legal body at once, all or nothing, and gives back what it
//! did not use when it ends: bodies that each held part of the room while waiting for the rest
//! would wait for each other, and a burst of them would all end `503`. A body that finds no room within [`BUDGET_WAIT`] is
//! answered `503` with `Retry-After`, and one that does not arrive whole within
//! [`BODY_READ_TIMEOUT`] `408`: each request is capped at 8 MiB, but without a total a few
//! hundred clients, or one client per principal, could make the server hold gigabytes
//! (docs/reliability.md, "HTTP exposure").

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use futures_util::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::MAX_REQUEST_BODY_BYTES;
use crate::transport::screen::{self, Screened};

/// Memory that request bodies may take at once, across all requests: one of the largest legal
/// requests with room to spare, or thousands of ordinary ones (a tool call is a few hundred
/// bytes).
pub const BODY_BUDGET_BYTES: usize = 64 * 1024 * 1024;
/// What one byte of a body costs while it is held: the byte, then the screen's parse into a
/// JSON value and a typed message, then rmcp's own parse (a large string argument is copied by
/// each). Measured: one 7.5 MiB body raises the server's peak by 46 MiB.
pub const MEMORY_PER_BODY_BYTE: usize = 6;
/// How long a whole body may take to arrive: 8 MiB at 140 KB/s. A client trickling a large
/// body holds its room in the budget meanwhile, and must not hold it for ever.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a body waits for room in the budget before it is refused: long enough for the
/// bodies ahead of it to reach rmcp (milliseconds each on loopback), short enough that a client
/// is told to come back rather than left hanging behind clients that send slowly.
pub const BUDGET_WAIT: Duration = Duration::from_secs(2);

/// The bytes of a body without a `Content-Length` that take room as they arrive; a longer one
/// takes room for the largest legal body at once. Small, so that the first bytes of many
/// chunked bodies at once (at most one per connection, 512) leave that room free: 512 × 4 KiB,
/// six times over, is 12 MiB of the 64.
pub const UNDECLARED_STEP_BYTES: usize = 4 * 1024;

/// The shared budget of buffered request bytes.
#[derive(Debug)]
pub struct BodyBudget {
    room: Arc<Semaphore>,
    /// The largest body (the request limit).
    largest_body: usize,
    /// [`UNDECLARED_STEP_BYTES`].
    undeclared_step: usize,
}

impl BodyBudget {
    pub fn new(bytes: usize) -> Arc<Self> {
        Self::with_sizes(bytes, MAX_REQUEST_BODY_BYTES, UNDECLARED_STEP_BYTES)
    }

    fn with_sizes(bytes: usize, largest_body: usize, undeclared_step: usize) -> Arc<Self> {
        Arc::new(Self {
            room: Arc::new(Semaphore::new(bytes)),
            largest_body,
            undeclared_step,
        })
    }

    /// Room for `bytes` more bytes of body, waiting at most [`BUDGET_WAIT`].
    async fn take(&self, bytes: usize) -> Result<OwnedSemaphorePermit, Refusal> {
        let count = bytes
            .checked_mul(MEMORY_PER_BODY_BYTE)
            .and_then(|memory| u32::try_from(memory).ok())
            .ok_or(Refusal::TooLarge)?;
        match tokio::time::timeout(BUDGET_WAIT, self.room.clone().acquire_many_owned(count)).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) | Err(_) => Err(Refusal::Busy),
        }
    }

    /// Reads a whole body within [`BODY_READ_TIMEOUT`], holding budget for every byte kept;
    /// `declared` is its `Content-Length` (already checked against the limit).
    async fn read(
        &self,
        body: Body,
        declared: Option<usize>,
    ) -> Result<(Bytes, Option<OwnedSemaphorePermit>), Refusal> {
        tokio::time::timeout(BODY_READ_TIMEOUT, self.read_whole(body, declared))
            .await
            .unwrap_or(Err(Refusal::Slow))
    }

    async fn read_whole(
        &self,
        body: Body,
        declared: Option<usize>,
    ) -> Result<(Bytes, Option<OwnedSemaphorePermit>), Refusal> {
        let mut held: Option<OwnedSemaphorePermit> = None;
        let mut reserved = 0;
        if let Some(length) = declared.filter(|length| *length > 0) {
            held = Some(self.take(length).await?);
            reserved = length;
        }
        let mut kept = BytesMut::with_capacity(declared.unwrap_or(0));
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|_| Refusal::Unreadable)?;
            let total = kept.len() + chunk.len();
            if total > self.largest_body {
                return Err(Refusal::TooLarge);
            }
            if total > reserved {
                // Past its first step, a chunked body asks once for all it may need.
                let wanted = if total > self.undeclared_step {
                    self.largest_body
                } else {
                    total
                };
                let more = self.take(wanted - reserved).await?;
                match held.as_mut() {
                    Some(permit) => permit.merge(more),
                    None => held = Some(more),
                }
                reserved = wanted;
            }
            kept.extend_from_slice(&chunk);
        }
        // Give back the room a chunked body took and did not fill.
        let unused = (reserved - kept.len()) * MEMORY_PER_BODY_BYTE;
        if unused > 0
            && let Some(permit) = held.as_mut()
        {
            drop(permit.split(unused));
        }
        Ok((kept.freeze(), held))
    }
}

/// Why a body was not read whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    TooLarge,
    Busy,
    Slow,
    Unreadable,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Self::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("Payload Too Large: request body exceeds {MAX_REQUEST_BODY_BYTES} bytes"),
            )
                .into_response(),
            Self::Busy => {
                let mut response = (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Service Unavailable: the server is receiving too many large requests at once; retry shortly",
                )
                    .into_response();
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                response
            }
            Self::Slow => (
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "Request Timeout: the request body did not arrive within {} seconds",
                    BODY_READ_TIMEOUT.as_secs()
                ),
            )
                .into_response(),
            Self::Unreadable => (
                StatusCode::BAD_REQUEST,
                "Bad Request: the request body could not be read",
            )
                .into_response(),
        }
    }
}

/// Screens a POST body; everything else passes through untouched.
pub async fn screen_post(
    State(budget): State<Arc<BodyBudget>>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() != Method::POST || !is_json(request.headers()) {
        return next.run(request).await;
    }
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok());
    let (parts, body) = request.into_parts();
    // Given back when this function returns: rmcp has then parsed the message and answered
    // with its response head (an SSE stream carries the rest).
    let (bytes, _budget) = match budget.read(body, declared).await {
        Ok(read) => read,
        Err(refusal) => return refusal.into_response(),
    };
    let body = match screen::screen(&bytes) {
        Screened::Reply(reply) => {
            let status = if reply["id"].is_null() {
                StatusCode::BAD_REQUEST
            } else {
                StatusCode::OK
            };
            return (
                status,
                [(header::CONTENT_TYPE, "application/json")],
                reply.to_string(),
            )
                .into_response();
        }
        Screened::Message(_) => match screen::repair(&bytes) {
            std::borrow::Cow::Borrowed(_) => bytes,
            std::borrow::Cow::Owned(repaired) => Bytes::from(repaired),
        },
        Screened::Skip => bytes,
    };
    next.run(Request::from_parts(parts, Body::from(body))).await
}

/// `Content-Type: application/json`, parameters ignored (rmcp's own test).
fn is_json(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            let essence = value.split_once(';').map_or(value, |(essence, _)| essence);
            essence.trim().eq_ignore_ascii_case("application/json")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunked(pieces: &[&'static [u8]]) -> Body {
        let chunks: Vec<Result<Bytes, std::io::Error>> = pieces
            .iter()
            .map(|piece| Ok(Bytes::from_static(piece)))
            .collect();
        Body::from_stream(futures_util::stream::iter(chunks))
    }

    #[tokio::test(start_paused = true)]
    async fn bodies_hold_budget_until_released_and_wait_briefly_for_it() {
        let budget = BodyBudget::new(10 * MEMORY_PER_BODY_BYTE);
        let (first, held) = budget.read(chunked(&[b"abc", b"def"]), None).await.unwrap();
        assert_eq!(&first[..], b"abcdef");
        assert_eq!(budget.room.available_permits(), 4 * MEMORY_PER_BODY_BYTE);
        // Over the budget while the first is held: refused after the wait.
        let started = tokio::time::Instant::now();
        let refused = budget.read(chunked(&[b"12345"]), None).await.unwrap_err();
        assert_eq!(refused, Refusal::Busy);
        assert!(started.elapsed() >= BUDGET_WAIT);
        // A declared length takes its room at once.
        assert_eq!(
            budget
                .read(chunked(&[b"12345"]), Some(5))
                .await
                .unwrap_err(),
            Refusal::Busy
        );
        drop(held);
        assert_eq!(budget.room.available_permits(), 10 * MEMORY_PER_BODY_BYTE);
        let (again, _held) = budget.read(chunked(&[b"12345"]), Some(5)).await.unwrap();
        assert_eq!(&again[..], b"12345");
    }

    /// A body sent a byte at a time, giving way to the others between bytes, as bodies that
    /// arrive at once over the network do.
    fn trickled(bytes: &'static [u8]) -> Body {
        let pieces = futures_util::stream::iter(bytes.chunks(1)).then(|piece| async move {
            tokio::task::yield_now().await;
            Ok::<_, std::io::Error>(Bytes::from_static(piece))
        });
        Body::from_stream(pieces)
    }

    #[tokio::test(start_paused = true)]
    async fn chunked_bodies_arriving_together_all_get_through_one_after_another() {
        // Room for 20 bytes of body; bodies of up to 16; the first 2 bytes taken as they come.
        let budget = BodyBudget::with_sizes(20 * MEMORY_PER_BODY_BYTE, 16, 2);
        let read = |body| {
            let budget = budget.clone();
            async move {
                // The caller drops the room at once, as rmcp's answer would give it back.
                budget
                    .read(body, None)
                    .await
                    .map(|(bytes, _room)| bytes.len())
            }
        };
        // Three 12-byte bodies, 36 bytes together: had each taken room byte by byte, each
        // would hold part of the 20 and wait for the rest until all were refused.
        let (a, b, c) = tokio::join!(
            read(trickled(b"aaaaaaaaaaaa")),
            read(trickled(b"bbbbbbbbbbbb")),
            read(trickled(b"cccccccccccc"))
        );
        assert_eq!((a, b, c), (Ok(12), Ok(12), Ok(12)));
        assert_eq!(budget.room.available_permits(), 20 * MEMORY_PER_BODY_BYTE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_chunked_body_keeps_room_only_for_what_it_sent() {
        let budget = BodyBudget::with_sizes(20 * MEMORY_PER_BODY_BYTE, 16, 2);
        let (bytes, room) = budget.read(trickled(b"abcde"), None).await.unwrap();
        assert_eq!(&bytes[..], b"abcde");
        assert_eq!(budget.room.available_permits(), 15 * MEMORY_PER_BODY_BYTE);
        drop(room);
        assert_eq!(budget.room.available_permits(), 20 * MEMORY_PER_BODY_BYTE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_never_ends_is_refused_after_the_read_timeout() {
        let budget = BodyBudget::new(100);
        let stalled =
            futures_util::stream::iter(vec![Ok::<_, std::io::Error>(Bytes::from_static(b"{"))])
                .chain(futures_util::stream::pending());
        let refused = budget
            .read(Body::from_stream(stalled), None)
            .await
            .unwrap_err();
        assert_eq!(refused, Refusal::Slow);
        assert_eq!(
            budget.room.available_permits(),
            100,
            "a refused body kept its room"
        );
    }
}
