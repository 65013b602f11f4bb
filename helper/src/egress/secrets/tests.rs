//! Unit tests of the substitution and refusal rules (`super::rewrite`, `super::check`).

use super::*;

const GH: &str = "kts_0123456789abcdef0123456789abcdef";
const NPM: &str = "kts_fedcba9876543210fedcba9876543210";
const VALUE: &str = "ghp_realvalue";

fn secret(name: &str, placeholder: &str, hosts: &[&str], template: &str, value: &str) -> Secret {
    let hosts = hosts.iter().map(|h| Rule::parse(h).unwrap()).collect();
    Secret::new(
        name,
        placeholder,
        hosts,
        template.as_bytes(),
        value.as_bytes().to_vec(),
    )
    .unwrap()
}

fn secrets() -> Vec<Secret> {
    vec![
        secret(
            "GH_TOKEN",
            GH,
            &["api.github.test", "*.github.test"],
            "Authorization: Bearer {}",
            VALUE,
        ),
        secret(
            "NPM_TOKEN",
            NPM,
            &["registry.npm.test"],
            "X-Api-Key: {}",
            "npm-value",
        ),
    ]
}

fn to(host: &str) -> Dest {
    Dest::Name(host.to_owned())
}

fn rewritten(head: &str, host: &str, port: u16) -> Result<String, String> {
    rewrite(head.as_bytes(), &secrets(), &to(host), port)
        .map(|bytes| String::from_utf8(bytes).unwrap())
}

#[test]
fn a_bound_placeholder_in_a_header_becomes_the_value() {
    let out = rewritten(
        &format!(
            "GET /repos HTTP/1.1\r\nHost: api.github.test\r\nAuthorization: token {GH}\r\n\r\n"
        ),
        "api.github.test",
        443,
    )
    .unwrap();
    assert_eq!(
        out,
        format!(
            "GET /repos HTTP/1.1\r\nHost: api.github.test\r\nAuthorization: token {VALUE}\r\nConnection: close\r\n\r\n"
        )
    );
    // Subdomains through the wildcard; uppercase placeholders too.
    let out = rewritten(
        &format!(
            "GET / HTTP/1.1\r\nHost: x.github.test\r\nX-A: a{}b{GH}\r\n\r\n",
            GH.to_uppercase()
        ),
        "x.github.test",
        80,
    )
    .unwrap();
    assert!(out.contains(&format!("X-A: a{VALUE}b{VALUE}\r\n")), "{out}");
    assert!(!out.contains("Authorization"), "{out}");
}

#[test]
fn a_placeholder_to_a_host_it_is_not_bound_to_is_refused() {
    let not_bound = Err(not_bound_reason("GH_TOKEN"));
    for head in [
        format!("GET / HTTP/1.1\r\nHost: evil.test\r\nAuthorization: Bearer {GH}\r\n\r\n"),
        format!("GET /?t={GH} HTTP/1.1\r\nHost: evil.test\r\n\r\n"),
        format!(
            "GET / HTTP/1.1\r\nHost: evil.test\r\nX: {}\r\n\r\n",
            GH.to_uppercase()
        ),
        format!(
            "GET / HTTP/1.1\r\nHost: evil.test\r\nAuthorization: Basic {}\r\n\r\n",
            base64::encode(format!("x:{GH}").as_bytes())
        ),
    ] {
        assert_eq!(rewritten(&head, "evil.test", 443), not_bound, "{head}");
    }
    // Bound to the host, but not on that port (patterns without a port cover 80 and 443).
    assert_eq!(
        rewritten(
            &format!("GET / HTTP/1.1\r\nHost: api.github.test:8443\r\nX: {GH}\r\n\r\n"),
            "api.github.test",
            8443
        ),
        not_bound
    );
    // Two secrets: the one not bound to the host is named.
    assert_eq!(
        rewritten(
            &format!("GET / HTTP/1.1\r\nHost: api.github.test\r\nX: {GH}\r\nY: {NPM}\r\n\r\n"),
            "api.github.test",
            443
        ),
        Err(not_bound_reason("NPM_TOKEN"))
    );
    // A CONNECT head alone.
    let connect = format!("CONNECT evil.test:443 HTTP/1.1\r\nProxy-Authorization: {GH}\r\n\r\n");
    assert_eq!(
        check(connect.as_bytes(), &secrets(), &to("evil.test"), 443),
        Err(not_bound_reason("GH_TOKEN"))
    );
    assert_eq!(
        check(connect.as_bytes(), &secrets(), &to("api.github.test"), 443),
        Ok(())
    );
}

#[test]
fn placeholders_in_the_request_line_and_the_body_are_left_alone() {
    let head = format!("POST /x?token={GH} HTTP/1.1\r\nHost: api.github.test\r\n\r\n");
    let out = rewritten(&head, "api.github.test", 443).unwrap();
    assert!(
        out.starts_with(&format!("POST /x?token={GH} HTTP/1.1\r\n")),
        "{out}"
    );
    // The template's header is added, since no header carried the placeholder.
    assert!(
        out.contains(&format!("Authorization: Bearer {VALUE}\r\n")),
        "{out}"
    );
    // A body is never given to `rewrite`: a head must end with its blank line.
    let with_body = format!("{head}{GH}");
    assert!(rewritten(&with_body, "api.github.test", 443).is_err());
}

#[test]
fn basic_credentials_are_decoded_replaced_and_encoded() {
    let credentials = base64::encode(format!("x-access-token:{GH}").as_bytes());
    let out = rewritten(
        &format!(
            "GET /o/r.git/info/refs HTTP/1.1\r\nHost: api.github.test\r\nauthorization: basic {credentials}\r\n\r\n"
        ),
        "api.github.test",
        443,
    )
    .unwrap();
    let expected = base64::encode(format!("x-access-token:{VALUE}").as_bytes());
    assert!(
        out.contains(&format!("authorization: Basic {expected}\r\n")),
        "{out}"
    );
    // The placeholder was carried, so the template's header is not added again.
    assert_eq!(out.matches("uthorization").count(), 1, "{out}");
}

#[test]
fn the_template_header_is_added_only_when_absent_and_not_carried() {
    let out = rewritten(
        "GET / HTTP/1.1\r\nHost: api.github.test\r\n\r\n",
        "api.github.test",
        443,
    )
    .unwrap();
    assert!(out.contains(&format!("Authorization: Bearer {VALUE}\r\n")));
    // The request's own Authorization header is kept as it is.
    let out = rewritten(
        "GET / HTTP/1.1\r\nHost: api.github.test\r\nAUTHORIZATION: Bearer mine\r\n\r\n",
        "api.github.test",
        443,
    )
    .unwrap();
    assert!(out.contains("AUTHORIZATION: Bearer mine\r\n"));
    assert!(!out.contains(VALUE));
    // Carried in another header: not added.
    let out = rewritten(
        &format!("GET / HTTP/1.1\r\nHost: api.github.test\r\nX-Token: {GH}\r\n\r\n"),
        "api.github.test",
        443,
    )
    .unwrap();
    assert_eq!(out.matches(VALUE).count(), 1, "{out}");
    assert!(!out.contains("Authorization"));
    // A host no secret is bound to gets nothing, but still Connection: close.
    let out = rewritten(
        "GET / HTTP/1.1\r\nHost: other.test\r\nConnection: keep-alive\r\n\r\n",
        "other.test",
        80,
    )
    .unwrap();
    assert_eq!(
        out,
        "GET / HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n"
    );
}

#[test]
fn connection_close_replaces_keep_alive_but_not_an_upgrade() {
    let out = rewritten(
        "GET / HTTP/1.1\r\nConnection: keep-alive\r\nHost: api.github.test\r\nconnection: x\r\n\r\n",
        "api.github.test",
        443,
    )
    .unwrap();
    assert_eq!(out.matches("onnection").count(), 1, "{out}");
    assert!(out.ends_with("Connection: close\r\n\r\n"), "{out}");
    let upgrade = format!(
        "GET /ws HTTP/1.1\r\nHost: api.github.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nX-T: {GH}\r\n\r\n"
    );
    let out = rewritten(&upgrade, "api.github.test", 443).unwrap();
    assert!(
        out.contains("Connection: Upgrade\r\nUpgrade: websocket\r\n"),
        "{out}"
    );
    assert!(!out.contains("close"), "{out}");
    assert!(out.contains(&format!("X-T: {VALUE}\r\n")), "{out}");
}

#[test]
fn hostile_heads_are_bounded() {
    // 10,000 headers do not fit in a head.
    let mut many = "GET / HTTP/1.1\r\nHost: api.github.test\r\n".to_owned();
    for _ in 0..10_000 {
        many.push_str(&format!("X: {GH}\r\n"));
    }
    many.push_str("\r\n");
    assert_eq!(
        rewritten(&many, "api.github.test", 443),
        Err("request head too large".to_owned())
    );
    // As many placeholders as fit, with a large value: refused, not grown.
    let big = secret(
        "BIG",
        GH,
        &["api.github.test"],
        "X-Big: {}",
        &"v".repeat(MAX_VALUE),
    );
    let mut head = "GET / HTTP/1.1\r\nHost: api.github.test\r\nX: ".to_owned();
    while head.len() + GH.len() + 4 < MAX_HEAD {
        head.push_str(GH);
    }
    head.push_str("\r\n\r\n");
    assert_eq!(
        rewrite(head.as_bytes(), &[&big], &to("api.github.test"), 443),
        Err(TOO_LARGE_AFTER.to_owned())
    );
    // A few values fit.
    let few = format!("GET / HTTP/1.1\r\nHost: api.github.test\r\nX: {GH}{GH}{GH}\r\n\r\n");
    let out = rewrite(few.as_bytes(), &[&big], &to("api.github.test"), 443).unwrap();
    assert!(out.len() > 3 * MAX_VALUE && out.len() <= MAX_REWRITTEN);
    // Malformed heads.
    for bad in [
        "GET / HTTP/1.1\r\nHost: a.test\r\n",
        "GET / HTTP/1.1\r\nno colon\r\n\r\n",
    ] {
        assert!(rewritten(bad, "a.test", 80).is_err(), "{bad:?}");
    }
}

#[test]
fn secrets_are_checked_and_never_shown() {
    let ok = secrets();
    let shown = format!("{:?}", ok);
    assert!(!shown.contains(VALUE) && !shown.contains(GH), "{shown}");
    let hosts = || vec![Rule::parse("a.test").unwrap()];
    for (name, placeholder, template, value) in [
        ("lower", GH, "X: {}", "v"),
        ("1ABC", GH, "X: {}", "v"),
        (&*"A".repeat(65), GH, "X: {}", "v"),
        ("A", &*GH.to_uppercase(), "X: {}", "v"),
        ("A", &GH[..35], "X: {}", "v"),
        ("A", GH, "X: none", "v"),
        ("A", GH, "X: {}{}", "v"),
        ("A", GH, "X Y: {}", "v"),
        ("A", GH, ": {}", "v"),
        ("A", GH, "Host: {}", "v"),
        ("A", GH, "X: {}\r\nY: z", "v"),
        ("A", GH, "X: {}", ""),
        ("A", GH, "X: {}", "a\r\nb"),
        ("A", GH, "X: {}", "a\0b"),
        ("A", GH, "X: {}", &*"v".repeat(MAX_VALUE + 1)),
    ] {
        assert!(
            Secret::new(
                name,
                placeholder,
                hosts(),
                template.as_bytes(),
                value.into()
            )
            .is_err(),
            "{name} {placeholder} {template:?}"
        );
    }
    assert!(Secret::new("A", GH, Vec::new(), b"X: {}", b"v".to_vec()).is_err());
    assert!(Secret::new("A_1", GH, hosts(), b"X-Key:{}", b"v".to_vec()).is_ok());
}
