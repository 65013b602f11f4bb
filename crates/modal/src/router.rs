//! Modal's per-task command router (`modal.task_command_router.TaskCommandRouter`), the way both
//! official SDKs exec since 2026: the control plane's `TaskGetCommandRouterAccess` names the
//! router's URL and a JWT for one task; every exec call then goes to that URL with
//! `authorization: Bearer <jwt>`. Access is cached per task until a minute before the JWT's
//! `exp`. Like [`super::api`], this is wire code only: what a command means lives in
//! [`super::exec`].

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::Mutex;
use tonic::codec::Streaming;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request};

use super::api::{Api, ApiError, jwt_expiry, pb, unix_now};

/// The messages and client stubs generated from `task_command_router.proto` (`build.rs`).
#[allow(
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs
)]
pub mod rpb {
    tonic::include_proto!("modal.task_command_router");
}

use rpb::task_command_router_client::TaskCommandRouterClient;

/// Renew router access this long before its JWT expires.
const ACCESS_REFRESH_SECS: i64 = 60;
/// A JWT without a readable `exp` is kept this long (the official SDK's fallback, one minute).
const ACCESS_FALLBACK_SECS: i64 = 60;
/// Bound for one unary router call (start, stdin write); the waits have their own.
const ROUTER_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Output chunks can be large; the router allows what the control plane does.
const MAX_MESSAGE: usize = 100 * 1024 * 1024;

/// One task's router: a channel to its URL and the JWT that admits us.
#[derive(Clone)]
pub(super) struct Router {
    client: TaskCommandRouterClient<Channel>,
    jwt: String,
    expiry: i64,
    pub task_id: String,
}

/// Router access per task id.
#[derive(Default)]
pub(super) struct Routers(Mutex<HashMap<String, Router>>);

impl Routers {
    /// The router of `task_id`, asking the control plane for access when there is none or it
    /// is about to expire. An error means the router cannot be used for this task (the caller
    /// decides whether to fall back).
    pub(super) async fn get(&self, api: &Api, task_id: &str) -> Result<Router, ApiError> {
        let mut routers = self.0.lock().await;
        if let Some(router) = routers.get(task_id)
            && unix_now() < router.expiry - ACCESS_REFRESH_SECS
        {
            return Ok(router.clone());
        }
        let access = api
            .task_get_command_router_access(pb::TaskGetCommandRouterAccessRequest {
                task_id: task_id.to_owned(),
            })
            .await?;
        let router = Router::connect(task_id, &access.url, access.jwt)?;
        routers.insert(task_id.to_owned(), router.clone());
        Ok(router)
    }

    /// Forgets a task's access (after the router refused our JWT).
    pub(super) async fn forget(&self, task_id: &str) {
        self.0.lock().await.remove(task_id);
    }
}

fn refused(call: &'static str, message: String) -> ApiError {
    ApiError {
        call,
        code: Code::Unavailable,
        message,
    }
}

impl Router {
    fn connect(task_id: &str, url: &str, jwt: String) -> Result<Self, ApiError> {
        const CALL: &str = "TaskGetCommandRouterAccess";
        if jwt.is_empty() || url.is_empty() {
            return Err(refused(
                CALL,
                "the answer named no router URL or JWT".to_owned(),
            ));
        }
        let mut endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| refused(CALL, format!("invalid router URL '{url}': {e}")))?
            .connect_timeout(Duration::from_secs(10))
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true);
        if url.starts_with("https://") {
            endpoint = endpoint
                .tls_config(ClientTlsConfig::new().with_native_roots())
                .map_err(|e| refused(CALL, format!("cannot set up TLS for '{url}': {e}")))?;
        } else if !url.starts_with("http://") {
            return Err(refused(CALL, format!("unsupported router URL '{url}'")));
        }
        let client = TaskCommandRouterClient::new(endpoint.connect_lazy())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let expiry = jwt_expiry(&jwt).unwrap_or_else(|| unix_now() + ACCESS_FALLBACK_SECS);
        Ok(Self {
            client,
            jwt,
            expiry,
            task_id: task_id.to_owned(),
        })
    }

    fn request<T>(&self, message: T, timeout: Option<Duration>) -> Request<T> {
        let mut request = Request::new(message);
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        if let Ok(value) = MetadataValue::try_from(format!("Bearer {}", self.jwt)) {
            request.metadata_mut().insert("authorization", value);
        }
        request
    }

    pub(super) async fn start(&self, message: rpb::TaskExecStartRequest) -> Result<(), ApiError> {
        let request = self.request(message, Some(ROUTER_CALL_TIMEOUT));
        self.client
            .clone()
            .task_exec_start(request)
            .await
            .map(drop)
            .map_err(|s| ApiError::new("TaskExecStart", &s))
    }

    pub(super) async fn stdin_write(
        &self,
        message: rpb::TaskExecStdinWriteRequest,
    ) -> Result<(), ApiError> {
        let request = self.request(message, Some(ROUTER_CALL_TIMEOUT));
        self.client
            .clone()
            .task_exec_stdin_write(request)
            .await
            .map(drop)
            .map_err(|s| ApiError::new("TaskExecStdinWrite", &s))
    }

    pub(super) async fn stdio_read(
        &self,
        message: rpb::TaskExecStdioReadRequest,
    ) -> Result<Streaming<rpb::TaskExecStdioReadResponse>, ApiError> {
        let request = self.request(message, None);
        self.client
            .clone()
            .task_exec_stdio_read(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| ApiError::new("TaskExecStdioRead", &s))
    }

    /// Blocks until the command ends (bounded by the caller).
    pub(super) async fn wait(
        &self,
        message: rpb::TaskExecWaitRequest,
    ) -> Result<rpb::TaskExecWaitResponse, ApiError> {
        let request = self.request(message, None);
        self.client
            .clone()
            .task_exec_wait(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| ApiError::new("TaskExecWait", &s))
    }
}
