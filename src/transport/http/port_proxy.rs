//! `/computers/<computer_id>/ports/<port>/…` (docs/files.md, "Ports"): a port in a computer
//! on the server's own listener, behind the same Host/Origin check and token as `/mcp`. Each
//! request opens one connection through [`crate::ports::Ports::connect`] (which never creates
//! or starts a computer) and speaks HTTP/1.1 to the port with the prefix taken off the path;
//! a WebSocket (any `Upgrade`) is carried both ways once the port agrees to it.
//!
//! The server's `Authorization` header never reaches the computer, and responses stream
//! through without being buffered here.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{
    AUTHORIZATION, CONNECTION, CONTENT_TYPE, HOST, LOCATION, PROXY_AUTHORIZATION, TE, TRAILER,
    TRANSFER_ENCODING, UPGRADE,
};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::Response;
use hyper::client::conn::http1 as client;
use hyper_util::rt::TokioIo;
use tracing::debug;

use crate::ids::ComputerId;
use crate::mcp::ports::message;
use crate::ports::{PortError, Ports};

/// How long the port may take to answer with its response headers (a dev server's first
/// page may compile first).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(120);
const PREFIX: &str = "/computers/";

fn text(status: StatusCode, body: String) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// The computer, port and rest of the path (`None`: no slash after the port).
struct Target {
    computer: ComputerId,
    port: u16,
    rest: Option<String>,
}

/// The target of a route path, or the status and text of its refusal.
fn parse(uri: &Uri) -> Result<Target, (StatusCode, String)> {
    let path = uri.path().strip_prefix(PREFIX).unwrap_or_default();
    let not_found = || (StatusCode::NOT_FOUND, "Not Found".to_owned());
    let (computer, after) = path.split_once('/').ok_or_else(not_found)?;
    let after = after.strip_prefix("ports/").ok_or_else(not_found)?;
    let (port, rest) = match after.split_once('/') {
        Some((port, rest)) => (port, Some(rest.to_owned())),
        None => (after, None),
    };
    let computer =
        ComputerId::parse(computer).map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
    let port = port.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
        (
            StatusCode::BAD_REQUEST,
            format!("port must be between 1 and 65535, got: {port}"),
        )
    })?;
    Ok(Target {
        computer,
        port,
        rest,
    })
}

/// Headers that belong to one hop (RFC 9110 §7.6.1) and are not passed along.
fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::try_from(name.trim()).ok())
        .collect();
    for name in named {
        if !(keep_upgrade && name == UPGRADE) {
            headers.remove(name);
        }
    }
    for name in [TE, TRAILER, TRANSFER_ENCODING, PROXY_AUTHORIZATION] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
    if !keep_upgrade {
        headers.remove(CONNECTION);
        headers.remove(UPGRADE);
    }
}

fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(UPGRADE)
        && headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
}

pub async fn proxy(State(ports): State<Arc<Ports>>, mut request: Request) -> Response {
    let target = match parse(request.uri()) {
        Ok(target) => target,
        Err((status, body)) => return text(status, body),
    };
    let Some(rest) = target.rest else {
        // Relative links in the page resolve against the directory, so it gets its slash.
        let query = request
            .uri()
            .query()
            .map(|q| format!("?{q}"))
            .unwrap_or_default();
        let mut response = Response::new(Body::empty());
        *response.status_mut() = StatusCode::PERMANENT_REDIRECT;
        if let Ok(location) = HeaderValue::try_from(format!("{}/{query}", request.uri().path())) {
            response.headers_mut().insert(LOCATION, location);
        }
        return response;
    };
    // Only the caller's own computers are reachable (docs/auth.md).
    let computer = target
        .computer
        .owned_by(&super::auth::principal_of(&request));
    let stream = match ports.connect(&computer, target.port).await {
        Ok(stream) => stream,
        Err(error @ PortError::NotFound(_)) => return text(StatusCode::NOT_FOUND, message(&error)),
        Err(error) => return text(StatusCode::BAD_GATEWAY, message(&error)),
    };
    let (mut sender, connection) = match client::handshake(TokioIo::new(stream)).await {
        Ok(pair) => pair,
        Err(error) => {
            return text(
                StatusCode::BAD_GATEWAY,
                format!("Port {}: {error}", target.port),
            );
        }
    };
    tokio::spawn(async move {
        if let Err(error) = connection.with_upgrades().await {
            debug!(%error, "port connection ended");
        }
    });

    let upgrade = wants_upgrade(request.headers());
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut request));
    let (mut parts, body) = request.into_parts();
    let query = parts
        .uri
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    parts.uri = match Uri::try_from(format!("/{rest}{query}")) {
        Ok(uri) => uri,
        Err(error) => return text(StatusCode::BAD_REQUEST, error.to_string()),
    };
    parts.version = axum::http::Version::HTTP_11;
    let headers = &mut parts.headers;
    strip_hop_by_hop(headers, upgrade);
    headers.remove(AUTHORIZATION);
    if let Some(host) = headers.remove(HOST) {
        headers.insert("x-forwarded-host", host);
    }
    // Dev servers commonly accept only their own names in Host.
    if let Ok(host) = HeaderValue::try_from(format!("localhost:{}", target.port)) {
        headers.insert(HOST, host);
    }
    if let Ok(prefix) =
        HeaderValue::try_from(format!("{PREFIX}{}/ports/{}", target.computer, target.port))
    {
        headers.insert("x-forwarded-prefix", prefix);
    }
    let upstream = axum::http::Request::from_parts(parts, body);
    let mut response =
        match tokio::time::timeout(RESPONSE_TIMEOUT, sender.send_request(upstream)).await {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => {
                return text(
                    StatusCode::BAD_GATEWAY,
                    format!("Port {}: {error}", target.port),
                );
            }
            Err(_) => {
                return text(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "Port {} did not answer within {} seconds.",
                        target.port,
                        RESPONSE_TIMEOUT.as_secs()
                    ),
                );
            }
        };
    if response.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_upgrade) = client_upgrade
    {
        let upstream_upgrade = hyper::upgrade::on(&mut response);
        tokio::spawn(async move {
            if let (Ok(client), Ok(upstream)) = (client_upgrade.await, upstream_upgrade.await) {
                let _ = tokio::io::copy_bidirectional(
                    &mut TokioIo::new(client),
                    &mut TokioIo::new(upstream),
                )
                .await;
            }
        });
    }
    let (mut parts, body) = response.into_parts();
    let switching = parts.status == StatusCode::SWITCHING_PROTOCOLS;
    strip_hop_by_hop(&mut parts.headers, switching);
    Response::from_parts(parts, Body::new(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_a_computer_a_port_and_the_rest() {
        let target = parse(&Uri::from_static("/computers/dev-box/ports/8080/a/b?x=1")).unwrap();
        assert_eq!(target.computer.as_str(), "dev-box");
        assert_eq!(target.port, 8080);
        assert_eq!(target.rest.as_deref(), Some("a/b"));
        let bare = parse(&Uri::from_static("/computers/dev-box/ports/8080")).unwrap();
        assert_eq!(bare.rest, None);
        for bad in [
            "/computers/dev-box/ports/0/",
            "/computers/dev-box/ports/65536/",
            "/computers/Not_An_Id!/ports/80/",
            "/computers/dev-box/files/80/",
        ] {
            assert!(parse(&Uri::from_static(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn hop_by_hop_headers_are_dropped_and_upgrades_kept_only_when_asked() {
        let mut headers = HeaderMap::new();
        headers.insert(CONNECTION, HeaderValue::from_static("Upgrade, x-private"));
        headers.insert(UPGRADE, HeaderValue::from_static("websocket"));
        headers.insert("x-private", HeaderValue::from_static("1"));
        headers.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        headers.insert("x-kept", HeaderValue::from_static("1"));
        assert!(wants_upgrade(&headers));
        let mut upgraded = headers.clone();
        strip_hop_by_hop(&mut upgraded, true);
        assert!(upgraded.contains_key(UPGRADE) && upgraded.contains_key(CONNECTION));
        assert!(!upgraded.contains_key("x-private") && !upgraded.contains_key(TRANSFER_ENCODING));
        strip_hop_by_hop(&mut headers, false);
        assert!(!headers.contains_key(UPGRADE) && !headers.contains_key(CONNECTION));
        assert!(headers.contains_key("x-kept"));
    }
}
