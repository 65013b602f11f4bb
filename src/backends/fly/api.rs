//! The Fly HTTP client: one `reqwest` client for the Machines API (`<base>/v1/...`) and the
//! GraphQL organization lookup, with lazy credentials, retries and error texts.
//!
//! Retries (`backends.md` §3 quirks): 429 always (the request was refused before it acted),
//! honouring `Retry-After`; 5xx and transport errors only for calls marked idempotent. At most
//! [`MAX_RETRIES`] retries with exponential backoff and jitter. 401/403 become the spec's token
//! message. Other failures carry the API call (`METHOD /path`) and Fly's own `error` text, so
//! callers only add which Machine or computer it was about.

use std::sync::Mutex;
use std::time::Duration;

use rand::RngExt;
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use super::auth::{self, Authorization};
use crate::backends::BackendError;
use crate::config::fly::TokenSources;

/// Retries after the first attempt, for 429 and (idempotent calls) 5xx (`backends.md` §3).
const MAX_RETRIES: u32 = 3;
/// First backoff step; doubled per retry (0.5 s, 1 s, 2 s), each with ±50 % jitter so several
/// servers sharing an app do not retry in lockstep.
const BACKOFF_BASE: Duration = Duration::from_millis(500);
/// Longest `Retry-After` we honour: Fly's documented limits are per second, so a longer value is
/// better reported than slept on while an MCP call waits.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(30);
/// Bound for ordinary control-plane calls (everything but `wait` and `exec`).
pub(super) const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// TCP/TLS connect bound; the API is a public HTTPS endpoint, so a slow connect means trouble.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest error body text kept in a message; Fly's errors are one short JSON field.
const MAX_ERROR_TEXT: usize = 500;

/// Whether a failed call may be sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retry {
    /// Reads, start, restart, wait, delete, metadata: repeating them is harmless.
    Idempotent,
    /// Creations and exec: only a 429 (refused before acting) is retried.
    RateLimitOnly,
}

/// A failed API call, before the caller names the Machine.
#[derive(Debug, Clone)]
pub(super) enum ApiError {
    /// No credentials, or Fly refused them: the text is the user-facing instruction.
    Auth(String),
    /// Fly answered with a non-success status.
    Status {
        call: String,
        status: u16,
        message: String,
    },
    /// No usable answer (connect failure, timeout, broken body).
    Transport { call: String, detail: String },
}

impl ApiError {
    pub(super) fn status(&self) -> Option<u16> {
        match self {
            Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// "`<call>` failed: <why>" — the API call and Fly's own words.
    pub(super) fn detail(&self) -> String {
        match self {
            Self::Auth(text) => text.clone(),
            Self::Status {
                call,
                status,
                message,
            } => format!("{call} returned HTTP {status}: {message}"),
            Self::Transport { call, detail } => format!("{call} failed: {detail}"),
        }
    }

    /// Maps to a [`BackendError`], prefixing `context` (which names the Machine or computer).
    pub(super) fn into_backend(self, context: impl std::fmt::Display) -> BackendError {
        match self {
            Self::Auth(text) => BackendError::Unavailable(text),
            other => BackendError::Provider(format!("{context}: {}", other.detail())),
        }
    }
}

/// The shared HTTP client. Credentials are discovered at first use and cached on success, so a
/// missing token fails tool calls, never startup.
pub(super) struct Api {
    http: reqwest::Client,
    base: String,
    graphql: String,
    tokens: TokenSources,
    auth: Mutex<Option<Authorization>>,
}

/// A request to send.
pub(super) struct Call<'a> {
    pub method: Method,
    /// Path under `/v1`, starting with `/`, query included.
    pub path: String,
    pub body: Option<&'a serde_json::Value>,
    pub retry: Retry,
    /// `None` = no client-side bound (the caller bounds it, e.g. exec).
    pub timeout: Option<Duration>,
}

impl Api {
    pub(super) fn new(
        base: &str,
        graphql: &str,
        tokens: TokenSources,
    ) -> Result<Self, BackendError> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(concat!(
                "mcp-sandbox-computer-vm-for-ai/",
                env!("CARGO_PKG_VERSION")
            ))
            .build()
            .map_err(|e| {
                BackendError::Unavailable(format!("Cannot set up the Fly API client: {e}"))
            })?;
        Ok(Self {
            http,
            base: base.to_owned(),
            graphql: graphql.to_owned(),
            tokens,
            auth: Mutex::new(None),
        })
    }

    fn authorization(&self) -> Result<Authorization, ApiError> {
        let mut cached = self.auth.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(auth) = cached.as_ref() {
            return Ok(auth.clone());
        }
        let found = auth::discover(&self.tokens)
            .ok_or_else(|| ApiError::Auth(auth::NO_TOKEN_MESSAGE.to_owned()))?;
        debug!(scheme = found.scheme(), "Fly API token found");
        *cached = Some(found.clone());
        Ok(found)
    }

    /// Sends `call` with retries and returns the successful response (body unread).
    pub(super) async fn send(&self, call: &Call<'_>) -> Result<reqwest::Response, ApiError> {
        let url = format!("{}/v1{}", self.base, call.path);
        let label = format!("{} /v1{}", call.method, call.path);
        self.send_to(&url, &label, call).await
    }

    async fn send_to(
        &self,
        url: &str,
        label: &str,
        call: &Call<'_>,
    ) -> Result<reqwest::Response, ApiError> {
        let auth = self.authorization()?;
        let mut attempt = 0;
        loop {
            let mut request = self
                .http
                .request(call.method.clone(), url)
                .header(reqwest::header::AUTHORIZATION, auth.header_value())
                .header(reqwest::header::ACCEPT, "application/json");
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
                (Some(delay), Ok(_) | Err(_)) if attempt < MAX_RETRIES => {
                    attempt += 1;
                    warn!(
                        call = label,
                        attempt,
                        delay_ms = delay.as_millis() as u64,
                        "Fly API call retried"
                    );
                    tokio::time::sleep(delay).await;
                }
                (_, Ok(response)) if response.status().is_success() => return Ok(response),
                (_, Ok(response)) => return Err(failure(label, response).await),
                (_, Err(error)) => {
                    return Err(ApiError::Transport {
                        call: label.to_owned(),
                        detail: describe_transport(&error),
                    });
                }
            }
        }
    }

    /// Sends `call` and decodes a JSON answer.
    pub(super) async fn json<T: DeserializeOwned>(&self, call: &Call<'_>) -> Result<T, ApiError> {
        let label = format!("{} /v1{}", call.method, call.path);
        let response = self.send(call).await?;
        decode(&label, response).await
    }

    /// Sends `call` and ignores the answer's body.
    pub(super) async fn unit(&self, call: &Call<'_>) -> Result<(), ApiError> {
        self.send(call).await.map(drop)
    }

    /// `POST <graphql>/graphql` with one query and no variables; returns `data`.
    pub(super) async fn graphql<T: DeserializeOwned>(&self, query: &str) -> Result<T, ApiError> {
        #[derive(Deserialize)]
        struct Envelope<T> {
            data: Option<T>,
            #[serde(default)]
            errors: Vec<GraphqlError>,
        }
        #[derive(Deserialize)]
        struct GraphqlError {
            #[serde(default)]
            message: String,
        }
        let url = format!("{}/graphql", self.graphql);
        let label = "POST /graphql".to_owned();
        let body = serde_json::json!({ "query": query });
        let call = Call {
            method: Method::POST,
            path: String::new(),
            body: Some(&body),
            retry: Retry::Idempotent,
            timeout: Some(CALL_TIMEOUT),
        };
        let response = self.send_to(&url, &label, &call).await?;
        let envelope: Envelope<T> = decode(&label, response).await?;
        match (envelope.data, envelope.errors.first()) {
            (_, Some(error)) => Err(ApiError::Status {
                call: label,
                status: 200,
                message: error.message.clone(),
            }),
            (Some(data), None) => Ok(data),
            (None, None) => Err(ApiError::Transport {
                call: label,
                detail: "the answer had no data".to_owned(),
            }),
        }
    }
}

async fn decode<T: DeserializeOwned>(
    label: &str,
    response: reqwest::Response,
) -> Result<T, ApiError> {
    let bytes = response.bytes().await.map_err(|e| ApiError::Transport {
        call: label.to_owned(),
        detail: describe_transport(&e),
    })?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::Transport {
        call: label.to_owned(),
        detail: format!("unexpected answer ({e})"),
    })
}

/// Turns a non-success answer into an error, reading Fly's `{"error": "..."}` when present.
async fn failure(label: &str, response: reqwest::Response) -> ApiError {
    let status = response.status().as_u16();
    if status == 401 || status == 403 {
        return ApiError::Auth(format!(
            "Fly rejected the API token (HTTP {status}). Run 'fly auth login' again or set a valid FLY_API_TOKEN."
        ));
    }
    let text = response.text().await.unwrap_or_default();
    ApiError::Status {
        call: label.to_owned(),
        status,
        message: error_text(&text),
    }
}

/// Fly's error bodies are `{"error": "..."}` (sometimes with `details`); fall back to the raw
/// text, shortened.
pub(super) fn error_text(body: &str) -> String {
    #[derive(Deserialize)]
    struct FlyError {
        error: Option<String>,
        details: Option<String>,
    }
    let text = match serde_json::from_str::<FlyError>(body) {
        Ok(FlyError {
            error: Some(error),
            details,
        }) => match details.filter(|d| !d.is_empty()) {
            Some(details) => format!("{error} ({details})"),
            None => error,
        },
        _ => body.trim().to_owned(),
    };
    let mut text = if text.is_empty() {
        "(no message)".to_owned()
    } else {
        text
    };
    if text.len() > MAX_ERROR_TEXT {
        let mut end = MAX_ERROR_TEXT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

fn describe_transport(error: &reqwest::Error) -> String {
    if error.is_timeout() {
        "timed out".to_owned()
    } else if error.is_connect() {
        "could not connect to the Fly API".to_owned()
    } else {
        error.to_string()
    }
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

/// Percent-encodes one path segment (app names and Machine ids are plain, but `--fly-app` is
/// user input and metadata keys contain no reserved characters only by convention).
pub(super) fn segment(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    for byte in raw.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_text_prefers_the_error_field() {
        assert_eq!(error_text(r#"{"error":"not found"}"#), "not found");
        assert_eq!(
            error_text(r#"{"error":"bad","details":"why"}"#),
            "bad (why)"
        );
        assert_eq!(error_text("plain\n"), "plain");
        assert_eq!(error_text(""), "(no message)");
        assert!(error_text(&"é".repeat(400)).ends_with('…'));
    }

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
        assert_eq!(segment("my-app_1.x"), "my-app_1.x");
        assert_eq!(segment("a/b c"), "a%2Fb%20c");
    }
}
