//! The OAuth 2.1 resource server (docs/auth.md, "OAuth"): JWT access tokens of one issuer,
//! verified against the issuer's JWKS with `jsonwebtoken` (signature, `iss`, `aud`, `exp`,
//! `nbf`), and the protected-resource metadata of RFC 9728 that tells clients which
//! authorization server to ask.
//!
//! The issuer's metadata (RFC 8414, else OpenID discovery) and keys are fetched on first use
//! and kept; a token signed with a key id not in the set refetches the keys, at most once per
//! [`REFETCH_INTERVAL`] so that made-up key ids cannot turn us into a load generator against the
//! issuer. Everything fetched is bounded in time and size.
//!
//! The same metadata names the endpoints the web dashboard signs a browser in with
//! (docs/auth.md, "Web dashboard sign-in"): [`Verifier::sign_in_endpoints`] exposes them, and
//! [`Verifier::register_client`] and [`Verifier::redeem_code`] are the two calls the server
//! relays for the page (registration and the code exchange), since authorization servers
//! rarely allow cross-origin requests to their registration endpoint. They live here because
//! this module owns the HTTP client for the issuer and the token check.

use std::sync::Arc;
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Value, json};
use tokio::sync::Mutex;

use super::Refusal;
use crate::config::{OAuthConfig, check_oauth_url};
use crate::ids::Principal;
use crate::secret::Secret;

/// Clock skew tolerated on `exp` and `nbf`.
const LEEWAY_SECS: u64 = 30;
/// Shortest time between two key fetches caused by unknown key ids.
const REFETCH_INTERVAL: Duration = Duration::from_secs(10);
/// Bound of one metadata or key fetch.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest metadata or key document read.
const MAX_DOCUMENT_BYTES: usize = 1024 * 1024;
/// Principal claims whose value is never given to another account: `sub` (OpenID Connect Core
/// §2: "never reassigned") and Microsoft Entra ID's immutable object id `oid`. Any other claim
/// is warned about at startup ([`Verifier::principal_claim_warning`]).
const STABLE_CLAIMS: [&str; 2] = ["sub", "oid"];
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
    set: Option<JwkSet>,
    fetched: Option<Instant>,
}

/// The issuer's metadata (RFC 8414 §2), as far as this server uses it: where its keys are, for
/// checking tokens, and the endpoints the web dashboard signs in with.
#[derive(Debug)]
struct ServerMetadata {
    /// The document's own `issuer`, spelled exactly as it is (RFC 9207 compares it so).
    issuer: String,
    jwks_uri: String,
    authorization_endpoint: Option<String>,
    token_endpoint: Option<String>,
    registration_endpoint: Option<String>,
    code_challenge_methods: Vec<String>,
    /// `authorization_response_iss_parameter_supported` (RFC 9207).
    iss_parameter: bool,
}

/// The metadata once found, or the last failure: a broken issuer is asked again at most once
/// per [`REFETCH_INTERVAL`], however many requests arrive.
#[derive(Default)]
struct Discovery {
    found: Option<Arc<ServerMetadata>>,
    failed: Option<(Instant, String)>,
}

/// Where the web dashboard signs in, checked: every endpoint `https://` (or `http://` on
/// loopback) without a fragment, and PKCE with S256 offered.
#[derive(Debug, Clone)]
pub struct SignInEndpoints {
    /// As the metadata spells it: the page compares the `iss` of the answer with it.
    pub issuer: String,
    pub authorization_endpoint: String,
    pub token_endpoint: String,
    pub registration_endpoint: Option<String>,
    /// The answer carries `iss` (RFC 9207), so the page requires it.
    pub iss_parameter: bool,
}

/// Why a dashboard sign-in step could not go on. Texts for the page are written at the edge
/// (`pages.rs`); the `String`s here are details for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignInError {
    /// The issuer's metadata cannot be fetched or is unusable.
    Discovery(String),
    /// This metadata field is missing, or not an `https://` URL without a fragment.
    Endpoint(&'static str),
    /// `code_challenge_methods_supported` does not list S256.
    NoS256,
    /// No `registration_endpoint`, and no client named by the operator.
    NoRegistration,
    /// The authorization server answered with an OAuth error (RFC 6749 §5.2, RFC 7591 §3.2.2).
    Refused {
        error: String,
        description: Option<String>,
    },
    /// The authorization server cannot be reached, or its answer is not usable.
    Upstream(String),
    /// The access token issued is not one this server accepts.
    Rejected(Refusal),
}

/// An authorization code to redeem for the dashboard (RFC 6749 §4.1.3, RFC 7636 §4.5).
pub struct CodeGrant<'a> {
    pub client_id: &'a str,
    pub code: &'a str,
    pub code_verifier: &'a str,
    pub redirect_uri: &'a str,
}

/// The code and verifier are credentials: never shown.
impl std::fmt::Debug for CodeGrant<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodeGrant")
            .field("client_id", &self.client_id)
            .field("redirect_uri", &self.redirect_uri)
            .finish_non_exhaustive()
    }
}

/// A redeemed code: the access token, checked as every request's token will be.
#[derive(Debug)]
pub struct SignedIn {
    pub access_token: Secret,
    pub expires_in: Option<u64>,
    pub principal: Principal,
}

/// Checks access tokens for one issuer and audience.
pub struct Verifier {
    issuer: String,
    audience: String,
    required_scopes: Vec<String>,
    principal_claim: String,
    http: reqwest::Client,
    keys: Mutex<Keys>,
    discovery: Mutex<Discovery>,
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
            discovery: Mutex::new(Discovery::default()),
        })
    }

    pub fn audience(&self) -> &str {
        &self.audience
    }

    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// The startup warning for a `--oauth-principal-claim` users may choose or change at many
    /// issuers (`email`, `preferred_username`, …): whoever holds such a value next owns the
    /// computers filed under it.
    pub fn principal_claim_warning(&self) -> Option<String> {
        let claim = &self.principal_claim;
        (!STABLE_CLAIMS.contains(&claim.as_str())).then(|| {
            format!(
                "--oauth-principal-claim {claim}: users may be able to choose or change this claim at the issuer, or it may be given to someone else later, and whoever holds a value owns the computers filed under it. Use sub (the default) unless the issuer guarantees that {claim} is unique and never reassigned (docs/auth.md, \"Who is calling\")."
            )
        })
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
                Refusal::Invalid(match error.kind() {
                    ErrorKind::ExpiredSignature => "the access token has expired".to_owned(),
                    ErrorKind::ImmatureSignature => "the access token is not valid yet".to_owned(),
                    ErrorKind::InvalidAudience => {
                        "the access token is for another resource (aud)".to_owned()
                    }
                    ErrorKind::InvalidIssuer => {
                        "the access token is from another issuer (iss)".to_owned()
                    }
                    ErrorKind::InvalidSignature => {
                        "the access token's signature does not verify".to_owned()
                    }
                    // Absent, or present with the wrong JSON type (an `exp` that is a string).
                    ErrorKind::MissingRequiredClaim(claim) => {
                        format!("the access token has no usable {} claim", quoted(claim))
                    }
                    // CVE-2026-25537: before jsonwebtoken 10.3 an `nbf` of the wrong JSON type
                    // was read as absent, so a token not valid yet passed.
                    ErrorKind::InvalidClaimFormat(claim) => {
                        format!("the access token's {} claim is not a number", quoted(claim))
                    }
                    _ => "the access token is not valid".to_owned(),
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
        // Qualified by the issuer, so never a tokens-file name nor `default` (docs/auth.md).
        Principal::oauth(&self.issuer, name)
            .map_err(|_| invalid("the access token's principal is not a valid name"))
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
        let jwks_uri = self.metadata().await?.jwks_uri.clone();
        let document = self.fetch_json(&jwks_uri).await?;
        let set: JwkSet = serde_json::from_value(document)
            .map_err(|e| format!("{jwks_uri} is not a JWK set: {e}"))?;
        tracing::info!(issuer = %self.issuer, keys = set.keys.len(), "fetched the OAuth issuer's keys");
        keys.set = Some(set);
        Ok(())
    }

    /// The issuer's metadata, fetched on first use and kept.
    async fn metadata(&self) -> Result<Arc<ServerMetadata>, String> {
        let mut discovery = self.discovery.lock().await;
        if let Some(found) = &discovery.found {
            return Ok(found.clone());
        }
        if let Some((at, error)) = &discovery.failed
            && at.elapsed() < REFETCH_INTERVAL
        {
            return Err(error.clone());
        }
        match self.discover().await {
            Ok(metadata) => {
                let metadata = Arc::new(metadata);
                discovery.found = Some(metadata.clone());
                discovery.failed = None;
                Ok(metadata)
            }
            Err(error) => {
                discovery.failed = Some((Instant::now(), error.clone()));
                Err(error)
            }
        }
    }

    /// The issuer's RFC 8414 metadata, else its OpenID configuration; the document must name
    /// the configured issuer exactly and have a `jwks_uri`.
    async fn discover(&self) -> Result<ServerMetadata, String> {
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
                    check_oauth_url("jwks_uri", jwks_uri).map_err(|e| e.0)?;
                    let text = |field: &str| {
                        document
                            .get(field)
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                    };
                    return Ok(ServerMetadata {
                        issuer: named.unwrap_or(issuer).to_owned(),
                        jwks_uri: jwks_uri.to_owned(),
                        authorization_endpoint: text("authorization_endpoint"),
                        token_endpoint: text("token_endpoint"),
                        registration_endpoint: text("registration_endpoint"),
                        code_challenge_methods: document
                            .get("code_challenge_methods_supported")
                            .and_then(Value::as_array)
                            .map(|methods| {
                                methods
                                    .iter()
                                    .filter_map(Value::as_str)
                                    .map(str::to_owned)
                                    .collect()
                            })
                            .unwrap_or_default(),
                        iss_parameter: document
                            .get("authorization_response_iss_parameter_supported")
                            .and_then(Value::as_bool)
                            .unwrap_or(false),
                    });
                }
                Err(error) => errors.push(error),
            }
        }
        Err(errors.join("; "))
    }

    /// The endpoints the web dashboard signs in with, from the issuer's metadata.
    pub async fn sign_in_endpoints(&self) -> Result<SignInEndpoints, SignInError> {
        let metadata = self.metadata().await.map_err(SignInError::Discovery)?;
        // Each URL reaches the browser (the authorization endpoint is navigated to) or gets
        // codes and tokens: the issuer's own https rule, and no fragment (RFC 6749 §3.1).
        let usable = |field: &'static str, value: Option<&String>| {
            value
                .filter(|url| !url.contains('#') && check_oauth_url(field, url).is_ok())
                .cloned()
                .ok_or(SignInError::Endpoint(field))
        };
        // OAuth 2.1 and the MCP authorization spec: without S256 advertised, do not sign in.
        if !metadata.code_challenge_methods.iter().any(|m| m == "S256") {
            return Err(SignInError::NoS256);
        }
        Ok(SignInEndpoints {
            issuer: metadata.issuer.clone(),
            authorization_endpoint: usable(
                "authorization_endpoint",
                metadata.authorization_endpoint.as_ref(),
            )?,
            token_endpoint: usable("token_endpoint", metadata.token_endpoint.as_ref())?,
            // Optional, but when named it must be usable like the others.
            registration_endpoint: metadata
                .registration_endpoint
                .as_ref()
                .map(|url| usable("registration_endpoint", Some(url)))
                .transpose()?,
            iss_parameter: metadata.iss_parameter,
        })
    }

    /// Registers the dashboard as a public client whose one redirect URI is `redirect_uri`
    /// (RFC 7591); returns its `client_id`.
    pub async fn register_client(&self, redirect_uri: &str) -> Result<String, SignInError> {
        let endpoints = self.sign_in_endpoints().await?;
        let url = endpoints
            .registration_endpoint
            .ok_or(SignInError::NoRegistration)?;
        let mut request = json!({
            "client_name": "Sandbox Computers dashboard",
            "redirect_uris": [redirect_uri],
            "grant_types": ["authorization_code"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
            "application_type": "web",
        });
        if !self.required_scopes.is_empty() {
            request["scope"] = json!(self.required_scopes.join(" "));
        }
        let response = self
            .http
            .post(&url)
            .header(reqwest::header::ACCEPT, "application/json")
            .json(&request)
            .send()
            .await
            .map_err(|e| SignInError::Upstream(format!("POST {url}: {e}")))?;
        let answer = answer_of(&url, response).await?;
        // A browser cannot keep a client secret: a client the server made confidential
        // anyway would fail at the token endpoint, so say so now.
        if let Some(method) = answer
            .get("token_endpoint_auth_method")
            .and_then(Value::as_str)
            && method != "none"
        {
            return Err(SignInError::Upstream(format!(
                "POST {url}: registered a client with token_endpoint_auth_method {method:?}, not a public one"
            )));
        }
        answer
            .get("client_id")
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| SignInError::Upstream(format!("POST {url}: no client_id")))
    }

    /// Redeems an authorization code at the token endpoint, for this server's audience
    /// (RFC 8707 `resource`), and checks the access token it gives.
    pub async fn redeem_code(&self, grant: &CodeGrant<'_>) -> Result<SignedIn, SignInError> {
        let url = self.sign_in_endpoints().await?.token_endpoint;
        let body = form_encode(&[
            ("grant_type", "authorization_code"),
            ("code", grant.code),
            ("redirect_uri", grant.redirect_uri),
            ("client_id", grant.client_id),
            ("code_verifier", grant.code_verifier),
            ("resource", &self.audience),
        ]);
        let response = self
            .http
            .post(&url)
            .header(reqwest::header::ACCEPT, "application/json")
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .body(body)
            .send()
            .await
            .map_err(|e| SignInError::Upstream(format!("POST {url}: {e}")))?;
        let answer = answer_of(&url, response).await?;
        let access_token = answer
            .get("access_token")
            .and_then(Value::as_str)
            .filter(|token| !token.is_empty())
            .ok_or_else(|| SignInError::Upstream(format!("POST {url}: no access_token")))?;
        // A DPoP-bound or other non-bearer token cannot be sent as the page sends it.
        if let Some(kind) = answer.get("token_type").and_then(Value::as_str)
            && !kind.eq_ignore_ascii_case("bearer")
        {
            return Err(SignInError::Upstream(format!(
                "POST {url}: token_type {kind:?}, not Bearer"
            )));
        }
        let principal = self
            .verify(access_token)
            .await
            .map_err(SignInError::Rejected)?;
        Ok(SignedIn {
            access_token: Secret::new(access_token),
            expires_in: answer.get("expires_in").and_then(Value::as_u64),
            principal,
        })
    }

    async fn fetch_json(&self, url: &str) -> Result<Value, String> {
        let response = self
            .http
            .get(url)
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        if !response.status().is_success() {
            return Err(format!("GET {url}: HTTP {}", response.status()));
        }
        read_json(url, response)
            .await
            .map_err(|e| format!("GET {e}"))
    }
}

/// A response body as JSON, read up to [`MAX_DOCUMENT_BYTES`]; errors start with `url`.
async fn read_json(url: &str, mut response: reqwest::Response) -> Result<Value, String> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| format!("{url}: {e}"))? {
        if body.len() + chunk.len() > MAX_DOCUMENT_BYTES {
            return Err(format!("{url}: larger than {MAX_DOCUMENT_BYTES} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body).map_err(|e| format!("{url}: not JSON: {e}"))
}

/// The JSON of a successful answer to a POST; for an unsuccessful one the OAuth error it
/// names, else its status.
async fn answer_of(url: &str, response: reqwest::Response) -> Result<Value, SignInError> {
    let status = response.status();
    let answer = read_json(url, response).await;
    if status.is_success() {
        return answer.map_err(|e| SignInError::Upstream(format!("POST {e}")));
    }
    let answer = answer.unwrap_or_default();
    let text = |field: &str| answer.get(field).and_then(Value::as_str).map(str::to_owned);
    Err(match text("error") {
        Some(error) => SignInError::Refused {
            error,
            description: text("error_description"),
        },
        None => SignInError::Upstream(format!("POST {url}: HTTP {status}")),
    })
}

/// `application/x-www-form-urlencoded` as browsers write it: ASCII letters, digits and `*-._`
/// as they are, space as `+`, every other byte as `%XX`.
fn form_encode(pairs: &[(&str, &str)]) -> String {
    let encode = |text: &str| {
        let mut out = String::with_capacity(text.len());
        for byte in text.bytes() {
            match byte {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'*' | b'-' | b'.' | b'_' => {
                    out.push(char::from(byte));
                }
                b' ' => out.push('+'),
                _ => out.push_str(&format!("%{byte:02X}")),
            }
        }
        out
    };
    pairs
        .iter()
        .map(|(name, value)| format!("{}={}", encode(name), encode(value)))
        .collect::<Vec<_>>()
        .join("&")
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
mod tests;
