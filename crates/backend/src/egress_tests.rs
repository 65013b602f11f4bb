//! Unit tests of the egress policy model: pattern parsing and normalisation, matching, the
//! deny-beats-allow decision, narrowing, and the recorded label.

use super::*;

fn pattern(text: &str) -> Pattern {
    Pattern::parse(text).unwrap()
}

fn name(text: &str) -> Host {
    Host::parse(text).unwrap()
}

fn policy(mode: EgressMode, allow: &[&str], deny: &[&str]) -> EgressPolicy {
    EgressPolicy {
        mode,
        allow: allow.iter().map(|p| pattern(p)).collect(),
        deny: deny.iter().map(|p| pattern(p)).collect(),
        ask: false,
        allow_private: false,
    }
}

#[test]
fn patterns_normalise_case_trailing_dot_idna_and_host_bits() {
    assert_eq!(pattern("Example.COM.").to_string(), "example.com");
    assert_eq!(
        pattern("*.Example.com:8443").to_string(),
        "*.example.com:8443"
    );
    assert_eq!(
        pattern("bücher.example").to_string(),
        "xn--bcher-kva.example"
    );
    assert_eq!(pattern("203.0.113.7").to_string(), "203.0.113.7");
    assert_eq!(pattern("203.0.113.7/24").to_string(), "203.0.113.0/24");
    assert_eq!(pattern("2001:db8::1").to_string(), "2001:db8::1");
    assert_eq!(
        pattern("[2001:db8::1]:443").to_string(),
        "[2001:db8::1]:443"
    );
    assert_eq!(pattern("2001:db8::/32").to_string(), "2001:db8::/32");
    assert_eq!(pattern("db.example.com:5432").port, Some(5432));
}

#[test]
fn invalid_patterns_say_why() {
    for (text, error) in [
        ("", PatternError::Empty),
        ("example.com:0", PatternError::BadPort),
        ("example.com:70000", PatternError::BadPort),
        ("example.com:", PatternError::BadPort),
        ("example.com:+80", PatternError::BadPort),
        ("10.0.0.0/33", PatternError::BadPrefix(32)),
        ("10.0.0.0/024", PatternError::BadPrefix(32)),
        ("10.0.0.0/", PatternError::BadPrefix(32)),
        ("2001:db8::/129", PatternError::BadPrefix(128)),
        ("example/24", PatternError::BadNetwork),
        ("*example.com", PatternError::BadWildcard),
        ("a.*.example.com", PatternError::BadWildcard),
        ("*", PatternError::BadWildcard),
    ] {
        assert_eq!(Pattern::parse(text), Err(error), "{text:?}");
    }
    for text in [
        "exa mple.com",
        "a..b",
        "-",
        "under_score.example",
        "1.2.3",
        "x.123",
        "[::1",
    ] {
        assert!(Pattern::parse(text).is_err(), "{text:?} was accepted");
    }
    let long = format!("{}.example", "a".repeat(64));
    assert!(Pattern::parse(&long).is_err());
}

#[test]
fn names_match_exactly_and_wildcards_only_subdomains() {
    let exact = pattern("example.com");
    assert!(exact.matches(&name("EXAMPLE.com."), 443));
    assert!(exact.matches(&name("example.com"), 80));
    assert!(!exact.matches(&name("example.com"), 8080));
    assert!(!exact.matches(&name("sub.example.com"), 443));
    assert!(!exact.matches(&name("badexample.com"), 443));
    let wild = pattern("*.example.com");
    assert!(wild.matches(&name("a.example.com"), 443));
    assert!(wild.matches(&name("a.b.example.com"), 443));
    assert!(!wild.matches(&name("example.com"), 443));
    assert!(!wild.matches(&name("aexample.com"), 443));
    let port = pattern("db.example.com:5432");
    assert!(port.matches(&name("db.example.com"), 5432));
    assert!(!port.matches(&name("db.example.com"), 443));
}

#[test]
fn ip_literals_match_only_ip_rules() {
    let net = pattern("203.0.113.0/24");
    assert!(net.matches(&Host::parse("203.0.113.9").unwrap(), 443));
    assert!(!net.matches(&Host::parse("203.0.114.9").unwrap(), 443));
    assert!(!net.matches(&Host::parse("::ffff:203.0.113.9").unwrap(), 443));
    // A name rule never matches an address, even the one the name resolves to.
    assert!(!pattern("example.com").matches(&Host::parse("203.0.113.9").unwrap(), 443));
    assert!(pattern("[2001:db8::1]:22").matches(&Host::parse("[2001:db8::1]").unwrap(), 22));
}

#[test]
fn deny_beats_allow_and_the_mode_decides_the_rest() {
    let p = policy(
        EgressMode::Allowlist,
        &["*.example.com"],
        &["evil.example.com"],
    );
    assert_eq!(p.decide(&name("api.example.com"), 443), Verdict::Allowed);
    assert_eq!(
        p.decide(&name("evil.example.com"), 443),
        Verdict::Refused(Refusal::DeniedByRule("evil.example.com".into()))
    );
    assert_eq!(
        p.decide(&name("other.test"), 443),
        Verdict::Refused(Refusal::NotAllowed)
    );
    let asking = EgressPolicy {
        ask: true,
        ..p.clone()
    };
    assert_eq!(asking.decide(&name("other.test"), 443), Verdict::Ask);
    // No question is ever asked for a denied host.
    assert!(matches!(
        asking.decide(&name("evil.example.com"), 443),
        Verdict::Refused(_)
    ));
    let open = policy(EgressMode::Open, &[], &["*.evil.example"]);
    assert_eq!(open.decide(&name("anything.test"), 443), Verdict::Allowed);
    assert_eq!(
        open.decide(&name("x.evil.example"), 80).clone(),
        Verdict::Refused(Refusal::DeniedByRule("*.evil.example".into()))
    );
    let none = policy(EgressMode::None, &[], &[]);
    assert_eq!(
        none.decide(&name("a.test"), 443),
        Verdict::Refused(Refusal::NoNetwork)
    );
    assert_eq!(
        Refusal::NotAllowed.to_string(),
        "not in this computer's allow-list"
    );
}

#[test]
fn narrowing_accepts_only_patterns_inside_the_servers() {
    let server = policy(
        EgressMode::Allowlist,
        &["*.example.com", "10.1.0.0/16", "api.test"],
        &["bad.example.com"],
    );
    let narrowed = server
        .narrowed(&[
            pattern("a.example.com"),
            pattern("*.b.example.com"),
            pattern("10.1.2.0/24"),
        ])
        .unwrap();
    assert_eq!(narrowed.mode, EgressMode::Allowlist);
    assert_eq!(narrowed.allow.len(), 3);
    assert_eq!(narrowed.deny, server.deny);
    for wider in [
        "example.com",
        "*.com",
        "10.0.0.0/8",
        "api.test:8080",
        "other.test",
    ] {
        let error = server.narrowed(&[pattern(wider)]).unwrap_err();
        assert_eq!(error.pattern, wider);
        assert!(error.to_string().contains(&format!("'{wider}'")), "{error}");
    }
    // A rule with one default port fits inside a default-port rule, not the other way round.
    assert!(server.narrowed(&[pattern("api.test:443")]).is_ok());
    let port_only = policy(EgressMode::Allowlist, &["api.test:443"], &[]);
    assert!(port_only.narrowed(&[pattern("api.test")]).is_err());
    // Open narrows to an allow-list of anything not denied; none narrows to nothing.
    let open = policy(EgressMode::Open, &[], &["*.evil.test"]);
    assert_eq!(
        open.narrowed(&[pattern("a.test")]).unwrap().mode,
        EgressMode::Allowlist
    );
    assert!(open.narrowed(&[pattern("x.evil.test")]).is_err());
    assert!(
        policy(EgressMode::None, &[], &[])
            .narrowed(&[pattern("a.test")])
            .is_err()
    );
}

#[test]
fn a_person_may_add_only_rules_within_the_servers_bounds() {
    let mut server = policy(
        EgressMode::Allowlist,
        &["*.example.com", "api.test"],
        &["bad.example.com"],
    );
    assert!(server.admits(&pattern("a.example.com")).is_ok());
    assert!(server.admits(&pattern("api.test:443")).is_ok());
    let outside = server.admits(&pattern("other.test")).unwrap_err();
    assert!(
        matches!(&outside, GrantError::Outside { pattern, .. } if pattern == "other.test"),
        "{outside}"
    );
    assert!(outside.to_string().contains("'other.test'"), "{outside}");
    let denied = server.admits(&pattern("bad.example.com")).unwrap_err();
    assert_eq!(
        denied.to_string(),
        "'bad.example.com' is denied by this server's rule 'bad.example.com'; a person cannot allow it."
    );
    // With --egress-ask a person could allow any host no deny rule covers: so can the dashboard.
    server.ask = true;
    assert!(server.admits(&pattern("other.test")).is_ok());
    assert!(server.admits(&pattern("bad.example.com")).is_err());
    let open = policy(EgressMode::Open, &[], &["*.evil.test"]);
    assert!(open.admits(&pattern("a.test")).is_ok());
    assert!(open.admits(&pattern("x.evil.test")).is_err());
    assert!(
        policy(EgressMode::None, &[], &[])
            .admits(&pattern("a.test"))
            .is_err()
    );
}

#[test]
fn the_label_round_trips_and_refuses_what_it_cannot_read() {
    let p = EgressPolicy {
        ask: true,
        ..policy(
            EgressMode::Allowlist,
            &["a.test", "[2001:db8::1]:22"],
            &["10.0.0.0/8"],
        )
    };
    let label = p.to_label();
    assert_eq!(
        label,
        r#"{"mode":"allowlist","allow":["a.test","[2001:db8::1]:22"],"deny":["10.0.0.0/8"],"ask":true,"allow_private":false}"#
    );
    assert_eq!(EgressPolicy::from_label(&label).unwrap(), p);
    for bad in [
        "",
        "[]",
        r#"{"mode":"wide"}"#,
        r#"{"mode":"open","allow":["a..b"]}"#,
        r#"{"mode":"open","deny":"x"}"#,
    ] {
        assert!(EgressPolicy::from_label(bad).is_err(), "{bad:?}");
    }
    assert!(EgressPolicy::open().is_unfiltered());
    assert!(!policy(EgressMode::Open, &[], &["a.test"]).is_unfiltered());
}

#[test]
fn a_refusal_becomes_the_stderr_line() {
    let denial = Denial {
        host: "other.test".to_owned(),
        port: 443,
        reason: "not in this computer's allow-list".to_owned(),
    };
    assert_eq!(
        denial.stderr_line(),
        "[kilntainers: network access to other.test:443 was blocked: not in this computer's allow-list]"
    );
}

#[test]
fn the_stderr_tail_shows_each_host_once_and_counts_past_five() {
    let denial = |host: &str, port: u16| Denial {
        host: host.to_owned(),
        port,
        reason: "why".to_owned(),
    };
    assert_eq!(stderr_tail(&[], false), "");
    assert_eq!(
        stderr_tail(&[denial("a.test", 443), denial("a.test", 443)], false),
        "\n[kilntainers: network access to a.test:443 was blocked: why]\n"
    );
    let many: Vec<Denial> = (0..8).map(|n| denial(&format!("h{n}.test"), 80)).collect();
    let tail = stderr_tail(&many, true);
    assert_eq!(tail.lines().count(), 6);
    assert!(tail.starts_with("[kilntainers: network access to h0.test:80"));
    assert!(tail.ends_with("[kilntainers: 3 more network accesses were blocked]\n"));
}

#[test]
fn deny_rules_within_allow_rules_are_found_ports_aside() {
    let apart = policy(
        EgressMode::Allowlist,
        &["a.test", "203.0.113.0/24"],
        &["b.test", "198.51.100.7"],
    );
    assert_eq!(apart.deny_within_allow(), None);
    let nested = policy(EgressMode::Allowlist, &["*.a.test"], &["x.b.a.test:22"]);
    assert_eq!(
        nested.deny_within_allow(),
        Some((&pattern("x.b.a.test:22"), &pattern("*.a.test")))
    );
    // Wider deny rules overlap too; an apex is not its own subdomain; a name never an address.
    assert!(pattern("*.a.test").overlaps_host(&pattern("*.x.a.test")));
    assert!(pattern("10.0.0.0/8").overlaps_host(&pattern("10.1.2.3:5432")));
    assert!(!pattern("*.a.test").overlaps_host(&pattern("a.test")));
    assert!(!pattern("a.test").overlaps_host(&pattern("203.0.113.7")));
    assert!(!pattern("10.0.0.0/8").overlaps_host(&pattern("2001:db8::/32")));
}
