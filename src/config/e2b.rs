//! The `--e2b-*` settings as one typed section (docs/decisions.md, "Backend options"). clap has
//! already applied the `E2B_API_KEY`, `E2B_DOMAIN` and `E2B_API_URL` fallbacks, so this reads no
//! environment itself; it splits the repeatable `key=value` flags and derives the two base URLs,
//! so the backend and its tests see plain data (a self-hosted E2B-compatible service is just
//! another pair of URLs).

use std::collections::BTreeMap;

pub use kilntainers_e2b::config::*;

use super::ConfigError;
use super::secret::SecretSource;
use crate::cli::Cli;
use crate::secret::Secret;

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

/// Builds the section from parsed flags. Value ranges and reserved metadata keys are
/// checked by `Config::from_cli` (docs/decisions.md, "Startup validation" row 19) before this matters; the key file
/// (`--e2b-api-key-file` / `E2B_API_KEY_FILE`) is read here and stands where the key would.
pub fn from_cli(cli: &Cli) -> Result<E2bConfig, ConfigError> {
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
    Ok(E2bConfig {
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
        state_dir: crate::state::state_dir(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_cli as cli;
    use super::*;

    #[test]
    fn every_port_has_a_host_name_of_its_own() {
        let config = from_cli(&cli(&[])).unwrap();
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
        let config = from_cli(&cli(&[])).unwrap();
        assert_eq!(config.template, "base");
        assert_eq!(config.sandbox_timeout_secs, 3600);
        assert_eq!(config.api_url, "https://api.e2b.app");
        assert_eq!(config.envd_base("isb1", None), "https://49983-isb1.e2b.app");
        assert_eq!(
            config.envd_base("isb1", Some("eu.example")),
            "https://49983-isb1.eu.example"
        );
        let own = from_cli(&cli(&["--e2b-domain", "sandbox.corp/"])).unwrap();
        assert_eq!(own.api_url, "https://api.sandbox.corp");
        assert_eq!(own.envd_base("x", Some("")), "https://49983-x.sandbox.corp");
    }

    #[test]
    fn explicit_urls_and_pairs() {
        let config = from_cli(&cli(&[
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
