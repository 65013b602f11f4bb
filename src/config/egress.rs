//! The egress flags (docs/egress.md, "Policy model") checked into one [`EgressSettings`]:
//! the mode, the allow and deny patterns, ask-to-allow, and the proxy's resolver, fixed
//! answers, upstream CA and network; then whether the chosen backend can enforce them. Every
//! refusal names the flag and the value, before any computer is touched.

use std::net::{IpAddr, SocketAddr};

use kilntainers_backend::egress::{
    EgressMode, EgressPolicy, EgressSettings, Pattern, normalise_name,
};

use super::{ConfigError, fail, switch_on};
use crate::cli::{BackendKind, Cli};

/// Fly's refusal, word for word from docs/egress.md, "Other backends".
pub const FLY_REFUSAL: &str =
    "Fly Machines have no outbound filtering; use --egress open or another backend";

/// Largest `--egress-upstream-ca` file read: a bundle of a few hundred certificates.
const MAX_CA_BYTES: u64 = 1024 * 1024;

/// Parses and checks the egress flags; `no_network` is `--no-network`.
pub fn from_cli(
    cli: &Cli,
    env: impl Fn(&str) -> Option<String>,
) -> Result<EgressSettings, ConfigError> {
    let mode = match cli.egress.as_deref().map(str::trim) {
        None => None,
        Some(text) => match EgressMode::parse(text) {
            Some(mode) => Some(mode),
            None => {
                return fail(format!(
                    "--egress must be 'open', 'allowlist' or 'none'; got '{text}'."
                ));
            }
        },
    };
    let mode = match (mode, cli.no_network) {
        (None, true) => EgressMode::None,
        (Some(mode @ (EgressMode::Open | EgressMode::Allowlist)), true) => {
            return fail(format!(
                "--egress {} conflicts with --no-network; use one of them.",
                mode.name()
            ));
        }
        (mode, _) => mode.unwrap_or(EgressMode::Open),
    };
    let allow = patterns("--egress-allow", &cli.egress_allow)?;
    let deny = patterns("--egress-deny", &cli.egress_deny)?;
    let ask = cli.egress_ask || switch_on(env("KILNTAINERS_EGRESS_ASK").as_deref());
    let allow_private =
        cli.egress_allow_private || switch_on(env("KILNTAINERS_EGRESS_ALLOW_PRIVATE").as_deref());
    if !allow.is_empty() && mode != EgressMode::Allowlist {
        return fail(format!(
            "--egress-allow needs --egress allowlist; got --egress {}. In open mode every host is allowed (--egress-deny makes a deny-list).",
            mode.name()
        ));
    }
    if ask && mode != EgressMode::Allowlist {
        return fail(format!(
            "--egress-ask needs --egress allowlist; got --egress {}.",
            mode.name()
        ));
    }
    if !deny.is_empty() && mode == EgressMode::None {
        return fail("--egress-deny has no effect with --egress none: computers have no network.");
    }
    let policy = EgressPolicy {
        mode,
        allow,
        deny,
        ask,
        allow_private,
    };
    let dns = cli.egress_dns.as_deref().map(parse_dns).transpose()?;
    let resolve = cli
        .egress_resolve
        .iter()
        .map(|entry| parse_resolve(entry))
        .collect::<Result<Vec<_>, _>>()?;
    let upstream_ca_pem = cli.egress_upstream_ca.as_deref().map(read_ca).transpose()?;
    let upstream_network = match cli.egress_upstream_network.as_deref().map(str::trim) {
        Some("") => return fail("--egress-upstream-network must name an engine network."),
        other => other.map(str::to_owned),
    };
    let settings = EgressSettings {
        policy,
        dns,
        resolve,
        upstream_ca_pem,
        upstream_network,
    };
    // Secrets put computers behind the proxy in open mode too (docs/secrets.md, "Egress modes").
    let brokering = !cli.secret.is_empty()
        || cli.secrets_file.is_some()
        || cli.secret_tools
        || switch_on(env("ENABLE_SECRET_TOOLS").as_deref());
    if !settings.filters() && !brokering {
        let proxy_flags = [
            ("--egress-allow-private", settings.policy.allow_private),
            ("--egress-dns", settings.dns.is_some()),
            ("--egress-resolve", !settings.resolve.is_empty()),
            ("--egress-upstream-ca", settings.upstream_ca_pem.is_some()),
            (
                "--egress-upstream-network",
                settings.upstream_network.is_some(),
            ),
        ];
        if let Some((flag, _)) = proxy_flags.iter().find(|(_, given)| *given) {
            return fail(format!(
                "{flag} configures the egress proxy, which runs only with --egress allowlist or --egress-deny rules; got --egress {} without rules.",
                settings.policy.mode.name()
            ));
        }
    }
    check_backend(cli, &settings)?;
    Ok(settings)
}

fn patterns(flag: &str, values: &[String]) -> Result<Vec<Pattern>, ConfigError> {
    values
        .iter()
        .map(|value| {
            Pattern::parse(value).map_err(|error| {
                ConfigError(format!("{flag}: invalid pattern '{value}': {error}."))
            })
        })
        .collect()
}

/// `ADDR[:PORT]`, IPv6 in brackets when it has a port; port 53 by default.
fn parse_dns(text: &str) -> Result<SocketAddr, ConfigError> {
    let text = text.trim();
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, 53));
    }
    match text.parse::<SocketAddr>() {
        Ok(addr) if addr.port() != 0 => Ok(addr),
        _ => fail(format!(
            "--egress-dns must be an IP address with an optional port, such as 192.0.2.53 or [2001:db8::53]:53; got '{text}'."
        )),
    }
}

/// `HOST=IP`: a host name (normalised) and the address the proxy uses for it.
fn parse_resolve(entry: &str) -> Result<(String, IpAddr), ConfigError> {
    let bad = |why: &str| {
        fail(format!(
            "--egress-resolve must be HOST=IP, such as api.example.com=203.0.113.7; got '{entry}' ({why})."
        ))
    };
    let Some((host, ip)) = entry.trim().split_once('=') else {
        return bad("no '='");
    };
    let Ok(name) = normalise_name(host.trim()) else {
        return bad("not a host name");
    };
    let ip = ip.trim();
    let ip = ip
        .strip_prefix('[')
        .and_then(|i| i.strip_suffix(']'))
        .unwrap_or(ip);
    match ip.parse::<IpAddr>() {
        Ok(ip) => Ok((name, ip)),
        Err(_) => bad("not an IP address"),
    }
}

fn read_ca(path: &std::path::Path) -> Result<String, ConfigError> {
    let shown = path.display();
    let metadata = std::fs::metadata(path).map_err(|e| {
        ConfigError(format!(
            "--egress-upstream-ca '{shown}': cannot read it: {e}."
        ))
    })?;
    if metadata.len() > MAX_CA_BYTES {
        return fail(format!(
            "--egress-upstream-ca '{shown}' is larger than {MAX_CA_BYTES} bytes; it should hold PEM certificates only."
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigError(format!(
            "--egress-upstream-ca '{shown}': cannot read it: {e}."
        ))
    })?;
    if !text.contains("-----BEGIN CERTIFICATE-----") {
        return fail(format!(
            "--egress-upstream-ca '{shown}' holds no PEM certificate (-----BEGIN CERTIFICATE-----)."
        ));
    }
    Ok(text)
}

/// Whether the chosen backend can keep the policy (docs/egress.md, "Other backends"); `none`
/// is `--no-network`, which each backend handles as before.
fn check_backend(cli: &Cli, settings: &EgressSettings) -> Result<(), ConfigError> {
    let policy = &settings.policy;
    // A provider's own network controls cannot say `why`.
    #[cfg_attr(
        not(any(feature = "e2b", feature = "modal", feature = "kubernetes")),
        expect(unused_variables)
    )]
    let unmappable = |why: &dyn std::fmt::Display| {
        ConfigError(format!(
            "--egress {}: {why}; change that rule, or use the docker backend.",
            policy.mode.name()
        ))
    };
    match cli.backend {
        BackendKind::Fly if policy.mode != EgressMode::Open || !policy.deny.is_empty() => {
            fail(FLY_REFUSAL)
        }
        // Guests have no network at all: every mode behaves as `none`.
        BackendKind::Wasm | BackendKind::GoBusybox => Ok(()),
        // Docker and Podman: the egress proxy beside the computers (docs/egress.md, "Docker
        // wiring", "Socket wiring"); nothing to refuse here.
        // E2B's own network config, where it can say the same (docs/egress.md, "E2B").
        #[cfg(feature = "e2b")]
        BackendKind::E2b => kilntainers_e2b::egress::network_config(policy)
            .map(drop)
            .map_err(|why| unmappable(&why)),
        // Modal's CIDR allow-list, where it can say the same (docs/egress.md, "Modal").
        #[cfg(feature = "modal")]
        BackendKind::Modal => kilntainers_modal::egress::allowed_cidrs(policy)
            .map(drop)
            .map_err(|why| unmappable(&why)),
        // One NetworkPolicy per computer, where it can say the same (docs/kubernetes.md,
        // "Egress"); a warm pool's Pods run before any policy of ours could be in place.
        #[cfg(feature = "kubernetes")]
        BackendKind::Kubernetes => {
            kilntainers_kubernetes::egress::check(policy).map_err(|why| unmappable(&why))?;
            let pool = cli.kubernetes.k8s_warm_pool.as_deref();
            if !policy.is_unfiltered() && pool.is_some_and(|p| !p.trim().is_empty()) {
                return fail(
                    "--egress rules (or --no-network) cannot be kept with --k8s-warm-pool: the pool's Pods run before a computer's NetworkPolicy could be made. Drop --k8s-warm-pool, or the egress rules.",
                );
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_cli;

    fn settings(args: &[&str]) -> Result<EgressSettings, String> {
        from_cli(&test_cli(args), |_| None).map_err(|e| e.0)
    }

    fn error(args: &[&str]) -> String {
        settings(args).unwrap_err()
    }

    #[test]
    fn no_egress_flag_is_open_without_rules() {
        let s = settings(&[]).unwrap();
        assert_eq!(s, EgressSettings::default());
        assert!(!s.filters());
        assert_eq!(
            settings(&["--no-network"]).unwrap().policy.mode,
            EgressMode::None
        );
        assert_eq!(
            settings(&["--egress", "none"]).unwrap().policy.mode,
            EgressMode::None
        );
        assert_eq!(
            settings(&["--egress", "none", "--no-network"])
                .unwrap()
                .policy
                .mode,
            EgressMode::None
        );
    }

    #[test]
    fn bad_values_are_named() {
        assert_eq!(
            error(&["--egress", "wide"]),
            "--egress must be 'open', 'allowlist' or 'none'; got 'wide'."
        );
        assert_eq!(
            error(&["--egress", "allowlist", "--egress-allow", "a..b"]),
            "--egress-allow: invalid pattern 'a..b': it is not a valid host name (IDNA conversion failed)."
        );
        assert_eq!(
            error(&["--egress-deny", "x.test:99999"]),
            "--egress-deny: invalid pattern 'x.test:99999': the port must be a number from 1 to 65535."
        );
        assert_eq!(
            error(&["--egress-ask"]),
            "--egress-ask needs --egress allowlist; got --egress open."
        );
        assert!(
            error(&["--egress-allow", "a.test"])
                .starts_with("--egress-allow needs --egress allowlist; got --egress open.")
        );
        assert!(
            error(&["--egress", "allowlist", "--no-network"])
                .contains("conflicts with --no-network")
        );
        assert!(error(&["--egress", "none", "--egress-deny", "a.test"]).contains("no effect"));
        assert!(
            error(&["--egress-dns", "8.8.8.8"])
                .starts_with("--egress-dns configures the egress proxy")
        );
    }

    #[test]
    fn proxy_settings_parse() {
        // The backend check is separate; parse on WASM, which accepts every mode.
        let s = settings(&[
            "--backend",
            "go_busybox",
            "--egress",
            "allowlist",
            "--egress-allow",
            "Allowed.Test",
            "--egress-allow",
            "*.allowed.test:8443",
            "--egress-deny",
            "198.18.0.0/15",
            "--egress-ask",
            "--egress-allow-private",
            "--egress-dns",
            "198.18.0.53",
            "--egress-resolve",
            "a.test=198.18.0.2",
            "--egress-resolve",
            "b.test=[2001:db8::2]",
            "--egress-upstream-network",
            "kbb-net",
        ])
        .unwrap();
        assert_eq!(s.policy.allow[0].to_string(), "allowed.test");
        assert_eq!(s.policy.allow[1].to_string(), "*.allowed.test:8443");
        assert!(s.policy.ask && s.policy.allow_private);
        assert_eq!(s.dns, Some("198.18.0.53:53".parse().unwrap()));
        assert_eq!(s.resolve[1].0, "b.test");
        assert_eq!(s.upstream_network.as_deref(), Some("kbb-net"));
        for bad in ["198.18.0.53:0", "dns.test", "[::1]"] {
            let e = error(&[
                "--egress-deny",
                "x.test",
                "--backend",
                "go_busybox",
                "--egress-dns",
                bad,
            ]);
            assert!(e.contains(&format!("got '{bad}'")), "{e}");
        }
        let e = error(&[
            "--egress-deny",
            "x.test",
            "--backend",
            "go_busybox",
            "--egress-resolve",
            "a.test",
        ]);
        assert!(
            e.starts_with("--egress-resolve must be HOST=IP") && e.contains("'a.test'"),
            "{e}"
        );
        let e = error(&[
            "--egress-deny",
            "x.test",
            "--backend",
            "go_busybox",
            "--egress-upstream-ca",
            "/nonexistent/ca.pem",
        ]);
        assert!(
            e.starts_with("--egress-upstream-ca '/nonexistent/ca.pem': cannot read it"),
            "{e}"
        );
    }

    #[test]
    fn backends_that_cannot_filter_refuse_at_startup() {
        assert_eq!(
            error(&["--backend", "fly", "--egress", "allowlist"]),
            FLY_REFUSAL
        );
        assert_eq!(
            error(&["--backend", "fly", "--egress", "none"]),
            FLY_REFUSAL
        );
        assert_eq!(
            error(&["--backend", "fly", "--egress-deny", "a.test"]),
            FLY_REFUSAL
        );
        assert!(settings(&["--backend", "fly", "--egress", "open"]).is_ok());
        assert!(settings(&["--backend", "go_busybox", "--egress", "allowlist"]).is_ok());
        if cfg!(feature = "e2b") {
            // E2B's network config: names and networks, no ports, no ask, no deny by name.
            assert!(
                settings(&[
                    "--backend",
                    "e2b",
                    "--egress",
                    "allowlist",
                    "--egress-allow",
                    "*.a.test"
                ])
                .is_ok()
            );
            assert!(settings(&["--backend", "e2b", "--egress-deny", "203.0.113.0/24"]).is_ok());
            assert_eq!(
                error(&[
                    "--backend",
                    "e2b",
                    "--egress",
                    "allowlist",
                    "--egress-allow",
                    "db.test:5432"
                ]),
                "--egress allowlist: 'db.test:5432' names a port, and E2B's network rules have none; change that rule, or use the docker backend."
            );
            assert_eq!(
                error(&["--backend", "e2b", "--egress-deny", "evil.test"]),
                "--egress open: deny rule 'evil.test' names a host, and E2B's denyOut takes only IP addresses and CIDR blocks; change that rule, or use the docker backend."
            );
            assert_eq!(
                error(&[
                    "--backend",
                    "e2b",
                    "--egress",
                    "allowlist",
                    "--egress-allow",
                    "a.test",
                    "--egress-ask"
                ]),
                "--egress allowlist: --egress-ask needs the egress proxy, which E2B sandboxes do not have; change that rule, or use the docker backend."
            );
        }
        assert!(settings(&["--backend", "modal", "--egress", "none"]).is_ok());
        if cfg!(feature = "modal") {
            // Modal's CIDR allow-list: networks only, no ports, no deny list, no ask.
            assert!(
                settings(&[
                    "--backend",
                    "modal",
                    "--egress",
                    "allowlist",
                    "--egress-allow",
                    "203.0.113.0/24"
                ])
                .is_ok()
            );
            assert_eq!(
                error(&[
                    "--backend",
                    "modal",
                    "--egress",
                    "allowlist",
                    "--egress-allow",
                    "pypi.org"
                ]),
                "--egress allowlist: 'pypi.org' names a host, and Modal's network allow-list takes only CIDR blocks; change that rule, or use the docker backend."
            );
            assert_eq!(
                error(&["--backend", "modal", "--egress-deny", "203.0.113.7"]),
                "--egress open: deny rule '203.0.113.7' has no counterpart in Modal, whose network access is open, blocked or an allow-list; change that rule, or use the docker backend."
            );
        }
        // Docker and Podman enforce it with the proxy.
        assert!(settings(&["--egress", "allowlist", "--egress-allow", "a.test"]).is_ok());
        assert!(settings(&["--egress-deny", "a.test"]).is_ok());
        assert!(settings(&["--egress-deny", "a.test", "--engine", "podman"]).is_ok());
        assert!(settings(&["--egress-deny", "a.test", "--warm-pool", "1"]).is_ok());
    }
}
