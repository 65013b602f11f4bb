//! The `--e2b-*` settings as one typed section (docs/decisions.md, "Backend options"). clap has
//! already applied the `E2B_API_KEY`, `E2B_DOMAIN` and `E2B_API_URL` fallbacks, so this reads no
//! environment itself; it splits the repeatable `key=value` flags and derives the two base URLs,
//! so the backend and its tests see plain data (a self-hosted E2B-compatible service is just
//! another pair of URLs).

use std::collections::BTreeMap;

use super::ConfigError;
use super::secret::SecretSource;
use crate::cli::Cli;
use crate::secret::Secret;

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
}

/// Splits `key=value` entries at the first `=`; entries without one are returned separately.
fn pairs(flag: &str, entries: &[String], skipped: &mut Vec<String>) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for entry in entries {
        match entry.split_once('=') {
            Some((key, value)) if !key.is_empty() => {
                map.insert(key.to_owned(), value.to_owned());
            }
            _ => skipped.push(format!("{flag} '{entry}'")),
        }
    }
    map
}

impl E2bConfig {
    /// Builds the section from parsed flags. Value ranges and reserved metadata keys are
    /// checked by `Config::from_cli` (docs/decisions.md, "Startup validation" row 19) before this matters; the key file
    /// (`--e2b-api-key-file` / `E2B_API_KEY_FILE`) is read here and stands where the key would.
    pub fn from_cli(cli: &Cli) -> Result<Self, ConfigError> {
        let api_key = SecretSource {
            flag: "--e2b-api-key",
            file_flag: "--e2b-api-key-file",
            value: cli.e2b.e2b_api_key.as_ref(),
            file: cli.e2b.e2b_api_key_file.as_deref(),
        }
        .resolve()?;
        let non_empty = |v: &Option<String>| v.clone().filter(|s| !s.trim().is_empty());
        let domain = non_empty(&cli.e2b.e2b_domain)
            .map(|d| d.trim().trim_end_matches('/').to_owned())
            .unwrap_or_else(|| DEFAULT_DOMAIN.to_owned());
        let api_url = non_empty(&cli.e2b.e2b_api_url)
            .map(|u| u.trim().trim_end_matches('/').to_owned())
            .unwrap_or_else(|| format!("https://api.{domain}"));
        let mut skipped = Vec::new();
        let metadata = pairs("--e2b-metadata", &cli.e2b.e2b_metadata, &mut skipped);
        let env = pairs("--e2b-env", &cli.e2b.e2b_env, &mut skipped);
        Ok(Self {
            api_key: api_key.map(|k| Secret::new(k.expose().trim())),
            template: cli.e2b.e2b_template.clone(),
            sandbox_timeout_secs: u64::try_from(cli.e2b.e2b_sandbox_timeout.max(1)).unwrap_or(1),
            metadata,
            env,
            skipped,
            domain,
            api_url,
            envd_url: non_empty(&cli.e2b.e2b_envd_url)
                .map(|u| u.trim().trim_end_matches('/').to_owned())
                .unwrap_or_else(|| DEFAULT_ENVD_URL.to_owned()),
        })
    }

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

#[cfg(test)]
mod tests {
    use super::super::test_cli as cli;
    use super::*;

    #[test]
    fn every_port_has_a_host_name_of_its_own() {
        let config = E2bConfig::from_cli(&cli(&[])).unwrap();
        assert_eq!(
            config.port_base("isb1", 8080, None),
            "https://8080-isb1.e2b.app"
        );
        assert_eq!(
            config.port_base("isb1", 3000, Some("eu.example")),
            "https://3000-isb1.eu.example"
        );
    }

    #[test]
    fn defaults_derive_both_urls_from_the_domain() {
        let config = E2bConfig::from_cli(&cli(&[])).unwrap();
        assert_eq!(config.template, "base");
        assert_eq!(config.sandbox_timeout_secs, 3600);
        assert_eq!(config.api_url, "https://api.e2b.app");
        assert_eq!(config.envd_base("isb1", None), "https://49983-isb1.e2b.app");
        assert_eq!(
            config.envd_base("isb1", Some("eu.example")),
            "https://49983-isb1.eu.example"
        );
        let own = E2bConfig::from_cli(&cli(&["--e2b-domain", "sandbox.corp/"])).unwrap();
        assert_eq!(own.api_url, "https://api.sandbox.corp");
        assert_eq!(own.envd_base("x", Some("")), "https://49983-x.sandbox.corp");
    }

    #[test]
    fn explicit_urls_and_pairs() {
        let config = E2bConfig::from_cli(&cli(&[
            "--e2b-api-url",
            "http://127.0.0.1:9/",
            "--e2b-envd-url",
            "http://127.0.0.1:10",
            "--e2b-metadata",
            "team=a=b",
            "--e2b-metadata",
            "novalue",
            "--e2b-env",
            "LANG=C",
            "--e2b-env",
            "=x",
            "--e2b-api-key",
            "secret",
        ]))
        .unwrap();
        assert_eq!(config.api_url, "http://127.0.0.1:9");
        assert_eq!(config.envd_base("abc", Some("d")), "http://127.0.0.1:10");
        assert_eq!(config.metadata["team"], "a=b");
        assert_eq!(config.env["LANG"], "C");
        assert_eq!(
            config.skipped,
            vec!["--e2b-metadata 'novalue'", "--e2b-env '=x'"]
        );
        assert!(!format!("{config:?}").contains("secret"));
    }

    #[test]
    fn e2b_backend_needs_its_feature_and_checks_its_values() {
        let config =
            |args: &[&str]| super::super::Config::from_cli(&cli(args), super::super::process_env);
        let result = config(&["--backend", "e2b"]);
        if cfg!(feature = "e2b") {
            assert!(result.is_ok());
            assert_eq!(
                config(&["--backend", "e2b", "--e2b-sandbox-timeout", "0"])
                    .unwrap_err()
                    .to_string(),
                "--e2b-sandbox-timeout must be at least 1 second."
            );
            assert_eq!(
                config(&["--backend", "e2b", "--e2b-metadata", "kilntainers-x=1"])
                    .unwrap_err()
                    .to_string(),
                "--e2b-metadata key 'kilntainers-x' is reserved."
            );
        } else {
            assert_eq!(
                result.unwrap_err().to_string(),
                "Backend 'e2b' requires additional dependencies. This build was compiled without the 'e2b' feature; install with: cargo install mcp-sandbox-computer-vm-for-ai --features e2b"
            );
        }
    }
}
