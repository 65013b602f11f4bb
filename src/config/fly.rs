//! The `--fly-*` settings as one typed section (docs/decisions.md, "Backend options"). The
//! environment is read here, once, so the Fly backend itself is pure data plus I/O and tests
//! can hand it any token sources, state file and API base URL they like.
//!
//! Token *discovery* order lives here (flag, then the three env names, then the flyctl config
//! file); reading that file and normalising the token is the backend's job, at first use, so a
//! missing token never stops the server from starting.

use std::path::PathBuf;

pub use kilntainers_fly::config::*;

use super::ConfigError;
use super::secret::SecretSource;
use crate::cli::{Cli, FlyCpuKind};
use crate::secret::Secret;

/// Builds the section from parsed flags and an environment lookup. Value ranges are
/// checked by `Config::from_cli` (docs/decisions.md, "Startup validation" row 17) before this matters; the token file
/// (`--fly-token-file`) is read here and stands where `--fly-token` would.
pub fn from_cli(cli: &Cli, env: impl Fn(&str) -> Option<String>) -> Result<FlyConfig, ConfigError> {
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
    Ok(FlyConfig {
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
pub fn check_sandbox_app(config: &FlyConfig) -> Result<(), ConfigError> {
    match (&config.app, &config.controller_app) {
        (Some(app), Some(own)) if app == own => Err(ConfigError(own_app_refusal(app))),
        _ => Ok(()),
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
        let config = from_cli(&cli(&["--fly-token", "a"]), env).unwrap();
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
        let config = from_cli(&cli(&["--fly-api-url", "http://127.0.0.1:1/"]), env).unwrap();
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
        let config = from_cli(&cli(&[]), env(true, None)).unwrap();
        assert_eq!(config.app.as_deref(), Some("controller"));
        assert_eq!(
            check_sandbox_app(&config).unwrap_err().0,
            own_app_refusal("controller")
        );
        // ...and so is naming it explicitly.
        let config = from_cli(&cli(&["--fly-app", "controller"]), env(true, None)).unwrap();
        assert!(check_sandbox_app(&config).is_err());
        // A separate app, by flag or by KILNTAINERS_FLY_APP, is fine.
        let config = from_cli(&cli(&["--fly-app", "boxes"]), env(true, None)).unwrap();
        assert_eq!(config.app.as_deref(), Some("boxes"));
        check_sandbox_app(&config).unwrap();
        let config = from_cli(&cli(&[]), env(true, Some("boxes2"))).unwrap();
        assert_eq!(config.app.as_deref(), Some("boxes2"));
        check_sandbox_app(&config).unwrap();
        // Off Fly, FLY_APP_NAME is the reference's plain fallback for the sandbox app.
        let config = from_cli(&cli(&[]), env(false, None)).unwrap();
        assert_eq!(config.app.as_deref(), Some("controller"));
        assert_eq!(config.controller_app, None);
        check_sandbox_app(&config).unwrap();
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
        let config = from_cli(&cli(&["--fly-token-file", path_text]), env).unwrap();
        assert_eq!(config.tokens.flag, Some(Secret::new("fm2_from_file")));
        assert!(
            from_cli(
                &cli(&["--fly-token", "x", "--fly-token-file", path_text]),
                env
            )
            .is_err()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
