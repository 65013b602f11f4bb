//! The Machines resource of one app (`/v1/apps/{app}/machines...`): wire types written from
//! Fly's Machines API reference and thin calls for list, get, create, start, restart, wait,
//! destroy and metadata. Exec lives in [`super::exec`]; what the calls *mean* for a computer
//! lives in [`super`].

use std::collections::BTreeMap;
use std::time::Duration;

use reqwest::Method;
use serde::{Deserialize, Serialize};

use super::api::{Api, ApiError, CALL_TIMEOUT, Call, Retry, segment};

/// Longest wait Fly's proxy allows on `/wait` (docs/decisions.md, "Fly Machines" quirks: clamped to 60 s).
pub(super) const MAX_WAIT_SECS: u64 = 60;
/// Client bound for one `/wait` call: the server-side wait plus time for the answer to travel.
const WAIT_SLACK: Duration = Duration::from_secs(15);

/// One Machine as `GET …/machines` and `GET …/machines/{id}` return it (fields we read).
#[derive(Debug, Clone, Deserialize)]
pub(super) struct Machine {
    pub id: String,
    #[serde(default)]
    pub state: String,
    /// The Machine's current version (its boot), what `/wait` takes for `stopped`.
    #[serde(default)]
    pub version: Option<String>,
    /// The deprecated alias of `version` (Fly sends both), read only when `version` is missing.
    /// See: issue 32 (item 8)
    #[serde(default)]
    instance_id: Option<String>,
    #[serde(default)]
    pub created_at: Option<String>,
    #[serde(default)]
    pub config: Option<MachineConfigView>,
}

/// The part of a Machine's `config` we read back.
#[derive(Debug, Clone, Default, Deserialize)]
pub(super) struct MachineConfigView {
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

impl Machine {
    /// `version`, else its deprecated alias `instance_id`.
    pub(super) fn version(&self) -> Option<&str> {
        self.version.as_deref().or(self.instance_id.as_deref())
    }

    pub(super) fn metadata(&self, key: &str) -> Option<&str> {
        self.config
            .as_ref()
            .and_then(|c| c.metadata.as_ref())
            .and_then(|m| m.get(key))
            .map(String::as_str)
    }

    /// Destroyed Machines (and ones on their way there) are gone for every purpose of ours.
    pub(super) fn is_gone(&self) -> bool {
        matches!(self.state.as_str(), "destroyed" | "destroying")
    }
}

/// `POST /v1/apps/{app}/machines` body.
#[derive(Debug, Serialize)]
pub(super) struct CreateRequest {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    pub config: CreateConfig,
}

#[derive(Debug, Serialize)]
pub(super) struct CreateConfig {
    pub image: String,
    pub init: Init,
    pub guest: Guest,
    pub rootfs: Rootfs,
    pub restart: RestartPolicy,
    pub auto_destroy: bool,
    pub metadata: BTreeMap<String, String>,
}

#[derive(Debug, Serialize)]
pub(super) struct Init {
    /// Overrides the image's entrypoint and command: the keep-alive runs as the main process.
    pub exec: Vec<String>,
}

#[derive(Debug, Serialize)]
pub(super) struct Guest {
    pub cpu_kind: String,
    pub cpus: u32,
    pub memory_mb: u32,
}

/// `rootfs.persist` replaces the deprecated `guest.persist_rootfs`.
#[derive(Debug, Serialize)]
pub(super) struct Rootfs {
    pub persist: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size_gb: Option<u32>,
}

#[derive(Debug, Serialize)]
pub(super) struct RestartPolicy {
    pub policy: &'static str,
}

/// How a `/wait` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Waited {
    Reached,
    /// The state was not reached within the asked-for time: Fly answered 408, or 200 with
    /// `"ok": false` as the current definition describes (`WaitMachineResponse`).
    TimedOut,
}

/// The Machines of one app.
pub(super) struct Machines<'a> {
    pub api: &'a Api,
    pub app: &'a str,
}

impl Machines<'_> {
    fn path(&self, rest: &str) -> String {
        format!("/apps/{}/machines{rest}", segment(self.app))
    }

    fn call<'b>(&self, method: Method, rest: &str, retry: Retry) -> Call<'b> {
        Call {
            method,
            path: self.path(rest),
            body: None,
            retry,
            timeout: Some(CALL_TIMEOUT),
        }
    }

    pub(super) async fn list(&self) -> Result<Vec<Machine>, ApiError> {
        self.api
            .json(&self.call(Method::GET, "", Retry::Idempotent))
            .await
    }

    /// `None` when Fly says 404.
    pub(super) async fn get(&self, id: &str) -> Result<Option<Machine>, ApiError> {
        let call = self.call(Method::GET, &format!("/{}", segment(id)), Retry::Idempotent);
        match self.api.json(&call).await {
            Ok(machine) => Ok(Some(machine)),
            Err(e) if e.status() == Some(404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub(super) async fn create(&self, request: &CreateRequest) -> Result<Machine, ApiError> {
        let body = serde_json::to_value(request).map_err(|e| ApiError::Transport {
            call: format!("POST /v1{}", self.path("")),
            detail: format!("cannot encode the request ({e})"),
        })?;
        let mut call = self.call(Method::POST, "", Retry::RateLimitOnly);
        call.body = Some(&body);
        self.api.json(&call).await
    }

    pub(super) async fn start(&self, id: &str) -> Result<(), ApiError> {
        let call = self.call(
            Method::POST,
            &format!("/{}/start", segment(id)),
            Retry::Idempotent,
        );
        self.api.unit(&call).await
    }

    pub(super) async fn restart(&self, id: &str) -> Result<(), ApiError> {
        let call = self.call(
            Method::POST,
            &format!("/{}/restart", segment(id)),
            Retry::Idempotent,
        );
        self.api.unit(&call).await
    }

    /// `GET …/{id}/wait?state=<state>&timeout=<secs>[&version=<v>]`; `secs` is clamped to
    /// Fly's 60 s. `version` (not its deprecated alias `instance_id`) names the boot a
    /// `stopped` wait is about.
    pub(super) async fn wait(
        &self,
        id: &str,
        state: &str,
        version: Option<&str>,
        secs: u64,
    ) -> Result<Waited, ApiError> {
        /// `WaitMachineResponse`: `ok` is false when the state was not reached in time.
        #[derive(Deserialize)]
        struct WaitAnswer {
            #[serde(default = "reached")]
            ok: bool,
        }
        fn reached() -> bool {
            true
        }
        let secs = secs.clamp(1, MAX_WAIT_SECS);
        let mut rest = format!(
            "/{}/wait?state={}&timeout={secs}",
            segment(id),
            segment(state)
        );
        if let Some(version) = version {
            rest.push_str(&format!("&version={}", segment(version)));
        }
        let mut call = self.call(Method::GET, &rest, Retry::Idempotent);
        call.timeout = Some(Duration::from_secs(secs) + WAIT_SLACK);
        // See: issue 32 (item 6): 200 with `ok: false` is a timeout too. A 200 whose body
        // cannot be read as `WaitMachineResponse` counts as reached, as before.
        match self.api.send(&call).await {
            Ok(response) => {
                let text = response.text().await.unwrap_or_default();
                match serde_json::from_str::<WaitAnswer>(&text) {
                    Ok(WaitAnswer { ok: false }) => Ok(Waited::TimedOut),
                    _ => Ok(Waited::Reached),
                }
            }
            Err(e) if e.status() == Some(408) => Ok(Waited::TimedOut),
            Err(e) => Err(e),
        }
    }

    /// `DELETE …/{id}?force=true` (force kills a running Machine; the definition declares no
    /// other parameter); a Machine already gone counts as destroyed.
    pub(super) async fn destroy(&self, id: &str) -> Result<(), ApiError> {
        let call = self.call(
            Method::DELETE,
            &format!("/{}?force=true", segment(id)),
            Retry::Idempotent,
        );
        match self.api.unit(&call).await {
            Err(e) if e.status() == Some(404) => Ok(()),
            other => other,
        }
    }

    /// `POST …/{id}/metadata/{key}` with `{"value": …}`.
    pub(super) async fn set_metadata(
        &self,
        id: &str,
        key: &str,
        value: &str,
    ) -> Result<(), ApiError> {
        let body = serde_json::json!({ "value": value });
        let mut call = self.call(
            Method::POST,
            &format!("/{}/metadata/{}", segment(id), segment(key)),
            Retry::Idempotent,
        );
        call.body = Some(&body);
        self.api.unit(&call).await
    }

    /// `POST …/{id}/exec`: the raw response, so the caller can stream-decode the body.
    pub(super) async fn exec(
        &self,
        id: &str,
        body: &serde_json::Value,
        timeout: Option<Duration>,
    ) -> Result<reqwest::Response, ApiError> {
        let mut call = self.call(
            Method::POST,
            &format!("/{}/exec", segment(id)),
            Retry::RateLimitOnly,
        );
        call.body = Some(body);
        call.timeout = timeout;
        self.api.send(&call).await
    }
}
