//! The egress policy as E2B's own network controls (docs/egress.md, "E2B"): a sandbox's
//! `network` config at creation (`SandboxNetworkConfig` in E2B's openapi.yml), whose `allowOut`
//! takes IP addresses, CIDR blocks and domain names (`*.example.com` too) and whose `denyOut`
//! takes IP addresses and CIDR blocks only; an allowed entry beats a denied one, and neither
//! carries a port. What our policy says and those fields cannot is refused, never widened: at
//! startup for the server's policy, at creation for a computer's narrowed one. E2B enforces
//! the rules; no proxy of ours is involved, so nothing here sees a refusal.

use kilntainers_backend::egress::{EgressMode, EgressPolicy, HostPattern};
use serde::Serialize;

/// What `denyOut` holds in `allowlist` mode: E2B's own definition of no internet access
/// (`allow_internet_access: false` "behaves the same as specifying denyOut to 0.0.0.0/0").
const EVERYTHING: &str = "0.0.0.0/0";

/// `SandboxNetworkConfig`, the fields we send.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetworkConfig {
    #[serde(rename = "allowOut", skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    #[serde(rename = "denyOut", skip_serializing_if = "Vec::is_empty")]
    pub deny_out: Vec<String>,
}

/// A rule E2B's network config cannot express.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unmappable {
    #[error("--egress-ask needs the egress proxy, which E2B sandboxes do not have")]
    Ask,
    #[error("'{0}' names a port, and E2B's network rules have none")]
    Port(String),
    #[error(
        "deny rule '{0}' names a host, and E2B's denyOut takes only IP addresses and CIDR blocks"
    )]
    DenyName(String),
    #[error("deny rule '{deny}' overlaps allow rule '{allow}', and on E2B an allow rule wins")]
    Overlap { deny: String, allow: String },
}

/// The `network` config of a sandbox under `policy`; `None` when it needs none (`open`
/// without rules; `none` is `allow_internet_access: false`, as with `--no-network`).
pub fn network_config(policy: &EgressPolicy) -> Result<Option<NetworkConfig>, Unmappable> {
    match policy.mode {
        EgressMode::None => Ok(None),
        EgressMode::Open if policy.deny.is_empty() => Ok(None),
        EgressMode::Open => {
            let deny_out = policy
                .deny
                .iter()
                .map(|rule| match rule.host {
                    _ if rule.port.is_some() => Err(Unmappable::Port(rule.to_string())),
                    HostPattern::Network { .. } => Ok(rule.to_string()),
                    HostPattern::Name(_) | HostPattern::Subdomains(_) => {
                        Err(Unmappable::DenyName(rule.to_string()))
                    }
                })
                .collect::<Result<_, _>>()?;
            Ok(Some(NetworkConfig {
                allow_out: Vec::new(),
                deny_out,
            }))
        }
        EgressMode::Allowlist => {
            if policy.ask {
                return Err(Unmappable::Ask);
            }
            let mut allow_out = Vec::with_capacity(policy.allow.len());
            for rule in &policy.allow {
                if rule.port.is_some() {
                    return Err(Unmappable::Port(rule.to_string()));
                }
                allow_out.push(rule.to_string());
            }
            // Everything not allowed is denied already; a deny rule inside an allowed range
            // would lose to it on E2B, where ours says deny wins.
            if let Some((deny, allow)) = policy.deny_within_allow() {
                return Err(Unmappable::Overlap {
                    deny: deny.to_string(),
                    allow: allow.to_string(),
                });
            }
            Ok(Some(NetworkConfig {
                allow_out,
                deny_out: vec![EVERYTHING.to_owned()],
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kilntainers_backend::egress::Pattern;

    fn policy(mode: EgressMode, allow: &[&str], deny: &[&str]) -> EgressPolicy {
        let patterns = |list: &[&str]| list.iter().map(|p| Pattern::parse(p).unwrap()).collect();
        EgressPolicy {
            mode,
            allow: patterns(allow),
            deny: patterns(deny),
            ask: false,
            allow_private: false,
        }
    }

    #[test]
    fn an_allowlist_becomes_allow_out_with_everything_else_denied() {
        let config = network_config(&policy(
            EgressMode::Allowlist,
            &[
                "allowed.test",
                "*.Example.COM",
                "203.0.113.7/24",
                "2001:db8::1",
            ],
            &["198.51.100.0/24", "other.test"],
        ))
        .unwrap()
        .unwrap();
        assert_eq!(
            config.allow_out,
            [
                "allowed.test",
                "*.example.com",
                "203.0.113.0/24",
                "2001:db8::1"
            ]
        );
        assert_eq!(config.deny_out, ["0.0.0.0/0"]);
        assert_eq!(
            serde_json::to_value(&config).unwrap(),
            serde_json::json!({"allowOut": ["allowed.test", "*.example.com", "203.0.113.0/24", "2001:db8::1"], "denyOut": ["0.0.0.0/0"]})
        );
    }

    #[test]
    fn deny_rules_in_open_mode_become_deny_out_when_they_are_addresses() {
        let config = network_config(&policy(
            EgressMode::Open,
            &[],
            &["203.0.113.9", "10.0.0.0/8"],
        ))
        .unwrap()
        .unwrap();
        assert_eq!(config.deny_out, ["203.0.113.9", "10.0.0.0/8"]);
        assert_eq!(
            serde_json::to_value(&config).unwrap(),
            serde_json::json!({"denyOut": ["203.0.113.9", "10.0.0.0/8"]})
        );
        assert_eq!(
            network_config(&policy(EgressMode::Open, &[], &["*.evil.test"])),
            Err(Unmappable::DenyName("*.evil.test".to_owned()))
        );
        assert_eq!(
            network_config(&policy(EgressMode::Open, &[], &[])),
            Ok(None)
        );
        assert_eq!(
            network_config(&policy(EgressMode::None, &[], &[])),
            Ok(None)
        );
    }

    #[test]
    fn what_e2b_cannot_say_is_refused_with_the_rule_named() {
        assert_eq!(
            network_config(&policy(EgressMode::Allowlist, &["db.test:5432"], &[])),
            Err(Unmappable::Port("db.test:5432".to_owned()))
        );
        assert_eq!(
            network_config(&policy(EgressMode::Open, &[], &["203.0.113.9:22"])),
            Err(Unmappable::Port("203.0.113.9:22".to_owned()))
        );
        assert_eq!(
            network_config(&policy(
                EgressMode::Allowlist,
                &["*.example.com"],
                &["bad.example.com"]
            )),
            Err(Unmappable::Overlap {
                deny: "bad.example.com".to_owned(),
                allow: "*.example.com".to_owned()
            })
        );
        assert_eq!(
            network_config(&policy(
                EgressMode::Allowlist,
                &["203.0.113.7"],
                &["203.0.113.0/24:443"]
            )),
            Err(Unmappable::Overlap {
                deny: "203.0.113.0/24:443".to_owned(),
                allow: "203.0.113.7".to_owned()
            })
        );
        let mut asking = policy(EgressMode::Allowlist, &["a.test"], &[]);
        asking.ask = true;
        assert_eq!(network_config(&asking), Err(Unmappable::Ask));
        assert_eq!(
            Unmappable::DenyName("x.test".to_owned()).to_string(),
            "deny rule 'x.test' names a host, and E2B's denyOut takes only IP addresses and CIDR blocks"
        );
    }
}
