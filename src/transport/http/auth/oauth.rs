//! The OAuth 2.1 resource server (docs/auth.md, "OAuth"): JWT access tokens of one issuer,
//! verified against the issuer's JWKS with `jsonwebtoken` (signature, `iss`, `aud`, `exp`,
//! `nbf`), and the protected-resource metadata of RFC 9728 that tells clients which
//! authorization server to ask.
//!
//! The issuer's metadata (RFC 8414, else OpenID discovery) and keys are fetched on first use
//! and kept; a token signed with a key id not in the set refetches the keys, at most once per
//! [`REFETCH_INTERVAL`] so that made-up key ids cannot turn us into a load generator against the
//! issuer. Everything fetched is bounded in time and size.

use std::time::{Duration, Instant};

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Value, json};
use tokio::sync::Mutex;

use super::Refusal;
use crate::config::OAuthConfig;
use crate::ids::Principal;

/// Clock skew tolerated on `exp` and `nbf`.
const LEEWAY_SECS: u64 = 30;
/// Shortest time between two key fetches caused by unknown key ids.
const REFETCH_INTERVAL: Duration = Duration::from_secs(10);
/// Bound of one metadata or key fetch.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest metadata or key document read.
const MAX_DOCUMENT_BYTES: usize = 1024 * 1024;
/// Signature algorithms accepted: asymmetric only, so no key in a public JWKS can sign.
const ALGORITHMS: [Algorithm; 9] = [
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
    Algorithm::ES256,
    Algorithm::ES384,
    Algorithm::EdDSA,
];

#[derive(Default)]
struct Keys {
    jwks_uri: Option<String>,
    set: Option<JwkSet>,
    fetched: Option<Instant>,
}

/// Checks access tokens for one issuer and audience.
pub struct Verifier {
    issuer: String,
    audience: String,
    required_scopes: Vec<String>,
    principal_claim: String,
    http: reqwest::Client,
    keys: Mutex<Keys>,
}

/// `scheme://authority` and the path of an absolute URL.
fn split_url(url: &str) -> (&str, &str) {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return (url, "");
    };
    match url[scheme_end..].find('/') {
        Some(slash) => url.split_at(scheme_end + slash),
        None => (url, ""),
    }
}

/// RFC 9728 §3.1: the metadata of resource `https://h/p` is at
/// `https://h/.well-known/oauth-protected-resource/p`.
pub fn metadata_url(resource: &str) -> String {
    let (origin, path) = split_url(resource);
    format!(
        "{origin}/.well-known/oauth-protected-resource{}",
        path.trim_end_matches('/')
    )
}

impl Verifier {
    /// `default_audience` is the listener's own `/mcp` URL, used without `--oauth-audience`.
    pub fn new(config: &OAuthConfig, default_audience: String) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("Cannot set up the OAuth HTTP client: {e}"))?;
        Ok(Self {
            issuer: config.issuer.clone(),
            audience: config.audience.clone().unwrap_or(default_audience),
            required_scopes: config.required_scopes.clone(),
            principal_claim: config.principal_claim.clone(),
            http,
            keys: Mutex::new(Keys::default()),
        })
    }

    pub fn audience(&self) -> &str {
        &self.audience
    }

    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// The RFC 9728 document served at [`metadata_url`].
    pub fn resource_metadata(&self) -> Value {
        let mut document = json!({
            "resource": self.audience,
            "authorization_servers": [self.issuer],
            "bearer_methods_supported": ["header"],
            "resource_name": "mcp-sandbox-computer-vm-for-ai",
        });
        if !self.required_scopes.is_empty() {
            document["scopes_supported"] = json!(self.required_scopes);
        }
        document
    }

    /// The `WWW-Authenticate` challenge (RFC 6750 §3, RFC 9728 §5.1).
    pub fn challenge(&self, refusal: &Refusal) -> String {
        let metadata = metadata_url(&self.audience);
        let scope = self.required_scopes.join(" ");
        let mut parts: Vec<String> = Vec::new();
        match refusal {
            Refusal::Missing => {}
            Refusal::Invalid(reason) => {
                parts.push(r#"error="invalid_token""#.to_owned());
                parts.push(format!(r#"error_description="{}""#, quoted(reason)));
            }
            Refusal::InsufficientScope => {
                parts.push(r#"error="insufficient_scope""#.to_owned());
            }
        }
        if !scope.is_empty() {
            parts.push(format!(r#"scope="{}""#, quoted(&scope)));
        }
        parts.push(format!(r#"resource_metadata="{}""#, quoted(&metadata)));
        format!("Bearer {}", parts.join(", "))
    }

    /// The principal of a valid access token.
    pub async fn verify(&self, token: &str) -> Result<Principal, Refusal> {
        let invalid = |reason: &str| Refusal::Invalid(reason.to_owned());
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| invalid("the access token is not a JWT"))?;
        if !ALGORITHMS.contains(&header.alg) {
            return Err(invalid(
                "the access token's signature algorithm is not accepted",
            ));
        }
        let key = self.key(header.kid.as_deref(), header.alg).await?;
        let mut validation = Validation::new(header.alg);
        validation.leeway = LEEWAY_SECS;
        validation.validate_nbf = true;
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[&self.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        let claims = jsonwebtoken::decode::<Value>(token, &key, &validation)
            .map_err(|error| {
                use jsonwebtoken::errors::ErrorKind;
                invalid(match error.kind() {
                    ErrorKind::ExpiredSignature => "the access token has expired",
                    ErrorKind::ImmatureSignature => "the access token is not valid yet",
                    ErrorKind::InvalidAudience => "the access token is for another resource (aud)",
                    ErrorKind::InvalidIssuer => "the access token is from another issuer (iss)",
                    ErrorKind::InvalidSignature => "the access token's signature does not verify",
                    ErrorKind::MissingRequiredClaim(_) => "the access token lacks exp, iss or aud",
                    _ => "the access token is not valid",
                })
            })?
            .claims;
        if !self.required_scopes.is_empty() {
            let granted = scopes(&claims);
            if !self
                .required_scopes
                .iter()
                .all(|s| granted.iter().any(|g| g == s))
            {
                return Err(Refusal::InsufficientScope);
            }
        }
        let name = claims
            .get(&self.principal_claim)
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("the access token names no principal"))?;
        let principal = Principal::parse(name)
            .ok_or_else(|| invalid("the access token's principal is not a valid name"))?;
        // `default` owns the computers of the single token and of the time before principals;
        // no token from outside may speak for it.
        if principal.is_default() {
            return Err(invalid("the principal 'default' is reserved"));
        }
        Ok(principal)
    }

    /// The verification key for `kid`, fetching the issuer's keys when needed.
    async fn key(&self, kid: Option<&str>, alg: Algorithm) -> Result<DecodingKey, Refusal> {
        let mut keys = self.keys.lock().await;
        if let Some(key) = find(keys.set.as_ref(), kid, alg) {
            return key;
        }
        let stale = keys
            .fetched
            .is_none_or(|at| at.elapsed() >= REFETCH_INTERVAL);
        if stale {
            match self.fetch_keys(&mut keys).await {
                Ok(()) => {
                    if let Some(key) = find(keys.set.as_ref(), kid, alg) {
                        return key;
                    }
                }
                Err(error) => {
                    tracing::warn!(issuer = %self.issuer, %error, "cannot fetch the OAuth issuer's keys");
                    return Err(Refusal::Invalid(
                        "the authorization server's keys are unavailable".to_owned(),
                    ));
                }
            }
        }
        Err(Refusal::Invalid(
            "the access token is signed with an unknown key".to_owned(),
        ))
    }

    async fn fetch_keys(&self, keys: &mut Keys) -> Result<(), String> {
        keys.fetched = Some(Instant::now());
        let jwks_uri = match &keys.jwks_uri {
            Some(uri) => uri.clone(),
            None => {
                let uri = self.discover_jwks_uri().await?;
                keys.jwks_uri = Some(uri.clone());
                uri
            }
        };
        let document = self.fetch_json(&jwks_uri).await?;
        let set: JwkSet = serde_json::from_value(document)
            .map_err(|e| format!("{jwks_uri} is not a JWK set: {e}"))?;
        tracing::info!(issuer = %self.issuer, keys = set.keys.len(), "fetched the OAuth issuer's keys");
        keys.set = Some(set);
        Ok(())
    }

    /// `jwks_uri` from the issuer's RFC 8414 metadata, else its OpenID configuration; the
    /// document must name the configured issuer exactly.
    async fn discover_jwks_uri(&self) -> Result<String, String> {
        let issuer = self.issuer.trim_end_matches('/');
        let (origin, path) = split_url(issuer);
        let candidates = [
            format!("{origin}/.well-known/oauth-authorization-server{path}"),
            format!("{issuer}/.well-known/openid-configuration"),
        ];
        let mut errors = Vec::new();
        for url in candidates {
            match self.fetch_json(&url).await {
                Ok(document) => {
                    let named = document.get("issuer").and_then(Value::as_str);
                    if named.map(|n| n.trim_end_matches('/')) != Some(issuer) {
                        return Err(format!(
                            "{url} names issuer {named:?}, not the configured {}",
                            self.issuer
                        ));
                    }
                    let jwks_uri = document
                        .get("jwks_uri")
                        .and_then(Value::as_str)
                        .ok_or_else(|| format!("{url} has no jwks_uri"))?;
                    crate::config::check_oauth_url("jwks_uri", jwks_uri).map_err(|e| e.0)?;
                    return Ok(jwks_uri.to_owned());
                }
                Err(error) => errors.push(error),
            }
        }
        Err(errors.join("; "))
    }

    async fn fetch_json(&self, url: &str) -> Result<Value, String> {
        let mut response = self
            .http
            .get(url)
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        if !response.status().is_success() {
            return Err(format!("GET {url}: HTTP {}", response.status()));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?
        {
            if body.len() + chunk.len() > MAX_DOCUMENT_BYTES {
                return Err(format!("GET {url}: larger than {MAX_DOCUMENT_BYTES} bytes"));
            }
            body.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&body).map_err(|e| format!("GET {url}: not JSON: {e}"))
    }
}

/// The key for `kid` (or the only key, when the token names none) usable with `alg`.
fn find(
    set: Option<&JwkSet>,
    kid: Option<&str>,
    alg: Algorithm,
) -> Option<Result<DecodingKey, Refusal>> {
    let set = set?;
    let jwk = match kid {
        Some(kid) => set.find(kid)?,
        None if set.keys.len() == 1 => set.keys.first()?,
        None => return None,
    };
    if let Some(declared) = jwk.common.key_algorithm
        && format!("{declared:?}") != format!("{alg:?}")
    {
        return Some(Err(Refusal::Invalid(
            "the access token's algorithm does not match its key".to_owned(),
        )));
    }
    Some(
        DecodingKey::from_jwk(jwk).map_err(|_| {
            Refusal::Invalid("the authorization server's key cannot be used".to_owned())
        }),
    )
}

/// Scopes granted by a token: `scope` (space-separated, RFC 9068) or `scp` (a list or a
/// string, as some providers send).
fn scopes(claims: &Value) -> Vec<String> {
    let words = |text: &str| {
        text.split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let mut granted = claims
        .get("scope")
        .and_then(Value::as_str)
        .map(words)
        .unwrap_or_default();
    match claims.get("scp") {
        Some(Value::String(text)) => granted.extend(words(text)),
        Some(Value::Array(items)) => {
            granted.extend(items.iter().filter_map(Value::as_str).map(str::to_owned));
        }
        _ => {}
    }
    granted
}

/// A value for inside a quoted-string of a header: no quotes, backslashes or controls.
fn quoted(text: &str) -> String {
    text.chars()
        .filter(|c| *c != '"' && *c != '\\' && !c.is_control())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verifier(scopes: &[&str]) -> Verifier {
        let config = OAuthConfig {
            issuer: "http://127.0.0.1:9/".to_owned(),
            audience: None,
            required_scopes: scopes.iter().map(|s| (*s).to_owned()).collect(),
            principal_claim: "sub".to_owned(),
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
    fn scopes_come_from_scope_or_scp() {
        assert_eq!(
            scopes(&json!({"scope": "a b", "scp": ["c"]})),
            ["a", "b", "c"]
        );
        assert_eq!(scopes(&json!({"scp": "d e"})), ["d", "e"]);
        assert!(scopes(&json!({})).is_empty());
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
}
