//! The non-MCP routes (docs/decisions.md, "HTTP routes"): `GET /healthz`, `GET /` (the server descriptor as JSON,
//! or for browsers the web dashboard with docs/decisions.md, "Dashboard content security policy" headers, or the "dashboard is
//! disabled" page), the 404 for everything else, and with OAuth on the three routes the web
//! dashboard signs in through ([`sign_in`], docs/auth.md, "Web dashboard sign-in").

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{
    ACCEPT, CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY,
    X_CONTENT_TYPE_OPTIONS,
};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::response::Response;
use serde_json::json;

use crate::dashboard;

/// The web-mode page policy of docs/decisions.md, "Dashboard content security policy": inline code only, fetches to this origin.
/// OAuth sign-in keeps it: the page only navigates to the authorization server, and the server
/// relays what the page would otherwise fetch from it ([`sign_in`]).
const WEB_CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Shown to browsers when lifecycle tools are off (docs/decisions.md, "Dashboard", top).
const DISABLED_PAGE: &str = "<!doctype html>
<html lang=\"en\">
<head>
<meta charset=\"utf-8\">
<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">
<title>Sandbox Computers</title>
<style>body{font-family:system-ui,sans-serif;max-width:40rem;margin:4rem auto;padding:0 1rem;line-height:1.5}@media (prefers-color-scheme:dark){body{background:#111;color:#eee}}</style>
</head>
<body>
<h1>Sandbox Computers</h1>
<p>The dashboard is disabled. Start the server with ENABLE_LIFECYCLE_TOOLS=true (or --lifecycle-tools) to enable it.</p>
</body>
</html>
";

fn with_type(status: StatusCode, content_type: &'static str, body: impl Into<Body>) -> Response {
    let mut response = Response::new(body.into());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// 404 for every path and method the server does not serve.
pub async fn not_found() -> Response {
    with_type(
        StatusCode::NOT_FOUND,
        "text/plain; charset=utf-8",
        "Not Found",
    )
}

fn is_get(method: &Method) -> bool {
    method == Method::GET || method == Method::HEAD
}

/// `GET /healthz`: never authenticated, never Host-checked (load balancers use IPs).
pub async fn healthz(request: Request) -> Response {
    if !is_get(request.method()) {
        return not_found().await;
    }
    with_type(StatusCode::OK, "application/json", r#"{"status":"ok"}"#)
}

/// `GET /`: HTML for browsers, the JSON descriptor otherwise. `State`: the backend's name when
/// the lifecycle tools (and so the dashboard) are on.
pub async fn root(State(dashboard): State<Option<&'static str>>, request: Request) -> Response {
    if !is_get(request.method()) {
        return not_found().await;
    }
    let wants_html = request
        .headers()
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.to_ascii_lowercase().contains("text/html"));
    if wants_html {
        let page = if let Some(backend) = dashboard {
            dashboard::html(dashboard::Mode::Web, backend)
        } else {
            DISABLED_PAGE.to_owned()
        };
        let mut response = with_type(StatusCode::OK, "text/html; charset=utf-8", page);
        let headers = response.headers_mut();
        headers.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(WEB_CSP));
        headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
        headers.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        return response;
    }
    // Keys in the 0.2.3 order (serde_json keeps insertion order here).
    let mut descriptor = json!({
        "name": env!("CARGO_PKG_NAME"),
        "mcp_endpoint": "/mcp",
        "health": "/healthz",
    });
    if dashboard.is_some()
        && let Some(object) = descriptor.as_object_mut()
    {
        object.insert(
            "dashboard_resource".to_owned(),
            json!(dashboard::RESOURCE_URI),
        );
    }
    with_type(StatusCode::OK, "application/json", descriptor.to_string())
}

/// The web dashboard's OAuth sign-in relay (docs/auth.md, "Web dashboard sign-in").
#[cfg(feature = "oauth")]
pub mod sign_in;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_page_has_the_spec_text() {
        assert!(DISABLED_PAGE.contains("<title>Sandbox Computers</title>"));
        assert!(DISABLED_PAGE.contains("The dashboard is disabled. Start the server with ENABLE_LIFECYCLE_TOOLS=true (or --lifecycle-tools) to enable it."));
    }
}
