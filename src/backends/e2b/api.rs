//! The E2B control plane (`backends.md` §4): the REST API under `--e2b-api-url`, authenticated
//! with `X-API-Key` (E2B deprecates bearer access tokens for this). Wire types are written by
//! hand from E2B's published OpenAPI definition (`NewSandbox`, `Sandbox`, `ListedSandbox`,
//! `ConnectSandbox`, `Error`), with only the fields we use.
//!
//! Retries: 429 always (refused before acting), 5xx and transport failures only for calls that
//! are safe to repeat; at most [`MAX_RETRIES`] retries with exponential backoff and jitter.
//! A 401/403 says how to set the key; every other failure names the call and carries E2B's own
//! `message`, so callers only add which sandbox or computer it was about.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::RngExt;
use reqwest::{Method, StatusCode};
use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::backends::BackendError;
use crate::config::Secret;

/// Retries after the first attempt (429, and 5xx/transport errors of repeatable calls).
const MAX_RETRIES: u32 = 3;
/// First backoff step; doubled per retry (0.5 s, 1 s, 2 s), each with ±50 % jitter so servers
/// sharing a team do not retry in lockstep.
const BACKOFF_BASE: Duration = Duration::from_millis(500);
/// Longest `Retry-After` honoured: longer waits are better reported than slept on.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(30);
/// Bound for one control-plane call; creating a sandbox from a cached template takes well under
/// a second, so 60 s leaves room for a cold template without hanging a tool call forever.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// TCP/TLS connect bound.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest error text kept in a message.
const MAX_ERROR_TEXT: usize = 500;
/// Bytes of an error body read at most (REST or envd). envd runs inside the sandbox, where a
/// root user can answer anything; a real error body is a short JSON object, and reading stops
/// here however much more is sent.
pub(super) const MAX_ERROR_BODY: usize = 16 * 1024;
/// `GET /v2/sandboxes` page size: the documented maximum.
const PAGE_LIMIT: &str = "100";
/// Pages followed at most, so a misbehaving `X-Next-Token` cannot loop forever (10,000 rows).
const MAX_PAGES: usize = 100;

/// The instruction every missing or rejected key leads to.
pub(super) const KEY_HINT: &str = "Pass --e2b-api-key or set E2B_API_KEY.";

/// Whether a failed call may be sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retry {
    Idempotent,
    /// Creation: a 5xx may have created a sandbox, so only a 429 is retried.
    RateLimitOnly,
}

/// A failed call, before the caller names the sandbox.
#[derive(Debug, Clone)]
pub(super) enum ApiError {
    /// No key, or E2B refused it: the text is the instruction.
    Auth {
        status: Option<u16>,
        /// E2B's own words (empty when there was no key to send).
        message: String,
        text: String,
    },
    Status {
        call: String,
        status: u16,
        message: String,
    },
    Transport {
        call: String,
        detail: String,
    },
}

impl ApiError {
    pub(super) fn status(&self) -> Option<u16> {
        match self {
            Self::Status { status, .. } => Some(*status),
            Self::Auth { status, .. } => *status,
            Self::Transport { .. } => None,
        }
    }

    /// `<call> returned HTTP <status>: <message>` or `<call> failed: <why>`.
    pub(super) fn detail(&self) -> String {
        match self {
            Self::Auth { text, .. } => text.clone(),
            Self::Status {
                call,
                status,
                message,
            } => format!("{call} returned HTTP {status}: {message}"),
            Self::Transport { call, detail } => format!("{call} failed: {detail}"),
        }
    }

    /// `<status> <message>` as the spec's validation and create messages print it; a
    /// rejected key adds how to set one.
    pub(super) fn short(&self) -> String {
        match self {
            Self::Auth {
                status: Some(status),
                message,
                ..
            } => format!("{status} {message}. {KEY_HINT}"),
            Self::Auth { text, .. } => text.clone(),
            Self::Status {
                status, message, ..
            } => format!("{status} {message}"),
            Self::Transport { detail, .. } => detail.clone(),
        }
    }

    pub(super) fn into_backend(self, context: impl std::fmt::Display) -> BackendError {
        match self {
            Self::Auth { text, .. } => BackendError::Unavailable(text),
            other => BackendError::Provider(format!("{context}: {}", other.detail())),
        }
    }
}

/// `POST /sandboxes` body (`NewSandbox`).
#[derive(Debug, Serialize)]
pub(super) struct NewSandbox<'a> {
    #[serde(rename = "templateID")]
    pub template_id: &'a str,
    /// Always sent: omitted, E2B gives the sandbox 15 s.
    pub timeout: u64,
    /// `secure: true` makes envd demand the access token we receive.
    pub secure: bool,
    pub allow_internet_access: bool,
    #[serde(rename = "autoPause")]
    pub auto_pause: bool,
    pub metadata: &'a BTreeMap<String, String>,
    #[serde(rename = "envVars")]
    pub env_vars: &'a BTreeMap<String, String>,
}

/// `Sandbox`: the answer of create and connect.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct Sandbox {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "envdAccessToken", default)]
    pub envd_access_token: Option<String>,
    #[serde(default)]
    pub domain: Option<String>,
}

/// `ListedSandbox` (and the fields of `SandboxDetail` we read).
#[derive(Debug, Clone, Deserialize)]
pub(super) struct Listed {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "startedAt", default)]
    pub started_at: Option<String>,
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

impl Listed {
    pub(super) fn meta(&self, key: &str) -> Option<&str> {
        self.metadata.as_ref()?.get(key).map(String::as_str)
    }
}

/// What `connect` did.
pub(super) enum Connected {
    Running(Sandbox),
    Resumed(Sandbox),
}

pub(super) struct Api {
    http: reqwest::Client,
    base: String,
    key: Option<Secret>,
}

/// Percent-encodes one metadata key or value (E2B's list filter wants each encoded, then the
/// whole `k=v&k=v` string encoded again as the query value, which reqwest does).
pub(super) fn encode(raw: &str) -> String {
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

/// The `metadata` filter value for `GET /v2/sandboxes`.
pub(super) fn metadata_query(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

impl Api {
    pub(super) fn new(base: &str, key: Option<Secret>) -> Result<Self, BackendError> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(concat!(
                "mcp-sandbox-computer-vm-for-ai/",
                env!("CARGO_PKG_VERSION")
            ))
            .build()
            .map_err(|e| {
                BackendError::Unavailable(format!("Cannot set up the E2B API client: {e}"))
            })?;
        Ok(Self {
            http,
            base: base.to_owned(),
            key,
        })
    }

    /// Sends one call with retries; returns the successful response, body unread.
    async fn send(
        &self,
        method: Method,
        path: &str,
        query: &[(&str, &str)],
        body: Option<&serde_json::Value>,
        retry: Retry,
    ) -> Result<reqwest::Response, ApiError> {
        let label = format!("{method} {path}");
        let Some(key) = &self.key else {
            return Err(ApiError::Auth {
                status: None,
                message: String::new(),
                text: format!("No E2B API key. {KEY_HINT}"),
            });
        };
        let url = format!("{}{path}", self.base);
        let mut attempt = 0;
        loop {
            let mut request = self
                .http
                .request(method.clone(), &url)
                .header("X-API-Key", key.expose())
                .header(reqwest::header::ACCEPT, "application/json")
                .timeout(CALL_TIMEOUT);
            if !query.is_empty() {
                request = request.query(query);
            }
            if let Some(body) = body {
                request = request.json(body);
            }
            let outcome = request.send().await;
            let retry_in = match &outcome {
                Ok(r) if r.status().is_success() => None,
                Ok(r) if r.status() == StatusCode::TOO_MANY_REQUESTS => {
                    Some(retry_after(r).unwrap_or_else(|| backoff(attempt)))
                }
                Ok(r) if r.status().is_server_error() && retry == Retry::Idempotent => {
                    Some(backoff(attempt))
                }
                Err(e) if retry == Retry::Idempotent && !e.is_timeout() => Some(backoff(attempt)),
                _ => None,
            };
            match (retry_in, outcome) {
                (Some(delay), _) if attempt < MAX_RETRIES => {
                    attempt += 1;
                    warn!(call = %label, attempt, delay_ms = delay.as_millis() as u64, "E2B API call retried");
                    tokio::time::sleep(delay).await;
                }
                (_, Ok(response)) if response.status().is_success() => return Ok(response),
                (_, Ok(response)) => return Err(failure(&label, response).await),
                (_, Err(error)) => {
                    return Err(ApiError::Transport {
                        call: label,
                        detail: describe_transport(&error),
                    });
                }
            }
        }
    }

    async fn json<T: serde::de::DeserializeOwned>(
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

    /// `GET /v2/sandboxes?limit=1`: the cheapest call that proves key and reachability.
    pub(super) async fn probe(&self) -> Result<(), ApiError> {
        self.send(
            Method::GET,
            "/v2/sandboxes",
            &[("limit", "1")],
            None,
            Retry::Idempotent,
        )
        .await
        .map(drop)
    }

    pub(super) async fn create(&self, body: &NewSandbox<'_>) -> Result<Sandbox, ApiError> {
        let value = serde_json::to_value(body).map_err(|e| ApiError::Transport {
            call: "POST /sandboxes".to_owned(),
            detail: e.to_string(),
        })?;
        let response = self
            .send(
                Method::POST,
                "/sandboxes",
                &[],
                Some(&value),
                Retry::RateLimitOnly,
            )
            .await?;
        Self::json("POST /sandboxes", response).await
    }

    /// Every running or paused sandbox matching the metadata filter, following `X-Next-Token`.
    pub(super) async fn list(&self, metadata: &str) -> Result<Vec<Listed>, ApiError> {
        let mut rows = Vec::new();
        let mut next: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let mut query = vec![
                ("metadata", metadata),
                ("state", "running,paused"),
                ("limit", PAGE_LIMIT),
            ];
            if let Some(token) = &next {
                query.push(("nextToken", token.as_str()));
            }
            let response = self
                .send(
                    Method::GET,
                    "/v2/sandboxes",
                    &query,
                    None,
                    Retry::Idempotent,
                )
                .await?;
            next = response
                .headers()
                .get("X-Next-Token")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .filter(|t| !t.is_empty());
            let page: Vec<Listed> = Self::json("GET /v2/sandboxes", response).await?;
            rows.extend(page);
            if next.is_none() {
                return Ok(rows);
            }
        }
        Ok(rows)
    }

    /// `GET /sandboxes/{id}`; `None` when E2B says 404.
    pub(super) async fn get(&self, sandbox_id: &str) -> Result<Option<Listed>, ApiError> {
        let path = format!("/sandboxes/{}", encode(sandbox_id));
        match self
            .send(Method::GET, &path, &[], None, Retry::Idempotent)
            .await
        {
            Ok(response) => Ok(Some(Self::json(&format!("GET {path}"), response).await?)),
            Err(e) if e.status() == Some(404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `DELETE /sandboxes/{id}`; 404 counts as gone.
    pub(super) async fn kill(&self, sandbox_id: &str) -> Result<(), ApiError> {
        let path = format!("/sandboxes/{}", encode(sandbox_id));
        match self
            .send(Method::DELETE, &path, &[], None, Retry::Idempotent)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.status() == Some(404) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `POST /sandboxes/{id}/connect {timeout}`: resumes a paused sandbox, extends the TTL
    /// (never shortens it) and returns a fresh envd access token.
    pub(super) async fn connect(
        &self,
        sandbox_id: &str,
        timeout_secs: u64,
    ) -> Result<Connected, ApiError> {
        let path = format!("/sandboxes/{}/connect", encode(sandbox_id));
        let body = serde_json::json!({ "timeout": timeout_secs });
        let response = self
            .send(Method::POST, &path, &[], Some(&body), Retry::Idempotent)
            .await?;
        let resumed = response.status() == StatusCode::CREATED;
        let sandbox = Self::json(&format!("POST {path}"), response).await?;
        Ok(if resumed {
            Connected::Resumed(sandbox)
        } else {
            Connected::Running(sandbox)
        })
    }

    /// `POST /sandboxes/{id}/timeout {timeout}`: the sandbox now expires `timeout_secs` from now.
    pub(super) async fn set_timeout(
        &self,
        sandbox_id: &str,
        timeout_secs: u64,
    ) -> Result<(), ApiError> {
        let path = format!("/sandboxes/{}/timeout", encode(sandbox_id));
        let body = serde_json::json!({ "timeout": timeout_secs });
        self.send(Method::POST, &path, &[], Some(&body), Retry::Idempotent)
            .await
            .map(drop)
    }

    /// `POST /sandboxes/{id}/pause` (204). Not every E2B-compatible service offers it.
    pub(super) async fn pause(&self, sandbox_id: &str) -> Result<(), ApiError> {
        let path = format!("/sandboxes/{}/pause", encode(sandbox_id));
        self.send(Method::POST, &path, &[], None, Retry::Idempotent)
            .await
            .map(drop)
    }
}

/// Reads E2B's `{"code", "message"}` error body; falls back to the raw text.
async fn failure(label: &str, response: reqwest::Response) -> ApiError {
    let status = response.status().as_u16();
    let text = bounded_text(response).await;
    let message = error_text(&text);
    if status == 401 || status == 403 {
        return ApiError::Auth {
            status: Some(status),
            text: format!("E2B rejected the API key (HTTP {status}: {message}). {KEY_HINT}"),
            message,
        };
    }
    ApiError::Status {
        call: label.to_owned(),
        status,
        message,
    }
}

/// The start of an error body as text: at most [`MAX_ERROR_BODY`] bytes are read, the rest is
/// never fetched (the response is dropped), and a read error ends it quietly.
pub(super) async fn bounded_text(mut response: reqwest::Response) -> String {
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

pub(super) fn error_text(body: &str) -> String {
    #[derive(Deserialize)]
    struct E2bError {
        message: Option<String>,
    }
    let text = match serde_json::from_str::<E2bError>(body) {
        Ok(E2bError {
            message: Some(message),
        }) if !message.trim().is_empty() => message,
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

pub(super) fn describe_transport(error: &reqwest::Error) -> String {
    if error.is_timeout() {
        "timed out".to_owned()
    } else if error.is_connect() {
        "could not connect".to_owned()
    } else {
        error.to_string()
    }
}

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
    fn metadata_filters_encode_each_key_and_value() {
        assert_eq!(
            metadata_query(&[("kilntainers", "true")]),
            "kilntainers=true"
        );
        assert_eq!(
            metadata_query(&[("a b", "c&d"), ("k", "v=1")]),
            "a%20b=c%26d&k=v%3D1"
        );
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

    #[test]
    fn error_text_reads_the_message_field() {
        assert_eq!(error_text(r#"{"code":404,"message":"nope"}"#), "nope");
        assert_eq!(error_text("plain\n"), "plain");
        assert_eq!(error_text(""), "(no message)");
    }

    #[test]
    fn new_sandbox_uses_the_documented_field_names() {
        let meta = BTreeMap::from([("k".to_owned(), "v".to_owned())]);
        let env = BTreeMap::new();
        let body = serde_json::to_value(NewSandbox {
            template_id: "base",
            timeout: 60,
            secure: true,
            allow_internet_access: false,
            auto_pause: false,
            metadata: &meta,
            env_vars: &env,
        })
        .unwrap();
        assert_eq!(
            body,
            serde_json::json!({"templateID": "base", "timeout": 60, "secure": true,
                "allow_internet_access": false, "autoPause": false, "metadata": {"k": "v"}, "envVars": {}})
        );
    }
}
