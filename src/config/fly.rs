//! The `--fly-*` settings as one typed section (docs/decisions.md, "Backend options"). The
//! environment is read here, once, so the Fly backend itself is pure data plus I/O and tests
//! can hand it any token sources, state file and API base URL they like.
//!
//! Token *discovery* order lives here (flag, then the three env names, then the flyctl config
//! file); reading that file and normalising the token is the backend's job, at first use, so a
//! missing token never stops the server from starting.

use std::path::PathBuf;

use super::ConfigError;
use super::secret::SecretSource;
use crate::cli::{Cli, FlyCpuKind};
use crate::secret::Secret;

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

impl FlyConfig {
    /// Builds the section from parsed flags and an environment lookup. Value ranges are
    /// checked by `Config::from_cli` (docs/decisions.md, "Startup validation" row 17) before this matters; the token file
    /// (`--fly-token-file`) is read here and stands where `--fly-token` would.
    pub fn from_cli(cli: &Cli, env: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let non_empty = |v: Option<String>| v.filter(|s| !s.trim().is_empty());
        let home = non_empty(env("HOME")).map(PathBuf::from);
        let flag = SecretSource {
            flag: "--fly-token",
            file_flag: "--fly-token-file",
            value: cli.fly.fly_token.as_ref(),
            file: cli.fly.fly_token_file.as_deref(),
        }
        .resolve()?;
        let own_app = non_empty(env(OWN_APP_ENV)).map(|a| a.trim().to_owned());
        let on_fly = non_empty(env(MACHINE_ID_ENV)).is_some();
        let app = non_empty(cli.fly.fly_app.clone())
            .or_else(|| non_empty(env(SANDBOX_APP_ENV)))
            .map(|a| a.trim().to_owned())
            .or_else(|| own_app.clone());
        let tokens = TokenSources {
            flag,
            env: TOKEN_ENV_NAMES
                .iter()
                .filter_map(|name| non_empty(env(name)).map(|v| (*name, Secret::new(v))))
                .collect(),
            config_file: home.as_ref().map(|h| h.join(".fly").join("config.yml")),
        };
        let state_file = non_empty(env(STATE_FILE_ENV))
            .map(PathBuf::from)
            .or_else(|| {
                home.as_ref()
                    .map(|h| h.join(crate::state::STATE_DIR_NAME).join(STATE_FILE_NAME))
            });
        let positive = |v: i64| u32::try_from(v).ok().filter(|v| *v > 0);
        Ok(Self {
            app,
            controller_app: own_app.filter(|_| on_fly),
            org: non_empty(cli.fly.fly_org.clone()),
            tokens,
            image: cli.fly.fly_image.clone(),
            region: non_empty(cli.fly.fly_region.clone()),
            cpu_kind: match cli.fly.fly_cpu_kind {
                FlyCpuKind::Shared => "shared",
                FlyCpuKind::Performance => "performance",
            },
            cpus: positive(cli.fly.fly_cpus).unwrap_or(1),
            memory_mb: positive(cli.fly.fly_memory).unwrap_or(512),
            rootfs_size_gb: cli.fly.fly_rootfs_size.and_then(positive),
            api_url: cli.fly.fly_api_url.trim_end_matches('/').to_owned(),
            graphql_url: cli.fly.fly_graphql_url.trim_end_matches('/').to_owned(),
            state_file,
            cli_notice: cli.fly.fly_cli != "fly",
        })
    }

    /// Refuses a sandbox app that is the controller's own app (`FlyConfig::controller_app`).
    pub fn check_sandbox_app(&self) -> Result<(), ConfigError> {
        match (&self.app, &self.controller_app) {
            (Some(app), Some(own)) if app == own => Err(ConfigError(own_app_refusal(app))),
            _ => Ok(()),
        }
    }
}

/// Why the controller's own app cannot hold sandbox Machines, and what to do instead.
pub fn own_app_refusal(app: &str) -> String {
    format!(
        "The Fly App for sandbox Machines ('{app}') is the app this server runs in. Fly gives every Machine of an app that app's secrets as environment variables, so each sandbox could read this server's tokens. Create a separate app without secrets for the sandboxes and name it with --fly-app or {SANDBOX_APP_ENV}."
    )
}

#[cfg(test)]
mod tests {
    use super::super::test_cli as cli;
    use super::*;

    #[test]
    fn token_sources_keep_the_spec_order_and_skip_empty_values() {
        let env = |name: &str| match name {
            "FLY_TOKEN" => Some("b".to_owned()),
            "FLY_API_TOKEN" => Some(" ".to_owned()),
            "FLY_ACCESS_TOKEN" => Some("c".to_owned()),
            "HOME" => Some("/home/u".to_owned()),
            _ => None,
        };
        let config = FlyConfig::from_cli(&cli(&["--fly-token", "a"]), env).unwrap();
        assert_eq!(config.tokens.flag, Some(Secret::new("a")));
        let names: Vec<&str> = config.tokens.env.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["FLY_TOKEN", "FLY_ACCESS_TOKEN"]);
        assert_eq!(
            config.tokens.config_file,
            Some(PathBuf::from("/home/u/.fly/config.yml"))
        );
        assert_eq!(
            config.state_file,
            Some(PathBuf::from(
                "/home/u/.mcp-sandbox-computer-vm-for-ai/fly.json"
            ))
        );
        assert!(!format!("{config:?}").contains("\"a\""));
    }

    #[test]
    fn fly_backend_needs_its_feature_and_checks_its_values() {
        let config =
            |args: &[&str]| super::super::Config::from_cli(&cli(args), super::super::process_env);
        let result = config(&["--backend", "fly"]);
        if cfg!(feature = "fly") {
            assert!(result.is_ok());
            assert_eq!(
                config(&["--backend", "fly", "--fly-memory", "128"])
                    .unwrap_err()
                    .to_string(),
                "--fly-memory must be at least 256 MB."
            );
        } else {
            assert_eq!(
                result.unwrap_err().to_string(),
                "Backend 'fly' requires additional dependencies. This build was compiled without the 'fly' feature; install with: cargo install mcp-sandbox-computer-vm-for-ai --features fly"
            );
        }
    }

    #[test]
    fn state_file_override_and_defaults() {
        let env = |name: &str| (name == STATE_FILE_ENV).then(|| "/tmp/f.json".to_owned());
        let config =
            FlyConfig::from_cli(&cli(&["--fly-api-url", "http://127.0.0.1:1/"]), env).unwrap();
        assert_eq!(config.state_file, Some(PathBuf::from("/tmp/f.json")));
        assert_eq!(config.api_url, "http://127.0.0.1:1");
        assert_eq!(config.graphql_url, "https://api.fly.io");
        assert_eq!((config.cpus, config.memory_mb), (1, 512));
        assert_eq!(config.cpu_kind, "shared");
        assert!(!config.cli_notice);
        assert!(config.tokens.config_file.is_none());
    }

    // See: issue 15
    #[test]
    fn issue_15_the_controllers_own_app_is_refused_on_fly_only() {
        let env = |on_fly: bool, sandbox_env: Option<&'static str>| {
            move |name: &str| match name {
                OWN_APP_ENV => Some("controller".to_owned()),
                MACHINE_ID_ENV if on_fly => Some("148e21ea".to_owned()),
                SANDBOX_APP_ENV => sandbox_env.map(str::to_owned),
                _ => None,
            }
        };
        // On Fly, FLY_APP_NAME names the controller: as the only source it is refused...
        let config = FlyConfig::from_cli(&cli(&[]), env(true, None)).unwrap();
        assert_eq!(config.app.as_deref(), Some("controller"));
        assert_eq!(
            config.check_sandbox_app().unwrap_err().0,
            own_app_refusal("controller")
        );
        // ...and so is naming it explicitly.
        let config =
            FlyConfig::from_cli(&cli(&["--fly-app", "controller"]), env(true, None)).unwrap();
        assert!(config.check_sandbox_app().is_err());
        // A separate app, by flag or by KILNTAINERS_FLY_APP, is fine.
        let config = FlyConfig::from_cli(&cli(&["--fly-app", "boxes"]), env(true, None)).unwrap();
        assert_eq!(config.app.as_deref(), Some("boxes"));
        config.check_sandbox_app().unwrap();
        let config = FlyConfig::from_cli(&cli(&[]), env(true, Some("boxes2"))).unwrap();
        assert_eq!(config.app.as_deref(), Some("boxes2"));
        config.check_sandbox_app().unwrap();
        // Off Fly, FLY_APP_NAME is the reference's plain fallback for the sandbox app.
        let config = FlyConfig::from_cli(&cli(&[]), env(false, None)).unwrap();
        assert_eq!(config.app.as_deref(), Some("controller"));
        assert_eq!(config.controller_app, None);
        config.check_sandbox_app().unwrap();
    }

    // See: issue 15
    #[test]
    fn issue_15_the_token_file_stands_where_the_flag_would() {
        let dir = std::env::temp_dir().join(format!("fly-token-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "fm2_from_file\n").unwrap();
        let path_text = path.to_str().unwrap();
        let env = |name: &str| (name == "FLY_API_TOKEN").then(|| "from-env".to_owned());
        let config = FlyConfig::from_cli(&cli(&["--fly-token-file", path_text]), env).unwrap();
        assert_eq!(config.tokens.flag, Some(Secret::new("fm2_from_file")));
        assert!(
            FlyConfig::from_cli(
                &cli(&["--fly-token", "x", "--fly-token-file", path_text]),
                env
            )
            .is_err()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
