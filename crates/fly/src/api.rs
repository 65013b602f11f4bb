//! The Fly HTTP client: the Machines API (`<base>/v1/...`) and the GraphQL organization lookup
//! over the shared [`RestClient`], with lazy credentials and Fly's error texts.
//!
//! Retries follow [`kilntainers_backend::rest`]. 401 becomes the token message, 403 one saying the
//! token lacks the right to the call. Other failures
//! carry the API call (`METHOD /path`) and Fly's own `error` text, so callers only add which
//! Machine or computer it was about.

use std::sync::Mutex;
use std::time::Duration;

use reqwest::Method;
use reqwest::header::{AUTHORIZATION, HeaderValue};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tracing::debug;

use super::auth::{self, Authorization};
use crate::config::TokenSources;
use kilntainers_backend::BackendError;
use kilntainers_backend::rest::{self, RestClient, RestError};
pub(super) use kilntainers_backend::rest::{Retry, encode as segment};

/// Bound for ordinary control-plane calls (everything but `wait` and `exec`).
pub(super) const CALL_TIMEOUT: Duration = Duration::from_secs(30);

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

impl From<RestError> for ApiError {
    fn from(error: RestError) -> Self {
        match error {
            RestError::Status { status: 401, .. } => Self::Auth(
                "Fly rejected the API token (HTTP 401). Run 'fly auth login' again or set a valid FLY_API_TOKEN."
                    .to_owned(),
            ),
            // 403 is a valid token without the right to this call (an app- or org-scoped
            // token used on another app or organization), not a bad token: say so.
            // See: issue 32 (item 10)
            RestError::Status { status: 403, body, .. } => Self::Auth(format!(
                "Fly accepted the API token but refused this call (HTTP 403: {}). Use a token with access to the app and organization (e.g. 'fly tokens create org'), or set --fly-app/--fly-org to ones this token may use.",
                error_text(&body)
            )),
            RestError::Status { call, status, body } => Self::Status {
                call,
                status,
                message: error_text(&body),
            },
            RestError::Transport { call, detail } => Self::Transport { call, detail },
        }
    }
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
    rest: RestClient,
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
        Ok(Self {
            rest: RestClient::new("Fly")?,
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
        self.send_to(url, label, call).await
    }

    async fn send_to(
        &self,
        url: String,
        label: String,
        call: &Call<'_>,
    ) -> Result<reqwest::Response, ApiError> {
        let auth = self.authorization()?;
        let mut header = HeaderValue::from_str(auth.header_value()).map_err(|_| {
            ApiError::Auth(
                "The Fly API token contains characters a header cannot carry.".to_owned(),
            )
        })?;
        header.set_sensitive(true);
        let call = rest::Call {
            method: call.method.clone(),
            url,
            label,
            query: &[],
            body: call.body,
            retry: call.retry,
            timeout: call.timeout,
        };
        Ok(self.rest.send(&call, (AUTHORIZATION, header)).await?)
    }

    /// Sends `call` and decodes a JSON answer.
    pub(super) async fn json<T: DeserializeOwned>(&self, call: &Call<'_>) -> Result<T, ApiError> {
        let label = format!("{} /v1{}", call.method, call.path);
        let response = self.send(call).await?;
        Ok(self.rest.decode(&label, response).await?)
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
        let label = "POST /graphql".to_owned();
        let body = serde_json::json!({ "query": query });
        let call = Call {
            method: Method::POST,
            path: String::new(),
            body: Some(&body),
            retry: Retry::Idempotent,
            timeout: Some(CALL_TIMEOUT),
        };
        let response = self
            .send_to(format!("{}/graphql", self.graphql), label.clone(), &call)
            .await?;
        let envelope: Envelope<T> = self.rest.decode(&label, response).await?;
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

/// Fly's error bodies are `ErrorResponse` (`{"error": "...", "status": ..., "details": {...}}`;
/// `details` is an object in the official definition, deprecated, and older answers had a
/// string there); fall back to the raw text, shortened.
pub(super) fn error_text(body: &str) -> String {
    #[derive(Deserialize)]
    struct FlyError {
        error: Option<String>,
        #[serde(default)]
        details: Option<serde_json::Value>,
    }
    match serde_json::from_str::<FlyError>(body) {
        Ok(FlyError {
            error: Some(error),
            details,
        }) => {
            let details = match details {
                Some(serde_json::Value::String(text)) => text,
                Some(serde_json::Value::Object(map)) if !map.is_empty() => {
                    serde_json::Value::Object(map).to_string()
                }
                _ => String::new(),
            };
            rest::shorten(&if details.is_empty() {
                error
            } else {
                format!("{error} ({details})")
            })
        }
        _ => rest::shorten(body),
    }
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
        // See: issue 32 (item 10): the official definition's `details` is an object.
        assert_eq!(
            error_text(r#"{"error":"bad","details":{"field":"name"}}"#),
            r#"bad ({"field":"name"})"#
        );
        assert_eq!(error_text(r#"{"error":"bad","details":{}}"#), "bad");
        assert_eq!(error_text("plain\n"), "plain");
        assert_eq!(error_text(""), "(no message)");
        assert!(error_text(&"é".repeat(400)).ends_with('…'));
    }
}
