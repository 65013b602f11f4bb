//! What stands between the network and `/mcp` (docs/decisions.md, "Host and Origin checks"–4): the Host and Origin checks
//! against DNS rebinding (421 / 403), the refusal of a body declared larger than any legal
//! request (413, before a byte of it is read) and the shutdown gate (503); authentication is
//! [`super::auth`]'s. Pure decisions are plain functions over header values, unit-tested here;
//! the axum middleware only maps them to responses.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST, ORIGIN};
use axum::http::{HeaderValue, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::Response;

/// Host names every listener accepts: the loopback names a local client uses.
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];
/// `--allowed-host` value that turns the Host check off.
const ANY_HOST: &str = "*";
/// Largest accepted POST body (413 beyond), sized to the largest legal request: 2 MiB of stdin
/// is at most 4 MiB once JSON-escaped when every byte is a quote, backslash or newline, and a
/// base64 file chunk of 2 MiB is 2.7 MiB; 8 MiB leaves room for both plus the envelope. Only
/// stdin made almost entirely of other control characters (6 bytes each as `\u00XX`) is
/// larger, and it gets a clear 413. A declared length beyond it is refused before reading; a
/// chunked body is cut by rmcp once it passes it.
pub const MAX_REQUEST_BODY_BYTES: usize = 8 * 1024 * 1024;

/// The Host names accepted on `/mcp` and `GET /` (docs/decisions.md, "Host and Origin checks" table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedHosts {
    any: bool,
    names: Vec<String>,
}

/// Lowercase, without IPv6 brackets or surrounding whitespace.
fn normalize(host: &str) -> String {
    host.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase()
}

/// Whether a bind address is loopback or a wildcard, i.e. adds no name of its own.
fn adds_no_name(bind: &str) -> bool {
    bind == "localhost"
        || bind
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified())
}

impl AllowedHosts {
    /// From the bind address (`--host`) and the `--allowed-host` / env values.
    pub fn new(bind_host: &str, extra: &[String]) -> Self {
        let bind = normalize(bind_host);
        let mut names: Vec<String> = Vec::new();
        if !adds_no_name(&bind) && !bind.is_empty() {
            names.push(bind);
        }
        names.extend(LOOPBACK_NAMES.iter().map(|name| (*name).to_owned()));
        let mut any = false;
        for value in extra {
            let value = normalize(value);
            if value == ANY_HOST {
                any = true;
            } else if !value.is_empty() {
                names.push(value);
            }
        }
        let mut seen = std::collections::HashSet::new();
        names.retain(|name| seen.insert(name.clone()));
        Self { any, names }
    }

    /// Whether the check is disabled (`--allowed-host '*'`).
    pub fn any(&self) -> bool {
        self.any
    }

    /// The names in the order they are checked and logged.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    fn allows(&self, host: &str) -> bool {
        self.any || self.names.iter().any(|name| *name == host)
    }

    /// The Host check: `value` is the `Host` header (or the request-target's authority).
    pub fn host_ok(&self, value: Option<&str>) -> bool {
        if self.any {
            return true;
        }
        value
            .and_then(|value| value.parse::<axum::http::uri::Authority>().ok())
            .is_some_and(|authority| self.allows(&normalize(authority.host())))
    }

    /// Whether ports' own origins (`p<port>-<key>.<domain>`) may live under `domain`: an
    /// allowed host name (`localhost` always), never an address.
    pub fn port_origin_domain_ok(&self, domain: &str) -> bool {
        domain.parse::<IpAddr>().is_err() && self.allows(domain)
    }

    /// The Origin check: absent passes; otherwise `http(s)://` + an allowed host, any port.
    pub fn origin_ok(&self, value: Option<&[u8]>) -> bool {
        let Some(value) = value else {
            return true;
        };
        let Ok(value) = std::str::from_utf8(value) else {
            return false;
        };
        let Ok(uri) = value.trim().parse::<Uri>() else {
            return false;
        };
        let scheme_ok = uri
            .scheme_str()
            .is_some_and(|s| s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https"));
        // An origin is scheme + authority only; anything else is not a browser's Origin.
        let bare = uri.path_and_query().is_none_or(|p| p.as_str() == "/");
        scheme_ok
            && bare
            && uri
                .authority()
                .is_some_and(|authority| self.allows(&normalize(authority.host())))
    }
}

/// Shared state of the guard middleware.
#[derive(Debug)]
pub struct Guard {
    pub hosts: AllowedHosts,
    /// Who may call, and as whom (docs/auth.md).
    pub auth: Arc<super::auth::Authenticator>,
    /// Set at shutdown: `/mcp` takes no new requests while computers are being removed.
    draining: AtomicBool,
}

impl Guard {
    pub fn new(hosts: AllowedHosts, auth: Arc<super::auth::Authenticator>) -> Self {
        Self {
            hosts,
            auth,
            draining: AtomicBool::new(false),
        }
    }

    /// From now on `/mcp` answers 503 (shutdown cleanup must not race new computers).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

fn text(status: StatusCode, body: &'static str) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Host (421) then Origin (403), before anything else on `/mcp` and `GET /`.
pub async fn check_host_and_origin(
    State(guard): State<Arc<Guard>>,
    request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    // HTTP/2 carries the host in the request target rather than a Host header.
    let host = headers
        .get(HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| request.uri().authority().map(|a| a.as_str().to_owned()));
    // Anyone can cause these lines: capped, escaped and rationed like the audit's refusals.
    if !guard.hosts.host_ok(host.as_deref()) {
        if let Some(suppressed) = guard.auth.refusals.admit() {
            tracing::warn!(
                host = super::auth::loggable(host.as_deref().unwrap_or("")),
                suppressed,
                "rejected request: Host not allowed"
            );
        }
        return text(StatusCode::MISDIRECTED_REQUEST, "Invalid Host header");
    }
    if !guard
        .hosts
        .origin_ok(headers.get(ORIGIN).map(HeaderValue::as_bytes))
    {
        if let Some(suppressed) = guard.auth.refusals.admit() {
            tracing::warn!(suppressed, "rejected request: Origin not allowed");
        }
        return text(StatusCode::FORBIDDEN, "Invalid Origin header");
    }
    next.run(request).await
}

/// 503 on `/mcp` once shutdown has begun: a request still arriving on an open connection
/// must not create a computer after the shutdown sweep has listed them.
pub async fn refuse_while_draining(
    State(guard): State<Arc<Guard>>,
    request: Request,
    next: Next,
) -> Response {
    if guard.is_draining() {
        return text(StatusCode::SERVICE_UNAVAILABLE, "Server is shutting down");
    }
    next.run(request).await
}

/// 413 for a body whose `Content-Length` exceeds [`MAX_REQUEST_BODY_BYTES`], without reading
/// it (rmcp would buffer up to the limit first). rmcp enforces the same limit on chunked
/// bodies while it reads them.
pub async fn refuse_declared_oversize(request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|length| length > MAX_REQUEST_BODY_BYTES as u64) {
        let mut response = Response::new(Body::from(format!(
            "Payload Too Large: request body exceeds {MAX_REQUEST_BODY_BYTES} bytes"
        )));
        *response.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        return response;
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(bind: &str, extra: &[&str]) -> AllowedHosts {
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        AllowedHosts::new(bind, &extra)
    }

    #[test]
    fn allowed_names_follow_the_bind_address() {
        let loopback = ["localhost", "127.0.0.1", "::1"];
        assert_eq!(hosts("127.0.0.1", &[]).names(), loopback);
        assert_eq!(hosts("127.0.0.2", &[]).names(), loopback);
        assert_eq!(hosts("::1", &[]).names(), loopback);
        assert_eq!(hosts("[::1]", &[]).names(), loopback);
        assert_eq!(hosts("0.0.0.0", &[]).names(), loopback);
        assert_eq!(hosts("::", &[]).names(), loopback);
        assert_eq!(
            hosts("10.1.2.3", &["MCP.example.com", "localhost"]).names(),
            [
                "10.1.2.3",
                "localhost",
                "127.0.0.1",
                "::1",
                "mcp.example.com"
            ]
        );
        assert!(hosts("0.0.0.0", &["*"]).any());
    }

    #[test]
    fn host_header_is_compared_without_port_and_case() {
        let allowed = hosts("127.0.0.1", &["mcp.example.com"]);
        for ok in [
            "localhost",
            "LOCALHOST:8435",
            "127.0.0.1:1",
            "[::1]:8435",
            "[::1]",
            "mcp.example.com",
            "Mcp.Example.Com:443",
        ] {
            assert!(allowed.host_ok(Some(ok)), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8435",
            "localhost.evil.example",
            "::1",
            "",
            "127.0.0.2",
        ] {
            assert!(!allowed.host_ok(Some(bad)), "{bad}");
        }
        assert!(!allowed.host_ok(None));
        assert!(hosts("127.0.0.1", &["*"]).host_ok(Some("evil.example")));
    }

    #[test]
    fn origin_must_be_http_or_https_on_an_allowed_host() {
        let allowed = hosts("127.0.0.1", &[]);
        assert!(allowed.origin_ok(None));
        for ok in [
            "http://localhost:8435",
            "https://127.0.0.1",
            "http://[::1]:9",
            "HTTP://LocalHost",
        ] {
            assert!(allowed.origin_ok(Some(ok.as_bytes())), "{ok}");
        }
        for bad in [
            "null",
            "http://evil.example",
            "https://evil.example:8435",
            "file://localhost",
            "localhost",
            "",
            "http://localhost.evil.example",
        ] {
            assert!(!allowed.origin_ok(Some(bad.as_bytes())), "{bad}");
        }
        assert!(!allowed.origin_ok(Some(&[0xff, 0xfe])));
        let any = hosts("127.0.0.1", &["*"]);
        assert!(any.origin_ok(Some(b"https://anything.example")));
        assert!(!any.origin_ok(Some(b"null")));
    }
}
