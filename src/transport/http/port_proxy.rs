//! The port proxy (docs/files.md, "Ports"): HTTP to a port in a computer, on two routes.
//!
//! - **A port's own origin**, `http://p<port>-<key>.localhost:<port>/…`: the URL `port_url`
//!   hands out over HTTP. The host name carries the port's key ([`crate::ports`]), which is
//!   the only credential asked for, so a browser can follow the link; being an origin of its
//!   own, the port's pages cannot read the server's other routes (`/mcp`, the dashboard's
//!   storage) or another port's. [`serve_port_origins`] takes such requests before any other
//!   route, whatever their path: `/mcp` on a port's origin is the computer's `/mcp`.
//! - **The path route**, `/computers/<computer_id>/ports/<port>/…` on the server's origin,
//!   behind the same Host/Origin check, token and drain gates as `/mcp`: for HTTP clients that
//!   send the token. Its pages share the server's origin, so they are sandboxed into an opaque
//!   one ([`SERVER_ORIGIN_POLICY`]).
//!
//! Both refuse requests that pages on other origins make ([`foreign_initiator`]), so that a page
//! a computer serves cannot reach another computer's ports, even when the server runs without
//! authentication. Each request opens one connection through [`crate::ports::Ports::connect`]
//! (which never creates or starts a computer) and speaks HTTP/1.1 to the port. Credentials stay
//! on their side: what a browser or a proxy in front adds to a request (cookies, `Authorization`,
//! `X-Forwarded-*`, `X-Auth-*`, …) never reaches the computer, and what a computer could use
//! to act on an origin beyond its page (`Set-Cookie`, `Service-Worker-Allowed`,
//! `Clear-Site-Data`, HSTS, `Alt-Svc`, reporting endpoints, CORS grants) never reaches the
//! browser. A WebSocket (any `Upgrade`) is carried both ways once the port agrees to it, as a
//! [tunnel](Tunnels): it keeps its connection slot of the listener, a principal holds at most
//! [`TUNNELS_PER_PRINCIPAL`], and one quiet for [`TUNNEL_IDLE_TIMEOUT`] is closed. Responses
//! stream through without being buffered here.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{
    CONNECTION, CONTENT_SECURITY_POLICY, CONTENT_TYPE, HOST, LOCATION, ORIGIN, PROXY_AUTHORIZATION,
    REFERRER_POLICY, TE, TRAILER, TRANSFER_ENCODING, UPGRADE,
};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::Response;
use hyper::client::conn::http1 as client;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;
use tracing::debug;

use super::guard::Guard;
use super::listener;
use crate::ids::ComputerId;
use crate::mcp::ports::message;
use crate::ports::{PortError, Ports};

/// How long the port may take to answer with its response headers (a dev server's first
/// page may compile first).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(120);
const PREFIX: &str = "/computers/";
/// Tunnels one principal holds at once. A browser tab holds one or two (a dev server's reload
/// socket); every tunnel also holds one of the listener's 512 connections, so one principal
/// must not be able to take them all.
pub const TUNNELS_PER_PRINCIPAL: usize = 64;
/// A tunnel with no byte either way for this long is closed. Long enough for a person
/// pausing over a page (a dev server's client reconnects its reload socket by itself), short
/// enough that tunnels a client forgot do not hold connection slots for hours.
pub const TUNNEL_IDLE_TIMEOUT: Duration = Duration::from_secs(10 * 60);
/// Pages on the server's origin run in an opaque origin of their own: scripts, forms and
/// pop-ups work, but nothing the server's origin holds (the dashboard's storage, `/mcp`,
/// other computers' routes) is theirs.
const SERVER_ORIGIN_POLICY: &str =
    "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads";
/// Pages on their own origin keep it (a dev server's ES modules and storage need it); the
/// sandbox still keeps them from navigating the browser's top window elsewhere.
const OWN_ORIGIN_POLICY: &str =
    "sandbox allow-scripts allow-same-origin allow-forms allow-popups allow-modals allow-downloads";
/// Request headers that carry the caller's credentials or a proxy's claims about the caller;
/// none of them is the computer's business.
const CREDENTIAL_HEADERS: [&str; 6] = [
    "authorization",
    "cookie",
    "forwarded",
    "x-real-ip",
    "x-remote-user",
    "remote-user",
];
/// Prefixes of the same: reverse proxies' `X-Forwarded-*` (user, e-mail, address),
/// `X-Auth-Request-*` (oauth2-proxy) and the identity assertions of AWS ALB, Cloudflare
/// Access, Google IAP and Azure App Service.
const CREDENTIAL_HEADER_PREFIXES: [&str; 6] = [
    "x-forwarded-",
    "x-auth-",
    "x-amzn-oidc-",
    "cf-access-",
    "x-goog-iap-",
    "x-ms-client-principal",
];
/// Response headers whose effect reaches beyond the page: cookies of the origin, a service
/// worker for all of it, wiping its storage, pinning the host to HTTPS or to another server,
/// reporting its traffic elsewhere.
const ORIGIN_WIDE_HEADERS: [&str; 9] = [
    "set-cookie",
    "set-cookie2",
    "service-worker-allowed",
    "clear-site-data",
    "strict-transport-security",
    "alt-svc",
    "nel",
    "report-to",
    "reporting-endpoints",
];
/// CORS grants: another origin's requests are refused before they reach the computer, so a
/// grant could only widen what the next change lets through.
const CORS_PREFIX: &str = "access-control-";

fn text(status: StatusCode, body: String) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// What the proxy routes share.
pub struct PortProxy {
    pub ports: Arc<Ports>,
    pub guard: Arc<Guard>,
    tunnels: Tunnels,
}

impl PortProxy {
    pub fn new(ports: Arc<Ports>, guard: Arc<Guard>) -> Arc<Self> {
        Arc::new(Self {
            ports,
            guard,
            tunnels: Tunnels::default(),
        })
    }
}

/// Which origin a route serves pages on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exposure {
    /// The server's own (the path route).
    ServerOrigin,
    /// The port's own (its key in the host name).
    OwnOrigin,
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

/// Removes every header named in `exact` or starting with one of `prefixes` (names are
/// lowercase in `HeaderMap`).
fn strip_named(headers: &mut HeaderMap, exact: &[&str], prefixes: &[&str]) {
    let doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            let name = name.as_str();
            exact.contains(&name) || prefixes.iter().any(|prefix| name.starts_with(prefix))
        })
        .cloned()
        .collect();
    for name in doomed {
        headers.remove(name);
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

/// Why a request comes from a page this route must not serve, if it does: a page on another
/// origin (its `Origin`, or Fetch Metadata's `Sec-Fetch-Site`). Requests without either (a
/// person typing the address, an HTTP client) pass. A port's own origin also takes top-level
/// navigations from elsewhere (a link in the dashboard or a chat): they need the port's key,
/// and what they load is a page, not something another page can read.
fn foreign_initiator(
    headers: &HeaderMap,
    method: &Method,
    exposure: Exposure,
) -> Option<&'static str> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(origin) = headers.get(ORIGIN) {
        let own = header(HOST.as_str()).unwrap_or_default();
        let same = origin
            .to_str()
            .ok()
            .and_then(|origin| {
                origin
                    .strip_prefix("http://")
                    .or_else(|| origin.strip_prefix("https://"))
            })
            .is_some_and(|authority| !own.is_empty() && authority.eq_ignore_ascii_case(own));
        if !same {
            return Some("a page on another origin");
        }
    }
    match header("sec-fetch-site") {
        None | Some("none" | "same-origin") => None,
        Some(_) => {
            let top_level_navigation = exposure == Exposure::OwnOrigin
                && matches!(*method, Method::GET | Method::HEAD)
                && header("sec-fetch-mode") == Some("navigate")
                && header("sec-fetch-dest") == Some("document");
            (!top_level_navigation).then_some("a page on another site")
        }
    }
}

fn refuse_initiator(why: &str) -> Response {
    text(
        StatusCode::FORBIDDEN,
        format!(
            "Forbidden: a port is served only to its own pages and to direct requests, not to {why}."
        ),
    )
}

/// The host name of a request, lowercase, without port or IPv6 brackets.
fn request_host(request: &Request) -> Option<String> {
    let value = request
        .headers()
        .get(HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| request.uri().authority().map(|a| a.as_str().to_owned()))?;
    let authority = value.parse::<axum::http::uri::Authority>().ok()?;
    Some(authority.host().to_ascii_lowercase())
}

/// axum middleware in front of every route: a request for a port's own origin (its host name
/// names a port key handed out, under an allowed name) goes to that port, whatever its path;
/// anything else goes on to the server's routes.
pub async fn serve_port_origins(
    State(proxy): State<Arc<PortProxy>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(host) = request_host(&request) else {
        return next.run(request).await;
    };
    let Some((label, domain)) = host.split_once('.') else {
        return next.run(request).await;
    };
    if !proxy.guard.hosts.port_origin_domain_ok(domain) {
        return next.run(request).await;
    }
    let Some((computer, port)) = proxy.ports.origin_of_host(&host) else {
        // A port origin's shape under our name but no key of ours: guessed, or its computer is
        // gone. Nothing else lives on such a name.
        if label.starts_with('p') && label.contains('-') && label.len() > 32 {
            return text(StatusCode::NOT_FOUND, "Not Found".to_owned());
        }
        return next.run(request).await;
    };
    if proxy.guard.is_draining() {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            "Server is shutting down".to_owned(),
        );
    }
    if let Some(why) = foreign_initiator(request.headers(), request.method(), Exposure::OwnOrigin) {
        return refuse_initiator(why);
    }
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    forward(
        &proxy,
        &computer,
        port,
        request,
        path,
        Exposure::OwnOrigin,
        None,
    )
    .await
}

/// The path route's handler, behind the Host/Origin check, the token and the drain gate.
pub async fn route(State(proxy): State<Arc<PortProxy>>, request: Request) -> Response {
    let target = match parse(request.uri()) {
        Ok(target) => target,
        Err((status, body)) => return text(status, body),
    };
    if let Some(why) =
        foreign_initiator(request.headers(), request.method(), Exposure::ServerOrigin)
    {
        return refuse_initiator(why);
    }
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
    let query = request
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let prefix = format!("{PREFIX}{}/ports/{}", target.computer, target.port);
    forward(
        &proxy,
        &computer,
        target.port,
        request,
        format!("/{rest}{query}"),
        Exposure::ServerOrigin,
        Some(prefix),
    )
    .await
}

/// One request to `port` in `computer` (already scoped to its owner), sent to `path` there.
async fn forward(
    proxy: &PortProxy,
    computer: &ComputerId,
    port: u16,
    mut request: Request,
    path: String,
    exposure: Exposure,
    prefix: Option<String>,
) -> Response {
    let upgrade = wants_upgrade(request.headers());
    // A tunnel is admitted before anything is dialled.
    let tunnel = if upgrade {
        match proxy.tunnels.admit(computer) {
            Some(tunnel) => Some(tunnel),
            None => {
                return text(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "Too many open tunnels (WebSocket connections) through the port proxy: at most {TUNNELS_PER_PRINCIPAL} at once per principal. Close some and retry."
                    ),
                );
            }
        }
    } else {
        None
    };
    let stream = match proxy.ports.connect(computer, port).await {
        Ok(stream) => stream,
        Err(error @ PortError::NotFound(_)) => return text(StatusCode::NOT_FOUND, message(&error)),
        Err(error) => return text(StatusCode::BAD_GATEWAY, message(&error)),
    };
    let (mut sender, connection) = match client::handshake(TokioIo::new(stream)).await {
        Ok(pair) => pair,
        Err(error) => {
            return text(StatusCode::BAD_GATEWAY, format!("Port {port}: {error}"));
        }
    };
    tokio::spawn(async move {
        if let Err(error) = connection.with_upgrades().await {
            debug!(%error, "port connection ended");
        }
    });

    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut request));
    let (mut parts, body) = request.into_parts();
    parts.uri = match Uri::try_from(path) {
        Ok(uri) => uri,
        Err(error) => return text(StatusCode::BAD_REQUEST, error.to_string()),
    };
    parts.version = axum::http::Version::HTTP_11;
    let headers = &mut parts.headers;
    strip_hop_by_hop(headers, upgrade);
    strip_named(headers, &CREDENTIAL_HEADERS, &CREDENTIAL_HEADER_PREFIXES);
    if let Some(host) = headers.remove(HOST) {
        headers.insert("x-forwarded-host", host);
    }
    // Dev servers commonly accept only their own names in Host.
    if let Ok(host) = HeaderValue::try_from(format!("localhost:{port}")) {
        headers.insert(HOST, host);
    }
    if let Some(prefix) = prefix
        && let Ok(prefix) = HeaderValue::try_from(prefix)
    {
        headers.insert("x-forwarded-prefix", prefix);
    }
    let upstream = axum::http::Request::from_parts(parts, body);
    let mut response =
        match tokio::time::timeout(RESPONSE_TIMEOUT, sender.send_request(upstream)).await {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => {
                return text(StatusCode::BAD_GATEWAY, format!("Port {port}: {error}"));
            }
            Err(_) => {
                return text(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "Port {port} did not answer within {} seconds.",
                        RESPONSE_TIMEOUT.as_secs()
                    ),
                );
            }
        };
    let switching = response.status() == StatusCode::SWITCHING_PROTOCOLS;
    if switching && let (Some(client_upgrade), Some(tunnel)) = (client_upgrade, tunnel) {
        let upstream_upgrade = hyper::upgrade::on(&mut response);
        // The listener's slot for this connection stays taken while the tunnel lives.
        let slot = listener::this_connection();
        tokio::spawn(async move {
            let _held = (tunnel, slot);
            if let (Ok(client), Ok(upstream)) = (client_upgrade.await, upstream_upgrade.await) {
                carry(
                    TokioIo::new(client),
                    TokioIo::new(upstream),
                    TUNNEL_IDLE_TIMEOUT,
                )
                .await;
            }
        });
    }
    let (mut parts, body) = response.into_parts();
    let headers = &mut parts.headers;
    strip_hop_by_hop(headers, switching);
    strip_named(headers, &ORIGIN_WIDE_HEADERS, &[CORS_PREFIX]);
    if !switching {
        let policy = match exposure {
            Exposure::ServerOrigin => SERVER_ORIGIN_POLICY,
            Exposure::OwnOrigin => OWN_ORIGIN_POLICY,
        };
        // Added next to any policy of the page's own: a browser enforces every one.
        headers.append(CONTENT_SECURITY_POLICY, HeaderValue::from_static(policy));
        // A port's host name is its key: pages must not send it to other sites.
        headers.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    }
    Response::from_parts(parts, Body::new(body))
}

/// The tunnels open now, per owner (the principal whose computer they reach).
#[derive(Default)]
struct Tunnels {
    open: Arc<Mutex<HashMap<String, usize>>>,
}

/// One admitted tunnel; dropping it gives its place back.
struct Tunnel {
    open: Arc<Mutex<HashMap<String, usize>>>,
    owner: String,
}

impl Tunnels {
    /// A place for a tunnel to `computer`, unless its owner holds [`TUNNELS_PER_PRINCIPAL`].
    fn admit(&self, computer: &ComputerId) -> Option<Tunnel> {
        // An id is its slug plus, for any principal but `default`, `.<owner tag>`.
        let owner = computer.as_str()[computer.slug().len()..].to_owned();
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let count = open.entry(owner.clone()).or_default();
        if *count >= TUNNELS_PER_PRINCIPAL {
            return None;
        }
        *count += 1;
        Some(Tunnel {
            open: self.open.clone(),
            owner,
        })
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = open.get_mut(&self.owner) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.owner);
            }
        }
    }
}

/// Copies both ways until either side ends or nothing moves for `idle`.
async fn carry<A, B>(client: A, upstream: B, idle: Duration)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let started = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let mut client = Watched {
        inner: client,
        started,
        last: last.clone(),
    };
    let mut upstream = Watched {
        inner: upstream,
        started,
        last: last.clone(),
    };
    let copy = tokio::io::copy_bidirectional(&mut client, &mut upstream);
    tokio::pin!(copy);
    loop {
        let quiet_since = started + Duration::from_millis(last.load(Ordering::Relaxed));
        tokio::select! {
            _ = &mut copy => return,
            () = tokio::time::sleep_until(quiet_since + idle) => {
                let moved = started + Duration::from_millis(last.load(Ordering::Relaxed));
                if moved == quiet_since {
                    debug!(idle_secs = idle.as_secs(), "closing an idle tunnel");
                    return;
                }
            }
        }
    }
}

/// A stream that records when bytes last came in (milliseconds since `started`).
struct Watched<T> {
    inner: T,
    started: Instant,
    last: Arc<AtomicU64>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            let elapsed = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
            self.last.store(elapsed, Ordering::Relaxed);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
