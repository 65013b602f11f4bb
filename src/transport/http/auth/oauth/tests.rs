//! Unit tests of `oauth`.

use super::*;

fn verifier(scopes: &[&str]) -> Verifier {
    let config = OAuthConfig {
        issuer: "http://127.0.0.1:9/".to_owned(),
        audience: None,
        required_scopes: scopes.iter().map(|s| (*s).to_owned()).collect(),
        principal_claim: "sub".to_owned(),
        dashboard_client_id: None,
    };
    Verifier::new(&config, "http://127.0.0.1:8435/mcp".to_owned()).unwrap()
}

#[test]
fn metadata_lives_under_the_resource_path() {
    assert_eq!(
        metadata_url("https://mcp.example.com/mcp"),
        "https://mcp.example.com/.well-known/oauth-protected-resource/mcp"
    );
    assert_eq!(
        metadata_url("https://mcp.example.com"),
        "https://mcp.example.com/.well-known/oauth-protected-resource"
    );
    assert_eq!(
        metadata_url("http://127.0.0.1:8435/team/mcp/"),
        "http://127.0.0.1:8435/.well-known/oauth-protected-resource/team/mcp"
    );
}

#[test]
fn challenges_name_the_metadata_and_the_error() {
    let plain = verifier(&[]);
    let metadata =
        r#"resource_metadata="http://127.0.0.1:8435/.well-known/oauth-protected-resource/mcp""#;
    assert_eq!(
        plain.challenge(&Refusal::Missing),
        format!("Bearer {metadata}")
    );
    let scoped = verifier(&["mcp:tools", "openid"]);
    assert_eq!(
        scoped.challenge(&Refusal::Invalid("the \"token\" expired".to_owned())),
        format!(
            r#"Bearer error="invalid_token", error_description="the token expired", scope="mcp:tools openid", {metadata}"#
        )
    );
    assert_eq!(
        scoped.challenge(&Refusal::InsufficientScope),
        format!(r#"Bearer error="insufficient_scope", scope="mcp:tools openid", {metadata}"#)
    );
    let document = scoped.resource_metadata();
    assert_eq!(document["resource"], "http://127.0.0.1:8435/mcp");
    assert_eq!(document["authorization_servers"][0], "http://127.0.0.1:9/");
    assert_eq!(document["scopes_supported"][1], "openid");
}

#[test]
fn form_bodies_are_encoded_as_browsers_do() {
    assert_eq!(
        form_encode(&[
            ("grant_type", "authorization_code"),
            ("redirect_uri", "http://127.0.0.1:8435/"),
            ("code", "a b+c~d*e"),
        ]),
        "grant_type=authorization_code&redirect_uri=http%3A%2F%2F127.0.0.1%3A8435%2F&code=a+b%2Bc%7Ed*e"
    );
    assert_eq!(form_encode(&[("x", "é")]), "x=%C3%A9");
}

#[test]
fn scopes_come_from_scope_or_scp() {
    assert_eq!(
        scopes(&json!({"scope": "a b", "scp": ["c"]})),
        ["a", "b", "c"]
    );
    assert_eq!(scopes(&json!({"scp": "d e"})), ["d", "e"]);
    assert!(scopes(&json!({})).is_empty());
}

/// RFC 8037 appendix A.1's Ed25519 key: the private seed `d` (decoded) and the public `x`.
const ED25519_SEED: [u8; 32] = [
    0x9d, 0x61, 0xb1, 0x9d, 0xef, 0xfd, 0x5a, 0x60, 0xba, 0x84, 0x4a, 0xf4, 0x92, 0xec, 0x2c, 0xc4,
    0x44, 0x49, 0xc5, 0x69, 0x7b, 0x32, 0x69, 0x19, 0x70, 0x3b, 0xac, 0x03, 0x1c, 0xae, 0x7f, 0x60,
];
const ED25519_X: &str = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo";

/// A verifier that already holds the RFC 8037 key as its JWKS (nothing is fetched), and a
/// signer of tokens with that key.
fn verifier_with_key() -> (Verifier, impl Fn(Value) -> String) {
    let check = verifier(&[]);
    let set: JwkSet = serde_json::from_value(json!({"keys": [
        {"kty": "OKP", "crv": "Ed25519", "x": ED25519_X, "kid": "k1", "alg": "EdDSA"}
    ]}))
    .unwrap();
    check.keys.try_lock().unwrap().set = Some(set);
    // PKCS#8 of an Ed25519 private key: a fixed 16-byte prefix, then the 32-byte seed.
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend_from_slice(&ED25519_SEED);
    let key = jsonwebtoken::EncodingKey::from_ed_der(&der);
    let sign = move |claims: Value| {
        let mut header = jsonwebtoken::Header::new(Algorithm::EdDSA);
        header.kid = Some("k1".to_owned());
        jsonwebtoken::encode(&header, &claims, &key).unwrap()
    };
    (check, sign)
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[test]
fn times_of_the_wrong_type_are_refused() {
    // See: issue 30 (CVE-2026-25537)
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (check, sign) = verifier_with_key();
    let claims = |extra: Value| {
        let mut claims = json!({
            "iss": "http://127.0.0.1:9/", "aud": "http://127.0.0.1:8435/mcp", "sub": "alice",
            "exp": now() + 600,
        });
        claims
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        claims
    };
    assert!(
        runtime
            .block_on(check.verify(&sign(claims(json!({})))))
            .is_ok()
    );
    let refused = |why: &str| Err(Refusal::Invalid(why.to_owned()));
    let nbf = "the access token's nbf claim is not a number";
    let exp = "the access token has no usable exp claim";
    for (extra, why) in [
        (json!({"nbf": (now() + 600).to_string()}), nbf),
        (
            json!({"nbf": now() - 600, "exp": (now() + 600).to_string()}),
            exp,
        ),
        (json!({"exp": (now() - 600).to_string()}), exp),
    ] {
        assert_eq!(
            runtime.block_on(check.verify(&sign(claims(extra.clone())))),
            refused(why),
            "{extra}"
        );
    }
    // Another type again: refused, for whatever reason the library gives.
    assert!(
        runtime
            .block_on(check.verify(&sign(claims(json!({"nbf": [now() + 600]})))))
            .is_err()
    );
}

#[test]
fn token_principals_are_named_after_the_issuer() {
    // See: issue 30
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (check, sign) = verifier_with_key();
    let token = |sub: &str| {
        sign(json!({
            "iss": "http://127.0.0.1:9/", "aud": "http://127.0.0.1:8435/mcp", "sub": sub,
            "exp": now() + 600,
        }))
    };
    let principal = runtime.block_on(check.verify(&token("bob"))).unwrap();
    assert_eq!(principal.as_str(), "http://127.0.0.1:9#bob");
    assert_ne!(principal, Principal::named("bob").unwrap());
    let default = runtime.block_on(check.verify(&token("default"))).unwrap();
    assert!(!default.is_default());
    assert_eq!(
        runtime.block_on(check.verify(&token("bo\u{200b}b"))),
        Err(Refusal::Invalid(
            "the access token's principal is not a valid name".to_owned()
        ))
    );
    assert!(check.principal_claim_warning().is_none());
    let mut email = verifier(&[]);
    email.principal_claim = "email".to_owned();
    assert!(
        email
            .principal_claim_warning()
            .is_some_and(|w| w.starts_with("--oauth-principal-claim email: "))
    );
}

#[test]
fn garbage_and_symmetric_tokens_are_refused_before_any_fetch() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let check = verifier(&[]);
    // Port 9 (discard) on loopback: nothing is fetched for either.
    assert!(matches!(
        runtime.block_on(check.verify("not-a-jwt")),
        Err(Refusal::Invalid(_))
    ));
    let hs256 = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(Algorithm::HS256),
        &json!({"sub": "mallory", "exp": 4_000_000_000u64}),
        &jsonwebtoken::EncodingKey::from_secret(b"public"),
    )
    .unwrap();
    assert_eq!(
        runtime.block_on(check.verify(&hs256)),
        Err(Refusal::Invalid(
            "the access token's signature algorithm is not accepted".to_owned()
        ))
    );
}
