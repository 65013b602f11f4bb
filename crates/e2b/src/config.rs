//! The E2B section of the configuration: what the `--e2b-*` flags resolve to (the server's
//! `config` module reads them), as plain data this backend is built from, and the URLs derived
//! from it (a self-hosted E2B-compatible service is just another pair of URLs).

use std::collections::BTreeMap;
use std::path::PathBuf;

use kilntainers_backend::secret::Secret;

/// E2B's public domain: the control plane is `api.<domain>`, sandboxes `<port>-<id>.<domain>`.
pub const DEFAULT_DOMAIN: &str = "e2b.app";

/// The envd URL shape E2B's SDKs use; `{port}` is envd's port ([`ENVD_PORT`]).
pub const DEFAULT_ENVD_URL: &str = "https://{port}-{sandbox_id}.{domain}";

/// The port envd (E2B's in-sandbox daemon) listens on.
pub const ENVD_PORT: u16 = 49983;

#[derive(Debug, Clone)]
pub struct E2bConfig {
    /// `--e2b-api-key` / `E2B_API_KEY`; `None` = every call explains how to set it.
    pub api_key: Option<Secret>,
    pub template: String,
    /// `--e2b-sandbox-timeout`: the lifetime sent on create and on every extension.
    pub sandbox_timeout_secs: u64,
    /// User metadata (`--e2b-metadata`), written next to our own keys (docs/decisions.md, "Labels and metadata").
    pub metadata: BTreeMap<String, String>,
    /// Sandbox environment (`--e2b-env`), sent as `envVars` on create.
    pub env: BTreeMap<String, String>,
    /// Entries of either flag without `=`: skipped, and the backend prints one warning each.
    pub skipped: Vec<String>,
    /// `--e2b-domain` / `E2B_DOMAIN`.
    pub domain: String,
    /// Control-plane base without a trailing slash.
    pub api_url: String,
    /// envd URL template with `{port}`, `{sandbox_id}` and `{domain}` placeholders.
    pub envd_url: String,
    /// The server's state directory: where checkpoint records live (docs/checkpoints.md).
    pub state_dir: Option<PathBuf>,
}

impl E2bConfig {
    /// The envd base URL for one sandbox; `domain` is the one the API returned for it, if any.
    pub fn envd_base(&self, sandbox_id: &str, domain: Option<&str>) -> String {
        self.port_base(sandbox_id, ENVD_PORT, domain)
    }

    /// Whether the envd URL template tells ports apart (a fixed test URL does not).
    pub fn serves_ports(&self) -> bool {
        self.envd_url.contains("{port}")
    }

    /// The URL of any port of one sandbox: E2B serves every port on a host name of its own.
    pub fn port_base(&self, sandbox_id: &str, port: u16, domain: Option<&str>) -> String {
        let domain = domain
            .filter(|d| !d.trim().is_empty())
            .unwrap_or(&self.domain);
        self.envd_url
            .replace("{port}", &port.to_string())
            .replace("{sandbox_id}", sandbox_id)
            .replace("{domain}", domain)
    }
}
