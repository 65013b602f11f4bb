//! The Fly section of the configuration: what the `--fly-*` flags and Fly's environment
//! variables resolve to (the server's `config` module reads them, in the documented order), as
//! plain data this backend is built from, and the names of those variables.

use std::path::PathBuf;

use kilntainers_backend::secret::Secret;

/// `KILNTAINERS_FLY_STATE_FILE`: where the auto-created app's name is remembered (the Python
/// reference's variable name).
pub const STATE_FILE_ENV: &str = "KILNTAINERS_FLY_STATE_FILE";

/// The remembered-app file's name under the state dir (docs/decisions.md, "Fly app and organisation").
pub const STATE_FILE_NAME: &str = "fly.json";

/// The token environment variables, in discovery order (docs/decisions.md, "Fly authentication").
pub const TOKEN_ENV_NAMES: [&str; 3] = ["FLY_API_TOKEN", "FLY_TOKEN", "FLY_ACCESS_TOKEN"];

/// The sandbox app's own variable. It comes before `FLY_APP_NAME`, which Fly sets in every
/// Machine to the Machine's *own* app and so names the controller when the server runs on Fly.
pub const SANDBOX_APP_ENV: &str = "KILNTAINERS_FLY_APP";

/// Set by Fly in every Machine to the app the Machine belongs to (docs/decisions.md, "Environment variables" also reads it as
/// the sandbox app, the Python reference's fallback).
pub const OWN_APP_ENV: &str = "FLY_APP_NAME";

/// Set by Fly in every Machine; its presence is how we know the server itself runs on Fly.
pub const MACHINE_ID_ENV: &str = "FLY_MACHINE_ID";

/// Where a Fly API token may come from, in order. Empty values count as absent.
#[derive(Debug, Clone, Default)]
pub struct TokenSources {
    /// `--fly-token`.
    pub flag: Option<Secret>,
    /// `(variable name, value)` for each of [`TOKEN_ENV_NAMES`] that is set, in order.
    pub env: Vec<(&'static str, Secret)>,
    /// `~/.fly/config.yml`, read lazily for its top-level `access_token`.
    pub config_file: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct FlyConfig {
    /// `--fly-app` / `KILNTAINERS_FLY_APP` / `FLY_APP_NAME`; `None` = remembered or created.
    pub app: Option<String>,
    /// The app this server itself runs in, when it runs on Fly (`FLY_MACHINE_ID` and
    /// `FLY_APP_NAME` set). Sandbox Machines must never live there: Fly gives every Machine of
    /// an app that app's secrets, the controller's API token among them.
    pub controller_app: Option<String>,
    /// `--fly-org` / `FLY_ORG`; `None` = `personal`, else the first organization.
    pub org: Option<String>,
    pub tokens: TokenSources,
    /// `--fly-image` as given (metadata keeps it verbatim; the API gets a normalised form).
    pub image: String,
    pub region: Option<String>,
    pub cpu_kind: &'static str,
    pub cpus: u32,
    pub memory_mb: u32,
    pub rootfs_size_gb: Option<u32>,
    /// Machines API base without a trailing slash; paths are appended under `/v1`.
    pub api_url: String,
    /// GraphQL API base without a trailing slash (organization lookup only).
    pub graphql_url: String,
    /// Where the auto-created app is remembered; `None` when there is no HOME and no override.
    pub state_file: Option<PathBuf>,
    /// `--fly-cli` was given a non-default value: print one notice that flyctl is unused.
    pub cli_notice: bool,
}

/// Why the controller's own app cannot hold sandbox Machines, and what to do instead.
pub fn own_app_refusal(app: &str) -> String {
    format!(
        "The Fly App for sandbox Machines ('{app}') is the app this server runs in. Fly gives every Machine of an app that app's secrets as environment variables, so each sandbox could read this server's tokens. Create a separate app without secrets for the sandboxes and name it with --fly-app or {SANDBOX_APP_ENV}."
    )
}
