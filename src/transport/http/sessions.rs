//! Who holds a request's computers, and when an HTTP session counts as idle
//! (docs/decisions.md, "Sessions, holders and leases", "Streamable HTTP service").
//!
//! **Stateful or stateless.** rmcp builds the handler through a factory that takes no
//! arguments, and calls it both when an `initialize` opens a session and for every
//! sessionless 2026-07-28 request, without saying which. The `/mcp` route therefore wraps the
//! rmcp service in [`scope_holder`], which classifies the request from its headers and exposes
//! the answer to the factory through a task-local for the duration of rmcp's `handle` (the
//! factory runs synchronously inside it, before rmcp spawns anything). The classification is
//! exact for every handler that ends up serving: rmcp routes a request statelessly only when it
//! names protocol ≥ 2026-07-28 in `MCP-Protocol-Version` (mandatory there) and then requires an
//! `Mcp-Method` header equal to the body's method, while an `initialize` always opens a session
//! and may carry `Mcp-Method` only as `initialize`. Handlers that rmcp builds and drops
//! without serving (schema look-ups, rejected requests) hold nothing.
//!
//! **Idle sessions.** rmcp's own `keep_alive` restarts its timer only when a message passes
//! through the session worker, so a `terminal_execute` that runs longer than the timeout
//! without progress notifications would get its session reaped mid-call. It is turned off;
//! [`IdleSessions`] wraps rmcp's `LocalSessionManager` and the session transport instead, and
//! counts a session idle only when no message has arrived for the timeout *and* no request of
//! it is in flight (a request is in flight from its arrival at the handler until its response
//! or error leaves, or until the client cancels it). A request counts as activity for at most
//! its own timeout (the `timeout` argument of a tool call, else `--timeout`): one that never
//! ends — a hung engine, a client gone mid-call — cannot keep its session alive beyond
//! `--session-timeout` plus that timeout. [`IdleSessions::close_idle`] closes such
//! sessions through the session manager, which drops the handler and so releases the
//! session's computers exactly as a client `DELETE` does.
//!
//! **Reconnects.** A request's stream cut before its end keeps its events, the answer
//! included, for the client's `GET` with `Last-Event-ID` ([`replay`]).

mod replay;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::Response;
use futures_util::Stream;
use rmcp::RoleServer;
use rmcp::model::{
    ClientJsonRpcMessage, ClientNotification, ClientRequest, RequestId, ServerJsonRpcMessage,
};
use rmcp::transport::Transport;
use rmcp::transport::WorkerTransport;
use rmcp::transport::streamable_http_server::session::local::{
    LocalSessionManager, LocalSessionManagerError, LocalSessionWorker, SessionConfig,
};
use rmcp::transport::streamable_http_server::session::{EventStore, ServerSseMessage};
use rmcp::transport::streamable_http_server::{SessionId, SessionManager};
use tracing::info;

use super::auth::principal_of;
use crate::config::MAX_TIMEOUT_SECS;
use crate::ids::Principal;
use crate::mcp::{SessionHandler, Surface};

/// Header naming the protocol revision of a request (rmcp's `HEADER_MCP_PROTOCOL_VERSION`).
const PROTOCOL_VERSION_HEADER: &str = "mcp-protocol-version";
/// The session header of Streamable HTTP.
const SESSION_ID_HEADER: &str = "mcp-session-id";
/// SEP-2243 header naming the JSON-RPC method; rmcp requires it on stateless requests.
const METHOD_HEADER: &str = "mcp-method";
/// The first revision without sessions: requests naming it (or later) are served statelessly.
const STATELESS_PROTOCOL: &str = "2026-07-28";

/// How the handler built for the current request holds its computers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// An MCP session (`initialize`): owner references, released when the session ends.
    Session,
    /// One 2026-07-28 request: leases renewed on use (docs/decisions.md, "Sessions, holders and leases").
    Sessionless,
}

/// Who a request is for, as the handler factory needs it.
#[derive(Debug, Clone)]
struct Caller {
    holder: Holder,
    principal: Principal,
}

tokio::task_local! {
    /// The holder kind and principal of the request rmcp is handling on this task (see the
    /// module doc).
    static CALLER: Caller;
}

/// Classifies a `/mcp` request from its headers (see the module doc for why this is exact).
pub fn classify(headers: &HeaderMap) -> Holder {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    // ISO dates compare correctly as strings; rmcp compares versions the same way.
    let stateless_version =
        header(PROTOCOL_VERSION_HEADER).is_some_and(|version| version.trim() >= STATELESS_PROTOCOL);
    let method = header(METHOD_HEADER).map(str::trim);
    if stateless_version && method.is_some_and(|m| m != "initialize") {
        Holder::Sessionless
    } else {
        Holder::Session
    }
}

/// axum middleware around the rmcp service: runs it with the request's [`Holder`] and
/// principal in scope.
pub async fn scope_holder(request: Request, next: Next) -> Response {
    let caller = Caller {
        holder: classify(request.headers()),
        principal: principal_of(&request),
    };
    CALLER.scope(caller, next.run(request)).await
}

/// The session a request names in its `Mcp-Session-Id` header, if any.
fn named_session(request: &Request) -> Option<SessionId> {
    request
        .headers()
        .get(SESSION_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(|v| SessionId::from(v.to_owned()))
}

/// axum middleware: a session belongs to the principal that opened it. Anyone else naming its
/// `Mcp-Session-Id` gets exactly rmcp's answer for an unknown session (docs/auth.md).
pub async fn refuse_foreign_session(
    State(sessions): State<Arc<IdleSessions>>,
    request: Request,
    next: Next,
) -> Response {
    let named = named_session(&request);
    if let Some(id) = named
        && let Some(owner) = lock(&sessions.owners).get(&id).cloned()
        && owner != principal_of(&request)
    {
        return session_not_found();
    }
    next.run(request).await
}

/// axum middleware for `DELETE /mcp`: an unknown session id is `404` like on any other method
/// (rmcp answers a `DELETE` of any id, known or not, as if it had ended a session; answering a
/// caller 200 for ids that do not exist and 404 for another principal's would tell which ids
/// exist), and a session it ended is `200` rather than rmcp's `202`. The official Python client
/// accepts only 200/204 there and otherwise logs "Session termination failed" on every clean
/// close (the Python reference's own server answers 200).
pub async fn end_session(
    State(sessions): State<Arc<IdleSessions>>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() != axum::http::Method::DELETE {
        return next.run(request).await;
    }
    let named = named_session(&request);
    if let Some(id) = named
        && !sessions.inner.has_session(&id).await.unwrap_or(false)
    {
        return session_not_found();
    }
    let mut response = next.run(request).await;
    if response.status() == axum::http::StatusCode::ACCEPTED {
        *response.status_mut() = axum::http::StatusCode::OK;
    }
    response
}

/// rmcp's answer for a session it does not know, byte for byte.
fn session_not_found() -> Response {
    let mut response = Response::new(axum::body::Body::from("Not Found: Session not found"));
    *response.status_mut() = axum::http::StatusCode::NOT_FOUND;
    response
}

/// The rmcp service factory: a session handler or a sessionless one, per [`HOLDER`].
pub fn handler_factory(
    surface: Arc<Surface>,
    lease_ttl: Duration,
) -> impl Fn() -> Result<SessionHandler, std::io::Error> + Send + Sync + 'static {
    move || {
        // Outside a scope (never expected) the safe default is a session: its holds end
        // with the handler rather than lingering for a lease.
        // Outside a scope the principal is `default`, which only unauthenticated servers
        // have anyway: every authenticated route runs inside `scope_holder`.
        let caller = CALLER.try_with(Caller::clone).unwrap_or(Caller {
            holder: Holder::Session,
            principal: Principal::default_principal(),
        });
        Ok(match caller.holder {
            Holder::Session => SessionHandler::new(surface.clone(), caller.principal),
            Holder::Sessionless => {
                SessionHandler::sessionless(surface.clone(), lease_ttl, caller.principal)
            }
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded data stays consistent at every await-free step; a panic elsewhere must not
    // stop idle reaping.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One session's activity: when a client message last arrived or a request last finished,
/// and until when each request being handled now counts as activity.
#[derive(Debug)]
struct Activity {
    last: Instant,
    in_flight: HashMap<RequestId, Instant>,
    /// How long a request without a `timeout` argument counts as activity (`--timeout`).
    default_call_timeout: Duration,
}

impl Activity {
    /// The moment from which the idle timeout runs.
    fn idle_since(&self) -> Instant {
        self.in_flight
            .values()
            .copied()
            .fold(self.last, Instant::max)
    }

    /// How long `request` may count as activity: its own timeout, bounded like any timeout.
    fn bound(&self, request: &ClientRequest) -> Duration {
        let ClientRequest::CallToolRequest(call) = request else {
            return self.default_call_timeout;
        };
        call.params
            .arguments
            .as_ref()
            .and_then(|arguments| arguments.get("timeout"))
            .and_then(|value| {
                value
                    .as_u64()
                    .or_else(|| value.as_str().and_then(|text| text.trim().parse().ok()))
            })
            .map_or(self.default_call_timeout, |secs: u64| {
                Duration::from_secs(secs.clamp(1, MAX_TIMEOUT_SECS))
            })
    }
}

type SharedActivity = Arc<Mutex<Activity>>;

/// rmcp's in-memory session manager plus our idle accounting (see the module doc).
pub struct IdleSessions {
    inner: LocalSessionManager,
    /// What cut request streams received since (see [`replay`]).
    replays: Arc<replay::Replays>,
    activity: Mutex<HashMap<SessionId, SharedActivity>>,
    /// The principal that opened each session.
    owners: Mutex<HashMap<SessionId, Principal>>,
    default_call_timeout: Duration,
}

impl IdleSessions {
    /// rmcp's idle timer is off (`keep_alive = None`); `init_timeout` drops sessions that never
    /// finish initializing; a request without its own `timeout` counts as activity for at most
    /// `default_call_timeout`.
    pub fn new(init_timeout: Duration, default_call_timeout: Duration) -> Self {
        let mut config = SessionConfig::default();
        config.keep_alive = None;
        config.init_timeout = Some(init_timeout);
        let mut inner = LocalSessionManager::default();
        inner.session_config = config;
        Self {
            inner,
            replays: Arc::new(replay::Replays::default()),
            activity: Mutex::new(HashMap::new()),
            owners: Mutex::new(HashMap::new()),
            default_call_timeout,
        }
    }

    /// Closes every session idle for at least `timeout` with no request in flight.
    pub async fn close_idle(&self, timeout: Duration) {
        let now = Instant::now();
        let idle: Vec<SessionId> = lock(&self.activity)
            .iter()
            .filter(|(_, activity)| {
                now.saturating_duration_since(lock(activity).idle_since()) >= timeout
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in idle {
            info!(session_id = %id, timeout_secs = timeout.as_secs(), "closing idle session");
            if let Err(error) = self.close_session(&id).await {
                tracing::warn!(session_id = %id, %error, "could not close idle session");
            }
        }
    }
}

impl SessionManager for IdleSessions {
    type Error = LocalSessionManagerError;
    type Transport = Tracked<WorkerTransport<LocalSessionWorker>>;

    async fn create_session(&self) -> Result<(SessionId, Self::Transport), Self::Error> {
        let (id, transport) = self.inner.create_session().await?;
        let activity = Arc::new(Mutex::new(Activity {
            last: Instant::now(),
            in_flight: HashMap::new(),
            default_call_timeout: self.default_call_timeout,
        }));
        lock(&self.activity).insert(id.clone(), activity.clone());
        if let Ok(principal) = CALLER.try_with(|caller| caller.principal.clone()) {
            lock(&self.owners).insert(id.clone(), principal);
        }
        Ok((
            id,
            Tracked {
                inner: transport,
                activity,
            },
        ))
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<ServerJsonRpcMessage, Self::Error> {
        self.inner.initialize_session(id, message).await
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        self.inner.has_session(id).await
    }

    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        lock(&self.activity).remove(id);
        lock(&self.owners).remove(id);
        self.replays.forget_session(id);
        self.inner.close_session(id).await
    }

    async fn create_stream(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        let stream = self.inner.create_stream(id, message).await?;
        Ok(self.replays.wrap(id.clone(), stream))
    }

    async fn accept_message(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<(), Self::Error> {
        self.inner.accept_message(id, message).await
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.inner.create_standalone_stream(id).await
    }

    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        // A cut request's kept events first; rmcp's own resume serves the rest (the standalone
        // stream, a request stream whose cut the server has not noticed yet), kept in turn if
        // this connection is cut too.
        if let Some(replay) = self.replays.resume(id, &last_event_id) {
            return Ok(futures_util::future::Either::Left(replay));
        }
        let resumed = self.inner.resume(id, last_event_id).await?;
        Ok(futures_util::future::Either::Right(
            self.replays.wrap(id.clone(), resumed),
        ))
    }

    fn event_store(&self) -> Option<Arc<dyn EventStore>> {
        self.inner.event_store()
    }
}

/// A session's transport as seen by its handler, recording activity as messages pass.
pub struct Tracked<T> {
    inner: T,
    activity: SharedActivity,
}

impl<T: Transport<RoleServer>> Transport<RoleServer> for Tracked<T> {
    type Error = T::Error;

    fn send(
        &mut self,
        item: ServerJsonRpcMessage,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let finished = match &item {
            ServerJsonRpcMessage::Response(response) => Some(&response.id),
            ServerJsonRpcMessage::Error(error) => error.id.as_ref(),
            _ => None,
        };
        if let Some(id) = finished {
            let mut activity = lock(&self.activity);
            activity.in_flight.remove(id);
            activity.last = Instant::now();
        }
        self.inner.send(item)
    }

    async fn receive(&mut self) -> Option<ClientJsonRpcMessage> {
        let message = self.inner.receive().await;
        if let Some(message) = &message {
            let mut activity = lock(&self.activity);
            let now = Instant::now();
            activity.last = now;
            match message {
                ClientJsonRpcMessage::Request(request) => {
                    let until = now + activity.bound(&request.request);
                    activity.in_flight.insert(request.id.clone(), until);
                }
                // rmcp sends no response for a request the client cancelled.
                ClientJsonRpcMessage::Notification(notification) => {
                    if let ClientNotification::CancelledNotification(cancelled) =
                        &notification.notification
                        && let Some(id) = &cancelled.params.request_id
                    {
                        activity.in_flight.remove(id);
                    }
                }
                _ => {}
            }
        }
        message
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        self.inner.close().await
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn initialize_and_legacy_requests_hold_by_session() {
        assert_eq!(classify(&headers(&[])), Holder::Session);
        assert_eq!(
            classify(&headers(&[("mcp-protocol-version", "2025-11-25")])),
            Holder::Session
        );
        // A legacy client may send anything in Mcp-Method; only the version routes.
        assert_eq!(
            classify(&headers(&[
                ("mcp-protocol-version", "2025-06-18"),
                ("mcp-method", "tools/call")
            ])),
            Holder::Session
        );
        assert_eq!(
            classify(&headers(&[
                ("mcp-protocol-version", "2026-07-28"),
                ("mcp-method", "initialize")
            ])),
            Holder::Session
        );
        // Without Mcp-Method rmcp rejects a stateless request, and an initialize is a session.
        assert_eq!(
            classify(&headers(&[("mcp-protocol-version", "2026-07-28")])),
            Holder::Session
        );
    }

    fn request(value: serde_json::Value) -> ClientRequest {
        serde_json::from_value(value).unwrap()
    }

    // See: issue 15
    #[test]
    fn a_request_counts_as_activity_for_its_own_timeout_only() {
        let start = Instant::now();
        let mut activity = Activity {
            last: start,
            in_flight: HashMap::new(),
            default_call_timeout: Duration::from_secs(120),
        };
        let call = |arguments: serde_json::Value| {
            request(serde_json::json!({
                "method": "tools/call",
                "params": {"name": "terminal_execute", "arguments": arguments}
            }))
        };
        let list = request(serde_json::json!({"method": "tools/list"}));
        assert_eq!(activity.bound(&list), Duration::from_secs(120));
        assert_eq!(
            activity.bound(&call(serde_json::json!({"command": "x"}))),
            Duration::from_secs(120)
        );
        assert_eq!(
            activity.bound(&call(serde_json::json!({"timeout": 5}))),
            Duration::from_secs(5)
        );
        assert_eq!(
            activity.bound(&call(serde_json::json!({"timeout": "7"}))),
            Duration::from_secs(7)
        );
        assert_eq!(
            activity.bound(&call(serde_json::json!({"timeout": u64::MAX}))),
            Duration::from_secs(MAX_TIMEOUT_SECS)
        );
        // Idle time runs from the last message, or from the end of the longest bound.
        assert_eq!(activity.idle_since(), start);
        let bound = activity.bound(&call(serde_json::json!({"timeout": 5})));
        activity
            .in_flight
            .insert(RequestId::Number(1), start + bound);
        assert_eq!(activity.idle_since(), start + Duration::from_secs(5));
        activity.last = start + Duration::from_secs(9);
        assert_eq!(activity.idle_since(), start + Duration::from_secs(9));
    }

    #[test]
    fn stateless_requests_hold_by_lease() {
        assert_eq!(
            classify(&headers(&[
                ("mcp-protocol-version", "2026-07-28"),
                ("mcp-method", "tools/call")
            ])),
            Holder::Sessionless
        );
        assert_eq!(
            classify(&headers(&[
                ("mcp-protocol-version", "2027-01-01"),
                ("mcp-method", "server/discover")
            ])),
            Holder::Sessionless
        );
    }
}
