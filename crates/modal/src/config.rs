//! The Modal section of the configuration: what the `--modal-*` flags (plus `--gpu`,
//! `--region`, `--sandbox-timeout`, `--image`) and Modal's environment variables resolve to (the
//! server's `config` module reads them), as plain data this backend is built from. The Modal
//! config file is only located there; this backend reads it at first use.

use std::path::PathBuf;

use kilntainers_backend::secret::Secret;

/// Modal's default API endpoint, the one its own clients use when nothing overrides it.
pub const DEFAULT_SERVER_URL: &str = "https://api.modal.com:443";

/// The image builder version Modal's Go client sends when no profile or env var sets one.
pub const DEFAULT_IMAGE_BUILDER_VERSION: &str = "2024.10";

/// Credentials in Modal's own precedence: explicit options, then `MODAL_TOKEN_ID` /
/// `MODAL_TOKEN_SECRET`, then the config-file profile. Each half is resolved on its own, as
/// Modal's clients do (an env id with a file secret is possible, if odd).
#[derive(Debug, Clone, Default)]
pub struct TokenSources {
    pub flag_id: Option<Secret>,
    pub flag_secret: Option<Secret>,
    pub env_id: Option<Secret>,
    pub env_secret: Option<Secret>,
}

#[derive(Debug, Clone)]
pub struct ModalConfig {
    pub tokens: TokenSources,
    /// `MODAL_CONFIG_PATH`, else `~/.modal.toml`; `None` without HOME.
    pub config_file: Option<PathBuf>,
    /// `MODAL_PROFILE`: the profile to use; `None` = the one with `active = true`.
    pub profile: Option<String>,
    /// `MODAL_SERVER_URL` (beats the profile's `server_url`).
    pub server_url_env: Option<String>,
    /// `MODAL_ENVIRONMENT` (beats the profile's `environment`).
    pub environment_env: Option<String>,
    /// `MODAL_IMAGE_BUILDER_VERSION` (beats the profile's `image_builder_version`).
    pub image_builder_version_env: Option<String>,
    pub app_name: String,
    /// `--image` when given, else `debian:bookworm-slim` (docs/decisions.md, "Modal sandboxes").
    pub image: String,
    /// Whether `--image` was given and differs from the default (description choice).
    pub custom_image: bool,
    pub milli_cpu: u32,
    pub memory_mib: u32,
    pub gpu: Option<String>,
    pub region: Option<String>,
    pub sandbox_timeout_secs: u32,
    /// `--modal-ports`: opened as encrypted tunnels on every sandbox this server creates
    /// (docs/files.md, "Ports"), sorted, without repeats.
    pub ports: Vec<u16>,
    /// The server's state directory: where checkpoint records live (docs/checkpoints.md).
    pub state_dir: Option<PathBuf>,
}
