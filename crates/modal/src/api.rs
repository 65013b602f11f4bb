//! The one module that speaks Modal's gRPC API (docs/decisions.md, "Modal sandboxes").
//!
//! **What this depends on:** Modal's *internal, undocumented* client API — service
//! `modal.client.ModalClient` as declared in Modal's published `modal_proto/api.proto`, whose
//! subset we redeclare in `modal_api.proto`, checked field by field against the official file
//! (`crates/modal/tests/definitions.rs`). Modal documents only its Python/JS/Go SDKs, not this
//! wire API, so a server-side change can break us without notice; every request built and every
//! response read is here, so that is the one place to adapt. There is no documented alternative
//! for a Rust binary: Modal offers no public REST API for sandboxes.
//!
//! Calls carry the metadata Modal's libmodal Go client sends (`x-modal-client-type: 9`,
//! `x-modal-client-version: 1.0.0`, the token pair, `x-modal-libmodal-version`) plus the
//! short-lived `x-modal-auth-token` from `AuthTokenGet`, refreshed five minutes before its JWT
//! `exp`. tonic, prost and the generated stubs appear only under `crates/modal/src/`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use tokio::sync::Mutex;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request, Status, Streaming};

use super::auth::Credentials;

/// The generated messages and client stubs of `modal_api.proto`.
#[allow(
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs
)]
pub mod pb {
    tonic::include_proto!("modal.client");
}

use pb::modal_client_client::ModalClientClient;

/// `CLIENT_TYPE_LIBMODAL_GO`: Modal's servers gate features on the client type and version, and
/// the Go client's protocol behaviour (`x-modal-client-version: 1.0.0`) is the one we follow.
pub const CLIENT_TYPE: &str = "9";
pub const CLIENT_VERSION: &str = "1.0.0";
/// `modal-go/<release>`, the form the official Go client sends (`"modal-go/" + sdkVersion`): with
/// client type 9 the server may read the release from it, so it names the modal-go release whose
/// protocol behaviour we follow (0.7.x: exec through the task command router). This program
/// names itself in the HTTP/2 `user-agent` instead ([`USER_AGENT`]).
pub const LIBMODAL_VERSION: &str = "modal-go/0.7.4";
/// Who is really calling, for Modal's logs.
pub const USER_AGENT: &str = concat!("mcp-sandbox-computer-vm-for-ai/", env!("CARGO_PKG_VERSION"));

/// Bound for one unary call: Modal's slow calls (`SandboxGetTaskId` with its own 55 s server
/// wait) finish well inside it; streams are bounded by their callers instead.
const UNARY_TIMEOUT: Duration = Duration::from_secs(90);
/// Refresh the auth token this long before it expires (Modal's clients use the same window).
const REFRESH_WINDOW_SECS: i64 = 300;
/// A token without a readable `exp` is kept this long (Modal's clients' fallback).
const DEFAULT_TOKEN_LIFETIME_SECS: i64 = 1200;
/// Modal allows messages up to 100 MB; image and listing answers can exceed tonic's 4 MB default.
const MAX_MESSAGE: usize = 100 * 1024 * 1024;

/// A failed call: which RPC, and the gRPC status Modal returned.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub call: &'static str,
    pub code: Code,
    pub message: String,
}

impl ApiError {
    pub(super) fn new(call: &'static str, status: &Status) -> Self {
        Self {
            call,
            code: status.code(),
            message: status.message().to_owned(),
        }
    }

    /// `<call>: <code>: <message>` for error texts and logs.
    pub fn detail(&self) -> String {
        if self.message.is_empty() {
            format!("{}: {:?}", self.call, self.code)
        } else {
            format!("{}: {:?}: {}", self.call, self.code, self.message)
        }
    }
}

struct CachedToken {
    token: String,
    expiry: i64,
}

/// A connection to one Modal server with one set of credentials.
pub struct Api {
    client: ModalClientClient<Channel>,
    credentials: Credentials,
    token: Mutex<Option<CachedToken>>,
}

pub(super) fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The `exp` claim of a JWT, without verifying it (the server does that).
pub(super) fn jwt_expiry(token: &str) -> Option<i64> {
    let payload = token.split('.').nth(1)?;
    // JWTs use the URL-safe alphabet without padding (RFC 7515, section 2); a padded one is
    // read too.
    let bytes = URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')).ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    claims.get("exp")?.as_f64().map(|e| e as i64)
}

impl Api {
    /// Prepares a lazily connecting channel: TLS (system roots) for `https://`, plaintext
    /// HTTP/2 for `http://` (the local fake).
    pub fn new(credentials: Credentials) -> Result<Self, String> {
        let url = credentials.server_url.clone();
        let mut endpoint = Endpoint::from_shared(url.clone())
            .map_err(|e| format!("invalid Modal server URL '{url}': {e}"))?
            .connect_timeout(Duration::from_secs(10))
            .user_agent(USER_AGENT)
            .map_err(|e| format!("invalid user agent: {e}"))?
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true);
        if url.starts_with("https://") {
            endpoint = endpoint
                .tls_config(ClientTlsConfig::new().with_native_roots())
                .map_err(|e| format!("cannot set up TLS for '{url}': {e}"))?;
        } else if !url.starts_with("http://") {
            return Err(format!(
                "invalid Modal server URL '{url}': it must start with https:// or http://"
            ));
        }
        let client = ModalClientClient::new(endpoint.connect_lazy())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        Ok(Self {
            client,
            credentials,
            token: Mutex::new(None),
        })
    }

    pub fn environment(&self) -> &str {
        &self.credentials.environment
    }

    pub fn image_builder_version(&self) -> &str {
        &self.credentials.image_builder_version
    }

    fn base_metadata(&self, metadata: &mut MetadataMap) {
        let pairs = [
            ("x-modal-client-type", CLIENT_TYPE),
            ("x-modal-client-version", CLIENT_VERSION),
            ("x-modal-libmodal-version", LIBMODAL_VERSION),
            ("x-modal-token-id", self.credentials.token_id.expose()),
            (
                "x-modal-token-secret",
                self.credentials.token_secret.expose(),
            ),
        ];
        for (key, value) in pairs {
            if let Ok(value) = MetadataValue::try_from(value) {
                metadata.insert(key, value);
            }
        }
    }

    /// The auth token, fetched or refreshed as needed. One fetch at a time.
    async fn auth_token(&self) -> Result<String, ApiError> {
        let mut cached = self.token.lock().await;
        if let Some(token) = cached.as_ref()
            && unix_now() < token.expiry - REFRESH_WINDOW_SECS
        {
            return Ok(token.token.clone());
        }
        let mut request = Request::new(pb::AuthTokenGetRequest {});
        request.set_timeout(UNARY_TIMEOUT);
        self.base_metadata(request.metadata_mut());
        let answer = self
            .client
            .clone()
            .auth_token_get(request)
            .await
            .map_err(|s| ApiError::new("AuthTokenGet", &s))?
            .into_inner();
        if answer.token.is_empty() {
            return Err(ApiError {
                call: "AuthTokenGet",
                code: Code::Internal,
                message: "the server returned no auth token".to_owned(),
            });
        }
        let expiry =
            jwt_expiry(&answer.token).unwrap_or_else(|| unix_now() + DEFAULT_TOKEN_LIFETIME_SECS);
        *cached = Some(CachedToken {
            token: answer.token.clone(),
            expiry,
        });
        Ok(answer.token)
    }

    async fn request<T>(
        &self,
        message: T,
        timeout: Option<Duration>,
    ) -> Result<Request<T>, ApiError> {
        let token = self.auth_token().await?;
        let mut request = Request::new(message);
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        self.base_metadata(request.metadata_mut());
        if let Ok(value) = MetadataValue::try_from(token.as_str()) {
            request.metadata_mut().insert("x-modal-auth-token", value);
        }
        Ok(request)
    }

    /// Forgets the auth token (after UNAUTHENTICATED, so the next call fetches a new one).
    async fn drop_token(&self) {
        *self.token.lock().await = None;
    }

    async fn check<T>(
        &self,
        call: &'static str,
        result: Result<tonic::Response<T>, Status>,
    ) -> Result<T, ApiError> {
        match result {
            Ok(response) => Ok(response.into_inner()),
            Err(status) => {
                if status.code() == Code::Unauthenticated {
                    self.drop_token().await;
                }
                Err(ApiError::new(call, &status))
            }
        }
    }
}

/// One unary RPC: `$method` on the stub, `$name` in errors.
macro_rules! unary {
    ($fn:ident, $method:ident, $name:literal, $req:ty, $resp:ty) => {
        pub async fn $fn(&self, message: $req) -> Result<$resp, ApiError> {
            let request = self.request(message, Some(UNARY_TIMEOUT)).await?;
            let result = self.client.clone().$method(request).await;
            self.check($name, result).await
        }
    };
}

/// One server-streaming RPC; the caller bounds how long it reads.
macro_rules! streaming {
    ($fn:ident, $method:ident, $name:literal, $req:ty, $item:ty) => {
        pub async fn $fn(&self, message: $req) -> Result<Streaming<$item>, ApiError> {
            let request = self.request(message, None).await?;
            let result = self.client.clone().$method(request).await;
            self.check($name, result).await
        }
    };
}

impl Api {
    unary!(
        app_get_or_create,
        app_get_or_create,
        "AppGetOrCreate",
        pb::AppGetOrCreateRequest,
        pb::AppGetOrCreateResponse
    );
    unary!(
        image_get_or_create,
        image_get_or_create,
        "ImageGetOrCreate",
        pb::ImageGetOrCreateRequest,
        pb::ImageGetOrCreateResponse
    );
    streaming!(
        image_join_streaming,
        image_join_streaming,
        "ImageJoinStreaming",
        pb::ImageJoinStreamingRequest,
        pb::ImageJoinStreamingResponse
    );
    unary!(
        task_get_command_router_access,
        task_get_command_router_access,
        "TaskGetCommandRouterAccess",
        pb::TaskGetCommandRouterAccessRequest,
        pb::TaskGetCommandRouterAccessResponse
    );
    unary!(
        sandbox_create,
        sandbox_create,
        "SandboxCreate",
        pb::SandboxCreateRequest,
        pb::SandboxCreateResponse
    );
    unary!(
        sandbox_get_task_id,
        sandbox_get_task_id,
        "SandboxGetTaskId",
        pb::SandboxGetTaskIdRequest,
        pb::SandboxGetTaskIdResponse
    );
    unary!(
        sandbox_get_tunnels,
        sandbox_get_tunnels,
        "SandboxGetTunnels",
        pb::SandboxGetTunnelsRequest,
        pb::SandboxGetTunnelsResponse
    );
    unary!(
        sandbox_tags_set,
        sandbox_tags_set,
        "SandboxTagsSet",
        pb::SandboxTagsSetRequest,
        ()
    );
    unary!(
        sandbox_tags_get,
        sandbox_tags_get,
        "SandboxTagsGet",
        pb::SandboxTagsGetRequest,
        pb::SandboxTagsGetResponse
    );
    unary!(
        sandbox_list,
        sandbox_list,
        "SandboxList",
        pb::SandboxListRequest,
        pb::SandboxListResponse
    );
    unary!(
        sandbox_terminate,
        sandbox_terminate,
        "SandboxTerminate",
        pb::SandboxTerminateRequest,
        pb::SandboxTerminateResponse
    );
    unary!(
        container_exec,
        container_exec,
        "ContainerExec",
        pb::ContainerExecRequest,
        pb::ContainerExecResponse
    );
    unary!(
        container_exec_put_input,
        container_exec_put_input,
        "ContainerExecPutInput",
        pb::ContainerExecPutInputRequest,
        ()
    );
    unary!(
        container_exec_wait,
        container_exec_wait,
        "ContainerExecWait",
        pb::ContainerExecWaitRequest,
        pb::ContainerExecWaitResponse
    );
    streaming!(
        container_exec_get_output,
        container_exec_get_output,
        "ContainerExecGetOutput",
        pb::ContainerExecGetOutputRequest,
        pb::RuntimeOutputBatch
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_expiry_of_a_jwt() {
        // {"alg":"none"} . {"exp":1700000000,"sub":"x"} . signature
        let token = "eyJhbGciOiJub25lIn0.eyJleHAiOjE3MDAwMDAwMDAsInN1YiI6IngifQ.c2ln";
        assert_eq!(jwt_expiry(token), Some(1_700_000_000));
        assert_eq!(jwt_expiry("not-a-jwt"), None);
    }
}
