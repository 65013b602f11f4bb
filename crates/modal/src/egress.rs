//! The egress policy as Modal's own network controls (docs/egress.md, "Modal"): a sandbox's
//! `NetworkAccess` at creation, from Modal's api.proto. Modal's documented control is an
//! allow-list of CIDR blocks with everything else blocked (`cidr_allowlist` in its SDK); it has
//! no deny list and no ports. The proto's `allowed_domains` (field 3) is not documented or
//! offered by Modal's SDK, so what it matches (wildcards, the apex) is unknown and domain rules
//! are refused rather than guessed at. What the policy says and Modal cannot is refused, never
//! widened: at startup for the server's policy, at creation for a computer's narrowed one.

use kilntainers_backend::egress::{EgressMode, EgressPolicy, HostPattern};

/// A rule Modal's network access cannot express.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unmappable {
    #[error("--egress-ask needs the egress proxy, which Modal sandboxes do not have")]
    Ask,
    #[error("'{0}' names a host, and Modal's network allow-list takes only CIDR blocks")]
    Name(String),
    #[error("'{0}' names a port, and Modal's network allow-list has none")]
    Port(String),
    #[error(
        "deny rule '{0}' has no counterpart in Modal, whose network access is open, blocked or an allow-list"
    )]
    OpenDeny(String),
    #[error("deny rule '{deny}' overlaps allow rule '{allow}', and Modal has no deny rules")]
    Overlap { deny: String, allow: String },
}

/// The CIDR blocks a sandbox under `policy` may reach, everything else blocked (an empty list
/// blocks everything); `None` when the policy needs no allow-list (`open` without rules; `none`
/// is the blocked network of `--no-network`).
pub fn allowed_cidrs(policy: &EgressPolicy) -> Result<Option<Vec<String>>, Unmappable> {
    match policy.mode {
        EgressMode::None => Ok(None),
        EgressMode::Open => match policy.deny.first() {
            None => Ok(None),
            Some(deny) => Err(Unmappable::OpenDeny(deny.to_string())),
        },
        EgressMode::Allowlist => {
            if policy.ask {
                return Err(Unmappable::Ask);
            }
            let cidrs = policy
                .allow
                .iter()
                .map(|rule| match rule.host {
                    _ if rule.port.is_some() => Err(Unmappable::Port(rule.to_string())),
                    // Always with its prefix: a bare address is not a CIDR block.
                    HostPattern::Network { addr, prefix } => Ok(format!("{addr}/{prefix}")),
                    HostPattern::Name(_) | HostPattern::Subdomains(_) => {
                        Err(Unmappable::Name(rule.to_string()))
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            // Everything not allowed is blocked already; a deny rule inside an allowed block
            // cannot be said.
            if let Some((deny, allow)) = policy.deny_within_allow() {
                return Err(Unmappable::Overlap {
                    deny: deny.to_string(),
                    allow: allow.to_string(),
                });
            }
            Ok(Some(cidrs))
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
    fn addresses_and_networks_become_the_cidr_allow_list() {
        assert_eq!(
            allowed_cidrs(&policy(
                EgressMode::Allowlist,
                &["203.0.113.7", "198.51.100.9/24", "2001:db8::/32"],
                &["192.0.2.1"],
            )),
            Ok(Some(vec![
                "203.0.113.7/32".to_owned(),
                "198.51.100.0/24".to_owned(),
                "2001:db8::/32".to_owned()
            ]))
        );
        assert_eq!(
            allowed_cidrs(&policy(EgressMode::Allowlist, &[], &[])),
            Ok(Some(Vec::new()))
        );
        assert_eq!(allowed_cidrs(&policy(EgressMode::Open, &[], &[])), Ok(None));
        assert_eq!(allowed_cidrs(&policy(EgressMode::None, &[], &[])), Ok(None));
    }

    #[test]
    fn what_modal_cannot_say_is_refused_with_the_rule_named() {
        assert_eq!(
            allowed_cidrs(&policy(EgressMode::Allowlist, &["pypi.org"], &[])),
            Err(Unmappable::Name("pypi.org".to_owned()))
        );
        assert_eq!(
            allowed_cidrs(&policy(EgressMode::Allowlist, &["203.0.113.7:22"], &[])),
            Err(Unmappable::Port("203.0.113.7:22".to_owned()))
        );
        assert_eq!(
            allowed_cidrs(&policy(EgressMode::Open, &[], &["203.0.113.7"])),
            Err(Unmappable::OpenDeny("203.0.113.7".to_owned()))
        );
        assert_eq!(
            allowed_cidrs(&policy(
                EgressMode::Allowlist,
                &["10.0.0.0/8"],
                &["10.1.0.0/16"]
            )),
            Err(Unmappable::Overlap {
                deny: "10.1.0.0/16".to_owned(),
                allow: "10.0.0.0/8".to_owned()
            })
        );
        let mut asking = policy(EgressMode::Allowlist, &["203.0.113.7"], &[]);
        asking.ask = true;
        assert_eq!(allowed_cidrs(&asking), Err(Unmappable::Ask));
        assert_eq!(
            Unmappable::Name("pypi.org".to_owned()).to_string(),
            "'pypi.org' names a host, and Modal's network allow-list takes only CIDR blocks"
        );
    }
}
