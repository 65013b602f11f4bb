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
//! metadata, builds every request itself (the redirect URI is the page's own origin, checked by
//! the Origin gate; `resource` is this server's audience), and hands back only the access
//! token, after checking it as every later request's token will be.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, ORIGIN, X_CONTENT_TYPE_OPTIONS};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::Response;
use axum::routing::any;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

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

/// Shared by the three routes.
struct Relay {
    verifier: Arc<Verifier>,
    /// `--oauth-dashboard-client-id`.
    client_id: Option<String>,
    in_flight: Semaphore,
}

/// `GET /dashboard/oauth`, `POST /dashboard/oauth/register`, `POST /dashboard/oauth/token`.
/// The caller adds the Host/Origin gate; none of them takes a credential (the browser has
/// none yet).
pub fn routes(verifier: Arc<Verifier>, client_id: Option<String>) -> Router {
    let relay = Arc::new(Relay {
        verifier,
        client_id,
        in_flight: Semaphore::new(MAX_IN_FLIGHT),
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

/// The dashboard's address as its browser sees it, from the request's `Origin`, which the
/// Origin gate has already checked against the allowed hosts: `scheme://authority/`.
/// Browsers send `Origin` with every POST, so one without it is not the page.
fn redirect_uri(headers: &HeaderMap) -> Option<String> {
    let origin = headers
        .get(ORIGIN)?
        .to_str()
        .ok()?
        .trim()
        .parse::<Uri>()
        .ok()?;
    let scheme = origin.scheme_str()?;
    let bare = origin.path_and_query().is_none_or(|p| p.as_str() == "/");
    let web = scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https");
    let authority = origin.authority()?;
    (web && bare).then(|| format!("{scheme}://{authority}/"))
}

fn not_the_page() -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "This request must come from the dashboard page (it has no usable Origin header).",
    )
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
    let Some(redirect_uri) = redirect_uri(request.headers()) else {
        return not_the_page();
    };
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
    let Some(redirect_uri) = redirect_uri(request.headers()) else {
        return not_the_page();
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

    fn origin(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(ORIGIN, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn the_redirect_uri_is_the_pages_origin() {
        assert_eq!(
            redirect_uri(&origin("http://127.0.0.1:8435")).as_deref(),
            Some("http://127.0.0.1:8435/")
        );
        assert_eq!(
            redirect_uri(&origin("https://mcp.example.com")).as_deref(),
            Some("https://mcp.example.com/")
        );
        assert_eq!(redirect_uri(&origin("null")), None);
        assert_eq!(redirect_uri(&origin("http://h/elsewhere")), None);
        assert_eq!(redirect_uri(&origin("javascript:alert(1)")), None);
        assert_eq!(redirect_uri(&HeaderMap::new()), None);
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
