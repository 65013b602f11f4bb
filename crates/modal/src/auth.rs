//! Modal credentials and endpoint, resolved the way Modal's own clients do (docs/decisions.md, "Modal sandboxes"):
//! `--modal-token-id/--modal-token-secret`, then `MODAL_TOKEN_ID/MODAL_TOKEN_SECRET`, then the
//! profile of the Modal config file that `modal setup` / `modal token set` write
//! (`MODAL_CONFIG_PATH` or `~/.modal.toml`; the profile named by `MODAL_PROFILE`, else the one
//! with `active = true`). The server URL is `MODAL_SERVER_URL`, then the profile's
//! `server_url`, then `https://api.modal.com:443`; the environment and image builder version
//! follow the same env-then-profile order.

use std::path::Path;

use serde::Deserialize;

use crate::config::ModalConfig;
use crate::config::{DEFAULT_IMAGE_BUILDER_VERSION, DEFAULT_SERVER_URL};
use kilntainers_backend::secret::Secret;

/// What a connection needs. `Debug` never shows the secret (it is a [`Secret`]).
#[derive(Debug, Clone)]
pub struct Credentials {
    pub token_id: Secret,
    pub token_secret: Secret,
    pub server_url: String,
    /// Empty = the workspace's default environment.
    pub environment: String,
    pub image_builder_version: String,
}

/// The message for absent credentials: says how to get them (issue requirement; Modal's CLI
/// writes the file with `modal setup`).
pub const MISSING_CREDENTIALS: &str = "Modal credentials not found. Either:\n  - Run 'modal setup' (or 'modal token set') to write ~/.modal.toml\n  - Set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET environment variables\n  - Pass --modal-token-id and --modal-token-secret";

#[derive(Debug, Default, Deserialize)]
struct Profile {
    token_id: Option<String>,
    token_secret: Option<String>,
    server_url: Option<String>,
    environment: Option<String>,
    image_builder_version: Option<String>,
    #[serde(default)]
    active: bool,
}

/// Reads the chosen profile of the config file; a missing file is an empty profile.
fn read_profile(path: &Path, wanted: Option<&str>) -> Result<Profile, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Profile::default()),
        Err(e) => {
            return Err(format!(
                "Cannot read the Modal config file {}: {e}",
                path.display()
            ));
        }
    };
    let mut profiles: std::collections::BTreeMap<String, Profile> = toml::from_str(&text)
        .map_err(|e| format!("Cannot parse the Modal config file {}: {e}", path.display()))?;
    let name = match wanted {
        Some(name) => Some(name.to_owned()),
        None => profiles
            .iter()
            .find(|(_, p)| p.active)
            .map(|(name, _)| name.clone()),
    };
    Ok(name.and_then(|n| profiles.remove(&n)).unwrap_or_default())
}

/// Resolves everything; an error text is user-facing.
pub fn resolve(config: &ModalConfig) -> Result<Credentials, String> {
    let profile = match &config.config_file {
        Some(path) => read_profile(path, config.profile.as_deref())?,
        None => Profile::default(),
    };
    let non_empty = |v: Option<String>| v.filter(|s| !s.trim().is_empty());
    let pick = |flag: &Option<Secret>, env: &Option<Secret>, file: Option<String>| {
        flag.clone()
            .or_else(|| env.clone())
            .or_else(|| non_empty(file).map(Secret::new))
    };
    let token_id = pick(
        &config.tokens.flag_id,
        &config.tokens.env_id,
        profile.token_id,
    );
    let token_secret = pick(
        &config.tokens.flag_secret,
        &config.tokens.env_secret,
        profile.token_secret,
    );
    let (Some(token_id), Some(token_secret)) = (token_id, token_secret) else {
        return Err(MISSING_CREDENTIALS.to_owned());
    };
    Ok(Credentials {
        token_id,
        token_secret,
        server_url: config
            .server_url_env
            .clone()
            .or_else(|| non_empty(profile.server_url))
            .unwrap_or_else(|| DEFAULT_SERVER_URL.to_owned())
            .trim_end_matches('/')
            .to_owned(),
        environment: config
            .environment_env
            .clone()
            .or_else(|| non_empty(profile.environment))
            .unwrap_or_default(),
        image_builder_version: config
            .image_builder_version_env
            .clone()
            .or_else(|| non_empty(profile.image_builder_version))
            .unwrap_or_else(|| DEFAULT_IMAGE_BUILDER_VERSION.to_owned()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TokenSources;

    /// The section as the server's config builds it from `--modal-token-id`/`-secret` (in
    /// `flags`) and the environment variables this module reads.
    fn config(flags: &[&str], env: &[(&str, &str)], file: Option<&Path>) -> ModalConfig {
        let env = |name: &str| {
            env.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| Secret::new(*v))
        };
        let flag = |name: &str| {
            flags
                .iter()
                .position(|f| *f == name)
                .and_then(|i| flags.get(i + 1))
                .map(|v| Secret::new(*v))
        };
        ModalConfig {
            tokens: TokenSources {
                flag_id: flag("--modal-token-id"),
                flag_secret: flag("--modal-token-secret"),
                env_id: env("MODAL_TOKEN_ID"),
                env_secret: env("MODAL_TOKEN_SECRET"),
            },
            config_file: file.map(Path::to_path_buf),
            profile: env("MODAL_PROFILE").map(|v| v.expose().to_owned()),
            server_url_env: env("MODAL_SERVER_URL").map(|v| v.expose().to_owned()),
            environment_env: env("MODAL_ENVIRONMENT").map(|v| v.expose().to_owned()),
            image_builder_version_env: None,
            app_name: "kilntainers".to_owned(),
            image: kilntainers_backend::DEFAULT_IMAGE.to_owned(),
            custom_image: false,
            milli_cpu: 1000,
            memory_mib: 512,
            gpu: None,
            region: None,
            sandbox_timeout_secs: 3600,
            ports: Vec::new(),
            state_dir: None,
        }
    }

    fn write(text: &str) -> tempfile_path::TempFile {
        tempfile_path::TempFile::new(text)
    }

    /// A file removed on drop (no tempfile crate in the dependency set).
    mod tempfile_path {
        pub struct TempFile(pub std::path::PathBuf);
        impl TempFile {
            pub fn new(text: &str) -> Self {
                let path =
                    std::env::temp_dir().join(format!("modal-{}.toml", uuid::Uuid::new_v4()));
                std::fs::write(&path, text).unwrap();
                Self(path)
            }
        }
        impl Drop for TempFile {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    const FILE: &str = "[other]\ntoken_id = \"ak-other\"\ntoken_secret = \"as-other\"\n\n[main]\ntoken_id = \"ak-file\"\ntoken_secret = \"as-file\"\nserver_url = \"http://127.0.0.1:7\"\nenvironment = \"dev\"\nactive = true\n";

    #[test]
    fn flags_beat_env_beat_the_active_profile() {
        let file = write(FILE);
        let c = resolve(&config(&[], &[], Some(&file.0))).unwrap();
        assert_eq!(c.token_id.expose(), "ak-file");
        assert_eq!(c.server_url, "http://127.0.0.1:7");
        assert_eq!(c.environment, "dev");
        assert_eq!(c.image_builder_version, DEFAULT_IMAGE_BUILDER_VERSION);
        let c = resolve(&config(&[], &[("MODAL_TOKEN_ID", "ak-env")], Some(&file.0))).unwrap();
        assert_eq!(c.token_id.expose(), "ak-env");
        assert_eq!(c.token_secret.expose(), "as-file");
        let c = resolve(&config(
            &[
                "--modal-token-id",
                "ak-flag",
                "--modal-token-secret",
                "as-flag",
            ],
            &[
                ("MODAL_TOKEN_ID", "ak-env"),
                ("MODAL_SERVER_URL", "http://h:1/"),
            ],
            Some(&file.0),
        ))
        .unwrap();
        assert_eq!(
            (c.token_id.expose(), c.token_secret.expose()),
            ("ak-flag", "as-flag")
        );
        assert_eq!(c.server_url, "http://h:1");
    }

    #[test]
    fn modal_profile_picks_a_profile() {
        let file = write(FILE);
        let c = resolve(&config(&[], &[("MODAL_PROFILE", "other")], Some(&file.0))).unwrap();
        assert_eq!(c.token_id.expose(), "ak-other");
        assert_eq!(c.server_url, DEFAULT_SERVER_URL);
    }

    #[test]
    fn missing_credentials_say_how_to_get_them() {
        let missing = std::env::temp_dir().join("no-such-modal.toml");
        let error = resolve(&config(&[], &[], Some(&missing))).unwrap_err();
        assert!(error.contains("modal setup"), "{error}");
        assert!(error.contains("MODAL_TOKEN_ID"), "{error}");
        let broken = write("not [toml");
        assert!(
            resolve(&config(&[], &[], Some(&broken.0)))
                .unwrap_err()
                .starts_with("Cannot parse the Modal config file")
        );
    }
}
