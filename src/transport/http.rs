//! The Streamable HTTP transport (docs/decisions.md, "HTTP transport"): an axum router with rmcp's
//! `StreamableHttpService` at `/mcp` (behind the Host/Origin check, bearer auth and body limit
//! of [`guard`]), `/healthz`, `GET /` and the dashboard's sign-in routes ([`pages`]), served by
//! the bounded accept loop of [`listener`]; the access token generated when none is
//! configured; session and lease reaping; and the shutdown sequence of docs/decisions.md,
//! "Shutdown".
//!
//! **API boundary:** everything an HTTP client observes besides MCP itself (routes, status codes,
//! headers) is decided here. Computers are never touched here: sessions are opened and closed
//! through [`crate::mcp::SessionHandler`] ([`sessions`] says how each request is held).

mod auth;
mod guard;
mod listener;
mod pages;
mod port_proxy;
mod screen_body;
mod secret_page;
mod sessions;

/// Stdio mode serves `secret_request`'s pages on a loopback listener of their own.
pub use secret_page::loopback_starter as secret_page_starter;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::any;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::HttpConfig;
use crate::mcp::Surface;
use crate::shutdown;
use crate::state::GeneratedToken;
use auth::{Authenticator, NamedTokens};
use guard::{AllowedHosts, Guard, MAX_REQUEST_BODY_BYTES};
use sessions::IdleSessions;

/// Sessions that never finish `initialize` are dropped after this long (docs/decisions.md, "Streamable HTTP service").
const INIT_TIMEOUT: Duration = Duration::from_secs(60);
/// SSE comment pings on open streams, so proxies do not cut streams that are merely quiet.
const SSE_KEEP_ALIVE: Duration = Duration::from_secs(15);
/// Reconnect delay announced to SSE clients.
const SSE_RETRY: Duration = Duration::from_secs(3);
/// Upper bound of the reaper period: an abandoned session or lease outlives its timeout by at
/// most this (docs/decisions.md, "Sessions, holders and leases"; acceptance: within timeout + 15 s).
const REAPER_MAX_PERIOD: Duration = Duration::from_secs(15);
/// Lower bound of the reaper period, so tiny timeouts do not spin.
const REAPER_MIN_PERIOD: Duration = Duration::from_secs(1);

/// What the startup line reports besides the HTTP settings.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions<'a> {
    /// Backend name for the startup line.
    pub backend: &'a str,
    /// Lifecycle tools on: the web dashboard and `dashboard_resource` in `GET /`.
    pub lifecycle_tools: bool,
    /// `--timeout`: how long a request without its own `timeout` keeps its session active.
    pub default_call_timeout: Duration,
    /// Where a generated access token is written (`None`: no HOME).
    pub state_dir: Option<&'a Path>,
}

/// `min(15 s, max(1 s, timeout / 4))` (docs/decisions.md, "Constants").
pub fn reaper_period(session_timeout: Duration) -> Duration {
    (session_timeout / 4).clamp(REAPER_MIN_PERIOD, REAPER_MAX_PERIOD)
}

/// `--host` as a URL authority part: IPv6 literals in brackets.
fn url_host(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

/// The host a person's browser opens the secret pages at: `--host`, or `localhost` when it is
/// a wildcard address (which is no address to open, nor one the Host check accepts).
fn page_host(host: &str) -> String {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<std::net::IpAddr>() {
        Ok(ip) if ip.is_unspecified() => "localhost".to_owned(),
        _ => url_host(host),
    }
}

/// The name ports' own origins live under (`p<port>-<key>.<this>`): the `--host` name when it
/// is one, else `localhost`, whose subdomains browsers resolve to loopback themselves.
fn origin_domain(host: &str) -> String {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.parse::<std::net::IpAddr>().is_ok() || bare.is_empty() {
        "localhost".to_owned()
    } else {
        bare.to_ascii_lowercase()
    }
}

/// Serves until SIGINT/SIGTERM, then drains; returns the process exit code.
pub async fn serve(surface: Arc<Surface>, config: &HttpConfig, options: ServeOptions<'_>) -> i32 {
    let mut signals = shutdown::Signals::install();
    // `[::1]` is accepted as a bind address too (the brackets are URL syntax, not the address).
    let bind_host = config.host.trim_start_matches('[').trim_end_matches(']');
    let listener = match TcpListener::bind((bind_host, config.port)).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!(
                "kilntainers: error: Cannot listen on {}:{}: {error}",
                config.host, config.port
            );
            return 1;
        }
    };
    let registry = surface.registry.clone();
    let hosts = AllowedHosts::new(&config.host, &config.extra_allowed_hosts);
    let port = listener
        .local_addr()
        .map_or(config.port, |addr: SocketAddr| addr.port());
    // Without a configured token, a fresh one guards `/mcp` unless the user opted out: on
    // loopback, computers with host networking and neighbouring containers reach us too.
    let named = match config.auth_tokens_file.as_deref().map(NamedTokens::load) {
        Some(Ok(named)) => Some(Arc::new(named)),
        Some(Err(message)) => {
            eprintln!("kilntainers: error: {message}");
            return 1;
        }
        None => None,
    };
    let configured = config.auth_token.is_some() || named.is_some() || config.oauth.is_some();
    let generated = if !configured && !config.allow_unauthenticated {
        match generate_token(options.state_dir, port) {
            Ok(generated) => Some(generated),
            Err(message) => {
                eprintln!("kilntainers: error: {message}");
                return 1;
            }
        }
    } else {
        None
    };
    let single = config
        .auth_token
        .clone()
        .or_else(|| generated.as_ref().map(|g| g.secret().clone()));
    let auth = Authenticator::new(single, named.clone());
    // The web dashboard's sign-in routes: only with OAuth and the dashboard both on.
    let sign_in: Option<Router> = None;
    #[cfg(feature = "oauth")]
    let (auth, sign_in) = match &config.oauth {
        Some(oauth) => {
            let default_audience = format!("http://{}:{port}/mcp", url_host(&config.host));
            match auth::oauth::Verifier::new(oauth, default_audience) {
                Ok(verifier) => {
                    eprintln!(
                        "kilntainers: OAuth: accepting access tokens of {} for resource {} (metadata: {})",
                        verifier.issuer(),
                        verifier.audience(),
                        auth::oauth::metadata_url(verifier.audience())
                    );
                    if let Some(warning) = verifier.principal_claim_warning() {
                        eprintln!("kilntainers: warning: {warning}");
                    }
                    let verifier = Arc::new(verifier);
                    let sign_in = options.lifecycle_tools.then(|| {
                        eprintln!(
                            "kilntainers: web dashboard: http://{}:{port}/ signs in with {} ({})",
                            url_host(&config.host),
                            verifier.issuer(),
                            match &oauth.dashboard_client_id {
                                Some(id) => format!("client {id}"),
                                None => "a client registered on first use".to_owned(),
                            }
                        );
                        // The page's own origins: this listener's port (unless any Host name
                        // reaches it), or the audience's, behind a proxy.
                        let page_origins = pages::sign_in::PageOrigins::new(
                            verifier.audience(),
                            (!hosts.any()).then_some(port),
                        );
                        pages::sign_in::routes(
                            verifier.clone(),
                            oauth.dashboard_client_id.clone(),
                            page_origins,
                        )
                    });
                    (auth.with_oauth(verifier), sign_in)
                }
                Err(message) => {
                    eprintln!("kilntainers: error: {message}");
                    return 1;
                }
            }
        }
        None => (auth, sign_in),
    };
    let allowed = if hosts.any() {
        "*".to_owned()
    } else {
        hosts.names().join(", ")
    };
    eprintln!(
        "kilntainers: mcp-sandbox-computer-vm-for-ai {} serving http://{}:{port}/mcp (backend: {}, lifecycle tools: {}, allowed hosts: {allowed})",
        env!("CARGO_PKG_VERSION"),
        url_host(&config.host),
        options.backend,
        if options.lifecycle_tools { "on" } else { "off" },
    );
    if hosts.any() {
        eprintln!(
            "kilntainers: warning: --allowed-host '*' disables the Host check; any web page can reach /mcp through DNS rebinding."
        );
    }
    let loopback_bind = matches!(config.host.as_str(), "127.0.0.1" | "localhost" | "::1");
    if !loopback_bind && !auth.enabled() {
        eprintln!(
            "kilntainers: warning: serving without authentication on a non-loopback address ({}); anyone who can reach it can run commands.",
            config.host
        );
    } else if !auth.enabled() {
        eprintln!(
            "kilntainers: warning: serving without authentication (--allow-unauthenticated-http); anything that reaches this machine's loopback, such as a computer with host networking, can run commands."
        );
    }
    if let Some(generated) = &generated {
        announce_token(
            generated,
            &url_host(&config.host),
            port,
            options.lifecycle_tools,
        );
    }
    info!(
        auth = if auth.enabled() { "on" } else { "off" },
        named_tokens = named.is_some(),
        oauth = config.oauth.is_some(),
        "bearer authentication on /mcp"
    );

    // Ends every rmcp session and open stream.
    let end_sessions = CancellationToken::new();
    // Closes the listener (connections in progress continue).
    let stop_accepting = CancellationToken::new();
    let guard = Arc::new(Guard::new(hosts, Arc::new(auth)));
    // Watched from here on, before the first request: SIGHUP's default action ends the process.
    let reloader = named.map(|named| {
        use tokio::signal::unix::{SignalKind, signal};
        let hangups = signal(SignalKind::hangup());
        tokio::spawn(reload_on_hangup(named, hangups))
    });
    let sessions = Arc::new(IdleSessions::new(
        INIT_TIMEOUT,
        options.default_call_timeout,
    ));
    let app = router(
        &surface,
        sessions.clone(),
        config.session_timeout,
        guard.clone(),
        options.lifecycle_tools,
        sign_in,
        end_sessions.child_token(),
    );
    surface.set_proxy_base(format!("http://{}:{port}", url_host(&config.host)));
    if let Some(onboarding) = &surface.onboarding {
        onboarding.set_base(format!("http://{}:{port}", page_host(&config.host)));
    }
    if let Some(ports) = &surface.ports {
        ports.route_over_http(crate::ports::OriginNames {
            domain: origin_domain(&config.host),
            listener_port: port,
        });
    }
    let mut server = tokio::spawn(listener::serve(listener, app, stop_accepting.clone()));
    let reaper = tokio::spawn(reap(sessions, registry.clone(), config.session_timeout));

    let trigger = tokio::select! {
        () = signals.next() => shutdown::Trigger::Signal,
        result = &mut server => {
            // The accept loop only returns on shutdown; anything else is a fault worth a line.
            warn!(?result, "HTTP server stopped unexpectedly");
            shutdown::Trigger::ClientGone
        }
    };
    // docs/decisions.md, "Shutdown". Sessions are ended only after the sweep, not before it: ending one
    // drops its handler, whose release removes the session's temporaries in a task of its own
    // that the sweep cannot see (the record is already taken) and that the exit would cut
    // short. Until then no new request is accepted, and calls killed by the sweep still get
    // their results (docs/decisions.md, "Shutdown").
    guard.start_draining();
    stop_accepting.cancel();
    reaper.abort();
    if let Some(reloader) = reloader {
        reloader.abort();
    }
    let code = shutdown::drain(&registry, trigger, &mut signals).await;
    end_sessions.cancel();
    // Connections still open after the drain are cut when the runtime goes away.
    server.abort();
    drop(generated);
    code
}

/// A fresh token in the state dir, or the startup error to print.
fn generate_token(state_dir: Option<&Path>, port: u16) -> Result<GeneratedToken, String> {
    let Some(dir) = state_dir else {
        return Err("Cannot store a generated access token for /mcp: HOME is not set. Set KILNTAINERS_AUTH_TOKEN/--auth-token, or pass --allow-unauthenticated-http.".to_owned());
    };
    GeneratedToken::create(dir, port).map_err(|error| {
        format!(
            "Cannot write a generated access token for /mcp to {}: {error}. Set KILNTAINERS_AUTH_TOKEN/--auth-token, or pass --allow-unauthenticated-http.",
            dir.display()
        )
    })
}

/// Says where the generated token is, never the token itself (logs get pasted into issues).
fn announce_token(generated: &GeneratedToken, host: &str, port: u16, dashboard: bool) {
    let path = generated.path().display();
    eprintln!(
        "kilntainers: /mcp requires the access token in {path} (send \"Authorization: Bearer <token>\"; set --auth-token to choose one, or pass --allow-unauthenticated-http to serve without)."
    );
    if dashboard {
        eprintln!(
            "kilntainers: web dashboard: open \"http://{host}:{port}/#token=$(cat '{path}')\", or open http://{host}:{port}/ and enter the token."
        );
    }
}

fn router(
    surface: &Arc<Surface>,
    sessions: Arc<IdleSessions>,
    session_timeout: Duration,
    guard: Arc<Guard>,
    lifecycle_tools: bool,
    sign_in: Option<Router>,
    cancellation: CancellationToken,
) -> Router {
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(true)
        .with_json_response(false)
        .with_sse_keep_alive(Some(SSE_KEEP_ALIVE))
        .with_sse_retry(Some(SSE_RETRY))
        .with_cancellation_token(cancellation)
        .with_max_request_body_bytes(MAX_REQUEST_BODY_BYTES)
        // Our guard checks Host and Origin with our status codes and allow-list.
        .disable_allowed_hosts()
        .disable_allowed_origins();
    let mcp = StreamableHttpService::new(
        sessions::handler_factory(surface.clone(), session_timeout),
        sessions.clone(),
        config,
    );
    // The last layer added runs first: Host/Origin, the token, the shutdown gate, the declared
    // body size, the DELETE of a session, the holder scope, then the body screen right before rmcp
    // (it reads at most MAX_REQUEST_BODY_BYTES, so a chunked body is capped while streaming,
    // and all bodies together within one budget).
    let mcp_routes = Router::new()
        .route_service("/mcp", mcp.clone())
        .route_service("/mcp/", mcp)
        .layer(from_fn_with_state(
            screen_body::BodyBudget::new(screen_body::BODY_BUDGET_BYTES),
            screen_body::screen_post,
        ))
        .layer(from_fn(sessions::scope_holder))
        .layer(from_fn_with_state(
            sessions.clone(),
            sessions::refuse_foreign_session,
        ))
        .layer(from_fn_with_state(sessions.clone(), sessions::end_session))
        .layer(from_fn(guard::refuse_declared_oversize))
        .layer(from_fn_with_state(
            guard.clone(),
            guard::refuse_while_draining,
        ))
        .layer(from_fn_with_state(guard.auth.clone(), auth::require_auth))
        .layer(from_fn_with_state(
            guard.clone(),
            guard::check_host_and_origin,
        ));
    let dashboard = lifecycle_tools.then(|| surface.registry.backend().kind());
    let mut root = Router::new().route("/", any(pages::root).with_state(dashboard));
    if let Some(document) = guard.auth.resource_metadata() {
        // RFC 9728: at the root, and under the path of the resource (`/mcp`). Public: a
        // client reads it before it has a token.
        let body = document.to_string();
        let serve = any(move || {
            let body = body.clone();
            async move {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    body,
                )
            }
        });
        root = root
            .route("/.well-known/oauth-protected-resource", serve.clone())
            .route("/.well-known/oauth-protected-resource/{*resource}", serve);
    }
    if let Some(sign_in) = sign_in {
        // Public like the metadata (the browser has no token yet), but closed at shutdown.
        root = root.merge(sign_in.layer(from_fn_with_state(
            guard.clone(),
            guard::refuse_while_draining,
        )));
    }
    let root = root.layer(from_fn_with_state(
        guard.clone(),
        guard::check_host_and_origin,
    ));
    let mut app = Router::new().merge(mcp_routes).merge(root);
    if let Some(onboarding) = &surface.onboarding {
        app = app.merge(secret_page::routes(onboarding.clone(), guard.clone()));
    }
    let proxy = surface
        .ports
        .as_ref()
        .map(|ports| port_proxy::PortProxy::new(ports.clone(), guard.clone()));
    if let Some(proxy) = &proxy {
        // The same gates as `/mcp`, in the same order (docs/files.md, "Ports").
        let route = any(port_proxy::route).with_state(proxy.clone());
        let port_routes = Router::new()
            .route("/computers/{computer_id}/ports/{port}", route.clone())
            .route("/computers/{computer_id}/ports/{port}/", route.clone())
            .route("/computers/{computer_id}/ports/{port}/{*rest}", route)
            .layer(from_fn_with_state(
                guard.clone(),
                guard::refuse_while_draining,
            ))
            .layer(from_fn_with_state(guard.auth.clone(), auth::require_auth))
            .layer(from_fn_with_state(guard, guard::check_host_and_origin));
        app = app.merge(port_routes);
    }
    let app = app
        .route("/healthz", any(pages::healthz))
        .fallback(pages::not_found);
    match proxy {
        // Before every route: a port's own origin is the port's, whatever the path.
        Some(proxy) => app.layer(from_fn_with_state(proxy, port_proxy::serve_port_origins)),
        None => app,
    }
}

/// Re-reads `--auth-tokens-file` on every SIGHUP until aborted; a broken file keeps only the
/// tokens its lines still give, and says why.
async fn reload_on_hangup(
    named: Arc<NamedTokens>,
    hangups: std::io::Result<tokio::signal::unix::Signal>,
) {
    let mut hangups = match hangups {
        Ok(hangups) => hangups,
        Err(error) => {
            warn!(%error, "cannot watch SIGHUP; --auth-tokens-file is read only at startup");
            return;
        }
    };
    while hangups.recv().await.is_some() {
        match named.reload() {
            Ok(count) => info!(
                target: auth::AUDIT,
                path = %named.path().display(),
                principals = count,
                "reloaded --auth-tokens-file"
            ),
            Err(failure) => {
                tracing::error!(
                    target: auth::AUDIT,
                    error = failure.error,
                    kept = failure.kept,
                    revoked = failure.revoked,
                    "cannot reload --auth-tokens-file; only the tokens of lines still in it stay valid"
                );
            }
        }
    }
}

/// Closes idle sessions and expired leases every [`reaper_period`] until aborted.
async fn reap(
    sessions: Arc<IdleSessions>,
    registry: Arc<crate::registry::Registry>,
    timeout: Duration,
) {
    let mut ticks = tokio::time::interval(reaper_period(timeout));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        sessions.close_idle(timeout).await;
        registry.reap_expired_leases().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaper_period_is_a_quarter_of_the_timeout_within_bounds() {
        assert_eq!(
            reaper_period(Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        assert_eq!(
            reaper_period(Duration::from_secs(2)),
            Duration::from_secs(1)
        );
        assert_eq!(
            reaper_period(Duration::from_secs(20)),
            Duration::from_secs(5)
        );
        assert_eq!(
            reaper_period(Duration::from_secs(300)),
            Duration::from_secs(15)
        );
    }

    #[test]
    fn ports_live_under_localhost_unless_the_listener_has_a_name() {
        assert_eq!(origin_domain("127.0.0.1"), "localhost");
        assert_eq!(origin_domain("0.0.0.0"), "localhost");
        assert_eq!(origin_domain("[::1]"), "localhost");
        assert_eq!(origin_domain("localhost"), "localhost");
        assert_eq!(origin_domain("MCP.example.com"), "mcp.example.com");
    }

    #[test]
    fn secret_pages_of_a_wildcard_listener_open_at_localhost() {
        assert_eq!(page_host("0.0.0.0"), "localhost");
        assert_eq!(page_host("::"), "localhost");
        assert_eq!(page_host("127.0.0.1"), "127.0.0.1");
        assert_eq!(page_host("::1"), "[::1]");
        assert_eq!(page_host("mcp.example.com"), "mcp.example.com");
    }

    #[test]
    fn ipv6_hosts_are_bracketed_in_urls() {
        assert_eq!(url_host("::1"), "[::1]");
        assert_eq!(url_host("[::1]"), "[::1]");
        assert_eq!(url_host("127.0.0.1"), "127.0.0.1");
    }
}
