//! The HTTP layer shared by the backends whose control plane is a REST API (Fly Machines,
//! E2B): one reqwest client per backend, the retry rule, bounded error bodies and
//! percent-encoding. Each provider keeps its own error type and texts (what its API puts in an
//! error body, what to do about a rejected credential) and builds them from [`RestError`].
//!
//! Retries (docs/decisions.md, "Provider API calls"): a 429 is always retried, because the
//! provider refused the request before acting on it, honouring `Retry-After`; a 5xx or a
//! transport failure only for calls marked [`Retry::Idempotent`]. At most [`MAX_RETRIES`]
//! retries with exponential backoff and jitter, so several servers sharing an account do not
//! retry in lockstep.

use std::time::Duration;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use rand::RngExt;
use reqwest::header::{HeaderName, HeaderValue};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use tracing::warn;

use super::BackendError;

/// Retries after the first attempt.
const MAX_RETRIES: u32 = 3;
/// First backoff step; doubled per retry (0.5 s, 1 s, 2 s), each with ±50 % jitter.
const BACKOFF_BASE: Duration = Duration::from_millis(500);
/// Longest `Retry-After` honoured: a longer wait is better reported than slept on while an MCP
/// call waits.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(30);
/// TCP/TLS connect bound; these APIs are public HTTPS endpoints, so a slow connect means trouble.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of an error body read at most. Some answers come from inside a computer (E2B's envd),
/// where a root user can send anything; a real error body is a short JSON object, and reading
/// stops here however much more is sent.
pub const MAX_ERROR_BODY: usize = 16 * 1024;
/// Longest error text kept in a user-facing message.
const MAX_ERROR_TEXT: usize = 500;

/// RFC 3986 unreserved characters stay; everything else in a path segment or query part is
/// encoded.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// Percent-encodes one path segment or query part: app names, Machine and sandbox ids and
/// metadata come from user input or from the provider, never trusted to be plain.
pub fn encode(raw: &str) -> String {
    utf8_percent_encode(raw, SEGMENT).to_string()
}

/// Whether a failed call may be sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Reads, start, restart, wait, delete, metadata: repeating them is harmless.
    Idempotent,
    /// Creations and exec: a 5xx may have acted, so only a 429 is retried.
    RateLimitOnly,
}

/// A call that did not succeed, before the provider reads its error body.
#[derive(Debug, Clone)]
pub enum RestError {
    /// The API answered with a non-success status; `body` is its start as text.
    Status {
        call: String,
        status: u16,
        body: String,
    },
    /// No usable answer (connect failure, timeout, broken body).
    Transport { call: String, detail: String },
}

/// One request to send.
pub struct Call<'a> {
    pub method: Method,
    pub url: String,
    /// `METHOD /path` as messages and logs name the call.
    pub label: String,
    pub query: &'a [(&'a str, &'a str)],
    pub body: Option<&'a serde_json::Value>,
    pub retry: Retry,
    /// `None` = no client-side bound (the caller bounds it, e.g. a command's own timeout).
    pub timeout: Option<Duration>,
}

/// One provider's HTTP client; the credential header is added per call because it may be
/// discovered lazily.
pub struct RestClient {
    http: reqwest::Client,
    /// "Fly", "E2B": used in logs and transport messages.
    provider: &'static str,
}

impl RestClient {
    pub fn new(provider: &'static str) -> Result<Self, BackendError> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(concat!(
                "mcp-sandbox-computer-vm-for-ai/",
                env!("CARGO_PKG_VERSION")
            ))
            .build()
            .map_err(|e| {
                BackendError::Unavailable(format!("Cannot set up the {provider} API client: {e}"))
            })?;
        Ok(Self { http, provider })
    }

    /// Sends `call` with `auth` as its credential header, retrying as [`Retry`] allows; returns
    /// the successful response with its body unread.
    pub async fn send(
        &self,
        call: &Call<'_>,
        auth: (HeaderName, HeaderValue),
    ) -> Result<reqwest::Response, RestError> {
        let mut attempt = 0;
        loop {
            let mut request = self
                .http
                .request(call.method.clone(), &call.url)
                .header(auth.0.clone(), auth.1.clone())
                .header(reqwest::header::ACCEPT, "application/json");
            if !call.query.is_empty() {
                request = request.query(call.query);
            }
            if let Some(body) = call.body {
                request = request.json(body);
            }
            if let Some(timeout) = call.timeout {
                request = request.timeout(timeout);
            }
            let outcome = request.send().await;
            let retry_in = match &outcome {
                Ok(response) if response.status().is_success() => None,
                Ok(response) if response.status() == StatusCode::TOO_MANY_REQUESTS => {
                    Some(retry_after(response).unwrap_or_else(|| backoff(attempt)))
                }
                Ok(response)
                    if response.status().is_server_error() && call.retry == Retry::Idempotent =>
                {
                    Some(backoff(attempt))
                }
                Err(e) if call.retry == Retry::Idempotent && !e.is_timeout() => {
                    Some(backoff(attempt))
                }
                _ => None,
            };
            match (retry_in, outcome) {
                (Some(delay), _) if attempt < MAX_RETRIES => {
                    attempt += 1;
                    warn!(
                        provider = self.provider,
                        call = %call.label,
                        attempt,
                        delay_ms = delay.as_millis() as u64,
                        "provider API call retried"
                    );
                    tokio::time::sleep(delay).await;
                }
                (_, Ok(response)) if response.status().is_success() => return Ok(response),
                (_, Ok(response)) => {
                    let status = response.status().as_u16();
                    return Err(RestError::Status {
                        call: call.label.clone(),
                        status,
                        body: bounded_text(response).await,
                    });
                }
                (_, Err(error)) => {
                    return Err(RestError::Transport {
                        call: call.label.clone(),
                        detail: self.describe_transport(&error),
                    });
                }
            }
        }
    }

    fn describe_transport(&self, error: &reqwest::Error) -> String {
        describe_transport(error, &format!("the {} API", self.provider))
    }

    /// Reads a successful answer as JSON.
    pub async fn decode<T: DeserializeOwned>(
        &self,
        label: &str,
        response: reqwest::Response,
    ) -> Result<T, RestError> {
        let bytes = response.bytes().await.map_err(|e| RestError::Transport {
            call: label.to_owned(),
            detail: self.describe_transport(&e),
        })?;
        serde_json::from_slice(&bytes).map_err(|e| RestError::Transport {
            call: label.to_owned(),
            detail: format!("unexpected answer ({e})"),
        })
    }
}

/// A transport failure in a few words; `service` says what could not be reached.
pub fn describe_transport(error: &reqwest::Error, service: &str) -> String {
    if error.is_timeout() {
        "timed out".to_owned()
    } else if error.is_connect() {
        format!("could not connect to {service}")
    } else {
        error.to_string()
    }
}

/// The start of an error body as text: at most [`MAX_ERROR_BODY`] bytes are read, the rest is
/// never fetched (the response is dropped), and a read error ends it quietly.
pub async fn bounded_text(mut response: reqwest::Response) -> String {
    let mut body = Vec::new();
    while body.len() < MAX_ERROR_BODY {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = MAX_ERROR_BODY - body.len();
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    String::from_utf8_lossy(&body).into_owned()
}

/// An error text as messages show it: trimmed, never empty, at most [`MAX_ERROR_TEXT`] bytes.
pub fn shorten(text: &str) -> String {
    let text = text.trim();
    if text.is_empty() {
        return "(no message)".to_owned();
    }
    if text.len() <= MAX_ERROR_TEXT {
        return text.to_owned();
    }
    let mut end = MAX_ERROR_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// `Retry-After` in seconds (the form rate limiters send), capped.
fn retry_after(response: &reqwest::Response) -> Option<Duration> {
    let seconds: f64 = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (seconds.is_finite() && seconds >= 0.0)
        .then(|| Duration::from_secs_f64(seconds).min(MAX_RETRY_AFTER))
}

fn backoff(attempt: u32) -> Duration {
    let base = BACKOFF_BASE.saturating_mul(1 << attempt.min(8));
    let jitter: f64 = rand::rng().random_range(0.5..1.5);
    base.mul_f64(jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter() {
        for attempt in 0..3 {
            let d = backoff(attempt);
            let base = BACKOFF_BASE * (1 << attempt);
            assert!(d >= base / 2 && d <= base * 3 / 2, "{d:?}");
        }
    }

    #[test]
    fn segments_are_encoded() {
        assert_eq!(encode("my-app_1.x~"), "my-app_1.x~");
        assert_eq!(encode("a/b c"), "a%2Fb%20c");
        assert_eq!(encode("c&d=é"), "c%26d%3D%C3%A9");
    }

    #[test]
    fn error_texts_are_trimmed_and_capped() {
        assert_eq!(shorten(" plain\n"), "plain");
        assert_eq!(shorten(""), "(no message)");
        let long = shorten(&"é".repeat(400));
        assert!(long.ends_with('…') && long.len() <= MAX_ERROR_TEXT + '…'.len_utf8());
    }

    /// A loopback server whose error body never ends (as a hostile envd could send): the
    /// reader returns once it has the cap, and keeps no more.
    #[tokio::test]
    async fn an_endless_error_body_is_read_only_up_to_the_cap() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut request).await;
            socket
                .write_all(b"HTTP/1.1 500 Oops\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            let chunk = format!("{:x}\r\n{}\r\n", 65536, "x".repeat(65536));
            let mut sent = 0usize;
            // Endless until the client hangs up; counts what it managed to send.
            while socket.write_all(chunk.as_bytes()).await.is_ok() {
                sent += 65536;
            }
            sent
        });
        let client = reqwest::Client::new();
        let response = client
            .get(format!("http://{address}/"))
            .send()
            .await
            .unwrap();
        let read = tokio::time::timeout(Duration::from_secs(10), bounded_text(response))
            .await
            .expect("the reader stops at the cap");
        assert_eq!(read.len(), MAX_ERROR_BODY);
        drop(client);
        let sent = tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the client hung up")
            .unwrap();
        // Socket buffers let the server get ahead a little, never by the megabytes a full read
        // would take.
        assert!(sent < 16 * 1024 * 1024, "{sent} bytes were sent");
    }
}
