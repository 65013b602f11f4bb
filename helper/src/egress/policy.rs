//! The proxy's copy of the egress decision (docs/egress.md, "Policy model"), over patterns the
//! server has already normalised (`kilntainers_backend::egress`; this crate depends on
//! nothing, so it re-reads their canonical text strictly rather than sharing the type), and the
//! private-address rule applied after resolution (docs/egress.md, "Enforcement").

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Ports a rule without `:PORT` covers.
const DEFAULT_PORTS: [u16; 2] = [80, 443];

#[derive(Debug, Clone, PartialEq, Eq)]
enum RuleHost {
    Name(String),
    Subdomains(String),
    Network { bits: u128, prefix: u8, v6: bool },
}

/// One allow or deny rule, with the text it came from (shown in `denied by rule …`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    host: RuleHost,
    port: Option<u16>,
    text: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Open,
    Allowlist,
    None,
}

/// One computer's policy as the proxy keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub mode: Mode,
    pub allow: Vec<Rule>,
    pub deny: Vec<Rule>,
    pub ask: bool,
    pub allow_private: bool,
}

/// A destination: a normalised name or an address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Dest {
    Name(String),
    Ip(IpAddr),
}

impl std::fmt::Display for Dest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Name(n) => f.write_str(n),
            Self::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]"),
            Self::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// The outcome before resolution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allow,
    Ask,
    /// The reason, as the stderr line says it.
    Refuse(String),
}

fn v6_bits(ip: IpAddr) -> (u128, bool) {
    match ip {
        IpAddr::V4(v4) => (u128::from(u32::from(v4)), false),
        IpAddr::V6(v6) => (u128::from(v6), true),
    }
}

fn mask(bits: u128, prefix: u8, v6: bool) -> u128 {
    let width = if v6 { 128 } else { 32 };
    let shift = u32::from(width - prefix.min(width));
    if shift >= 128 {
        0
    } else {
        (bits >> shift) << shift
    }
}

/// A host name in the canonical form the server sends: lower-case letters, digits, hyphens
/// and dots, no empty label.
fn canonical_name(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 253
        && text.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

impl Rule {
    /// Reads one canonical pattern (`a.test`, `*.a.test`, `198.18.0.0/15`, `[2001:db8::1]:22`…).
    pub fn parse(text: &str) -> Option<Self> {
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (inner, after) = rest.split_once(']')?;
            let port = match after {
                "" => None,
                _ => Some(after.strip_prefix(':')?),
            };
            (inner, port)
        } else if text.matches(':').count() > 1 {
            (text, None)
        } else {
            match text.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (text, None),
            }
        };
        let port = match port {
            None => None,
            Some(p) => Some(p.parse::<u16>().ok().filter(|p| *p > 0)?),
        };
        let (addr, prefix) = match host.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (host, None),
        };
        let rule_host = if let Ok(ip) = addr.parse::<IpAddr>() {
            let (bits, v6) = v6_bits(ip);
            let width = if v6 { 128 } else { 32 };
            let prefix = match prefix {
                None => width,
                Some(p) => p.parse::<u8>().ok().filter(|p| *p <= width)?,
            };
            RuleHost::Network {
                bits: mask(bits, prefix, v6),
                prefix,
                v6,
            }
        } else if prefix.is_some() {
            return None;
        } else if let Some(domain) = host.strip_prefix("*.") {
            canonical_name(domain).then(|| RuleHost::Subdomains(domain.to_owned()))?
        } else {
            canonical_name(host).then(|| RuleHost::Name(host.to_owned()))?
        };
        Some(Self {
            host: rule_host,
            port,
            text: text.to_owned(),
        })
    }

    /// Whether the rule covers `dest:port` (without `:PORT`, ports 80 and 443).
    pub fn matches(&self, dest: &Dest, port: u16) -> bool {
        let port_ok = match self.port {
            Some(p) => p == port,
            None => DEFAULT_PORTS.contains(&port),
        };
        port_ok
            && match (&self.host, dest) {
                (RuleHost::Name(n), Dest::Name(d)) => n == d,
                (RuleHost::Subdomains(n), Dest::Name(d)) => {
                    d.len() > n.len() + 1
                        && d.ends_with(n.as_str())
                        && d.as_bytes()[d.len() - n.len() - 1] == b'.'
                }
                (RuleHost::Network { bits, prefix, v6 }, Dest::Ip(ip)) => {
                    let (ip_bits, ip_v6) = v6_bits(*ip);
                    ip_v6 == *v6 && mask(ip_bits, *prefix, *v6) == *bits
                }
                _ => false,
            }
    }
}

impl Policy {
    /// Deny beats allow; then the mode.
    pub fn decide(&self, dest: &Dest, port: u16) -> Decision {
        if self.mode == Mode::None {
            return Decision::Refuse("this computer has no network".to_owned());
        }
        if let Some(rule) = self.deny.iter().find(|r| r.matches(dest, port)) {
            return Decision::Refuse(format!("denied by rule {}", rule.text));
        }
        if self.mode == Mode::Open || self.allow.iter().any(|r| r.matches(dest, port)) {
            Decision::Allow
        } else if self.ask {
            Decision::Ask
        } else {
            Decision::Refuse("not in this computer's allow-list".to_owned())
        }
    }

    /// Whether some rule could allow `name` on some port (the DNS answer: the port is not
    /// known yet); in ask mode, names not denied on 80 and 443 resolve too.
    pub fn name_may_resolve(&self, name: &str) -> bool {
        let dest = Dest::Name(name.to_owned());
        let ports = self
            .allow
            .iter()
            .chain(&self.deny)
            .filter_map(|r| r.port)
            .chain(DEFAULT_PORTS);
        let mut any = false;
        for port in ports {
            match self.decide(&dest, port) {
                Decision::Allow => any = true,
                // A question is only ever about a name not denied on 80 and 443.
                Decision::Ask => any |= DEFAULT_PORTS.contains(&port),
                Decision::Refuse(_) => {}
            }
        }
        any
    }
}

/// Whether an upstream address is one the proxy refuses without `--egress-allow-private`:
/// unspecified, loopback, RFC 1918, CGNAT, link-local (cloud metadata lives there), IETF
/// protocol assignments, multicast, broadcast, ULA, and IPv4-mapped forms of any of them.
pub fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => private_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return private_v4(v4);
            }
            let seg = v6.segments();
            v6.is_unspecified()
                || v6.is_loopback()
                || v6.is_multicast()
                || (seg[0] & 0xfe00) == 0xfc00
                || (seg[0] & 0xffc0) == 0xfe80
                // NAT64 well-known prefix: it reaches IPv4 addresses, private ones too.
                || (seg[0] == 0x64 && seg[1] == 0xff9b)
                || v6 == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)
        }
    }
}

fn private_v4(v4: Ipv4Addr) -> bool {
    let [a, b, ..] = v4.octets();
    v4.is_unspecified()
        || v4.is_loopback()
        || v4.is_private()
        || v4.is_link_local()
        || v4.is_broadcast()
        || v4.is_multicast()
        || a == 0
        || (a == 100 && (64..128).contains(&b))
        || (a == 192 && b == 0 && v4.octets()[2] == 0)
        || a >= 240
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(texts: &[&str]) -> Vec<Rule> {
        texts.iter().map(|t| Rule::parse(t).unwrap()).collect()
    }

    fn name(n: &str) -> Dest {
        Dest::Name(n.to_owned())
    }

    #[test]
    fn the_decision_matches_the_servers() {
        let p = Policy {
            mode: Mode::Allowlist,
            allow: rules(&[
                "allowed.test",
                "*.allowed.test",
                "198.18.0.0/15",
                "db.test:5432",
            ]),
            deny: rules(&["bad.allowed.test"]),
            ask: false,
            allow_private: false,
        };
        assert_eq!(p.decide(&name("allowed.test"), 443), Decision::Allow);
        assert_eq!(p.decide(&name("x.allowed.test"), 80), Decision::Allow);
        assert_eq!(
            p.decide(&name("allowed.test"), 8443),
            Decision::Refuse("not in this computer's allow-list".into())
        );
        assert_eq!(
            p.decide(&name("bad.allowed.test"), 443),
            Decision::Refuse("denied by rule bad.allowed.test".into())
        );
        assert_eq!(
            p.decide(&Dest::Ip("198.19.1.1".parse().unwrap()), 443),
            Decision::Allow
        );
        assert!(matches!(
            p.decide(&Dest::Ip("203.0.113.1".parse().unwrap()), 443),
            Decision::Refuse(_)
        ));
        assert_eq!(p.decide(&name("db.test"), 5432), Decision::Allow);
        assert!(p.name_may_resolve("db.test"));
        assert!(p.name_may_resolve("x.allowed.test"));
        assert!(!p.name_may_resolve("bad.allowed.test"));
        assert!(!p.name_may_resolve("other.test"));
        let asking = Policy {
            ask: true,
            ..p.clone()
        };
        assert_eq!(asking.decide(&name("other.test"), 443), Decision::Ask);
        assert!(asking.name_may_resolve("other.test"));
        assert!(!asking.name_may_resolve("bad.allowed.test"));
    }

    #[test]
    fn rules_are_read_strictly() {
        for bad in [
            "",
            "A.test",
            "a..test",
            "*.",
            "a.test:0",
            "a.test:x",
            "10.0.0.0/33",
            "a/8",
            "[::1",
            "*.*.a",
        ] {
            assert!(Rule::parse(bad).is_none(), "{bad:?}");
        }
        assert!(Rule::parse("[2001:db8::1]:22").is_some());
        assert!(Rule::parse("2001:db8::/32").is_some());
    }

    #[test]
    fn private_destinations_are_recognised() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:10.0.0.1",
            "64:ff9b::a00:1",
            "224.0.0.1",
            "255.255.255.255",
        ] {
            assert!(is_private(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "198.18.0.7",
            "203.0.113.9",
            "8.8.8.8",
            "2001:db8::1",
            "::ffff:198.18.0.1",
        ] {
            assert!(!is_private(ip.parse().unwrap()), "{ip}");
        }
    }
}
