//! The web dashboard's OAuth sign-in (docs/auth.md, "Web dashboard sign-in"): what the page
//! needs from the issuer's metadata, and the two requests it cannot send to the authorization
//! server itself, relayed.
//!
//! Why relay rather than let the page call the authorization server: a browser may only read
//! cross-origin answers the server allows (CORS), and authorization servers commonly allow it
//! on their token endpoint for registered web origins but not on their registration endpoint
//! (oidc-provider, the test issuer, has no CORS there at all). Relayed, sign-in works with any
//! issuer, and the page's `connect-src 'self'` stays as it is. The relay can do nothing a
//! browser could not do directly: it only ever calls the endpoints of the configured issuer's
//! metadata, builds every request itself (`resource` is this server's audience), and hands back
//! only the access token, after checking it as every later request's token will be.
//!
//! The redirect URI it registers and redeems for is the dashboard's own address and nothing
//! else: the request's `Origin` must be the very origin the request was sent to (its `Host`),
//! on this listener's port or the audience's origin. A page on another port of an allowed host
//! (another local service, a computer's forwarded port) could otherwise register a client that
//! redirects to itself, send the user through the issuer with it, and redeem the code it gets
//! back for the user's access token. The routes take no credential, so they are rate-limited
//! as well.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{
    CACHE_CONTROL, CONTENT_TYPE, HOST, ORIGIN, RETRY_AFTER, X_CONTENT_TYPE_OPTIONS,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::Response;
use axum::routing::any;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use super::super::auth::allowance::Allowance;
use super::super::auth::oauth::{CodeGrant, SignInError, Verifier};
use super::super::auth::{AUDIT, Refusal};

/// Largest request body read: the token request's three fields are a few hundred bytes.
const MAX_BODY_BYTES: usize = 16 * 1024;
/// Relayed requests in flight at once; one more is answered 503 at once. Each may hold an
/// outbound request to the issuer for up to its 10 s fetch limit, and these routes take no
/// credential, so their number is bounded instead.
const MAX_IN_FLIGHT: usize = 16;
/// Longest text of the authorization server's shown to the page.
const MAX_UPSTREAM_TEXT: usize = 300;
/// Client registrations relayed at once, and then one more every [`REGISTRATION_EVERY`]: a
/// browser registers once per issuer and keeps the client, so a team signing in on the same
/// morning fits, while a script cannot fill the issuer with clients through us.
const REGISTRATION_BURST: u32 = 10;
const REGISTRATION_EVERY: Duration = Duration::from_secs(6);
/// Code exchanges relayed at once, and then one more every [`TOKEN_EVERY`]: one per sign-in.
const TOKEN_BURST: u32 = 30;
const TOKEN_EVERY: Duration = Duration::from_secs(1);

/// Where the dashboard is served from: the only origin the relay registers and redeems for.
#[derive(Debug, Clone)]
pub struct PageOrigins {
    /// The audience's origin (behind a proxy, the public one).
    audience: Option<WebOrigin>,
    /// This listener's port, for `http://<allowed host>:<port>`; `None` with `--allowed-host
    /// '*'`, where any name may reach the listener and only the audience's origin counts.
    listener_port: Option<u16>,
}

impl PageOrigins {
    pub fn new(audience: &str, listener_port: Option<u16>) -> Self {
        Self {
            audience: audience
                .parse::<Uri>()
                .ok()
                .and_then(|uri| WebOrigin::of(&uri)),
            listener_port,
        }
    }

    fn allows(&self, origin: &WebOrigin) -> bool {
        self.audience.as_ref() == Some(origin)
            || (origin.scheme == "http" && self.listener_port == Some(origin.port))
    }
}

/// `scheme://host:port` of an `http(s)` URL, lowercase, the port always written out.
#[derive(Debug, Clone, PartialEq, Eq)]
struct WebOrigin {
    scheme: String,
    host: String,
    port: u16,
}

impl WebOrigin {
    fn of(uri: &Uri) -> Option<Self> {
        let scheme = uri.scheme_str()?.to_ascii_lowercase();
        let default_port = match scheme.as_str() {
            "http" => 80,
            "https" => 443,
            _ => return None,
        };
        let authority = uri.authority()?;
        Some(Self {
            host: authority.host().to_ascii_lowercase(),
            port: authority.port_u16().unwrap_or(default_port),
            scheme,
        })
    }

    /// Whether `host` (a `Host` header) names this origin's host and port.
    fn is_host(&self, host: &str) -> bool {
        host.parse::<axum::http::uri::Authority>()
            .is_ok_and(|authority| {
                authority.host().eq_ignore_ascii_case(&self.host)
                    && authority.port_u16().unwrap_or(match self.scheme.as_str() {
                        "https" => 443,
                        _ => 80,
                    }) == self.port
            })
    }
}

/// Shared by the three routes.
struct Relay {
    verifier: Arc<Verifier>,
    /// `--oauth-dashboard-client-id`.
    client_id: Option<String>,
    pages: PageOrigins,
    in_flight: Semaphore,
    registrations: Allowance,
    tokens: Allowance,
}

/// `GET /dashboard/oauth`, `POST /dashboard/oauth/register`, `POST /dashboard/oauth/token`.
/// The caller adds the Host/Origin gate; none of them takes a credential (the browser has
/// none yet).
pub fn routes(verifier: Arc<Verifier>, client_id: Option<String>, pages: PageOrigins) -> Router {
    let relay = Arc::new(Relay {
        verifier,
        client_id,
        pages,
        in_flight: Semaphore::new(MAX_IN_FLIGHT),
        registrations: Allowance::new(REGISTRATION_BURST, REGISTRATION_EVERY),
        tokens: Allowance::new(TOKEN_BURST, TOKEN_EVERY),
    });
    Router::new()
        .route("/dashboard/oauth", any(endpoints))
        .route("/dashboard/oauth/register", any(register))
        .route("/dashboard/oauth/token", any(token))
        .with_state(relay)
}

fn answer(status: StatusCode, body: &Value) -> Response {
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    // RFC 6749 §5.1: answers that carry tokens are never stored.
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    response
}

/// An error as the page shows it: an OAuth-style code and one sentence.
fn error(status: StatusCode, code: &str, description: &str) -> Response {
    answer(
        status,
        &json!({"error": code, "error_description": description}),
    )
}

fn shortened(text: &str) -> String {
    text.chars()
        .filter(|c| !c.is_control())
        .take(MAX_UPSTREAM_TEXT)
        .collect()
}

/// The page's text for each failure; details of the issuer's answers go to the log only.
fn failure(step: &str, failed: &SignInError) -> Response {
    tracing::warn!(target: AUDIT, step, error = ?failed, "dashboard sign-in failed");
    let upstream = |text: &str| error(StatusCode::BAD_GATEWAY, "temporarily_unavailable", text);
    match failed {
        SignInError::Discovery(_) => upstream(
            "The authorization server's metadata cannot be read; the server's log says why.",
        ),
        SignInError::Upstream(_) => upstream(
            "The authorization server cannot be reached or gave an unusable answer; the server's log says why.",
        ),
        SignInError::Endpoint(field) => error(
            StatusCode::BAD_GATEWAY,
            "server_error",
            &format!(
                "The authorization server's metadata has no usable {field} (an https:// URL is required)."
            ),
        ),
        SignInError::NoS256 => error(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "The authorization server does not offer PKCE with S256 (code_challenge_methods_supported), which sign-in requires.",
        ),
        SignInError::NoRegistration => error(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "The authorization server offers no client registration. Register a public client whose redirect URI is this page's address and start the server with --oauth-dashboard-client-id.",
        ),
        SignInError::Refused {
            error: code,
            description,
        } => {
            let code = shortened(code);
            let text = description
                .as_deref()
                .map(shortened)
                .filter(|d| !d.is_empty())
                .unwrap_or_else(|| format!("The authorization server refused: {code}."));
            error(StatusCode::BAD_REQUEST, &code, &text)
        }
        SignInError::Rejected(refusal) => {
            let why = match refusal {
                Refusal::Invalid(reason) => reason.as_str(),
                Refusal::InsufficientScope => "it lacks a required scope",
                Refusal::Missing => "there is none",
            };
            error(
                StatusCode::BAD_REQUEST,
                "invalid_token",
                &format!(
                    "The authorization server issued an access token this server does not accept: {why}."
                ),
            )
        }
    }
}

/// Why a relayed POST is not the dashboard page's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NotThePage {
    /// No usable `Origin` (browsers send one with every POST).
    NoOrigin,
    /// An origin other than the one the request was sent to, or than where the page is served.
    OtherOrigin,
}

/// The dashboard's address as its browser sees it, `scheme://authority/`, from the request's
/// `Origin`, which must be the origin the request was sent to (`Host`; and `Sec-Fetch-Site:
/// same-origin` where the browser says) and one the page is served from ([`PageOrigins`]).
fn redirect_uri(pages: &PageOrigins, headers: &HeaderMap) -> Result<String, NotThePage> {
    let origin = headers
        .get(ORIGIN)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<Uri>().ok())
        .filter(|uri| uri.path_and_query().is_none_or(|p| p.as_str() == "/"))
        .ok_or(NotThePage::NoOrigin)?;
    let (Some(scheme), Some(authority), Some(parsed)) = (
        origin.scheme_str(),
        origin.authority(),
        WebOrigin::of(&origin),
    ) else {
        return Err(NotThePage::NoOrigin);
    };
    let site = headers
        .get("sec-fetch-site")
        .map(|value| value.as_bytes().eq_ignore_ascii_case(b"same-origin"));
    let host = headers.get(HOST).and_then(|value| value.to_str().ok());
    let same_origin = site != Some(false) && host.is_some_and(|host| parsed.is_host(host));
    if !same_origin || !pages.allows(&parsed) {
        return Err(NotThePage::OtherOrigin);
    }
    Ok(format!("{scheme}://{authority}/"))
}

fn not_the_page(why: NotThePage) -> Response {
    match why {
        NotThePage::NoOrigin => error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "This request must come from the dashboard page (it has no usable Origin header).",
        ),
        NotThePage::OtherOrigin => error(
            StatusCode::FORBIDDEN,
            "invalid_request",
            "This request must come from the dashboard page at this server's own address; sign-in is relayed for no other origin.",
        ),
    }
}

/// 429 with `Retry-After` once a route's allowance is used up.
fn slow_down(wait: Duration) -> Response {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let mut response = error(
        StatusCode::TOO_MANY_REQUESTS,
        "temporarily_unavailable",
        &format!("Too many sign-in requests; try again in {seconds} s."),
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(seconds));
    response
}

fn busy() -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "temporarily_unavailable",
        "Too many sign-ins at once; try again.",
    )
}

/// `GET /dashboard/oauth`: where to send the browser, and with which client.
async fn endpoints(State(relay): State<Arc<Relay>>, request: Request) -> Response {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return super::not_found().await;
    }
    let Ok(_permit) = relay.in_flight.try_acquire() else {
        return busy();
    };
    let endpoints = match relay.verifier.sign_in_endpoints().await {
        Ok(endpoints) => endpoints,
        Err(failed) => return failure("metadata", &failed),
    };
    // Without a named client the page registers one, which needs the endpoint.
    if relay.client_id.is_none() && endpoints.registration_endpoint.is_none() {
        return failure("metadata", &SignInError::NoRegistration);
    }
    let mut document = json!({
        "issuer": endpoints.issuer,
        "authorization_endpoint": endpoints.authorization_endpoint,
        "authorization_response_iss_parameter_supported": endpoints.iss_parameter,
    });
    if let Some(id) = &relay.client_id {
        document["client_id"] = json!(id);
    }
    answer(StatusCode::OK, &document)
}

/// `POST /dashboard/oauth/register`: a public client for this page's address (RFC 7591).
async fn register(State(relay): State<Arc<Relay>>, request: Request) -> Response {
    if request.method() != Method::POST {
        return super::not_found().await;
    }
    let redirect_uri = match redirect_uri(&relay.pages, request.headers()) {
        Ok(uri) => uri,
        Err(why) => return not_the_page(why),
    };
    if let Err(wait) = relay.registrations.take() {
        return slow_down(wait);
    }
    let Ok(_permit) = relay.in_flight.try_acquire() else {
        return busy();
    };
    match relay.verifier.register_client(&redirect_uri).await {
        Ok(client_id) => {
            tracing::info!(target: AUDIT, redirect_uri, client_id, "registered a dashboard client");
            answer(
                StatusCode::OK,
                &json!({"client_id": client_id, "redirect_uri": redirect_uri}),
            )
        }
        Err(failed) => failure("register", &failed),
    }
}

/// A `{"name": "text"}` field of the token request, within RFC 6749 §A's character set
/// (printable ASCII) and `max` bytes.
fn field<'a>(body: &'a Value, name: &str, max: usize) -> Option<&'a str> {
    body.get(name)
        .and_then(Value::as_str)
        .filter(|v| !v.is_empty() && v.len() <= max && v.chars().all(|c| (' '..='~').contains(&c)))
}

/// `POST /dashboard/oauth/token` with `{"client_id", "code", "code_verifier"}`: the code
/// redeemed for this server's audience; answers the access token and whom it names.
async fn token(State(relay): State<Arc<Relay>>, request: Request) -> Response {
    if request.method() != Method::POST {
        return super::not_found().await;
    }
    let redirect_uri = match redirect_uri(&relay.pages, request.headers()) {
        Ok(uri) => uri,
        Err(why) => return not_the_page(why),
    };
    let Ok(bytes) = axum::body::to_bytes(request.into_body(), MAX_BODY_BYTES).await else {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request",
            "The request is too large.",
        );
    };
    let body: Value = serde_json::from_slice(&bytes).unwrap_or_default();
    // RFC 7636 §4.1: a verifier is 43-128 unreserved characters.
    let verifier = field(&body, "code_verifier", 128).filter(|v| {
        v.len() >= 43
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._~".contains(&b))
    });
    let (Some(client_id), Some(code), Some(code_verifier)) = (
        field(&body, "client_id", 1024),
        field(&body, "code", 4096),
        verifier,
    ) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "The request needs client_id, code and a PKCE code_verifier.",
        );
    };
    if let Err(wait) = relay.tokens.take() {
        return slow_down(wait);
    }
    let Ok(_permit) = relay.in_flight.try_acquire() else {
        return busy();
    };
    let grant = CodeGrant {
        client_id,
        code,
        code_verifier,
        redirect_uri: &redirect_uri,
    };
    match relay.verifier.redeem_code(&grant).await {
        Ok(signed_in) => {
            tracing::info!(target: AUDIT, principal = %signed_in.principal, "dashboard sign-in");
            let mut document = json!({
                "access_token": signed_in.access_token.expose(),
                "token_type": "Bearer",
                "principal": signed_in.principal.as_str(),
            });
            if let Some(seconds) = signed_in.expires_in {
                document["expires_in"] = json!(seconds);
            }
            answer(StatusCode::OK, &document)
        }
        Err(failed) => failure("token", &failed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(origin: &str, host: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(ORIGIN, HeaderValue::from_str(origin).unwrap());
        headers.insert(HOST, HeaderValue::from_str(host).unwrap());
        headers
    }

    #[test]
    fn the_redirect_uri_is_the_pages_own_origin() {
        // See: issue 30
        let local = PageOrigins::new("http://127.0.0.1:8435/mcp", Some(8435));
        let proxied = PageOrigins::new("https://mcp.example.com/mcp", Some(8435));
        let uri = |pages: &PageOrigins, origin: &str, host: &str| {
            redirect_uri(pages, &request(origin, host))
        };
        assert_eq!(
            uri(&local, "http://127.0.0.1:8435", "127.0.0.1:8435").as_deref(),
            Ok("http://127.0.0.1:8435/")
        );
        assert_eq!(
            uri(&local, "http://localhost:8435", "LOCALHOST:8435").as_deref(),
            Ok("http://localhost:8435/")
        );
        assert_eq!(
            uri(&proxied, "https://mcp.example.com", "mcp.example.com").as_deref(),
            Ok("https://mcp.example.com/")
        );
        let other = Err(NotThePage::OtherOrigin);
        // Another port of an allowed host, sent to that port or to ours.
        assert_eq!(
            uri(&local, "http://127.0.0.1:9999", "127.0.0.1:9999"),
            other
        );
        assert_eq!(
            uri(&local, "http://127.0.0.1:9999", "127.0.0.1:8435"),
            other
        );
        // Another host than the request's, another scheme, a proxy origin not the audience's.
        assert_eq!(
            uri(&local, "http://localhost:8435", "127.0.0.1:8435"),
            other
        );
        assert_eq!(
            uri(&local, "https://127.0.0.1:8435", "127.0.0.1:8435"),
            other
        );
        assert_eq!(
            uri(&proxied, "https://other.example.com", "other.example.com"),
            other
        );
        // With `--allowed-host '*'` only the audience's origin.
        let any_host = PageOrigins::new("https://mcp.example.com/mcp", None);
        assert_eq!(
            uri(&any_host, "http://evil.example:8435", "evil.example:8435"),
            other
        );
        // A browser that says the request is not same-origin.
        let mut cross = request("http://127.0.0.1:8435", "127.0.0.1:8435");
        cross.insert("sec-fetch-site", HeaderValue::from_static("same-site"));
        assert_eq!(redirect_uri(&local, &cross), other);
        cross.insert("sec-fetch-site", HeaderValue::from_static("same-origin"));
        assert!(redirect_uri(&local, &cross).is_ok());
        let none = Err(NotThePage::NoOrigin);
        for bad in ["null", "http://h/elsewhere", "javascript:alert(1)"] {
            assert_eq!(uri(&local, bad, "127.0.0.1:8435"), none, "{bad}");
        }
        assert_eq!(redirect_uri(&local, &HeaderMap::new()), none);
    }

    #[test]
    fn token_request_fields_are_bounded_printable_text() {
        let body = json!({"code": "abc", "long": "x".repeat(20), "ctl": "a\nb", "n": 1});
        assert_eq!(field(&body, "code", 10), Some("abc"));
        assert_eq!(field(&body, "long", 10), None);
        assert_eq!(field(&body, "ctl", 10), None);
        assert_eq!(field(&body, "n", 10), None);
        assert_eq!(field(&body, "missing", 10), None);
    }
}
