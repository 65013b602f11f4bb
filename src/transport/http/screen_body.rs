//! Runs each JSON POST body to `/mcp` through [`crate::transport::screen`] before rmcp reads it,
//! so HTTP clients get the same answers as stdio clients: a lone surrogate escape is repaired
//! instead of failing the whole body with `415`, and a malformed request gets its JSON-RPC
//! error (`-32700`, `-32600`, `-32602`) with the request's id when it can be read.
//!
//! An answer that carries an id goes back as `200` with an `application/json` body, which MCP
//! clients match to the pending request; one with `id: null` goes back as `400`, as rmcp does
//! for the requests it refuses itself. Bodies of any other content type are left to rmcp.

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::MAX_REQUEST_BODY_BYTES;
use crate::transport::screen::{self, Screened};

/// Screens a POST body; everything else passes through untouched.
pub async fn screen_post(request: Request, next: Next) -> Response {
    if request.method() != Method::POST || !is_json(request.headers()) {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_REQUEST_BODY_BYTES).await {
        Ok(bytes) => bytes,
        Err(_) => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("Payload Too Large: request body exceeds {MAX_REQUEST_BODY_BYTES} bytes"),
            )
                .into_response();
        }
    };
    let body = match screen::screen(&bytes) {
        Screened::Reply(reply) => {
            let status = if reply["id"].is_null() {
                StatusCode::BAD_REQUEST
            } else {
                StatusCode::OK
            };
            return (
                status,
                [(header::CONTENT_TYPE, "application/json")],
                reply.to_string(),
            )
                .into_response();
        }
        Screened::Message(_) => match screen::repair(&bytes) {
            std::borrow::Cow::Borrowed(_) => bytes,
            std::borrow::Cow::Owned(repaired) => Bytes::from(repaired),
        },
        Screened::Skip => bytes,
    };
    next.run(Request::from_parts(parts, Body::from(body))).await
}

/// `Content-Type: application/json`, parameters ignored (rmcp's own test).
fn is_json(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            let essence = value.split_once(';').map_or(value, |(essence, _)| essence);
            essence.trim().eq_ignore_ascii_case("application/json")
        })
}
