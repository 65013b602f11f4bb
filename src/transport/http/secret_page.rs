//! `GET`/`POST /secrets/enter/<id>`: the one-time pages of `secret_request`
//! (docs/secrets-onboarding.md, "The page"), on the HTTP listener or, in stdio mode, on a
//! loopback listener of their own started on the first request ([`loopback_starter`]).
//!
//! No bearer token: the page's unguessable id is its capability, and a browser opening a link
//! has no token to send. The Host check stays (DNS rebinding), the Origin of a POST must be the
//! page's own (CSRF; [`crate::mcp::onboarding`] decides), the body is capped, and every answer
//! forbids caching, framing, scripts and sending the address on as a referrer. What each
//! request gets is decided by [`Onboarding`]; this module only carries it.

use std::sync::{Arc, Weak};
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, HOST, ORIGIN, REFERRER_POLICY,
    X_CONTENT_TYPE_OPTIONS, X_FRAME_OPTIONS,
};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::from_fn_with_state;
use axum::response::Response;
use axum::routing::any;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::auth::Authenticator;
use super::guard::{self, AllowedHosts, Guard};
use super::listener;
use crate::mcp::onboarding::{MAX_BODY_BYTES, Onboarding, PAGE_PATH, PageReply, Starter};

/// The page needs no script and posts only to itself.
const PAGE_CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

/// The page routes, behind `guard`'s Host and Origin checks and its shutdown gate.
pub fn routes(onboarding: Arc<Onboarding>, guard: Arc<Guard>) -> Router {
    Router::new()
        .route(
            &format!("{PAGE_PATH}{{id}}"),
            any(page).with_state(onboarding),
        )
        .layer(from_fn_with_state(
            guard.clone(),
            guard::refuse_while_draining,
        ))
        .layer(from_fn_with_state(guard, guard::check_host_and_origin))
}

async fn page(
    State(onboarding): State<Arc<Onboarding>>,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    let now = Instant::now();
    let method = request.method().clone();
    if method == Method::GET || method == Method::HEAD {
        return reply(onboarding.show(&id, now));
    }
    if method != Method::POST {
        let mut response = reply(PageReply {
            status: 405,
            html: String::new(),
        });
        response
            .headers_mut()
            .insert("allow", HeaderValue::from_static("GET, POST"));
        return response;
    }
    // Read before the body is awaited: a borrow of the request must not live across it.
    let (origin, host) = {
        let header = |name: axum::http::HeaderName| {
            request
                .headers()
                .get(name)
                .and_then(|v: &HeaderValue| v.to_str().ok())
                .map(str::to_owned)
        };
        let host =
            header(HOST).or_else(|| request.uri().authority().map(|a| a.as_str().to_owned()));
        (header(ORIGIN), host)
    };
    let Ok(body) = axum::body::to_bytes(request.into_body(), MAX_BODY_BYTES).await else {
        return reply(PageReply {
            status: 413,
            html: String::new(),
        });
    };
    reply(
        onboarding
            .submit(&id, origin.as_deref(), host.as_deref(), &body, now)
            .await,
    )
}

fn reply(page: PageReply) -> Response {
    let mut response = Response::new(Body::from(page.html));
    *response.status_mut() =
        StatusCode::from_u16(page.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(PAGE_CSP));
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // The address is the capability: never sent on, never kept.
    headers.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// Stdio mode: a starter that serves the pages on `127.0.0.1:<ephemeral>` (loopback names
/// only in Host, no token) until `stop` is cancelled, and gives the base URL.
pub fn loopback_starter(onboarding: Weak<Onboarding>, stop: CancellationToken) -> Starter {
    Box::new(move || {
        let onboarding = onboarding.clone();
        let stop = stop.clone();
        Box::pin(async move {
            let onboarding = onboarding
                .upgrade()
                .ok_or_else(|| "the server is stopping".to_owned())?;
            let listener = TcpListener::bind(("127.0.0.1", 0))
                .await
                .map_err(|e| format!("cannot listen on 127.0.0.1: {e}"))?;
            let port = listener
                .local_addr()
                .map_err(|e| format!("cannot read the listener's port: {e}"))?
                .port();
            let guard = Arc::new(Guard::new(
                AllowedHosts::new("127.0.0.1", &[]),
                Arc::new(Authenticator::new(None, None)),
            ));
            let app = routes(onboarding, guard).fallback(super::pages::not_found);
            tokio::spawn(listener::serve(listener, app, stop));
            tracing::info!(port, "serving the secret pages on 127.0.0.1");
            Ok(format!("http://127.0.0.1:{port}"))
        })
    })
}
