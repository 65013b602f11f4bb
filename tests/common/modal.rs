//! The local fake of Modal's gRPC API (the `fake-modal` workspace crate), started in process on
//! a loopback port, and a Modal backend pointed at it. Shared by `suite::modal` and the contract
//! suite.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use fake_modal::{FakeConfig, FakeModal};

use mcp_sandbox_computer_vm_for_ai::backends::Backend;
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;
use mcp_sandbox_computer_vm_for_ai::providers;
use mcp_sandbox_computer_vm_for_ai::secret::Secret;

/// A Modal backend pointed at the fake with the given token pair and no config file (never
/// the developer's real `~/.modal.toml`).
pub fn backend_with(fake: &FakeModal, secret: Option<&str>, extra: &[&str]) -> Arc<dyn Backend> {
    let mut args = vec!["x", "--backend", "modal", "--shell", "/bin/sh"];
    if !extra.contains(&"--image") {
        args.extend(["--image", "sandbox-busybox:full"]);
    }
    args.extend_from_slice(extra);
    let cli = Cli::try_parse_from(args).unwrap();
    let mut config =
        Config::from_cli(&cli, mcp_sandbox_computer_vm_for_ai::config::process_env).unwrap();
    config.modal.tokens.flag_id = Some(Secret::new(fake.config().token_id.clone()));
    config.modal.tokens.flag_secret = secret.map(Secret::new);
    config.modal.tokens.env_id = None;
    config.modal.tokens.env_secret = None;
    config.modal.config_file = Some(PathBuf::from("/nonexistent/modal.toml"));
    config.modal.profile = None;
    config.modal.server_url_env = Some(fake.url());
    config.modal.environment_env = None;
    config.modal.image_builder_version_env = None;
    config.modal.state_dir = Some(state_dir(fake));
    providers::build(&config).unwrap()
}

/// The backends' state directory (checkpoint records) for one fake: shared by every backend
/// pointed at it, as two server processes of one user share theirs. Removed by
/// [`StateDir`].
pub fn state_dir(fake: &FakeModal) -> PathBuf {
    let port = fake.url().rsplit(':').next().unwrap_or_default().to_owned();
    std::env::temp_dir().join(format!("kt-modal-state-{}-{port}", std::process::id()))
}

/// Removes a fake's state directory when dropped.
pub struct StateDir(pub PathBuf);

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A Modal backend with the token pair the fake accepts.
pub fn modal(fake: &FakeModal, extra: &[&str]) -> Arc<dyn Backend> {
    let secret = fake.config().token_secret.clone();
    backend_with(fake, Some(&secret), extra)
}

/// The fake with a list page size of 1, so every listing has to follow the pages.
pub async fn fake() -> FakeModal {
    FakeModal::start(FakeConfig {
        page_size: 1,
        ..FakeConfig::default()
    })
    .await
    .unwrap()
}
