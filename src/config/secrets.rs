//! The secrets flags (docs/secrets.md, "Options") checked into one [`SecretsConfig`]: each
//! `--secret NAME=SOURCE` read from its environment variable or file, joined with its
//! `--secret-hosts` and `--secret-header`, plus the entries of `--secrets-file`; then whether
//! the chosen backend and egress mode can broker them. Every refusal names the flag and the
//! secret, never the value, before any computer is touched.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kilntainers_backend::brokering::{
    BrokerCa, BrokeredSecret, HeaderTemplate, OnChange, SecretBook, SecretName, check_value,
};
use kilntainers_backend::egress::{EgressMode, EgressSettings, Pattern};

use super::{ConfigError, fail, switch_on};
use crate::cli::{BackendKind, Cli};
use crate::secret::Secret;

/// Largest secret file or secrets file read.
const MAX_FILE_BYTES: u64 = 256 * 1024;

/// What the secrets flags resolve to.
#[derive(Debug, Clone, Default)]
pub struct SecretsConfig {
    /// The server's own secrets, in the order given.
    pub server: Vec<BrokeredSecret>,
    /// `--secret-tools` / `ENABLE_SECRET_TOOLS`: the `secret_request` tool is listed.
    pub tools: bool,
    /// `--secrets-store`: where secrets users entered are kept, encrypted.
    pub store: Option<PathBuf>,
}

impl SecretsConfig {
    /// Whether brokering runs at all.
    pub fn enabled(&self) -> bool {
        !self.server.is_empty() || self.tools
    }
}

/// One secret as the flags or the file give it, before it is read.
#[derive(Default)]
struct Draft {
    source: Option<Source>,
    hosts: Option<String>,
    header: Option<String>,
    /// Where it was given, for messages: `--secret` or the file's path.
    origin: String,
}

enum Source {
    Env(String),
    File(PathBuf),
    /// Only from the secrets file, which is private to its owner.
    Literal(Secret),
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSecrets {
    #[serde(default)]
    secret: Vec<FileSecret>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSecret {
    name: String,
    source: Option<String>,
    value: Option<String>,
    hosts: Vec<String>,
    header: Option<String>,
}

/// Parses and checks the secrets flags.
pub fn from_cli(
    cli: &Cli,
    env: impl Fn(&str) -> Option<String>,
    egress: &EgressSettings,
) -> Result<SecretsConfig, ConfigError> {
    let mut drafts: BTreeMap<String, Draft> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    for entry in &cli.secret {
        let (name, source) = split_entry("--secret", entry, "NAME=env:VAR or NAME=file:PATH")?;
        let source = parse_source(&name, source)?;
        let draft = draft_of(&mut drafts, &mut order, &name, "--secret");
        if draft.source.is_some() {
            return fail(format!("--secret {name} is given twice."));
        }
        draft.source = Some(source);
    }
    for (flag, values, is_hosts) in [
        ("--secret-hosts", &cli.secret_hosts, true),
        ("--secret-header", &cli.secret_header, false),
    ] {
        for entry in values {
            let example = if is_hosts {
                "NAME=api.example.com[,*.example.com]"
            } else {
                "NAME=X-Api-Key: {}"
            };
            let (name, value) = split_entry(flag, entry, example)?;
            let Some(draft) = drafts.get_mut(&name) else {
                return fail(format!(
                    "{flag} names {name}, but no --secret {name}=… is given."
                ));
            };
            let slot = if is_hosts {
                &mut draft.hosts
            } else {
                &mut draft.header
            };
            if slot.replace(value.to_owned()).is_some() {
                return fail(format!("{flag} {name} is given twice."));
            }
        }
    }
    let file_path = cli.secrets_file.clone();
    if let Some(path) = &file_path {
        for entry in read_secrets_file(path)? {
            let shown = path.display().to_string();
            let name = SecretName::parse(entry.name.trim())
                .map_err(|e| ConfigError(format!("--secrets-file '{shown}': {e}.")))?
                .to_string();
            if drafts.contains_key(&name) {
                return fail(format!(
                    "secret {name} is given twice (by a flag and in --secrets-file '{shown}'), or twice in the file."
                ));
            }
            let source = match (entry.source, entry.value) {
                (Some(source), None) => parse_source(&name, &source)?,
                (None, Some(value)) => Source::Literal(Secret::new(value)),
                _ => {
                    return fail(format!(
                        "--secrets-file '{shown}': secret {name} needs exactly one of source = \"env:VAR\" / \"file:PATH\" or value = \"…\"."
                    ));
                }
            };
            let draft = draft_of(&mut drafts, &mut order, &name, &shown);
            draft.source = Some(source);
            draft.hosts = Some(entry.hosts.join(","));
            draft.header = entry.header;
        }
    }
    let mut server = Vec::with_capacity(order.len());
    for name in order {
        let Some(draft) = drafts.remove(&name) else {
            continue;
        };
        server.push(finish(&name, draft, &env)?);
    }
    let config = SecretsConfig {
        server,
        tools: cli.secret_tools || switch_on(env("ENABLE_SECRET_TOOLS").as_deref()),
        store: cli.secrets_store.clone(),
    };
    if config.store.is_some() && !config.tools {
        return fail(
            "--secrets-store keeps secrets users enter with the secret_request tool; add --secret-tools (or ENABLE_SECRET_TOOLS=true).",
        );
    }
    if config.enabled() {
        check_backend(cli, egress)?;
    }
    Ok(config)
}

fn draft_of<'a>(
    drafts: &'a mut BTreeMap<String, Draft>,
    order: &mut Vec<String>,
    name: &str,
    origin: &str,
) -> &'a mut Draft {
    if !drafts.contains_key(name) {
        order.push(name.to_owned());
    }
    drafts.entry(name.to_owned()).or_insert_with(|| Draft {
        origin: origin.to_owned(),
        ..Draft::default()
    })
}

/// `NAME=rest`, NAME checked.
fn split_entry<'a>(
    flag: &str,
    entry: &'a str,
    example: &str,
) -> Result<(String, &'a str), ConfigError> {
    let Some((name, rest)) = entry.split_once('=') else {
        return fail(format!("{flag} must be {example}; got no '='."));
    };
    let name = SecretName::parse(name.trim()).map_err(|e| ConfigError(format!("{flag}: {e}.")))?;
    Ok((name.to_string(), rest))
}

fn parse_source(name: &str, text: &str) -> Result<Source, ConfigError> {
    let text = text.trim();
    if let Some(var) = text.strip_prefix("env:") {
        if var.is_empty() {
            return fail(format!(
                "--secret {name}=env: names no environment variable."
            ));
        }
        return Ok(Source::Env(var.to_owned()));
    }
    if let Some(path) = text.strip_prefix("file:") {
        if path.is_empty() {
            return fail(format!("--secret {name}=file: names no file."));
        }
        return Ok(Source::File(PathBuf::from(path)));
    }
    // The text is not echoed: it may well be the value itself.
    fail(format!(
        "--secret {name} must come from env:VAR or file:PATH; a value on the command line is readable by every local user (/proc/<pid>/cmdline) and is refused."
    ))
}

fn finish(
    name: &str,
    draft: Draft,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<BrokeredSecret, ConfigError> {
    let origin = &draft.origin;
    let Some(hosts) = draft.hosts.filter(|h| !h.trim().is_empty()) else {
        return fail(format!(
            "secret {name} has no hosts: add --secret-hosts {name}=api.example.com (the hosts the proxy may send it to)."
        ));
    };
    let hosts = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| {
            Pattern::parse(h).map_err(|e| {
                ConfigError(format!("secret {name}: invalid host pattern '{h}': {e}."))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let header = match draft.header.as_deref() {
        None => HeaderTemplate::default(),
        Some(text) => {
            HeaderTemplate::parse(text).map_err(|e| ConfigError(format!("secret {name}: {e}.")))?
        }
    };
    let value = match draft.source {
        None => {
            return fail(format!(
                "{origin} gives settings for secret {name}, but not where its value comes from."
            ));
        }
        Some(Source::Env(var)) => match env(&var) {
            Some(value) => Secret::new(value),
            None => {
                return fail(format!(
                    "secret {name}: environment variable {var} is not set."
                ));
            }
        },
        Some(Source::File(path)) => read_value_file(name, &path)?,
        Some(Source::Literal(value)) => value,
    };
    check_value(value.expose()).map_err(|e| ConfigError(format!("secret {name}: {e}.")))?;
    let name = SecretName::parse(name).map_err(|e| ConfigError(format!("{e}.")))?;
    Ok(BrokeredSecret {
        name,
        hosts,
        header,
        value,
    })
}

/// A secret's file: bounded, one trailing newline trimmed.
fn read_value_file(name: &str, path: &Path) -> Result<Secret, ConfigError> {
    let shown = path.display();
    let bytes = read_bounded(path)
        .map_err(|e| ConfigError(format!("secret {name}: cannot read '{shown}': {e}.")))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| ConfigError(format!("secret {name}: '{shown}' is not UTF-8 text.")))?;
    let text = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(&text);
    Ok(Secret::new(text))
}

fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(std::io::Error::other(format!(
            "larger than {} KiB",
            MAX_FILE_BYTES / 1024
        )));
    }
    Ok(bytes)
}

/// The TOML secrets file: refused unless only its owner can read it.
fn read_secrets_file(path: &Path) -> Result<Vec<FileSecret>, ConfigError> {
    use std::os::unix::fs::PermissionsExt;
    let shown = path.display();
    let metadata = std::fs::metadata(path)
        .map_err(|e| ConfigError(format!("--secrets-file '{shown}': cannot read it: {e}.")))?;
    let mode = metadata.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return fail(format!(
            "--secrets-file '{shown}' is mode {mode:04o}; it holds secrets, so only its owner may read it: chmod 600 '{shown}'."
        ));
    }
    let bytes = read_bounded(path)
        .map_err(|e| ConfigError(format!("--secrets-file '{shown}': cannot read it: {e}.")))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| ConfigError(format!("--secrets-file '{shown}' is not UTF-8 text.")))?;
    // toml's messages quote the offending line, which may be a value: say where, not what.
    let parsed: FileSecrets = toml::from_str(&text).map_err(|e| {
        let at = e
            .span()
            .map(|span| {
                let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                format!(" at line {line}")
            })
            .unwrap_or_default();
        ConfigError(format!(
            "--secrets-file '{shown}' is not valid{at}: expected [[secret]] tables with name, source or value, hosts and an optional header."
        ))
    })?;
    Ok(parsed.secret)
}

/// Only Docker and Podman computers sit behind the proxy that brokers (docs/secrets.md,
/// "Backends"); and a computer without a network has nothing to send a secret over.
fn check_backend(cli: &Cli, egress: &EgressSettings) -> Result<(), ConfigError> {
    let backend = match cli.backend {
        BackendKind::Docker => None,
        BackendKind::Fly => Some("Fly Machines"),
        BackendKind::E2b => Some("E2B"),
        BackendKind::Modal => Some("Modal"),
        BackendKind::Wasm | BackendKind::GoBusybox => Some("WebAssembly"),
        BackendKind::Kubernetes => Some("Kubernetes"),
    };
    if let Some(backend) = backend {
        return fail(format!(
            "secrets brokering (--secret, --secrets-file, --secret-tools) needs the egress proxy, which the {backend} backend does not run; use --backend docker (Docker or Podman)."
        ));
    }
    if egress.policy.mode == EgressMode::None {
        return fail(
            "secrets are sent over the network, but --egress none / --no-network gives computers none; drop one or the other.",
        );
    }
    if let Err(why) = kilntainers_docker::broker_available() {
        return fail(format!(
            "secrets brokering needs the TLS broker, and {why}."
        ));
    }
    Ok(())
}

/// The book every layer shares: empty when brokering is off; else the server's secrets with
/// the placeholder key and CA from the state dir (made on first use), or this process's own
/// without one.
pub fn book(config: &SecretsConfig, state_dir: Option<&Path>) -> Result<SecretBook, ConfigError> {
    if !config.enabled() {
        return Ok(SecretBook::default());
    }
    let material = match state_dir {
        Some(dir) => crate::state::broker_material(dir).map_err(|e| {
            ConfigError(format!(
                "secrets brokering keeps its CA in {}: {e}.",
                dir.join("secrets").display()
            ))
        })?,
        None => {
            eprintln!(
                "kilntainers: warning: no state directory (HOME is not set): the secrets broker's CA and placeholders last for this process only."
            );
            crate::state::ephemeral_broker_material()
                .map_err(|e| ConfigError(format!("cannot make the secrets broker's CA: {e}.")))?
        }
    };
    let ca = BrokerCa {
        cert_pem: material.ca_cert_pem,
        key_pem: material.ca_key_pem,
    };
    let (loaded, on_change) = match &config.store {
        None => (std::collections::HashMap::new(), None),
        Some(path) => {
            let (store, loaded) = crate::secrets_store::SecretsStore::open(path)
                .map_err(|e| ConfigError(format!("--secrets-store: {e}.")))?;
            (loaded, Some(persist_to(store)))
        }
    };
    Ok(SecretBook::new(
        material.placeholder_key,
        Some(ca),
        config.server.clone(),
        loaded,
        on_change,
    ))
}

/// The book's change hook that keeps `store` current. A failed write leaves the secret set in
/// memory (it works until the server stops) and says so; the line names the file, never a value.
fn persist_to(store: crate::secrets_store::SecretsStore) -> OnChange {
    Box::new(move |principal, secrets| {
        if let Err(error) = store.save(principal, secrets) {
            tracing::error!(
                target: "kilntainers::audit",
                %principal,
                %error,
                "the secrets store was not updated; the secret lasts until the server stops"
            );
        }
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use crate::cli::Cli;
    use crate::config::Config;

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kilntainers-secrets-config-{tag}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn config(args: &[&str], home: &std::path::Path) -> Result<Config, String> {
        let cli = Cli::from_test_args(args)?;
        let home = home.to_string_lossy().into_owned();
        let env = |name: &str| match name {
            "HOME" => Some(home.clone()),
            "KT_VALUE" => Some("sk-live-42".to_owned()),
            _ => None,
        };
        Config::from_cli(&cli, env).map_err(|e| e.0)
    }

    #[test]
    fn a_secret_from_the_environment_with_hosts_and_header_is_read() {
        let home = temp_dir("env");
        let c = config(
            &[
                "--secret",
                "API_KEY=env:KT_VALUE",
                "--secret-hosts",
                "API_KEY=api.example.com,*.example.org",
                "--secret-header",
                "API_KEY=X-Api-Key: {}",
            ],
            &home,
        )
        .unwrap();
        let [secret] = c.secrets.server.as_slice() else {
            panic!("one secret expected");
        };
        assert_eq!(secret.name.as_str(), "API_KEY");
        assert_eq!(secret.hosts_text(), "api.example.com,*.example.org");
        assert_eq!(secret.header.as_str(), "X-Api-Key: {}");
        assert_eq!(secret.value.expose(), "sk-live-42");
        assert!(c.secret_book.enabled());
        // The CA and the placeholder key are made once in the state dir, private.
        let ca = home.join(".mcp-sandbox-computer-vm-for-ai/secrets/broker-ca.pem");
        assert_eq!(
            std::fs::metadata(&ca).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let first = std::fs::read_to_string(&ca).unwrap();
        let again = config(
            &[
                "--secret",
                "API_KEY=env:KT_VALUE",
                "--secret-hosts",
                "API_KEY=api.example.com",
            ],
            &home,
        )
        .unwrap();
        assert_eq!(std::fs::read_to_string(&ca).unwrap(), first);
        let id = crate::ids::ComputerId::parse("box").unwrap();
        assert_eq!(c.secret_book.env_for(&id), again.secret_book.env_for(&id));
        assert!(!format!("{c:?}").contains("sk-live-42"));
        std::fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn every_bad_secret_is_a_startup_error_that_never_quotes_the_value() {
        let home = temp_dir("bad");
        let cases: [(&[&str], &str); 9] = [
            (
                &[
                    "--secret",
                    "API_KEY=sk-literal-99",
                    "--secret-hosts",
                    "API_KEY=a.test",
                ],
                "env:VAR or file:PATH",
            ),
            (
                &["--secret", "api-key=env:KT_VALUE"],
                "is not a secret name",
            ),
            (&["--secret", "API_KEY=env:KT_VALUE"], "has no hosts"),
            (
                &[
                    "--secret",
                    "API_KEY=env:UNSET_VAR",
                    "--secret-hosts",
                    "API_KEY=a.test",
                ],
                "UNSET_VAR is not set",
            ),
            (
                &[
                    "--secret",
                    "API_KEY=file:/nonexistent/key",
                    "--secret-hosts",
                    "API_KEY=a.test",
                ],
                "cannot read '/nonexistent/key'",
            ),
            (&["--secret-hosts", "API_KEY=a.test"], "no --secret API_KEY"),
            (
                &[
                    "--secret",
                    "API_KEY=env:KT_VALUE",
                    "--secret-hosts",
                    "API_KEY=a.test",
                    "--secret-header",
                    "API_KEY=X-Key: none",
                ],
                "exactly one '{}'",
            ),
            (
                &[
                    "--secret",
                    "API_KEY=env:KT_VALUE",
                    "--secret-hosts",
                    "API_KEY=a.test",
                    "--backend",
                    "e2b",
                ],
                "the E2B backend",
            ),
            (
                &[
                    "--secret",
                    "API_KEY=env:KT_VALUE",
                    "--secret-hosts",
                    "API_KEY=a.test",
                    "--egress",
                    "none",
                ],
                "--egress none",
            ),
        ];
        for (args, expected) in cases {
            let error = config(args, &home).unwrap_err();
            assert!(error.contains(expected), "{args:?}: {error}");
            assert!(
                !error.contains("sk-literal-99") && !error.contains("sk-live-42"),
                "{error}"
            );
        }
        std::fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn the_secrets_file_must_be_private_and_its_errors_name_the_line_only() {
        let home = temp_dir("file");
        let file = home.join("secrets.toml");
        std::fs::write(
            &file,
            "[[secret]]\nname = \"TOKEN\"\nvalue = \"sk-from-file-7\"\nhosts = [\"git.example.com\"]\nheader = \"Authorization: token {}\"\n",
        )
        .unwrap();
        let path = file.to_string_lossy().into_owned();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let error = config(&["--secrets-file", &path], &home).unwrap_err();
        assert!(error.contains("chmod 600"), "{error}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let c = config(&["--secrets-file", &path], &home).unwrap();
        assert_eq!(c.secrets.server[0].value.expose(), "sk-from-file-7");
        assert_eq!(
            c.secrets.server[0].header.as_str(),
            "Authorization: token {}"
        );
        std::fs::write(
            &file,
            "[[secret]]\nname = \"TOKEN\"\nvalue = \"sk-from-file-7\nhosts = 3\n",
        )
        .unwrap();
        let error = config(&["--secrets-file", &path], &home).unwrap_err();
        assert!(
            error.contains("line") && !error.contains("sk-from-file-7"),
            "{error}"
        );
        std::fs::remove_dir_all(&home).unwrap();
    }
}
