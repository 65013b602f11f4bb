//! Which Fly App owns our Machines (docs/decisions.md, "Fly app and organisation"): the configured one (must be visible),
//! else the one remembered in `fly.json` (if still visible), else a new
//! `mcp-sandbox-computers-<8 hex>` created in `--fly-org`/`FLY_ORG`, `personal`, or the first
//! organization the token sees, and remembered atomically.
//!
//! An app we did not just create is used only when it has no secrets and is not the app this
//! server runs in: Fly puts an app's secrets into the environment of every Machine of that
//! app, so a sandbox there could read the controller's tokens from `/proc/1/environ`.

use std::path::Path;

use rand::RngExt;
use reqwest::Method;
use serde::Deserialize;
use tracing::{info, warn};

use super::api::{Api, ApiError, CALL_TIMEOUT, Call, Retry, segment};
use crate::config::FlyConfig;
use kilntainers_backend::BackendError;

/// The organization lookup (the one call outside the Machines API, on Fly's GraphQL API): the
/// top-level `organizations` connection of Fly's current schema (`schema.graphql` in
/// superfly/fly-go), not the deprecated `viewer { organizations }` path. Pinned by the contract
/// tests; the schema itself is not vendored (docs/fly.md).
pub(super) const ORGANIZATIONS_QUERY: &str = "{ organizations { nodes { slug type } } }";
/// Name prefix of apps this server creates.
pub(super) const APP_PREFIX: &str = "mcp-sandbox-computers-";

/// Resolves the app once; the caller caches success.
pub(super) async fn resolve(api: &Api, config: &FlyConfig) -> Result<String, BackendError> {
    if let Some(app) = existing(api, config).await? {
        return Ok(app);
    }
    let org = match &config.org {
        Some(org) => org.clone(),
        None => organization(api).await?,
    };
    let app = format!("{APP_PREFIX}{:08x}", rand::rng().random::<u32>());
    // `name` as the current definition and Fly's own client send it (older documents said
    // `app_name`); `?wait=true` as Fly's own client asks, so the app is usable when this
    // returns; an idempotency key so a retry after a lost answer gets this app back instead
    // of a name conflict. See: issue 32 (items 2 and 9)
    let key = format!("{app}-{:016x}", rand::rng().random::<u64>());
    let body = serde_json::json!({ "name": app, "org_slug": org, "idempotency_key": key });
    let call = Call {
        method: Method::POST,
        path: "/apps?wait=true".to_owned(),
        body: Some(&body),
        // Safe to repeat: the idempotency key makes a retry return the same app.
        retry: Retry::Idempotent,
        timeout: Some(CALL_TIMEOUT),
    };
    api.unit(&call).await.map_err(|e| match e {
        ApiError::Auth(text) => BackendError::Unavailable(text),
        other => BackendError::Provider(format!(
            "Fly could not create an app in organization '{org}': {}",
            other.detail()
        )),
    })?;
    info!(app, org, "created Fly App for sandbox Machines");
    if let Some(path) = &config.state_file
        && let Err(error) = remember(path, &app)
    {
        warn!(%error, path = %path.display(), "could not remember the Fly App; the next server will create another");
    }
    Ok(app)
}

/// The configured or remembered app, without creating one: `Ok(None)` when there is neither
/// (or the remembered one is gone). An app that must not hold sandboxes is an error.
pub(super) async fn existing(
    api: &Api,
    config: &FlyConfig,
) -> Result<Option<String>, BackendError> {
    existing_checked(api, config).await.map_err(|e| match e {
        Unsafe::Refused(text) => BackendError::Unavailable(text),
        Unsafe::Unknown(error) => error,
    })
}

/// Why an app was not accepted.
pub(super) enum Unsafe {
    /// The app must not hold sandboxes (it has secrets, or it is the controller's app).
    Refused(String),
    /// The app could not be looked up or checked (network, token, Fly errors).
    Unknown(BackendError),
}

/// [`existing`], telling a refusal apart from a failed lookup (startup refuses to run only on
/// the former; the latter is retried at first use, where it still fails closed).
pub(super) async fn existing_checked(
    api: &Api,
    config: &FlyConfig,
) -> Result<Option<String>, Unsafe> {
    if let Some(app) = &config.app {
        return match visible(api, app).await.map_err(Unsafe::Unknown)? {
            true => {
                check_safe(api, config, app).await?;
                Ok(Some(app.clone()))
            }
            false => Err(Unsafe::Unknown(BackendError::Provider(format!(
                "Fly App '{app}' is not visible to the current account or token."
            )))),
        };
    }
    if let Some(path) = &config.state_file
        && let Some(app) = remembered(path)
    {
        if visible(api, &app).await.map_err(Unsafe::Unknown)? {
            check_safe(api, config, &app).await?;
            return Ok(Some(app));
        }
        warn!(
            app,
            "the remembered Fly App is gone; a new one will be created when needed"
        );
    }
    Ok(None)
}

/// Refuses the controller's own app and any app with secrets. Fails closed: when the secrets
/// cannot be listed, the app is not used.
async fn check_safe(api: &Api, config: &FlyConfig, app: &str) -> Result<(), Unsafe> {
    if config.controller_app.as_deref() == Some(app) {
        return Err(Unsafe::Refused(crate::config::own_app_refusal(app)));
    }
    let names = secret_names(api, app).await.map_err(|e| match e {
        ApiError::Auth(text) => Unsafe::Unknown(BackendError::Unavailable(text)),
        other => Unsafe::Unknown(BackendError::Provider(format!(
            "Could not check that Fly App '{app}' has no secrets, so no sandbox Machine is created in it: {}",
            other.detail()
        ))),
    })?;
    if names.is_empty() {
        return Ok(());
    }
    Err(Unsafe::Refused(format!(
        "Fly App '{app}' has secrets ({}). Fly gives every Machine of an app that app's secrets as environment variables, so each sandbox could read them. Use a separate app without secrets for sandbox Machines (--fly-app or {}), or remove them with 'fly secrets unset -a {app} <NAME>...'.",
        names.join(", "),
        crate::config::SANDBOX_APP_ENV
    )))
}

/// `GET /v1/apps/{app}/secrets`: the names of the app's secrets (Fly never returns values).
/// The documented answer is `{"secrets": [{"name", "digest", "created_at", "updated_at"}]}`;
/// a bare array is accepted too.
async fn secret_names(api: &Api, app: &str) -> Result<Vec<String>, ApiError> {
    #[derive(Deserialize)]
    struct Listed {
        name: String,
    }
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Answer {
        Object {
            #[serde(default)]
            secrets: Vec<Listed>,
        },
        Array(Vec<Listed>),
    }
    let call = Call {
        method: Method::GET,
        path: format!("/apps/{}/secrets", segment(app)),
        body: None,
        retry: Retry::Idempotent,
        timeout: Some(CALL_TIMEOUT),
    };
    let answer: Answer = api.json(&call).await?;
    let listed = match answer {
        Answer::Object { secrets } | Answer::Array(secrets) => secrets,
    };
    Ok(listed.into_iter().map(|s| s.name).collect())
}

/// `GET /v1/apps/{app}`: 200 → visible, 404 → not.
async fn visible(api: &Api, app: &str) -> Result<bool, BackendError> {
    let call = Call {
        method: Method::GET,
        path: format!("/apps/{}", segment(app)),
        body: None,
        retry: Retry::Idempotent,
        timeout: Some(CALL_TIMEOUT),
    };
    match api.unit(&call).await {
        Ok(()) => Ok(true),
        Err(e) if e.status() == Some(404) => Ok(false),
        Err(e) => Err(e.into_backend(format!("Fly App '{app}' lookup failed"))),
    }
}

async fn organization(api: &Api) -> Result<String, BackendError> {
    #[derive(Deserialize)]
    struct Data {
        organizations: Organizations,
    }
    #[derive(Deserialize)]
    struct Organizations {
        #[serde(default)]
        nodes: Vec<Organization>,
    }
    #[derive(Deserialize)]
    struct Organization {
        slug: String,
        #[serde(default, rename = "type")]
        kind: Option<String>,
    }
    let data: Data = api
        .graphql(ORGANIZATIONS_QUERY)
        .await
        .map_err(|e| e.into_backend("Fly organization lookup failed"))?;
    let nodes = data.organizations.nodes;
    let personal = nodes.iter().find(|o| {
        o.slug == "personal"
            || o.kind
                .as_deref()
                .is_some_and(|k| k.eq_ignore_ascii_case("personal"))
    });
    personal
        .or(nodes.first())
        .map(|o| o.slug.clone())
        .ok_or_else(|| {
            BackendError::Provider(
                "No Fly organization is available for this account. Create one in Fly.io or set FLY_ORG."
                    .to_owned(),
            )
        })
}

/// The app name in `fly.json`, if the file exists and says one.
fn remembered(path: &Path) -> Option<String> {
    #[derive(Deserialize)]
    struct State {
        app: String,
    }
    let text = std::fs::read_to_string(path).ok()?;
    let state: State = serde_json::from_str(&text).ok()?;
    let app = state.app.trim().to_owned();
    (!app.is_empty()).then_some(app)
}

/// Writes `{"app": …}` pretty-printed with a trailing newline, via a `.tmp` file and rename so a
/// reader never sees half a file.
fn remember(path: &Path, app: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut text = serde_json::to_string_pretty(&serde_json::json!({ "app": app }))
        .map_err(std::io::Error::other)?;
    text.push('\n');
    let mut staging = path.as_os_str().to_owned();
    staging.push(".tmp");
    std::fs::write(&staging, text)?;
    std::fs::rename(&staging, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remember_then_read_back() {
        let dir = std::env::temp_dir().join(format!("fly-app-{}", std::process::id()));
        let path = dir.join("nested").join("fly.json");
        remember(&path, "mcp-sandbox-computers-0000abcd").unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\n  \"app\": \"mcp-sandbox-computers-0000abcd\"\n}\n"
        );
        assert_eq!(
            remembered(&path).as_deref(),
            Some("mcp-sandbox-computers-0000abcd")
        );
        std::fs::write(&path, "not json").unwrap();
        assert_eq!(remembered(&path), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
