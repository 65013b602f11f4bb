//! The egress policy as a NetworkPolicy (docs/kubernetes.md, "Egress"). Kubernetes' own
//! NetworkPolicy (networking.k8s.io/v1) speaks of address blocks (`ipBlock` with `except`),
//! ports and pods, never of names: allow rules must be addresses or networks, names are refused
//! at startup, as on Modal. What the policy says and a NetworkPolicy cannot is refused, never
//! widened. Everything else maps exactly:
//!
//! - an allow rule is a block and its ports (a rule without a port: 80 and 443, over TCP, as the
//!   proxy on Docker reads it);
//! - a deny rule inside an allowed block becomes one of its `except` entries; one that covers the
//!   block drops it; a deny rule with a port that meets an allowed block cannot be said;
//! - the private ranges the proxy refuses without `--egress-allow-private` (loopback, RFC 1918,
//!   CGNAT, link-local and metadata, ULA, …) are excepted from every block, as the proxy
//!   refuses them after resolution; an allowed block that lies wholly in one is dropped;
//! - `open` with deny rules is every address except the denied and the private blocks, on every
//!   port, plus DNS to the cluster's resolver (`kube-dns` in `kube-system`), which lives at a
//!   private address;
//! - `none` (and `--no-network`) is no egress rule at all.
//!
//! Every policy made also has no ingress rule: a computer takes no connection from other pods
//! (port previews reach it through `pods/portforward`, which a NetworkPolicy does not see).
//! Nothing here talks to the API server; the cluster's network plugin enforces what is made.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kilntainers_backend::egress::{DEFAULT_PORTS, EgressMode, EgressPolicy, HostPattern, Pattern};
use kilntainers_backend::labels::kubernetes as keys;

/// The blocks the egress proxy refuses as destinations without `--egress-allow-private`
/// (the helper's `is_private`, as networks). The IPv4-mapped IPv6 block is excepted whole.
const PRIVATE_BLOCKS: [(IpAddr, u8); 16] = [
    (v4(0, 0, 0, 0), 8),
    (v4(10, 0, 0, 0), 8),
    (v4(100, 64, 0, 0), 10),
    (v4(127, 0, 0, 0), 8),
    (v4(169, 254, 0, 0), 16),
    (v4(172, 16, 0, 0), 12),
    (v4(192, 0, 0, 0), 24),
    (v4(192, 168, 0, 0), 16),
    (v4(224, 0, 0, 0), 4),
    (v4(240, 0, 0, 0), 4),
    (v6([0, 0]), 127),
    (v6([0, 0xffff]), 96),
    (v6([0x64, 0xff9b]), 96),
    (v6([0xfc00, 0]), 7),
    (v6([0xfe80, 0]), 10),
    (v6([0xff00, 0]), 8),
];
/// Every address of each family.
const EVERYWHERE: [(IpAddr, u8); 2] = [(v4(0, 0, 0, 0), 0), (v6([0, 0]), 0)];

const fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

/// An IPv6 network address from its first two segments (the mapped block's are its fifth and
/// sixth: `::ffff:0:0`).
const fn v6([a, b]: [u16; 2]) -> IpAddr {
    if a == 0 && b == 0xffff {
        IpAddr::V6(Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0))
    } else {
        IpAddr::V6(Ipv6Addr::new(a, b, 0, 0, 0, 0, 0, 0))
    }
}

/// Where the cluster's resolver runs on nearly every distribution (kubeadm, EKS, GKE, AKS,
/// k3s): pods labelled `k8s-app=kube-dns` in `kube-system`.
const DNS_NAMESPACE: &str = "kube-system";
const DNS_POD_LABEL: (&str, &str) = ("k8s-app", "kube-dns");
/// The label every namespace carries with its own name (Kubernetes 1.22 and later).
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// A rule a NetworkPolicy cannot express.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unmappable {
    #[error("--egress-ask needs the egress proxy, which the kubernetes backend does not run")]
    Ask,
    #[error(
        "'{0}' names a host, and a Kubernetes NetworkPolicy takes only address blocks (CIDRs); allow the host's addresses instead"
    )]
    Name(String),
    #[error(
        "deny rule '{deny}' has a port, and a NetworkPolicy cannot take one port out of the allowed block '{allow}'; drop the port to deny the whole address"
    )]
    DenyPort { deny: String, allow: String },
}

/// Whether a NetworkPolicy can say what `policy` says (the server's check at startup).
pub fn check(policy: &EgressPolicy) -> Result<(), Unmappable> {
    egress_rules(policy).map(drop)
}

/// The egress rules of a computer's NetworkPolicy under `policy`; `None` when the policy needs
/// none (`open` without rules: no NetworkPolicy is made).
pub(crate) fn egress_rules(
    policy: &EgressPolicy,
) -> Result<Option<Vec<NetworkPolicyEgressRule>>, Unmappable> {
    match policy.mode {
        EgressMode::None => Ok(Some(Vec::new())),
        EgressMode::Open if policy.deny.is_empty() => Ok(None),
        EgressMode::Open => {
            // Every deny rule meets "everything", but a name never overlaps an address block,
            // so `block_rule` would pass it by; ports are its to refuse.
            if let Some(named) = policy
                .deny
                .iter()
                .find(|deny| !matches!(deny.host, HostPattern::Network { .. }))
            {
                return Err(Unmappable::Name(named.to_string()));
            }
            let mut rules = Vec::new();
            for (addr, prefix) in EVERYWHERE {
                if let Some(rule) = block_rule(policy, &network(addr, prefix), None)? {
                    rules.push(rule);
                }
            }
            if !policy.allow_private {
                rules.push(dns_rule());
            }
            Ok(Some(rules))
        }
        EgressMode::Allowlist => {
            if policy.ask {
                return Err(Unmappable::Ask);
            }
            let mut rules = Vec::new();
            for allow in &policy.allow {
                if !matches!(allow.host, HostPattern::Network { .. }) {
                    return Err(Unmappable::Name(allow.to_string()));
                }
                let ports = allow.port.map_or(DEFAULT_PORTS.to_vec(), |port| vec![port]);
                if let Some(rule) = block_rule(policy, allow, Some(&ports))? {
                    rules.push(rule);
                }
            }
            Ok(Some(rules))
        }
    }
}

/// The rule for one allowed `block` (its port ignored; `ports` says which, `None` = all), with
/// the denied and private blocks inside it excepted; `None` when they cover all of it.
///
/// A deny rule applies to the block's ports it names (none named: 80 and 443, as the proxy
/// reads it); one whose ports the block does not allow changes nothing. An `except` entry takes
/// an address off every port of the rule, so a deny rule is excepted when it names a port only
/// if that is the rule's one port; a deny rule without a port is excepted from every port (a
/// little stricter than the proxy when the block has other ports too). Private blocks are
/// refused on every port, as the proxy refuses them after resolution.
fn block_rule(
    policy: &EgressPolicy,
    block: &Pattern,
    ports: Option<&[u16]>,
) -> Result<Option<NetworkPolicyEgressRule>, Unmappable> {
    let block = host_only(block);
    let mut except: Vec<String> = Vec::new();
    let mut take_out = |denied: &Pattern| {
        if denied.covers(&block) {
            return false;
        }
        let text = cidr(denied);
        if !except.contains(&text) {
            except.push(text);
        }
        true
    };
    for deny in &policy.deny {
        let denied = host_only(deny);
        if !denied.overlaps_host(&block) {
            continue;
        }
        let deny_ports: &[u16] = match &deny.port {
            Some(port) => std::slice::from_ref(port),
            None => &DEFAULT_PORTS,
        };
        if ports.is_some_and(|ports| !ports.iter().any(|p| deny_ports.contains(p))) {
            continue;
        }
        if !matches!(deny.host, HostPattern::Network { .. }) {
            return Err(Unmappable::Name(deny.to_string()));
        }
        if deny.port.is_some() && ports.is_none_or(|ports| ports != deny_ports) {
            return Err(Unmappable::DenyPort {
                deny: deny.to_string(),
                allow: block.to_string(),
            });
        }
        if !take_out(&denied) {
            return Ok(None);
        }
    }
    if !policy.allow_private {
        for (addr, prefix) in PRIVATE_BLOCKS {
            let private = network(addr, prefix);
            if private.overlaps_host(&block) && !take_out(&private) {
                return Ok(None);
            }
        }
    }
    Ok(Some(NetworkPolicyEgressRule {
        to: Some(vec![NetworkPolicyPeer {
            ip_block: Some(IPBlock {
                cidr: cidr(&block),
                except: (!except.is_empty()).then_some(except),
            }),
            ..NetworkPolicyPeer::default()
        }]),
        ports: ports.map(|ports| ports.iter().map(|&port| tcp(port)).collect()),
    }))
}

/// DNS to the cluster's resolver, over UDP and TCP.
fn dns_rule() -> NetworkPolicyEgressRule {
    NetworkPolicyEgressRule {
        to: Some(vec![NetworkPolicyPeer {
            namespace_selector: Some(match_labels([(NAMESPACE_NAME_LABEL, DNS_NAMESPACE)])),
            pod_selector: Some(match_labels([DNS_POD_LABEL])),
            ..NetworkPolicyPeer::default()
        }]),
        ports: Some(vec![
            NetworkPolicyPort {
                port: Some(IntOrString::Int(53)),
                protocol: Some("UDP".to_owned()),
                ..NetworkPolicyPort::default()
            },
            tcp(53),
        ]),
    }
}

/// The NetworkPolicy of the computer whose objects carry `meta` and whose Pods carry the
/// object-name label `pod_name` (docs/kubernetes.md, "Egress").
pub(crate) fn network_policy(
    meta: ObjectMeta,
    pod_name: &str,
    rules: Vec<NetworkPolicyEgressRule>,
) -> NetworkPolicy {
    NetworkPolicy {
        metadata: meta,
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(match_labels([
                (keys::MANAGED, "true"),
                (keys::NAME, pod_name),
            ])),
            policy_types: Some(vec!["Ingress".to_owned(), "Egress".to_owned()]),
            egress: Some(rules),
            ingress: None,
        }),
    }
}

fn match_labels<const N: usize>(pairs: [(&str, &str); N]) -> LabelSelector {
    LabelSelector {
        match_labels: Some(
            pairs
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect::<BTreeMap<_, _>>(),
        ),
        ..LabelSelector::default()
    }
}

fn tcp(port: u16) -> NetworkPolicyPort {
    NetworkPolicyPort {
        port: Some(IntOrString::Int(i32::from(port))),
        protocol: Some("TCP".to_owned()),
        ..NetworkPolicyPort::default()
    }
}

fn network(addr: IpAddr, prefix: u8) -> Pattern {
    Pattern {
        host: HostPattern::Network { addr, prefix },
        port: None,
    }
}

fn host_only(pattern: &Pattern) -> Pattern {
    Pattern {
        host: pattern.host.clone(),
        port: None,
    }
}

/// A network pattern as a CIDR, always with its prefix (a bare address is not a CIDR block).
fn cidr(pattern: &Pattern) -> String {
    match &pattern.host {
        HostPattern::Network { addr, prefix } => format!("{addr}/{prefix}"),
        other => unreachable!("only networks become CIDRs, not {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// (cidr, except, ports) of each rule; ports as "TCP/443".
    fn summary(rules: &[NetworkPolicyEgressRule]) -> Vec<(String, Vec<String>, Vec<String>)> {
        rules
            .iter()
            .map(|rule| {
                let peer = &rule.to.as_ref().unwrap()[0];
                let (cidr, except) = match &peer.ip_block {
                    Some(block) => (block.cidr.clone(), block.except.clone().unwrap_or_default()),
                    None => ("dns".to_owned(), Vec::new()),
                };
                let ports = (rule.ports.iter().flatten())
                    .map(|p| {
                        let Some(IntOrString::Int(port)) = p.port else {
                            panic!("a numbered port")
                        };
                        format!("{}/{port}", p.protocol.as_deref().unwrap())
                    })
                    .collect();
                (cidr, except, ports)
            })
            .collect()
    }

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    /// The private blocks of one family as CIDR text.
    fn private(ipv6: bool) -> Vec<String> {
        PRIVATE_BLOCKS
            .iter()
            .filter(|(addr, _)| addr.is_ipv6() == ipv6)
            .map(|&(addr, prefix)| format!("{addr}/{prefix}"))
            .collect()
    }

    #[test]
    fn the_private_blocks_are_the_networks_they_say_and_hold_what_the_proxy_refuses() {
        assert_eq!(
            private(false),
            strings(&[
                "0.0.0.0/8",
                "10.0.0.0/8",
                "100.64.0.0/10",
                "127.0.0.0/8",
                "169.254.0.0/16",
                "172.16.0.0/12",
                "192.0.0.0/24",
                "192.168.0.0/16",
                "224.0.0.0/4",
                "240.0.0.0/4"
            ])
        );
        assert_eq!(
            private(true),
            strings(&[
                "::/127",
                "::ffff:0.0.0.0/96",
                "64:ff9b::/96",
                "fc00::/7",
                "fe80::/10",
                "ff00::/8"
            ])
        );
        // Each is a network address (no host bits), as a Pattern would have it.
        for (addr, prefix) in PRIVATE_BLOCKS {
            let parsed = Pattern::parse(&format!("{addr}/{prefix}")).unwrap();
            assert_eq!(parsed, network(addr, prefix), "{addr}/{prefix}");
        }
    }

    #[test]
    fn open_without_rules_needs_no_policy_and_none_allows_nothing() {
        assert_eq!(egress_rules(&EgressPolicy::open()), Ok(None));
        assert_eq!(
            egress_rules(&policy(EgressMode::None, &[], &[])),
            Ok(Some(Vec::new()))
        );
    }

    #[test]
    fn allowed_blocks_keep_their_ports_and_lose_the_private_and_denied_blocks_inside() {
        let rules = egress_rules(&policy(
            EgressMode::Allowlist,
            &[
                "203.0.113.7",
                "198.51.100.0/24",
                "0.0.0.0/0:443",
                "10.1.0.0/16",
            ],
            &["198.51.100.128/25", "203.0.113.0/24", "pypi.org"],
        ))
        .unwrap()
        .unwrap();
        let private = private(false);
        assert_eq!(
            summary(&rules),
            vec![
                // 203.0.113.7 is inside the denied /24: gone. 10.1.0.0/16 is private: gone.
                (
                    "198.51.100.0/24".to_owned(),
                    strings(&["198.51.100.128/25"]),
                    strings(&["TCP/80", "TCP/443"])
                ),
                (
                    "0.0.0.0/0".to_owned(),
                    [strings(&["198.51.100.128/25", "203.0.113.0/24"]), private].concat(),
                    strings(&["TCP/443"])
                ),
            ]
        );
        let mut open_private = policy(EgressMode::Allowlist, &["10.1.0.0/16"], &[]);
        open_private.allow_private = true;
        assert_eq!(
            summary(&egress_rules(&open_private).unwrap().unwrap()),
            vec![(
                "10.1.0.0/16".to_owned(),
                Vec::new(),
                strings(&["TCP/80", "TCP/443"])
            )]
        );
    }

    #[test]
    fn a_deny_rule_applies_to_the_ports_it_names() {
        let rules = egress_rules(&policy(
            EgressMode::Allowlist,
            &["203.0.113.0/24:22", "198.51.100.0/24:443"],
            // 80 and 443 only: not port 22. Port 443 exactly: the second block's one port.
            &["203.0.113.7", "198.51.100.9:443"],
        ))
        .unwrap()
        .unwrap();
        assert_eq!(
            summary(&rules),
            vec![
                (
                    "203.0.113.0/24".to_owned(),
                    Vec::new(),
                    strings(&["TCP/22"])
                ),
                (
                    "198.51.100.0/24".to_owned(),
                    strings(&["198.51.100.9/32"]),
                    strings(&["TCP/443"])
                ),
            ]
        );
    }

    #[test]
    fn open_with_deny_rules_is_everything_else_on_every_port_and_the_cluster_dns() {
        let rules = egress_rules(&policy(
            EgressMode::Open,
            &[],
            &["203.0.113.0/24", "2001:db8::/32"],
        ))
        .unwrap()
        .unwrap();
        let got = summary(&rules);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].0, "0.0.0.0/0");
        assert_eq!(
            got[0].1,
            [strings(&["203.0.113.0/24"]), private(false)].concat()
        );
        assert!(got[0].2.is_empty() && rules[0].ports.is_none());
        assert_eq!(got[1].0, "::/0");
        assert_eq!(
            got[1].1,
            [strings(&["2001:db8::/32"]), private(true)].concat()
        );
        assert_eq!(
            got[2],
            ("dns".to_owned(), Vec::new(), strings(&["UDP/53", "TCP/53"]))
        );
    }

    #[test]
    fn what_a_network_policy_cannot_say_is_refused_with_the_rule_named() {
        assert_eq!(
            egress_rules(&policy(EgressMode::Allowlist, &["pypi.org"], &[])),
            Err(Unmappable::Name("pypi.org".to_owned()))
        );
        assert_eq!(
            egress_rules(&policy(EgressMode::Open, &[], &["*.evil.test"])),
            Err(Unmappable::Name("*.evil.test".to_owned()))
        );
        assert_eq!(
            egress_rules(&policy(
                EgressMode::Allowlist,
                &["203.0.113.0/24"],
                &["203.0.113.7:443"]
            )),
            Err(Unmappable::DenyPort {
                deny: "203.0.113.7:443".to_owned(),
                allow: "203.0.113.0/24".to_owned()
            })
        );
        let mut ask = policy(EgressMode::Allowlist, &["203.0.113.7"], &[]);
        ask.ask = true;
        assert_eq!(egress_rules(&ask), Err(Unmappable::Ask));
        // A deny rule apart from every allowed block or port changes nothing, whatever it names.
        assert!(
            egress_rules(&policy(
                EgressMode::Allowlist,
                &["203.0.113.7"],
                &["pypi.org", "198.51.100.1:22", "203.0.113.7:22"]
            ))
            .is_ok()
        );
    }

    #[test]
    fn the_policy_selects_the_computer_s_pods_and_takes_no_ingress() {
        let meta = ObjectMeta {
            name: Some("quiet-fox-0a1b".to_owned()),
            ..ObjectMeta::default()
        };
        let made = network_policy(meta, "quiet-fox-0a1b", Vec::new());
        let spec = made.spec.unwrap();
        assert_eq!(
            spec.pod_selector.unwrap().match_labels.unwrap(),
            BTreeMap::from([
                (keys::MANAGED.to_owned(), "true".to_owned()),
                (keys::NAME.to_owned(), "quiet-fox-0a1b".to_owned()),
            ])
        );
        assert_eq!(spec.policy_types.unwrap(), ["Ingress", "Egress"]);
        assert!(spec.ingress.is_none() && spec.egress.unwrap().is_empty());
    }
}
