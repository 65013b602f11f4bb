//! The E2B control plane (docs/decisions.md, "E2B sandboxes"): the REST API under `--e2b-api-url`, authenticated
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

use reqwest::header::{HeaderName, HeaderValue};
use reqwest::{Method, StatusCode};
use serde::{Deserialize, Serialize};

use kilntainers_backend::BackendError;
use kilntainers_backend::rest::{self, RestClient, RestError, Retry};
use kilntainers_backend::secret::Secret;

/// Bound for one control-plane call; creating a sandbox from a cached template takes well under
/// a second, so 60 s leaves room for a cold template without hanging a tool call forever.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// `GET /v2/sandboxes` page size: the documented maximum.
const PAGE_LIMIT: &str = "100";
/// Pages followed at most, so a misbehaving `X-Next-Token` cannot loop forever (10,000 rows).
const MAX_PAGES: usize = 100;

/// The instruction every missing or rejected key leads to.
pub(super) const KEY_HINT: &str = "Pass --e2b-api-key or set E2B_API_KEY.";

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

impl From<RestError> for ApiError {
    fn from(error: RestError) -> Self {
        match error {
            RestError::Status { call, status, body } => {
                let message = error_text(&body);
                if status == 401 || status == 403 {
                    Self::Auth {
                        status: Some(status),
                        text: format!(
                            "E2B rejected the API key (HTTP {status}: {message}). {KEY_HINT}"
                        ),
                        message,
                    }
                } else {
                    Self::Status {
                        call,
                        status,
                        message,
                    }
                }
            }
            RestError::Transport { call, detail } => Self::Transport { call, detail },
        }
    }
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
    /// The egress policy as E2B's network config ([`crate::egress`]); absent without rules.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::egress::NetworkConfig>,
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
    /// The sandbox's envd release; what envd accepts depends on it (see
    /// `process::EnvdVersion`).
    #[serde(rename = "envdVersion", default)]
    pub envd_version: Option<String>,
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

/// `SnapshotInfo`: the answer of `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct SnapshotInfo {
    /// The snapshot template's id with its tag (`<template>:<tag>`); what a new sandbox's
    /// `templateID` names.
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
}

/// The template id of a snapshot id: the part before its `:<tag>`.
pub(super) fn template_of(snapshot_id: &str) -> &str {
    snapshot_id
        .rsplit_once(':')
        .map_or(snapshot_id, |(template, _)| template)
}

/// What `connect` did.
pub(super) enum Connected {
    Running(Sandbox),
    Resumed(Sandbox),
}

pub(super) struct Api {
    rest: RestClient,
    base: String,
    key: Option<Secret>,
}

/// The `metadata` filter value for `GET /v2/sandboxes`.
pub(super) fn metadata_query(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", rest::encode(k), rest::encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

impl Api {
    pub(super) fn new(base: &str, key: Option<Secret>) -> Result<Self, BackendError> {
        Ok(Self {
            rest: RestClient::new("E2B")?,
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
        let Some(key) = &self.key else {
            return Err(ApiError::Auth {
                status: None,
                message: String::new(),
                text: format!("No E2B API key. {KEY_HINT}"),
            });
        };
        let mut header = HeaderValue::from_str(key.expose()).map_err(|_| ApiError::Auth {
            status: None,
            message: String::new(),
            text: format!("The E2B API key contains characters a header cannot carry. {KEY_HINT}"),
        })?;
        header.set_sensitive(true);
        let call = rest::Call {
            method: method.clone(),
            url: format!("{}{path}", self.base),
            label: format!("{method} {path}"),
            query,
            body,
            retry,
            timeout: Some(CALL_TIMEOUT),
        };
        Ok(self
            .rest
            .send(&call, (HeaderName::from_static("x-api-key"), header))
            .await?)
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        label: &str,
        response: reqwest::Response,
    ) -> Result<T, ApiError> {
        Ok(self.rest.decode(label, response).await?)
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
        self.json("POST /sandboxes", response).await
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
            let page: Vec<Listed> = self.json("GET /v2/sandboxes", response).await?;
            rows.extend(page);
            if next.is_none() {
                return Ok(rows);
            }
        }
        Ok(rows)
    }

    /// `GET /sandboxes/{id}`; `None` when E2B says 404.
    pub(super) async fn get(&self, sandbox_id: &str) -> Result<Option<Listed>, ApiError> {
        let path = format!("/sandboxes/{}", rest::encode(sandbox_id));
        match self
            .send(Method::GET, &path, &[], None, Retry::Idempotent)
            .await
        {
            Ok(response) => Ok(Some(self.json(&format!("GET {path}"), response).await?)),
            Err(e) if e.status() == Some(404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `DELETE /sandboxes/{id}`; 404 counts as gone.
    pub(super) async fn kill(&self, sandbox_id: &str) -> Result<(), ApiError> {
        self.delete_gone(&format!("/sandboxes/{}", rest::encode(sandbox_id)))
            .await
    }

    /// `DELETE path`; 404 counts as gone (the goal is met).
    async fn delete_gone(&self, path: &str) -> Result<(), ApiError> {
        match self
            .send(Method::DELETE, path, &[], None, Retry::Idempotent)
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
        let path = format!("/sandboxes/{}/connect", rest::encode(sandbox_id));
        let body = serde_json::json!({ "timeout": timeout_secs });
        let response = self
            .send(Method::POST, &path, &[], Some(&body), Retry::Idempotent)
            .await?;
        let resumed = response.status() == StatusCode::CREATED;
        let sandbox = self.json(&format!("POST {path}"), response).await?;
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
        let path = format!("/sandboxes/{}/timeout", rest::encode(sandbox_id));
        let body = serde_json::json!({ "timeout": timeout_secs });
        self.send(Method::POST, &path, &[], Some(&body), Retry::Idempotent)
            .await
            .map(drop)
    }

    /// `POST /sandboxes/{id}/pause` (204). Not every E2B-compatible service offers it.
    pub(super) async fn pause(&self, sandbox_id: &str) -> Result<(), ApiError> {
        let path = format!("/sandboxes/{}/pause", rest::encode(sandbox_id));
        self.send(Method::POST, &path, &[], None, Retry::Idempotent)
            .await
            .map(drop)
    }
}

impl Api {
    /// `POST /sandboxes/{id}/snapshots` (`SandboxSnapshotRequest`, no name: E2B then names the
    /// snapshot template by its id): a persistent snapshot that new sandboxes start from.
    pub(super) async fn snapshot(&self, sandbox_id: &str) -> Result<SnapshotInfo, ApiError> {
        let path = format!("/sandboxes/{}/snapshots", rest::encode(sandbox_id));
        let body = serde_json::json!({});
        let response = self
            .send(Method::POST, &path, &[], Some(&body), Retry::RateLimitOnly)
            .await?;
        self.json(&format!("POST {path}"), response).await
    }

    /// `DELETE /templates/{templateID}` of a snapshot's template; 404 counts as gone.
    pub(super) async fn delete_template(&self, template_id: &str) -> Result<(), ApiError> {
        self.delete_gone(&format!("/templates/{}", rest::encode(template_id)))
            .await
    }
}

/// E2B's error bodies are `{"code", "message"}`; fall back to the raw text, shortened.
pub(super) fn error_text(body: &str) -> String {
    #[derive(Deserialize)]
    struct E2bError {
        message: Option<String>,
    }
    match serde_json::from_str::<E2bError>(body) {
        Ok(E2bError {
            message: Some(message),
        }) if !message.trim().is_empty() => rest::shorten(&message),
        _ => rest::shorten(body),
    }
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

    #[test]
    fn a_snapshot_names_its_template_before_the_tag() {
        assert_eq!(template_of("abc123:default"), "abc123");
        assert_eq!(template_of("team/snap:v2"), "team/snap");
        assert_eq!(template_of("abc123"), "abc123");
        let info: SnapshotInfo =
            serde_json::from_str(r#"{"snapshotID":"abc:default","names":[]}"#).unwrap();
        assert_eq!(info.snapshot_id, "abc:default");
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
            network: None,
        })
        .unwrap();
        assert_eq!(
            body,
            serde_json::json!({"templateID": "base", "timeout": 60, "secure": true,
                "allow_internet_access": false, "autoPause": false, "metadata": {"k": "v"}, "envVars": {}})
        );
    }
}
