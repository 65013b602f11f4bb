//! The `--modal-*` settings (plus `--gpu`, `--region`, `--sandbox-timeout`, `--image`) as one
//! typed section (docs/decisions.md, "Backend options"). The environment is read here, once;
//! the Modal config file (`~/.modal.toml`, written by `modal setup` / `modal token set`) is only
//! *located* here and read by the backend at first use, so a broken file never stops the server
//! from starting (docs/decisions.md, "Startup validation": credentials are checked lazily).

use std::path::PathBuf;

pub use kilntainers_modal::config::*;

use super::ConfigError;
use super::DEFAULT_IMAGE;
use super::secret::SecretSource;
use crate::cli::Cli;
use crate::secret::Secret;

/// `--modal-ports` as written: comma-separated ports between 1 and 65535; empty is none.
pub fn parse_ports(raw: &str) -> Result<Vec<u16>, ConfigError> {
    let mut ports = Vec::new();
    for item in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match item.parse::<u16>() {
            Ok(port) if port > 0 => ports.push(port),
            _ => {
                return Err(ConfigError(format!(
                    "--modal-ports must be comma-separated ports between 1 and 65535, got: {raw}"
                )));
            }
        }
    }
    ports.sort_unstable();
    ports.dedup();
    Ok(ports)
}

/// Builds the section from parsed flags and an environment lookup. Value ranges are checked
/// by `Config::from_cli` (docs/decisions.md, "Startup validation" row 18) before this matters; the secret file
/// (`--modal-token-secret-file` / `MODAL_TOKEN_SECRET_FILE`) stands where the flag would.
pub fn from_cli(
    cli: &Cli,
    env: impl Fn(&str) -> Option<String>,
) -> Result<ModalConfig, ConfigError> {
    let flag_secret = SecretSource {
        flag: "--modal-token-secret",
        file_flag: "--modal-token-secret-file",
        value: cli.modal.modal_token_secret.as_ref(),
        file: cli.modal.modal_token_secret_file.as_deref(),
    }
    .resolve()?;
    let non_empty = |v: Option<String>| v.filter(|s| !s.trim().is_empty());
    let home = non_empty(env("HOME")).map(PathBuf::from);
    let config_file = non_empty(env("MODAL_CONFIG_PATH"))
        .map(PathBuf::from)
        .or_else(|| home.as_ref().map(|h| h.join(".modal.toml")));
    let image = non_empty(cli.docker.image.clone());
    Ok(ModalConfig {
        state_dir: home.map(|h| h.join(crate::state::STATE_DIR_NAME)),
        tokens: TokenSources {
            flag_id: non_empty(cli.modal.modal_token_id.clone()).map(Secret::new),
            flag_secret,
            env_id: non_empty(env("MODAL_TOKEN_ID")).map(Secret::new),
            env_secret: non_empty(env("MODAL_TOKEN_SECRET")).map(Secret::new),
        },
        config_file,
        profile: non_empty(env("MODAL_PROFILE")),
        server_url_env: non_empty(env("MODAL_SERVER_URL")),
        environment_env: non_empty(env("MODAL_ENVIRONMENT")),
        image_builder_version_env: non_empty(env("MODAL_IMAGE_BUILDER_VERSION")),
        app_name: cli.modal.modal_app_name.clone(),
        custom_image: image.as_deref().is_some_and(|i| i != DEFAULT_IMAGE),
        image: image.unwrap_or_else(|| DEFAULT_IMAGE.to_owned()),
        milli_cpu: (cli.modal.modal_cpu * 1000.0)
            .round()
            .clamp(1.0, u32::MAX as f64) as u32,
        memory_mib: u32::try_from(cli.modal.modal_memory).unwrap_or(512).max(1),
        gpu: non_empty(cli.modal.gpu.clone()),
        region: non_empty(cli.modal.region.clone()),
        sandbox_timeout_secs: u32::try_from(cli.modal.sandbox_timeout).unwrap_or(3600),
        ports: parse_ports(cli.modal.modal_ports.as_deref().unwrap_or(""))?,
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_cli as cli;
    use super::*;

    #[test]
    fn modal_ports_are_read_sorted_and_checked() {
        assert_eq!(parse_ports("").unwrap(), Vec::<u16>::new());
        assert_eq!(parse_ports("8080, 3000,8080").unwrap(), vec![3000, 8080]);
        for bad in ["0", "65536", "80,x", "-1"] {
            assert_eq!(
                parse_ports(bad).unwrap_err().0,
                format!(
                    "--modal-ports must be comma-separated ports between 1 and 65535, got: {bad}"
                )
            );
        }
    }

    #[test]
    fn reads_flags_and_environment() {
        let env = |name: &str| match name {
            "HOME" => Some("/home/u".to_owned()),
            "MODAL_TOKEN_ID" => Some("ak-env".to_owned()),
            "MODAL_TOKEN_SECRET" => Some(" ".to_owned()),
            "MODAL_SERVER_URL" => Some("http://127.0.0.1:9".to_owned()),
            _ => None,
        };
        let config = from_cli(
            &cli(&["--modal-token-secret", "as-flag", "--modal-cpu", "0.25"]),
            env,
        )
        .unwrap();
        assert_eq!(config.tokens.flag_secret, Some(Secret::new("as-flag")));
        assert_eq!(config.tokens.env_id, Some(Secret::new("ak-env")));
        assert!(config.tokens.env_secret.is_none());
        assert_eq!(
            config.config_file,
            Some(PathBuf::from("/home/u/.modal.toml"))
        );
        assert_eq!(config.server_url_env.as_deref(), Some("http://127.0.0.1:9"));
        assert_eq!(config.milli_cpu, 250);
        assert_eq!(config.memory_mib, 512);
        assert_eq!(config.image, DEFAULT_IMAGE);
        assert!(!config.custom_image);
        assert_eq!(config.app_name, "kilntainers");
        assert!(!format!("{config:?}").contains("as-flag"));
    }

    #[test]
    fn config_path_override_and_image() {
        let env = |name: &str| (name == "MODAL_CONFIG_PATH").then(|| "/tmp/m.toml".to_owned());
        let config = from_cli(&cli(&["--image", "alpine:3"]), env).unwrap();
        assert_eq!(config.config_file, Some(PathBuf::from("/tmp/m.toml")));
        assert_eq!(config.image, "alpine:3");
        assert!(config.custom_image);
    }

    #[test]
    fn modal_backend_checks_its_values() {
        let config =
            |args: &[&str]| super::super::Config::from_cli(&cli(args), super::super::process_env);
        assert_eq!(
            config(&["--backend", "modal"]).is_ok(),
            cfg!(feature = "modal")
        );
        if cfg!(feature = "modal") {
            assert_eq!(
                config(&["--backend", "modal", "--sandbox-timeout", "86401"])
                    .unwrap_err()
                    .to_string(),
                "--sandbox-timeout must be between 1 and 86400 seconds."
            );
            assert!(config(&["--backend", "modal", "--sandbox-timeout", "86400"]).is_ok());
        }
    }
}
