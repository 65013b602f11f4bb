//! Secrets brokering's vocabulary (docs/secrets.md): a [`BrokeredSecret`] (a name, the hosts it
//! may be sent to, the header it is sent in, and its value), the per-computer placeholder that
//! stands in for it inside a computer, and the [`SecretBook`] every layer shares: the server's
//! own secrets (`--secret`, `--secrets-file`), those each principal entered at run time, the
//! key placeholders are derived with and the CA the proxy terminates TLS with.
//!
//! A value is a [`Secret`]: no `Debug` shows it, and the only way to it is
//! [`Secret::expose`], used where a control line to the proxy is written. Placeholders are not
//! secret: one is worthless anywhere but in a request the proxy sends to a bound host.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock};

use crate::egress::Pattern;
use crate::ids::{ComputerId, Principal};
use crate::secret::Secret;

/// Longest value accepted: a few KiB covers every API key and JWT we know of, and bounds
/// what one substitution adds to a request head.
pub const MAX_VALUE_BYTES: usize = 16 * 1024;
/// The header a secret is sent in when none is given.
pub const DEFAULT_HEADER: &str = "Authorization: Bearer {}";
/// What every placeholder starts with.
pub const PLACEHOLDER_PREFIX: &str = "kts_";
/// Secrets one principal may enter at run time; the server's own are not counted.
pub const MAX_PER_PRINCIPAL: usize = 64;

/// Why a name, header template or value was refused; the text is the user-facing reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BrokeringError(pub String);

fn refuse<T>(why: impl Into<String>) -> Result<T, BrokeringError> {
    Err(BrokeringError(why.into()))
}

/// An environment variable name: `[A-Z][A-Z0-9_]{0,63}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SecretName(String);

impl SecretName {
    pub fn parse(text: &str) -> Result<Self, BrokeringError> {
        let bytes = text.as_bytes();
        let ok = !bytes.is_empty()
            && bytes.len() <= 64
            && bytes[0].is_ascii_uppercase()
            && bytes
                .iter()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || *b == b'_');
        if ok {
            Ok(Self(text.to_owned()))
        } else {
            refuse(format!(
                "'{text}' is not a secret name: use 1 to 64 of A-Z, 0-9 and _, starting with a letter (it becomes an environment variable)"
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SecretName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How a secret is sent: `Header-Name: text with {} where the value goes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderTemplate(String);

impl HeaderTemplate {
    pub fn parse(text: &str) -> Result<Self, BrokeringError> {
        let text = text.trim();
        let Some((name, rest)) = text.split_once(':') else {
            return refuse(format!(
                "header template '{text}' has no ':'; write it as 'Header-Name: … {{}} …', such as 'X-Api-Key: {{}}'"
            ));
        };
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if name.is_empty() || !name.bytes().all(token) {
            return refuse(format!(
                "header template '{text}': '{name}' is not a header name"
            ));
        }
        if rest.matches("{}").count() != 1 {
            return refuse(format!(
                "header template '{text}' must hold exactly one '{{}}', where the value goes"
            ));
        }
        if rest.bytes().any(|b| b.is_ascii_control()) {
            return refuse(format!(
                "header template '{text}' holds a control character"
            ));
        }
        Ok(Self(format!("{name}: {}", rest.trim())))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for HeaderTemplate {
    fn default() -> Self {
        Self(DEFAULT_HEADER.to_owned())
    }
}

/// Checks a value as a header can carry it; the error never quotes the value.
pub fn check_value(value: &str) -> Result<(), BrokeringError> {
    if value.is_empty() {
        return refuse("the value is empty");
    }
    if value.len() > MAX_VALUE_BYTES {
        return refuse(format!("the value is longer than {MAX_VALUE_BYTES} bytes"));
    }
    if value.bytes().any(|b| b.is_ascii_control()) {
        return refuse(
            "the value holds a control character (a line break, tab or NUL), which no header can carry",
        );
    }
    Ok(())
}

/// One secret: what it is called inside computers, where the proxy may send it and how.
#[derive(Debug, Clone)]
pub struct BrokeredSecret {
    pub name: SecretName,
    /// Never empty.
    pub hosts: Vec<Pattern>,
    pub header: HeaderTemplate,
    pub value: Secret,
}

impl BrokeredSecret {
    /// The hosts as one comma-separated list of canonical patterns.
    pub fn hosts_text(&self) -> String {
        self.hosts
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// A secret's name and hosts, for listings: never the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretSummary {
    pub name: String,
    pub hosts: Vec<String>,
    /// `server` (a flag or the secrets file) or `user` (entered by the principal).
    pub origin: &'static str,
}

/// The per-server CA the proxy mints certificates for bound hosts with (PEM).
#[derive(Clone)]
pub struct BrokerCa {
    pub cert_pem: String,
    pub key_pem: Secret,
}

impl fmt::Debug for BrokerCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BrokerCa(<certificate and redacted key>)")
    }
}

/// Called with the principal and its secrets whenever they change (the `--secrets-store`).
pub type OnChange = Box<dyn Fn(&Principal, &[BrokeredSecret]) + Send + Sync>;

/// Every secret this server brokers, shared by the configuration, the MCP tools and the
/// backend. Cheap to clone.
#[derive(Clone, Default)]
pub struct SecretBook {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Placeholders are an HMAC of the computer and the name under this key.
    key: [u8; 32],
    ca: Option<BrokerCa>,
    server: Vec<BrokeredSecret>,
    by_principal: RwLock<HashMap<Principal, Vec<BrokeredSecret>>>,
    on_change: Option<OnChange>,
}

impl fmt::Debug for SecretBook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretBook")
            .field("server", &self.inner.server.len())
            .field("ca", &self.inner.ca.is_some())
            .finish_non_exhaustive()
    }
}

impl SecretBook {
    /// A book holding the server's secrets. `key` derives placeholders (keep it across restarts
    /// so a computer's placeholders stay the same); `ca` is needed for HTTPS.
    pub fn new(
        key: [u8; 32],
        ca: Option<BrokerCa>,
        server: Vec<BrokeredSecret>,
        loaded: HashMap<Principal, Vec<BrokeredSecret>>,
        on_change: Option<OnChange>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                key,
                ca,
                server,
                by_principal: RwLock::new(loaded),
                on_change,
            }),
        }
    }

    /// Whether brokering is on at all: secrets were configured, or principals may enter them
    /// (a CA exists).
    pub fn enabled(&self) -> bool {
        !self.inner.server.is_empty() || self.inner.ca.is_some()
    }

    pub fn ca(&self) -> Option<&BrokerCa> {
        self.inner.ca.as_ref()
    }

    /// The secrets the computer `id` has: the server's, then its principal's (a principal's
    /// secret of the same name replaces the server's for its computers).
    pub fn for_computer(&self, id: &ComputerId) -> Vec<BrokeredSecret> {
        let by_principal = self
            .inner
            .by_principal
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let own: Vec<&BrokeredSecret> = by_principal
            .iter()
            .filter(|(principal, _)| id.belongs_to(principal))
            .flat_map(|(_, secrets)| secrets.iter())
            .collect();
        let mut all: Vec<BrokeredSecret> = self
            .inner
            .server
            .iter()
            .filter(|s| !own.iter().any(|o| o.name == s.name))
            .cloned()
            .collect();
        all.extend(own.into_iter().cloned());
        all
    }

    /// `NAME=placeholder` for each of the computer's secrets.
    pub fn env_for(&self, id: &ComputerId) -> Vec<String> {
        self.for_computer(id)
            .iter()
            .map(|s| format!("{}={}", s.name, self.placeholder(id, &s.name)))
            .collect()
    }

    /// The placeholder of secret `name` in computer `id`: `kts_` and 32 hex digits of an
    /// HMAC-SHA256 of both under the book's key. Stable across restarts of the server (same
    /// key), different per computer and per secret, and telling nothing about the value.
    pub fn placeholder(&self, id: &ComputerId, name: &SecretName) -> String {
        use hmac::{KeyInit, Mac};
        let mut mac = match hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.inner.key) {
            Ok(mac) => mac,
            // HMAC takes keys of any length; this arm is never taken.
            Err(_) => return format!("{PLACEHOLDER_PREFIX}{}", "0".repeat(32)),
        };
        mac.update(id.as_str().as_bytes());
        mac.update(b"\0");
        mac.update(name.as_str().as_bytes());
        let digest = mac.finalize().into_bytes();
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("{PLACEHOLDER_PREFIX}{hex}")
    }

    /// Names and hosts of the secrets `principal`'s computers get.
    pub fn summaries(&self, principal: &Principal) -> Vec<SecretSummary> {
        let by_principal = self
            .inner
            .by_principal
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let own = by_principal.get(principal).cloned().unwrap_or_default();
        let summary = |s: &BrokeredSecret, origin| SecretSummary {
            name: s.name.to_string(),
            hosts: s.hosts.iter().map(ToString::to_string).collect(),
            origin,
        };
        let mut out: Vec<SecretSummary> = self
            .inner
            .server
            .iter()
            .filter(|s| !own.iter().any(|o| o.name == s.name))
            .map(|s| summary(s, "server"))
            .collect();
        out.extend(own.iter().map(|s| summary(s, "user")));
        out
    }

    /// Sets (or replaces) a secret of `principal`. The change hook runs under the book's lock,
    /// so two changes of one principal reach the store in the order they were made.
    pub fn set(&self, principal: &Principal, secret: BrokeredSecret) -> Result<(), BrokeringError> {
        let mut by_principal = self
            .inner
            .by_principal
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let own = by_principal.entry(principal.clone()).or_default();
        own.retain(|s| s.name != secret.name);
        if own.len() >= MAX_PER_PRINCIPAL {
            return refuse(format!("this user already has {MAX_PER_PRINCIPAL} secrets"));
        }
        own.push(secret);
        if let Some(on_change) = &self.inner.on_change {
            on_change(principal, own);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(name: &str, host: &str, value: &str) -> BrokeredSecret {
        BrokeredSecret {
            name: SecretName::parse(name).unwrap(),
            hosts: vec![Pattern::parse(host).unwrap()],
            header: HeaderTemplate::default(),
            value: Secret::new(value),
        }
    }

    #[test]
    fn names_follow_the_environment_variable_rule() {
        assert!(SecretName::parse("GITHUB_TOKEN").is_ok());
        assert!(SecretName::parse(&format!("A{}", "B".repeat(63))).is_ok());
        for bad in [
            "",
            "github",
            "1ABC",
            "A-B",
            "A B",
            &format!("A{}", "B".repeat(64)),
        ] {
            assert!(SecretName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn header_templates_need_a_name_and_one_slot() {
        assert_eq!(
            HeaderTemplate::parse("X-Api-Key:{}").unwrap().as_str(),
            "X-Api-Key: {}"
        );
        for bad in [
            "{}",
            "X-Api-Key: none",
            "X Api: {}",
            "A: {} {}",
            "A: {}\r\nB: x",
        ] {
            assert!(HeaderTemplate::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn values_a_header_cannot_carry_are_refused_without_quoting_them() {
        assert!(check_value("sk-live-123").is_ok());
        let error = check_value("line\nbreak-sk-9").unwrap_err();
        assert!(!error.0.contains("sk-9"));
        assert!(check_value("").is_err());
        assert!(check_value(&"x".repeat(MAX_VALUE_BYTES + 1)).is_err());
    }

    #[test]
    fn placeholders_differ_per_computer_and_name_and_stay_with_the_key() {
        let book = SecretBook::new(
            [7; 32],
            None,
            vec![secret("A", "a.test", "v")],
            HashMap::new(),
            None,
        );
        let one = ComputerId::parse("one").unwrap();
        let two = ComputerId::parse("two").unwrap();
        let a = SecretName::parse("A").unwrap();
        let b = SecretName::parse("B").unwrap();
        let p = book.placeholder(&one, &a);
        assert!(p.starts_with("kts_") && p.len() == 36);
        assert!(
            p[4..]
                .bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(p, book.placeholder(&two, &a));
        assert_ne!(p, book.placeholder(&one, &b));
        let again = SecretBook::new([7; 32], None, Vec::new(), HashMap::new(), None);
        assert_eq!(p, again.placeholder(&one, &a));
        let other = SecretBook::new([8; 32], None, Vec::new(), HashMap::new(), None);
        assert_ne!(p, other.placeholder(&one, &a));
    }

    #[test]
    fn a_principal_s_secrets_reach_its_computers_only() {
        let book = SecretBook::new(
            [1; 32],
            None,
            vec![secret("SHARED", "s.test", "v0")],
            HashMap::new(),
            None,
        );
        let alice = Principal::parse("alice").unwrap();
        let bob = Principal::parse("bob").unwrap();
        book.set(&alice, secret("MINE", "m.test", "v1")).unwrap();
        book.set(&alice, secret("SHARED", "own.test", "v2"))
            .unwrap();
        let of_alice = ComputerId::parse("box").unwrap().owned_by(&alice);
        let of_bob = ComputerId::parse("box").unwrap().owned_by(&bob);
        let names = |id: &ComputerId| {
            book.for_computer(id)
                .iter()
                .map(|s| (s.name.to_string(), s.hosts_text()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(&of_alice),
            [
                ("MINE".to_owned(), "m.test".to_owned()),
                ("SHARED".to_owned(), "own.test".to_owned())
            ]
        );
        assert_eq!(names(&of_bob), [("SHARED".to_owned(), "s.test".to_owned())]);
        assert_eq!(book.summaries(&bob).len(), 1);
        assert_eq!(book.env_for(&of_bob).len(), 1);
        assert!(!format!("{book:?}").contains("v0"));
    }
}
