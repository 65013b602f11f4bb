//! The `--fly-*` settings as one typed section (`cli.md` §3 "fly backend options", §5). The
//! environment is read here, once, so the Fly backend itself is pure data plus I/O and tests
//! can hand it any token sources, state file and API base URL they like.
//!
//! Token *discovery* order lives here (flag, then the three env names, then the flyctl config
//! file); reading that file and normalising the token is the backend's job, at first use, so a
//! missing token never stops the server from starting.

use std::fmt;
use std::path::PathBuf;

use crate::cli::{Cli, FlyCpuKind};

/// `KILNTAINERS_FLY_STATE_FILE`: where the auto-created app's name is remembered (the Python
/// reference's variable name).
pub const STATE_FILE_ENV: &str = "KILNTAINERS_FLY_STATE_FILE";

/// The remembered-app file's name under the state dir (`backends.md` §3.2).
pub const STATE_FILE_NAME: &str = "fly.json";

/// The token environment variables, in discovery order (`backends.md` §3.1).
pub const TOKEN_ENV_NAMES: [&str; 3] = ["FLY_API_TOKEN", "FLY_TOKEN", "FLY_ACCESS_TOKEN"];

/// A credential. `Debug` never shows it, so a logged config cannot leak it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

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
    /// `--fly-app` / `FLY_APP_NAME`; `None` = remembered or created.
    pub app: Option<String>,
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
    /// checked by `Config::from_cli` (`cli.md` §4 row 17) before this matters.
    pub fn from_cli(cli: &Cli, env: impl Fn(&str) -> Option<String>) -> Self {
        let non_empty = |v: Option<String>| v.filter(|s| !s.trim().is_empty());
        let home = non_empty(env("HOME")).map(PathBuf::from);
        let tokens = TokenSources {
            flag: non_empty(cli.fly_token.clone()).map(Secret::new),
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
        Self {
            app: non_empty(cli.fly_app.clone()),
            org: non_empty(cli.fly_org.clone()),
            tokens,
            image: cli.fly_image.clone(),
            region: non_empty(cli.fly_region.clone()),
            cpu_kind: match cli.fly_cpu_kind {
                FlyCpuKind::Shared => "shared",
                FlyCpuKind::Performance => "performance",
            },
            cpus: positive(cli.fly_cpus).unwrap_or(1),
            memory_mb: positive(cli.fly_memory).unwrap_or(512),
            rootfs_size_gb: cli.fly_rootfs_size.and_then(positive),
            api_url: cli.fly_api_url.trim_end_matches('/').to_owned(),
            graphql_url: cli.fly_graphql_url.trim_end_matches('/').to_owned(),
            state_file,
            cli_notice: cli.fly_cli != "fly",
        }
    }
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
        let config = FlyConfig::from_cli(&cli(&["--fly-token", "a"]), env);
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
        let config = |args: &[&str]| super::super::Config::from_cli(&cli(args), None);
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
        let config = FlyConfig::from_cli(&cli(&["--fly-api-url", "http://127.0.0.1:1/"]), env);
        assert_eq!(config.state_file, Some(PathBuf::from("/tmp/f.json")));
        assert_eq!(config.api_url, "http://127.0.0.1:1");
        assert_eq!(config.graphql_url, "https://api.fly.io");
        assert_eq!((config.cpus, config.memory_mb), (1, 512));
        assert_eq!(config.cpu_kind, "shared");
        assert!(!config.cli_notice);
        assert!(config.tokens.config_file.is_none());
    }
}
