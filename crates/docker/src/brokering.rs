//! Secrets brokering on Docker and Podman (docs/secrets.md): what the server tells the egress
//! proxy (the CA, extra upstream roots, each computer's secrets as control lines), what a
//! computer gets (its placeholders and the CA's environment in every command, the CA in its
//! trust stores), and nothing else. A value leaves this process only inside a `secret` control
//! line on the proxy's stdin, which the engine does not record: it never enters a container's
//! configuration, environment, command line or file.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Mutex;

use base64::Engine as _;
use kilntainers_backend::brokering::SecretBook;
use kilntainers_backend::egress::{EgressMode, EgressPolicy};
use kilntainers_backend::ids::ComputerId;

/// Where the CA lands in a computer: its certificate, and a bundle of the system's roots with
/// it appended, for the variables that replace rather than extend a trust store.
pub(crate) const CA_FILE: &str = "/etc/kilntainers/broker-ca.pem";
pub(crate) const BUNDLE_FILE: &str = "/etc/kilntainers/ca-bundle.pem";

/// Run as root with the CA's PEM as `$1` at each start of a computer (idempotent): writes
/// [`CA_FILE`], builds [`BUNDLE_FILE`] from the first system bundle found (without an earlier
/// copy of ours), appends the CA between markers to that system bundle when it is writable,
/// and drops it where `update-ca-certificates` looks, so a later run of that keeps it. Plain
/// POSIX sh and `sed`, present in Debian, Alpine and busybox images.
pub(crate) const INSTALL_CA: &str = r#"set -e
umask 022
mkdir -p /etc/kilntainers
printf '%s' "$1" > /etc/kilntainers/broker-ca.pem
begin='# kilntainers secrets broker CA: begin'
end='# kilntainers secrets broker CA: end'
system=
for f in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt /etc/ssl/cert.pem; do
  if [ -f "$f" ]; then system=$f; break; fi
done
{
  if [ -n "$system" ]; then sed "/^$begin\$/,/^$end\$/d" "$system"; fi
  printf '%s\n%s%s\n' "$begin" "$1" "$end"
} > /etc/kilntainers/ca-bundle.pem.new
mv /etc/kilntainers/ca-bundle.pem.new /etc/kilntainers/ca-bundle.pem
if [ -n "$system" ] && [ -w "$system" ]; then
  cp /etc/kilntainers/ca-bundle.pem "$system.kilntainers-new" && mv "$system.kilntainers-new" "$system" || true
fi
if [ -d /usr/local/share/ca-certificates ]; then
  cp /etc/kilntainers/broker-ca.pem /usr/local/share/ca-certificates/kilntainers-broker.crt || true
fi
"#;

/// The environment every command of a computer with the CA installed gets: the bundle for
/// the variables that replace the trust store, the CA alone for Node's, which extends it.
pub(crate) fn ca_env() -> Vec<String> {
    let mut env: Vec<String> = [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
    ]
    .iter()
    .map(|key| format!("{key}={BUNDLE_FILE}"))
    .collect();
    env.push(format!("NODE_EXTRA_CA_CERTS={CA_FILE}"));
    env
}

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text.as_bytes())
}

/// The lines a new proxy gets before any computer's: the CA, and the extra upstream roots.
pub(crate) fn proxy_setup_lines(book: &SecretBook, upstream_ca_pem: Option<&str>) -> String {
    let mut lines = String::new();
    if let Some(ca) = book.ca() {
        lines.push_str(&format!(
            "ca {} {}\n",
            b64(&ca.cert_pem),
            b64(ca.key_pem.expose())
        ));
    }
    if let Some(roots) = upstream_ca_pem.filter(|_| book.enabled()) {
        lines.push_str(&format!("roots {}\n", b64(roots)));
    }
    lines
}

/// The `secret` lines of the computer `id` at policy key `address`. Holds values: written to
/// the proxy's stdin and nowhere else.
pub(crate) fn secret_lines(book: &SecretBook, address: IpAddr, id: &ComputerId) -> String {
    book.for_computer(id)
        .iter()
        .map(|secret| {
            format!(
                "secret {address} {} {} {} {} {}\n",
                secret.name,
                book.placeholder(id, &secret.name),
                secret.hosts_text(),
                b64(secret.header.as_str()),
                b64(secret.value.expose()),
            )
        })
        .collect()
}

/// The policy the proxy gets for a computer with secrets: an allow-list also allows the
/// hosts its secrets are bound to (binding a secret to a host is the operator saying it may
/// be reached); deny rules still win. In open mode without rules (brokering alone put the
/// computer behind the proxy) private addresses stay reachable, as they are without a proxy.
pub(crate) fn with_bound_hosts(
    book: &SecretBook,
    id: &ComputerId,
    mut policy: EgressPolicy,
) -> EgressPolicy {
    if !book.enabled() {
        return policy;
    }
    if policy.mode == EgressMode::Allowlist {
        for secret in book.for_computer(id) {
            for host in secret.hosts {
                if !policy.allow.contains(&host) {
                    policy.allow.push(host);
                }
            }
        }
    }
    if policy.is_unfiltered() {
        policy.allow_private = true;
    }
    policy
}

/// The containers (12-digit ids) this process installed the CA in, whose commands get
/// [`ca_env`]; a container the install failed in gets no variables pointing at missing files.
#[derive(Default)]
pub(crate) struct Installed(Mutex<HashSet<String>>);

impl Installed {
    pub(crate) fn mark(&self, container: &str, installed: bool) {
        let key: String = container.chars().take(12).collect();
        let mut set = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if installed {
            set.insert(key);
        } else {
            set.remove(&key);
        }
    }

    pub(crate) fn has(&self, container: &str) -> bool {
        let key: String = container.chars().take(12).collect();
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kilntainers_backend::brokering::{BrokerCa, BrokeredSecret, HeaderTemplate, SecretName};
    use kilntainers_backend::egress::Pattern;
    use kilntainers_backend::secret::Secret;

    fn book() -> SecretBook {
        SecretBook::new(
            [3; 32],
            Some(BrokerCa {
                cert_pem: "CERT".to_owned(),
                key_pem: Secret::new("KEY"),
            }),
            vec![BrokeredSecret {
                name: SecretName::parse("API_KEY").unwrap(),
                hosts: vec![
                    Pattern::parse("api.test").unwrap(),
                    Pattern::parse("*.api.test").unwrap(),
                ],
                header: HeaderTemplate::parse("X-Api-Key: {}").unwrap(),
                value: Secret::new("sk-value-1"),
            }],
            Default::default(),
            None,
        )
    }

    #[test]
    fn a_secret_line_carries_the_placeholder_hosts_header_and_value_encoded() {
        let book = book();
        let id = ComputerId::parse("box").unwrap();
        let line = secret_lines(&book, IpAddr::from([10, 0, 0, 2]), &id);
        let words: Vec<&str> = line.trim_end().split(' ').collect();
        assert_eq!(words[..3], ["secret", "10.0.0.2", "API_KEY"]);
        assert_eq!(
            words[3],
            book.placeholder(&id, &SecretName::parse("API_KEY").unwrap())
        );
        assert_eq!(words[4], "api.test,*.api.test");
        assert_eq!(words[5], b64("X-Api-Key: {}"));
        assert_eq!(words[6], b64("sk-value-1"));
        assert!(!line.contains("sk-value-1"));
        assert_eq!(
            proxy_setup_lines(&book, Some("ROOTS")),
            format!(
                "ca {} {}\nroots {}\n",
                b64("CERT"),
                b64("KEY"),
                b64("ROOTS")
            )
        );
    }

    #[test]
    fn an_allow_list_allows_the_bound_hosts_and_open_mode_keeps_private_addresses() {
        let book = book();
        let id = ComputerId::parse("box").unwrap();
        let policy = |mode| EgressPolicy {
            mode,
            allow: Vec::new(),
            deny: Vec::new(),
            ask: false,
            allow_private: false,
        };
        let mut allowlist = policy(EgressMode::Allowlist);
        allowlist.allow = vec![Pattern::parse("pypi.org").unwrap()];
        let widened = with_bound_hosts(&book, &id, allowlist);
        let shown: Vec<String> = widened.allow.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["pypi.org", "api.test", "*.api.test"]);
        assert!(!widened.allow_private);
        let open = with_bound_hosts(&book, &id, policy(EgressMode::Open));
        assert!(open.allow_private);
        assert!(
            !with_bound_hosts(&SecretBook::default(), &id, policy(EgressMode::Open)).allow_private
        );
    }

    #[test]
    fn the_ca_environment_points_at_the_installed_files() {
        let env = ca_env();
        assert!(env.contains(&format!("SSL_CERT_FILE={BUNDLE_FILE}")));
        assert!(env.contains(&format!("NODE_EXTRA_CA_CERTS={CA_FILE}")));
        assert_eq!(env.len(), 5);
    }
}
