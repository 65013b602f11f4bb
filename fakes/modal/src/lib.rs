//! A local fake of the Modal gRPC subset the server uses (a test-only workspace crate, never a
//! dependency of the shipped binary), built from the same `crates/modal/src/modal_api.proto` as
//! the client. It is *our reading* of Modal's API, so it catches regressions in our requests and
//! our handling of answers, never a misreading of Modal.
//!
//! Strict by design: every call must carry the libmodal metadata (client type 9, version
//! 1.0.0, the expected token pair, a libmodal version in the Go client's `modal-go/<x.y.z>`
//! form) and, except `AuthTokenGet`, the auth token
//! it issued; stdin indexes must be consecutive. It serves the task command router too, on its
//! own address: `TaskGetCommandRouterAccess` hands out that URL and a JWT per task, and the
//! router's `TaskExec*` calls must carry it (`authorization: Bearer`), with consecutive stdin
//! byte offsets; `FakeConfig::router = false` turns the router off (UNIMPLEMENTED), so clients
//! must fall back to `ContainerExec*`. Every call is recorded (method, `x-modal-*`
//! metadata, typed request) for the tests to inspect. Sandboxes are real local Docker
//! containers (`docker` CLI, label `fake-modal=<label>`), so execs have real semantics: stdin,
//! working directory, exit codes, /proc for the kill sweep. `SandboxSnapshotFs` commits a
//! sandbox's container (`docker commit`, paused: the filesystem only) into an image that
//! `SandboxCreate` takes as `image_id`, and `ImageDelete` removes it. Everything it started or
//! committed is removed when it is dropped or stopped.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::Stream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{ChildStdin, Command};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// The messages and server stubs generated from the server's `modal_api.proto` (`build.rs`).
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

/// The router's messages and server stubs (`crates/modal/src/task_command_router.proto`).
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

use pb::modal_client_server::{ModalClient, ModalClientServer};
use rpb::task_command_router_server::{TaskCommandRouter, TaskCommandRouterServer};

/// The metadata keys the fake records (all of Modal's client headers).
const RECORDED_PREFIX: &str = "x-modal-";
/// Lifetime of issued auth tokens; long enough that no test sees a refresh by accident.
const TOKEN_LIFETIME_SECS: u64 = 3600;

/// One recorded call.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: &'static str,
    pub metadata: BTreeMap<String, String>,
    pub request: Req,
}

/// The typed request of a recorded call.
#[derive(Debug, Clone)]
pub enum Req {
    AuthTokenGet,
    AppGetOrCreate(pb::AppGetOrCreateRequest),
    ImageGetOrCreate(pb::ImageGetOrCreateRequest),
    ImageJoinStreaming(pb::ImageJoinStreamingRequest),
    ImageDelete(pb::ImageDeleteRequest),
    SandboxSnapshotFs(pb::SandboxSnapshotFsRequest),
    SandboxCreate(pb::SandboxCreateRequest),
    SandboxGetTaskId(pb::SandboxGetTaskIdRequest),
    SandboxGetTunnels(pb::SandboxGetTunnelsRequest),
    SandboxTagsSet(pb::SandboxTagsSetRequest),
    SandboxTagsGet(pb::SandboxTagsGetRequest),
    SandboxList(pb::SandboxListRequest),
    SandboxTerminate(pb::SandboxTerminateRequest),
    ContainerExec(pb::ContainerExecRequest),
    ContainerExecPutInput(pb::ContainerExecPutInputRequest),
    ContainerExecGetOutput(pb::ContainerExecGetOutputRequest),
    ContainerExecWait(pb::ContainerExecWaitRequest),
    TaskGetCommandRouterAccess(pb::TaskGetCommandRouterAccessRequest),
    TaskExecStart(rpb::TaskExecStartRequest),
    TaskExecStdinWrite(rpb::TaskExecStdinWriteRequest),
    TaskExecStdioRead(rpb::TaskExecStdioReadRequest),
    TaskExecWait(rpb::TaskExecWaitRequest),
}

/// What the fake accepts and how it behaves.
#[derive(Debug, Clone)]
pub struct FakeConfig {
    pub token_id: String,
    pub token_secret: String,
    /// Containers get the label `fake-modal=<label>` (tests clean up by it).
    pub label: String,
    /// `SandboxList` page size (small values exercise paging).
    pub page_size: usize,
    /// Serve the task command router (`TaskGetCommandRouterAccess` and the router's calls);
    /// without it `TaskGetCommandRouterAccess` answers UNIMPLEMENTED, as a service without the
    /// router would, and clients must fall back to `ContainerExec*`.
    pub router: bool,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            token_id: "ak-fake".to_owned(),
            token_secret: "as-fake".to_owned(),
            label: format!("run-{}", uuid::Uuid::new_v4().simple()),
            page_size: 100,
            router: true,
        }
    }
}

struct Sandbox {
    app_id: String,
    name: Option<String>,
    container: String,
    task_id: String,
    tags: BTreeMap<String, String>,
    created_at: f64,
    result: Option<pb::GenericResult>,
    definition: pb::Sandbox,
}

#[derive(Default)]
struct ExecOutput {
    /// Batches per file descriptor (index = position + 1).
    stdout: Vec<Vec<u8>>,
    stderr: Vec<Vec<u8>>,
    exit: Option<i32>,
}

struct Exec {
    stdin: tokio::sync::Mutex<Option<ChildStdin>>,
    next_index: Mutex<u64>,
    /// Stdin bytes written through the command router (its offsets).
    written: Mutex<u64>,
    output: Mutex<ExecOutput>,
    changed: Notify,
}

#[derive(Default)]
struct State {
    log: Vec<Recorded>,
    apps: BTreeMap<String, String>,
    images: HashMap<String, (String, bool)>,
    sandboxes: BTreeMap<String, Sandbox>,
    execs: HashMap<String, Arc<Exec>>,
    counter: u64,
    /// Every auth token issued: each stays valid, as Modal's do until they expire, so two
    /// clients (two servers) can use the fake at once.
    tokens: std::collections::HashSet<String>,
    /// Task id → the router JWT issued for it.
    router_jwts: HashMap<String, String>,
}

#[derive(Clone)]
struct Service {
    config: Arc<FakeConfig>,
    state: Arc<Mutex<State>>,
    /// Where this fake serves, also the router URL it hands out.
    url: String,
}

/// `(sandbox id, name, tags, definition)` of a sandbox that has not ended.
pub type LiveSandbox = (
    String,
    Option<String>,
    BTreeMap<String, String>,
    pb::Sandbox,
);

/// A running fake: its URL, its call log, and cleanup on drop.
pub struct FakeModal {
    addr: SocketAddr,
    config: Arc<FakeConfig>,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

async fn docker(args: &[&str]) -> Result<String, String> {
    let out = Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| format!("docker: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

/// The official Go client's form of `x-modal-libmodal-version`: `modal-go/` and a release.
fn is_libmodal_go_version(value: &str) -> bool {
    value.strip_prefix("modal-go/").is_some_and(|release| {
        let parts: Vec<&str> = release.split('.').collect();
        parts.len() == 3
            && parts
                .iter()
                .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// Starts `args` in `container` with `docker exec -i` and collects its output as it comes.
fn spawn_exec(
    container: &str,
    args: &[String],
    workdir: Option<&str>,
) -> Result<Arc<Exec>, Status> {
    let mut command = Command::new("docker");
    command.args(["exec", "-i"]);
    if let Some(dir) = workdir {
        command.args(["-w", dir]);
    }
    command
        .arg(container)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .map_err(|e| Status::internal(e.to_string()))?;
    let exec = Arc::new(Exec {
        stdin: tokio::sync::Mutex::new(child.stdin.take()),
        next_index: Mutex::new(1),
        written: Mutex::new(0),
        output: Mutex::new(ExecOutput::default()),
        changed: Notify::new(),
    });
    let readers: Vec<_> = [
        child.stdout.take().map(|s| {
            (
                true,
                Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
            )
        }),
        child.stderr.take().map(|s| {
            (
                false,
                Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
            )
        }),
    ]
    .into_iter()
    .flatten()
    .map(|(is_stdout, mut pipe)| {
        let exec = exec.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n) = pipe.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                {
                    let mut out = exec.output.lock().unwrap_or_else(|p| p.into_inner());
                    let target = if is_stdout {
                        &mut out.stdout
                    } else {
                        &mut out.stderr
                    };
                    target.push(buf[..n].to_vec());
                }
                exec.changed.notify_waiters();
            }
        })
    })
    .collect();
    let waiter = exec.clone();
    tokio::spawn(async move {
        let status = child.wait().await;
        for reader in readers {
            let _ = reader.await;
        }
        let code = status.ok().and_then(|s| s.code()).unwrap_or(-1);
        waiter.output.lock().unwrap_or_else(|p| p.into_inner()).exit = Some(code);
        waiter.changed.notify_waiters();
    });
    Ok(exec)
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

impl Service {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn next_id(&self, prefix: &str) -> String {
        let mut state = self.state();
        state.counter += 1;
        format!("{prefix}-{}", state.counter)
    }

    /// Checks the metadata strictly and records the call.
    fn admit<T>(&self, method: &'static str, request: &Request<T>, req: Req) -> Result<(), Status> {
        let metadata: BTreeMap<String, String> = request
            .metadata()
            .iter()
            .filter_map(|kv| match kv {
                tonic::metadata::KeyAndValueRef::Ascii(k, v) => Some((
                    k.as_str().to_owned(),
                    v.to_str().unwrap_or_default().to_owned(),
                )),
                tonic::metadata::KeyAndValueRef::Binary(..) => None,
            })
            .filter(|(k, _)| k.starts_with(RECORDED_PREFIX))
            .collect();
        let mut state = self.state();
        state.log.push(Recorded {
            method,
            metadata: metadata.clone(),
            request: req,
        });
        let get = |k: &str| metadata.get(k).map(String::as_str);
        if get("x-modal-client-type") != Some("9") || get("x-modal-client-version") != Some("1.0.0")
        {
            return Err(Status::failed_precondition(
                "unsupported client type or version",
            ));
        }
        if !get("x-modal-libmodal-version").is_some_and(is_libmodal_go_version) {
            return Err(Status::failed_precondition(
                "x-modal-libmodal-version must be modal-go/<major>.<minor>.<patch> for client type 9",
            ));
        }
        if get("x-modal-token-id") != Some(&self.config.token_id)
            || get("x-modal-token-secret") != Some(&self.config.token_secret)
        {
            return Err(Status::unauthenticated("Token missing or invalid"));
        }
        if method != "AuthTokenGet"
            && !get("x-modal-auth-token").is_some_and(|t| state.tokens.contains(t))
        {
            return Err(Status::unauthenticated(
                "missing or invalid x-modal-auth-token",
            ));
        }
        Ok(())
    }

    fn sandbox_by_task(&self, task_id: &str) -> Option<(String, String)> {
        self.state()
            .sandboxes
            .iter()
            .find(|(_, s)| s.task_id == task_id && s.result.is_none())
            .map(|(id, s)| (id.clone(), s.container.clone()))
    }

    fn exec(&self, exec_id: &str) -> Result<Arc<Exec>, Status> {
        self.state()
            .execs
            .get(exec_id)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("exec {exec_id} not found")))
    }

    /// The Docker repository of this fake's filesystem snapshots.
    fn snapshot_repository(&self) -> String {
        format!("fake-modal-snapshot-{}", self.config.label)
    }

    /// Ends a sandbox: removes its container and records why.
    async fn end(&self, sandbox_id: &str, status: pb::generic_result::GenericStatus) {
        let container = {
            let mut state = self.state();
            let Some(sandbox) = state.sandboxes.get_mut(sandbox_id) else {
                return;
            };
            if sandbox.result.is_some() {
                return;
            }
            sandbox.result = Some(pb::GenericResult {
                status: status as i32,
                ..Default::default()
            });
            sandbox.container.clone()
        };
        let _ = docker(&["rm", "-f", &container]).await;
    }
}

#[tonic::async_trait]
impl ModalClient for Service {
    async fn auth_token_get(
        &self,
        request: Request<pb::AuthTokenGetRequest>,
    ) -> Result<Response<pb::AuthTokenGetResponse>, Status> {
        self.admit("AuthTokenGet", &request, Req::AuthTokenGet)?;
        let exp = now() as u64 + TOKEN_LIFETIME_SECS;
        let token = format!(
            "{}.{}.{}",
            base64url(br#"{"alg":"none"}"#),
            base64url(format!("{{\"exp\":{exp},\"n\":\"{}\"}}", uuid::Uuid::new_v4()).as_bytes()),
            base64url(b"fake")
        );
        self.state().tokens.insert(token.clone());
        Ok(Response::new(pb::AuthTokenGetResponse { token }))
    }

    async fn app_get_or_create(
        &self,
        request: Request<pb::AppGetOrCreateRequest>,
    ) -> Result<Response<pb::AppGetOrCreateResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit("AppGetOrCreate", &request, Req::AppGetOrCreate(r.clone()))?;
        if r.object_creation_type != pb::ObjectCreationType::CreateIfMissing as i32 {
            return Err(Status::not_found(format!("app '{}' not found", r.app_name)));
        }
        if r.app_name.is_empty() {
            return Err(Status::invalid_argument("app_name is required"));
        }
        let app_id = format!("ap-{}", r.app_name);
        self.state().apps.insert(app_id.clone(), r.app_name);
        Ok(Response::new(pb::AppGetOrCreateResponse { app_id }))
    }

    async fn image_get_or_create(
        &self,
        request: Request<pb::ImageGetOrCreateRequest>,
    ) -> Result<Response<pb::ImageGetOrCreateResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit(
            "ImageGetOrCreate",
            &request,
            Req::ImageGetOrCreate(r.clone()),
        )?;
        if !self.state().apps.contains_key(&r.app_id) || r.builder_version.is_empty() {
            return Err(Status::invalid_argument(
                "app_id and builder_version are required",
            ));
        }
        let commands = r.image.map(|i| i.dockerfile_commands).unwrap_or_default();
        let [command] = commands.as_slice() else {
            return Err(Status::invalid_argument(
                "expected exactly one Dockerfile command",
            ));
        };
        let Some(name) = command.strip_prefix("FROM ") else {
            return Err(Status::invalid_argument("expected a FROM command"));
        };
        let image_id = self.next_id("im");
        if docker(&["image", "inspect", "--format", "{{.Id}}", name])
            .await
            .is_err()
        {
            return Ok(Response::new(pb::ImageGetOrCreateResponse {
                image_id,
                result: Some(pb::GenericResult {
                    status: pb::generic_result::GenericStatus::Failure as i32,
                    exception: format!("pull access denied for {name}"),
                    exitcode: 1,
                }),
            }));
        }
        // Built, but reported as pending: the client must join the build stream.
        self.state()
            .images
            .insert(image_id.clone(), (name.to_owned(), true));
        Ok(Response::new(pb::ImageGetOrCreateResponse {
            image_id,
            result: None,
        }))
    }

    type ImageJoinStreamingStream = BoxStream<pb::ImageJoinStreamingResponse>;

    async fn image_join_streaming(
        &self,
        request: Request<pb::ImageJoinStreamingRequest>,
    ) -> Result<Response<Self::ImageJoinStreamingStream>, Status> {
        let r = request.get_ref().clone();
        self.admit(
            "ImageJoinStreaming",
            &request,
            Req::ImageJoinStreaming(r.clone()),
        )?;
        if !self.state().images.contains_key(&r.image_id) {
            return Err(Status::not_found("image not found"));
        }
        let items = vec![
            Ok(pb::ImageJoinStreamingResponse {
                result: None,
                entry_id: "1-0".to_owned(),
                eof: false,
            }),
            Ok(pb::ImageJoinStreamingResponse {
                result: Some(pb::GenericResult {
                    status: pb::generic_result::GenericStatus::Success as i32,
                    ..Default::default()
                }),
                entry_id: "2-0".to_owned(),
                eof: true,
            }),
        ];
        Ok(Response::new(Box::pin(futures_util::stream::iter(items))))
    }

    async fn image_delete(
        &self,
        request: Request<pb::ImageDeleteRequest>,
    ) -> Result<Response<()>, Status> {
        let r = request.get_ref().clone();
        self.admit("ImageDelete", &request, Req::ImageDelete(r.clone()))?;
        let removed = self.state().images.remove(&r.image_id);
        let Some((name, _)) = removed else {
            return Err(Status::not_found(format!("image {} not found", r.image_id)));
        };
        // Only the fake's own snapshots are removed from Docker; a container still running
        // from one keeps it until the fake's cleanup.
        if name.starts_with(&self.snapshot_repository()) {
            let _ = docker(&["rmi", &name]).await;
        }
        Ok(Response::new(()))
    }

    async fn sandbox_snapshot_fs(
        &self,
        request: Request<pb::SandboxSnapshotFsRequest>,
    ) -> Result<Response<pb::SandboxSnapshotFsResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit(
            "SandboxSnapshotFs",
            &request,
            Req::SandboxSnapshotFs(r.clone()),
        )?;
        let container = {
            let state = self.state();
            let sandbox = state
                .sandboxes
                .get(&r.sandbox_id)
                .ok_or_else(|| Status::not_found("sandbox not found"))?;
            if sandbox.result.is_some() {
                return Err(Status::failed_precondition("sandbox has already finished"));
            }
            sandbox.container.clone()
        };
        let image_id = self.next_id("im");
        let name = format!("{}:{image_id}", self.snapshot_repository());
        let committed = docker(&["commit", "--pause=true", &container, &name]).await;
        let result = match committed {
            Ok(_) => {
                self.state().images.insert(image_id.clone(), (name, true));
                pb::GenericResult {
                    status: pb::generic_result::GenericStatus::Success as i32,
                    ..Default::default()
                }
            }
            Err(error) => pb::GenericResult {
                status: pb::generic_result::GenericStatus::Failure as i32,
                exception: error,
                exitcode: 1,
            },
        };
        Ok(Response::new(pb::SandboxSnapshotFsResponse {
            image_id,
            result: Some(result),
        }))
    }

    async fn sandbox_create(
        &self,
        request: Request<pb::SandboxCreateRequest>,
    ) -> Result<Response<pb::SandboxCreateResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit("SandboxCreate", &request, Req::SandboxCreate(r.clone()))?;
        let definition = r
            .definition
            .ok_or_else(|| Status::invalid_argument("definition is required"))?;
        let image = {
            let state = self.state();
            if !state.apps.contains_key(&r.app_id) {
                return Err(Status::not_found("app not found"));
            }
            if let Some(name) = &definition.name
                && state.sandboxes.values().any(|s| {
                    s.app_id == r.app_id && s.result.is_none() && s.name.as_ref() == Some(name)
                })
            {
                return Err(Status::already_exists(format!(
                    "Sandbox with name '{name}' already exists"
                )));
            }
            state
                .images
                .get(&definition.image_id)
                .map(|(name, _)| name.clone())
                .ok_or_else(|| Status::invalid_argument("unknown image_id"))?
        };
        let Some((entrypoint, args)) = definition.entrypoint_args.split_first() else {
            return Err(Status::invalid_argument("entrypoint_args is required"));
        };
        let sandbox_id = self.next_id("sb");
        let container = format!("fake-modal-{}-{sandbox_id}", self.config.label);
        let label = format!("fake-modal={}", self.config.label);
        let blocked = definition.network_access.as_ref().is_some_and(|n| {
            n.network_access_type == pb::network_access::NetworkAccessType::Blocked as i32
        });
        // An allow-list holds CIDR blocks (`cidr_allowlist` in Modal's SDK). The fake keeps it
        // in the definition, which tests read from the log; it does not filter traffic.
        if let Some(access) = &definition.network_access
            && let Some(bad) = access.allowed_cidrs.iter().find(|cidr| !is_cidr(cidr))
        {
            return Err(Status::invalid_argument(format!(
                "allowed_cidrs: '{bad}' is not a CIDR block"
            )));
        }
        let mut argv = vec!["run", "-d", "--rm", "--name", &container, "--label", &label];
        if blocked {
            argv.extend(["--network", "none"]);
        }
        argv.extend(["--entrypoint", entrypoint.as_str(), image.as_str()]);
        argv.extend(args.iter().map(String::as_str));
        docker(&argv).await.map_err(Status::invalid_argument)?;
        let timeout = definition.timeout_secs;
        {
            let mut state = self.state();
            state.counter += 1;
            let created_at = now() + state.counter as f64 * 1e-3;
            state.sandboxes.insert(
                sandbox_id.clone(),
                Sandbox {
                    app_id: r.app_id,
                    name: definition.name.clone(),
                    container,
                    task_id: format!("ta-{sandbox_id}"),
                    tags: BTreeMap::new(),
                    created_at,
                    result: None,
                    definition,
                },
            );
        }
        if timeout > 0 {
            // The sandbox lifetime: Modal ends it with a TIMEOUT result.
            let service = self.clone();
            let id = sandbox_id.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(u64::from(timeout))).await;
                service
                    .end(&id, pb::generic_result::GenericStatus::Timeout)
                    .await;
            });
        }
        Ok(Response::new(pb::SandboxCreateResponse { sandbox_id }))
    }

    /// The tunnels of the ports the sandbox opened at creation (`open_ports`), with hosts
    /// shaped like Modal's and TLS port 443; nothing listens on them (a fake has no edge).
    async fn sandbox_get_tunnels(
        &self,
        request: Request<pb::SandboxGetTunnelsRequest>,
    ) -> Result<Response<pb::SandboxGetTunnelsResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit(
            "SandboxGetTunnels",
            &request,
            Req::SandboxGetTunnels(r.clone()),
        )?;
        let state = self.state();
        let sandbox = state
            .sandboxes
            .get(&r.sandbox_id)
            .ok_or_else(|| Status::not_found("sandbox not found"))?;
        let tunnels = match &sandbox.definition.open_ports_oneof {
            Some(pb::sandbox::OpenPortsOneof::OpenPorts(specs)) => specs
                .ports
                .iter()
                .map(|spec| pb::TunnelData {
                    host: format!(
                        "{}-{}.fake-modal.test",
                        r.sandbox_id.to_ascii_lowercase(),
                        spec.port
                    ),
                    port: 443,
                    unencrypted_host: None,
                    unencrypted_port: None,
                    container_port: spec.port,
                })
                .collect(),
            None => Vec::new(),
        };
        Ok(Response::new(pb::SandboxGetTunnelsResponse {
            result: Some(pb::GenericResult {
                status: pb::generic_result::GenericStatus::Success as i32,
                ..Default::default()
            }),
            tunnels,
        }))
    }

    async fn sandbox_get_task_id(
        &self,
        request: Request<pb::SandboxGetTaskIdRequest>,
    ) -> Result<Response<pb::SandboxGetTaskIdResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit(
            "SandboxGetTaskId",
            &request,
            Req::SandboxGetTaskId(r.clone()),
        )?;
        let (container, task_id, result) = {
            let state = self.state();
            let sandbox = state
                .sandboxes
                .get(&r.sandbox_id)
                .ok_or_else(|| Status::not_found("sandbox not found"))?;
            (
                sandbox.container.clone(),
                sandbox.task_id.clone(),
                sandbox.result.clone(),
            )
        };
        if result.is_some() {
            return Ok(Response::new(pb::SandboxGetTaskIdResponse {
                task_id: None,
                task_result: result,
            }));
        }
        // A container that died outside the fake ends its sandbox, as a crashed task would.
        if docker(&["inspect", "--format", "{{.State.Running}}", &container])
            .await
            .as_deref()
            != Ok("true")
        {
            self.end(&r.sandbox_id, pb::generic_result::GenericStatus::Failure)
                .await;
            let result = self
                .state()
                .sandboxes
                .get(&r.sandbox_id)
                .and_then(|s| s.result.clone());
            return Ok(Response::new(pb::SandboxGetTaskIdResponse {
                task_id: None,
                task_result: result,
            }));
        }
        Ok(Response::new(pb::SandboxGetTaskIdResponse {
            task_id: Some(task_id),
            task_result: None,
        }))
    }

    async fn sandbox_tags_set(
        &self,
        request: Request<pb::SandboxTagsSetRequest>,
    ) -> Result<Response<()>, Status> {
        let r = request.get_ref().clone();
        self.admit("SandboxTagsSet", &request, Req::SandboxTagsSet(r.clone()))?;
        let mut state = self.state();
        let sandbox = state
            .sandboxes
            .get_mut(&r.sandbox_id)
            .ok_or_else(|| Status::not_found("sandbox not found"))?;
        sandbox.tags = r
            .tags
            .into_iter()
            .map(|t| (t.tag_name, t.tag_value))
            .collect();
        Ok(Response::new(()))
    }

    async fn sandbox_tags_get(
        &self,
        request: Request<pb::SandboxTagsGetRequest>,
    ) -> Result<Response<pb::SandboxTagsGetResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit("SandboxTagsGet", &request, Req::SandboxTagsGet(r.clone()))?;
        let state = self.state();
        let sandbox = state
            .sandboxes
            .get(&r.sandbox_id)
            .ok_or_else(|| Status::not_found("sandbox not found"))?;
        let tags = sandbox
            .tags
            .iter()
            .map(|(k, v)| pb::SandboxTag {
                tag_name: k.clone(),
                tag_value: v.clone(),
            })
            .collect();
        Ok(Response::new(pb::SandboxTagsGetResponse { tags }))
    }

    async fn sandbox_list(
        &self,
        request: Request<pb::SandboxListRequest>,
    ) -> Result<Response<pb::SandboxListResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit("SandboxList", &request, Req::SandboxList(r.clone()))?;
        let state = self.state();
        let mut found: Vec<&Sandbox> = state
            .sandboxes
            .values()
            .filter(|s| r.app_id.is_empty() || s.app_id == r.app_id)
            .filter(|s| r.include_finished || s.result.is_none())
            .filter(|s| r.before_timestamp <= 0.0 || s.created_at < r.before_timestamp)
            .filter(|s| {
                r.tags
                    .iter()
                    .all(|t| s.tags.get(&t.tag_name) == Some(&t.tag_value))
            })
            .collect();
        found.sort_by(|a, b| b.created_at.total_cmp(&a.created_at));
        let sandboxes = found
            .into_iter()
            .take(self.config.page_size)
            .map(|s| pb::SandboxInfo {
                id: state
                    .sandboxes
                    .iter()
                    .find(|(_, x)| x.task_id == s.task_id)
                    .map(|(id, _)| id.clone())
                    .unwrap_or_default(),
                created_at: s.created_at,
                task_info: Some(pb::TaskInfo {
                    id: s.task_id.clone(),
                    started_at: s.created_at,
                    ..Default::default()
                }),
                app_id: s.app_id.clone(),
            })
            .collect();
        Ok(Response::new(pb::SandboxListResponse { sandboxes }))
    }

    async fn sandbox_terminate(
        &self,
        request: Request<pb::SandboxTerminateRequest>,
    ) -> Result<Response<pb::SandboxTerminateResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit(
            "SandboxTerminate",
            &request,
            Req::SandboxTerminate(r.clone()),
        )?;
        let existing = {
            let state = self.state();
            let sandbox = state
                .sandboxes
                .get(&r.sandbox_id)
                .ok_or_else(|| Status::not_found("sandbox not found"))?;
            sandbox.result.clone()
        };
        self.end(&r.sandbox_id, pb::generic_result::GenericStatus::Terminated)
            .await;
        Ok(Response::new(pb::SandboxTerminateResponse {
            existing_result: existing,
        }))
    }

    async fn task_get_command_router_access(
        &self,
        request: Request<pb::TaskGetCommandRouterAccessRequest>,
    ) -> Result<Response<pb::TaskGetCommandRouterAccessResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit(
            "TaskGetCommandRouterAccess",
            &request,
            Req::TaskGetCommandRouterAccess(r.clone()),
        )?;
        if !self.config.router {
            return Err(Status::unimplemented(
                "the task command router is not available",
            ));
        }
        if self.sandbox_by_task(&r.task_id).is_none() {
            return Err(Status::not_found(format!("task {} not found", r.task_id)));
        }
        let exp = now() as u64 + TOKEN_LIFETIME_SECS;
        let jwt = format!(
            "{}.{}.{}",
            base64url(br#"{"alg":"none"}"#),
            base64url(
                format!(
                    "{{\"exp\":{exp},\"task_id\":\"{}\",\"n\":\"{}\"}}",
                    r.task_id,
                    uuid::Uuid::new_v4()
                )
                .as_bytes()
            ),
            base64url(b"fake")
        );
        self.state().router_jwts.insert(r.task_id, jwt.clone());
        Ok(Response::new(pb::TaskGetCommandRouterAccessResponse {
            jwt,
            url: self.url.clone(),
        }))
    }

    async fn container_exec(
        &self,
        request: Request<pb::ContainerExecRequest>,
    ) -> Result<Response<pb::ContainerExecResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit("ContainerExec", &request, Req::ContainerExec(r.clone()))?;
        let (_, container) = self
            .sandbox_by_task(&r.task_id)
            .ok_or_else(|| Status::not_found(format!("task {} not found", r.task_id)))?;
        if r.command.is_empty() {
            return Err(Status::invalid_argument("command is required"));
        }
        let exec = spawn_exec(&container, &r.command, r.workdir.as_deref())?;
        let exec_id = self.next_id("ex");
        self.state().execs.insert(exec_id.clone(), exec);
        Ok(Response::new(pb::ContainerExecResponse { exec_id }))
    }

    async fn container_exec_put_input(
        &self,
        request: Request<pb::ContainerExecPutInputRequest>,
    ) -> Result<Response<()>, Status> {
        let r = request.get_ref().clone();
        self.admit(
            "ContainerExecPutInput",
            &request,
            Req::ContainerExecPutInput(r.clone()),
        )?;
        let exec = self.exec(&r.exec_id)?;
        let input = r
            .input
            .ok_or_else(|| Status::invalid_argument("input is required"))?;
        {
            let mut next = exec.next_index.lock().unwrap_or_else(|p| p.into_inner());
            if input.message_index != *next {
                return Err(Status::invalid_argument(format!(
                    "message_index {} out of order (expected {})",
                    input.message_index, *next
                )));
            }
            *next += 1;
        }
        let mut stdin = exec.stdin.lock().await;
        let Some(pipe) = stdin.as_mut() else {
            return Err(Status::failed_precondition("stdin already closed"));
        };
        if !input.message.is_empty() && pipe.write_all(&input.message).await.is_err() {
            return Err(Status::failed_precondition("process is not reading stdin"));
        }
        if input.eof {
            *stdin = None;
        }
        Ok(Response::new(()))
    }

    type ContainerExecGetOutputStream = BoxStream<pb::RuntimeOutputBatch>;

    async fn container_exec_get_output(
        &self,
        request: Request<pb::ContainerExecGetOutputRequest>,
    ) -> Result<Response<Self::ContainerExecGetOutputStream>, Status> {
        let r = request.get_ref().clone();
        self.admit(
            "ContainerExecGetOutput",
            &request,
            Req::ContainerExecGetOutput(r.clone()),
        )?;
        let exec = self.exec(&r.exec_id)?;
        let fd = r.file_descriptor;
        let is_stdout = fd == pb::FileDescriptor::Stdout as i32;
        if !is_stdout && fd != pb::FileDescriptor::Stderr as i32 {
            return Err(Status::invalid_argument(
                "file_descriptor must be stdout or stderr",
            ));
        }
        let raw = r.get_raw_bytes;
        let poll = Duration::from_secs_f32(r.timeout.clamp(0.1, 60.0));
        let stream = futures_util::stream::unfold(
            (
                exec,
                r.last_batch_index,
                false,
                tokio::time::Instant::now() + poll,
            ),
            move |(exec, mut sent, finished, deadline)| async move {
                if finished {
                    return None;
                }
                loop {
                    let changed = exec.changed.notified();
                    {
                        let out = exec.output.lock().unwrap_or_else(|p| p.into_inner());
                        let batches = if is_stdout { &out.stdout } else { &out.stderr };
                        if let Some(data) = batches.get(sent as usize) {
                            sent += 1;
                            let item = pb::RuntimeOutputMessage {
                                file_descriptor: fd,
                                message: if raw {
                                    String::new()
                                } else {
                                    String::from_utf8_lossy(data).into_owned()
                                },
                                message_bytes: if raw { data.clone() } else { Vec::new() },
                            };
                            let batch = pb::RuntimeOutputBatch {
                                items: vec![item],
                                batch_index: sent,
                                exit_code: None,
                            };
                            return Some((Ok(batch), (exec.clone(), sent, false, deadline)));
                        }
                        if let Some(code) = out.exit {
                            let batch = pb::RuntimeOutputBatch {
                                items: Vec::new(),
                                batch_index: sent,
                                exit_code: Some(code),
                            };
                            return Some((Ok(batch), (exec.clone(), sent, true, deadline)));
                        }
                    }
                    // Nothing new before the poll deadline: end the stream (the client resumes).
                    if tokio::time::timeout_at(deadline, changed).await.is_err() {
                        return None;
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn container_exec_wait(
        &self,
        request: Request<pb::ContainerExecWaitRequest>,
    ) -> Result<Response<pb::ContainerExecWaitResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit(
            "ContainerExecWait",
            &request,
            Req::ContainerExecWait(r.clone()),
        )?;
        let exec = self.exec(&r.exec_id)?;
        let deadline =
            tokio::time::Instant::now() + Duration::from_secs_f32(r.timeout.clamp(0.0, 60.0));
        loop {
            let changed = exec.changed.notified();
            let exit = exec.output.lock().unwrap_or_else(|p| p.into_inner()).exit;
            if let Some(code) = exit {
                return Ok(Response::new(pb::ContainerExecWaitResponse {
                    exit_code: Some(code),
                    completed: true,
                }));
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Ok(Response::new(pb::ContainerExecWaitResponse {
                    exit_code: None,
                    completed: false,
                }));
            }
        }
    }
}

impl Service {
    /// Records a router call and checks its `authorization: Bearer <jwt>` against the JWT
    /// issued for its task; router calls carry no `x-modal-*` metadata.
    fn admit_router<T>(
        &self,
        method: &'static str,
        request: &Request<T>,
        task_id: &str,
        req: Req,
    ) -> Result<(), Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let mut metadata = BTreeMap::new();
        if let Some(value) = &authorization {
            metadata.insert("authorization".to_owned(), value.clone());
        }
        let mut state = self.state();
        state.log.push(Recorded {
            method,
            metadata,
            request: req,
        });
        if !self.config.router {
            return Err(Status::unimplemented(
                "the task command router is not available",
            ));
        }
        let expected = state
            .router_jwts
            .get(task_id)
            .map(|jwt| format!("Bearer {jwt}"));
        if expected.is_none() || authorization != expected {
            return Err(Status::unauthenticated(
                "missing or invalid router JWT for this task",
            ));
        }
        Ok(())
    }

    fn routed_exec(&self, task_id: &str, exec_id: &str) -> Result<Arc<Exec>, Status> {
        self.exec(&format!("{task_id}/{exec_id}"))
    }
}

#[tonic::async_trait]
impl TaskCommandRouter for Service {
    async fn task_exec_start(
        &self,
        request: Request<rpb::TaskExecStartRequest>,
    ) -> Result<Response<rpb::TaskExecStartResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit_router(
            "TaskExecStart",
            &request,
            &r.task_id,
            Req::TaskExecStart(r.clone()),
        )?;
        if r.exec_id.is_empty() {
            return Err(Status::invalid_argument("exec_id is required"));
        }
        if r.command_args.is_empty() {
            return Err(Status::invalid_argument("command_args is required"));
        }
        let key = format!("{}/{}", r.task_id, r.exec_id);
        if self.state().execs.contains_key(&key) {
            // Idempotent: a retried start of the same exec id starts nothing new.
            return Ok(Response::new(rpb::TaskExecStartResponse {}));
        }
        let (_, container) = self
            .sandbox_by_task(&r.task_id)
            .ok_or_else(|| Status::not_found(format!("task {} not found", r.task_id)))?;
        let exec = spawn_exec(&container, &r.command_args, r.workdir.as_deref())?;
        self.state().execs.insert(key, exec);
        Ok(Response::new(rpb::TaskExecStartResponse {}))
    }

    async fn task_exec_stdin_write(
        &self,
        request: Request<rpb::TaskExecStdinWriteRequest>,
    ) -> Result<Response<rpb::TaskExecStdinWriteResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit_router(
            "TaskExecStdinWrite",
            &request,
            &r.task_id,
            Req::TaskExecStdinWrite(r.clone()),
        )?;
        let exec = self.routed_exec(&r.task_id, &r.exec_id)?;
        {
            let mut written = exec.written.lock().unwrap_or_else(|p| p.into_inner());
            if r.offset != *written {
                return Err(Status::invalid_argument(format!(
                    "offset {} does not follow the {} bytes written",
                    r.offset, *written
                )));
            }
            *written += r.data.len() as u64;
        }
        let mut stdin = exec.stdin.lock().await;
        let Some(pipe) = stdin.as_mut() else {
            return Err(Status::failed_precondition("stdin already closed"));
        };
        if !r.data.is_empty() && pipe.write_all(&r.data).await.is_err() {
            return Err(Status::failed_precondition("process is not reading stdin"));
        }
        if r.eof {
            *stdin = None;
        }
        Ok(Response::new(rpb::TaskExecStdinWriteResponse {}))
    }

    type TaskExecStdioReadStream = BoxStream<rpb::TaskExecStdioReadResponse>;

    async fn task_exec_stdio_read(
        &self,
        request: Request<rpb::TaskExecStdioReadRequest>,
    ) -> Result<Response<Self::TaskExecStdioReadStream>, Status> {
        let r = request.get_ref().clone();
        self.admit_router(
            "TaskExecStdioRead",
            &request,
            &r.task_id,
            Req::TaskExecStdioRead(r.clone()),
        )?;
        let exec = self.routed_exec(&r.task_id, &r.exec_id)?;
        let is_stdout = r.file_descriptor == rpb::TaskExecStdioFileDescriptor::Stdout as i32;
        // From `offset` on, each answer carries what arrived since; the stream ends once the
        // command has ended and everything was sent.
        let stream =
            futures_util::stream::unfold((exec, r.offset), move |(exec, offset)| async move {
                loop {
                    let changed = exec.changed.notified();
                    {
                        let out = exec.output.lock().unwrap_or_else(|p| p.into_inner());
                        let batches = if is_stdout { &out.stdout } else { &out.stderr };
                        let all: Vec<u8> = batches.concat();
                        if (all.len() as u64) > offset {
                            let data = all[offset as usize..].to_vec();
                            let next = all.len() as u64;
                            return Some((
                                Ok(rpb::TaskExecStdioReadResponse { data }),
                                (exec.clone(), next),
                            ));
                        }
                        if out.exit.is_some() {
                            return None;
                        }
                    }
                    changed.await;
                }
            });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn task_exec_wait(
        &self,
        request: Request<rpb::TaskExecWaitRequest>,
    ) -> Result<Response<rpb::TaskExecWaitResponse>, Status> {
        let r = request.get_ref().clone();
        self.admit_router(
            "TaskExecWait",
            &request,
            &r.task_id,
            Req::TaskExecWait(r.clone()),
        )?;
        let exec = self.routed_exec(&r.task_id, &r.exec_id)?;
        loop {
            let changed = exec.changed.notified();
            let exit = exec.output.lock().unwrap_or_else(|p| p.into_inner()).exit;
            if let Some(code) = exit {
                return Ok(Response::new(rpb::TaskExecWaitResponse {
                    exit_status: Some(rpb::task_exec_wait_response::ExitStatus::Code(code)),
                }));
            }
            changed.await;
        }
    }
}

impl FakeModal {
    /// Starts the fake on a free loopback port.
    pub async fn start(config: FakeConfig) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let config = Arc::new(config);
        let state = Arc::new(Mutex::new(State::default()));
        let service = Service {
            config: config.clone(),
            state: state.clone(),
            url: format!("http://{addr}"),
        };
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(ModalClientServer::new(service.clone()))
                .add_service(TaskCommandRouterServer::new(service))
                .serve_with_incoming_shutdown(incoming, stopped.cancelled_owned())
                .await;
        });
        Ok(Self {
            addr,
            config,
            state,
            stop,
        })
    }

    /// The `MODAL_SERVER_URL` to point a client at.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn config(&self) -> &FakeConfig {
        &self.config
    }

    /// Every call so far, in order.
    pub fn log(&self) -> Vec<Recorded> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .log
            .clone()
    }

    /// Sandboxes not yet ended: `(sandbox id, name, tags, definition)`.
    pub fn live_sandboxes(&self) -> Vec<LiveSandbox> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state
            .sandboxes
            .iter()
            .filter(|(_, s)| s.result.is_none())
            .map(|(id, s)| {
                (
                    id.clone(),
                    s.name.clone(),
                    s.tags.clone(),
                    s.definition.clone(),
                )
            })
            .collect()
    }

    /// The Docker container behind a sandbox (tests use it to simulate provider-side events).
    pub fn container_of(&self, sandbox_id: &str) -> Option<String> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.sandboxes.get(sandbox_id).map(|s| s.container.clone())
    }

    /// Removes every container this fake started (synchronously, so it also works in `Drop`).
    /// It asks again until none is left, for at most [`CLEANUP_WAIT`]: a container whose
    /// removal a terminate began is refused (409) until that removal is over, and is still
    /// listed meanwhile.
    pub fn cleanup(&self) {
        let filter = format!("label=fake-modal={}", self.config.label);
        let deadline = std::time::Instant::now() + CLEANUP_WAIT;
        while let Ok(out) = std::process::Command::new("docker")
            .args(["ps", "-aq", "--filter", &filter])
            .output()
        {
            let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .map(str::to_owned)
                .collect();
            if ids.is_empty() || std::time::Instant::now() >= deadline {
                break;
            }
            let _ = std::process::Command::new("docker")
                .args(["rm", "-f"])
                .args(&ids)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            // Room for the removal under way to end before the next look.
            std::thread::sleep(Duration::from_millis(100));
        }
        // The filesystem snapshots it committed (after their containers, which used them).
        let repository = format!("fake-modal-snapshot-{}", self.config.label);
        if let Ok(out) = std::process::Command::new("docker")
            .args([
                "images",
                "--format",
                "{{.Repository}}:{{.Tag}}",
                &repository,
            ])
            .output()
        {
            let names: Vec<String> = String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .map(str::to_owned)
                .collect();
            if !names.is_empty() {
                let _ = std::process::Command::new("docker")
                    .args(["rmi", "-f"])
                    .args(&names)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

/// How long [`FakeModal::cleanup`] keeps removing containers that are still listed.
const CLEANUP_WAIT: Duration = Duration::from_secs(30);

impl Drop for FakeModal {
    fn drop(&mut self) {
        self.stop.cancel();
        self.cleanup();
    }
}

/// The `fake-modal` binary: prints `FAKE_MODAL_URL=<url>` on stdout, serves until stdin closes
/// or SIGTERM/SIGINT, then removes its containers. `FAKE_MODAL_TOKEN_ID`,
/// `FAKE_MODAL_TOKEN_SECRET`, `FAKE_MODAL_LABEL` and `FAKE_MODAL_PAGE_SIZE` configure it;
/// with `FAKE_MODAL_LOG=<file>` every call is appended there as one line
/// (`<method>\t<metadata>\t<request>`), for black-box assertions.
/// `address/prefix` with the prefix within the address's length.
fn is_cidr(text: &str) -> bool {
    let Some((addr, prefix)) = text.split_once('/') else {
        return false;
    };
    match (addr.parse::<std::net::IpAddr>(), prefix.parse::<u8>()) {
        (Ok(std::net::IpAddr::V4(_)), Ok(prefix)) => prefix <= 32,
        (Ok(std::net::IpAddr::V6(_)), Ok(prefix)) => prefix <= 128,
        _ => false,
    }
}

pub fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("fake-modal: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let mut config = FakeConfig::default();
        if let Some(v) = env("FAKE_MODAL_TOKEN_ID") {
            config.token_id = v;
        }
        if let Some(v) = env("FAKE_MODAL_TOKEN_SECRET") {
            config.token_secret = v;
        }
        if let Some(v) = env("FAKE_MODAL_LABEL") {
            config.label = v;
        }
        if let Some(v) = env("FAKE_MODAL_PAGE_SIZE").and_then(|v| v.parse().ok()) {
            config.page_size = v;
        }
        let fake = match FakeModal::start(config).await {
            Ok(fake) => fake,
            Err(error) => {
                eprintln!("fake-modal: cannot listen: {error}");
                return ExitCode::FAILURE;
            }
        };
        println!("FAKE_MODAL_URL={}", fake.url());
        let log_file = env("FAKE_MODAL_LOG");
        let mut written = 0;
        let mut stdin = tokio::io::stdin();
        let mut sink = [0u8; 64];
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(error) => {
                eprintln!("fake-modal: {error}");
                return ExitCode::FAILURE;
            }
        };
        let mut flush = tokio::time::interval(Duration::from_millis(50));
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = tokio::signal::ctrl_c() => break,
                read = stdin.read(&mut sink) => if matches!(read, Ok(0) | Err(_)) { break },
                _ = flush.tick() => {
                    if let Some(path) = &log_file {
                        let log = fake.log();
                        if log.len() > written {
                            let mut text = String::new();
                            for call in &log[written..] {
                                text.push_str(&format!("{}\t{:?}\t{:?}\n", call.method, call.metadata, call.request));
                            }
                            written = log.len();
                            if let Ok(mut file) = tokio::fs::OpenOptions::new().create(true).append(true).open(path).await {
                                let _ = file.write_all(text.as_bytes()).await;
                            }
                        }
                    }
                }
            }
        }
        drop(fake);
        ExitCode::SUCCESS
    })
}
