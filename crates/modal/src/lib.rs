//! Modal sandboxes over Modal's gRPC API (docs/decisions.md, "Modal sandboxes"). A computer is a sandbox in the app
//! `--modal-app-name`, *named* by its computer id (names are unique among an app's running
//! sandboxes, so two servers racing to create the same id cannot both succeed) and tagged with
//! our tag keys (docs/decisions.md, "Labels and metadata"), which is how permanent computers are found again after a restart. Modal cannot
//! stop and start a sandbox, so restart is terminate + create (`state_preserved: false`), and a
//! sandbox lives at most `--sandbox-timeout` seconds.
//!
//! Split: [`auth`] (credentials, endpoint), [`api`] (the control plane's wire API),
//! [`checkpoints`] (filesystem snapshots as checkpoints), [`egress`] (the egress policy as
//! Modal's network allow-list),
//! [`router`] (the per-task command router's wire API), [`exec`] (commands: through the router,
//! or through `ContainerExec*` when it is unavailable). The local stand-in server of the tests is its own crate, `fakes/modal/`.

mod api;
mod auth;
mod checkpoints;
pub mod config;
pub mod egress;
mod exec;
mod router;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::ModalConfig;
use api::{Api, ApiError, pb};
use kilntainers_backend::Common;
use kilntainers_backend::egress::EgressPolicy;
use kilntainers_backend::ids::{ComputerId, ExecId, InstanceId, Principal, SandboxId};
use kilntainers_backend::labels::{self, modal as tag};
use kilntainers_backend::posix::{self, KILL_SWEEP_TIMEOUT, SweepReach, shell_basename};
use kilntainers_backend::snapshots::SnapshotCheckpoints;
use kilntainers_backend::{
    Backend, BackendError, ComputerInfo, CreateSpec, ExecEnd, ExecSpec, Found, IdleStop,
    OutputSink, PortRoute, Progress, Restarted, SandboxRef,
};

/// Readiness exec after create/attach (docs/decisions.md, "Constants": E2B/Modal 10 s).
const READINESS_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a new sandbox may take to be scheduled and started (image pull on Modal's side
/// included); each `SandboxGetTaskId` round waits up to `TASK_POLL_SECS` server-side.
const START_DEADLINE: Duration = Duration::from_secs(300);
const TASK_POLL_SECS: f32 = 50.0;
/// How long an image build may take before creation gives up.
const IMAGE_BUILD_DEADLINE: Duration = Duration::from_secs(1800);
const IMAGE_POLL_SECS: f32 = 55.0;
/// Listing pages stop after this many rounds, a guard against a server that never ends a list.
const MAX_LIST_PAGES: usize = 100;

/// The Modal reference text (docs/decisions.md, "Tool descriptions") without the timeout paragraph, which is appended.
const T_MODAL_FIRST: &str = "Execute a shell command in a remote cloud sandbox (Modal). Commands run in {shell}. Each call is independent — no state (shell variables, working directory) persists between calls. Use the working_directory parameter or chain commands with && to control execution context.";

pub struct ModalBackend {
    inner: Arc<ModalInner>,
}

pub(crate) struct ModalInner {
    config: ModalConfig,
    shell: String,
    network: bool,
    default_timeout_secs: u64,
    /// Credentials and channel, resolved at first use; retried after a failure.
    api: OnceCell<Arc<Api>>,
    app_id: OnceCell<String>,
    /// Image name → Modal image id, once built (per process, docs/decisions.md, "Modal sandboxes").
    images: tokio::sync::Mutex<HashMap<String, String>>,
    /// Sandbox id → task id: exec addresses the task.
    tasks: Mutex<HashMap<String, String>>,
    /// Command router access per task (`router.rs`).
    routers: router::Routers,
    /// Which exec path was last logged: 1 router, 2 fallback (each is logged when it changes).
    exec_path: std::sync::atomic::AtomicU8,
    /// Checkpoint records (`checkpoints`), under the state directory.
    records: SnapshotCheckpoints,
    /// The server's egress policy: new computers get it unless they narrow it.
    egress_policy: EgressPolicy,
}

impl ModalBackend {
    pub fn new(config: &ModalConfig, common: &Common) -> Self {
        Self {
            inner: Arc::new(ModalInner {
                config: config.clone(),
                shell: common.shell.clone(),
                network: common.network,
                default_timeout_secs: common.default_timeout_secs,
                api: OnceCell::new(),
                app_id: OnceCell::new(),
                images: tokio::sync::Mutex::new(HashMap::new()),
                tasks: Mutex::new(HashMap::new()),
                routers: router::Routers::default(),
                exec_path: std::sync::atomic::AtomicU8::new(0),
                records: SnapshotCheckpoints::new(config.state_dir.as_deref(), "modal"),
                egress_policy: common.egress.policy.clone(),
            }),
        }
    }
}

/// The egress policy recorded in a sandbox's tags (docs/egress.md, "Recorded"); one the
/// server cannot read is an error for that computer, never an open computer.
fn recorded_policy(
    id: &ComputerId,
    tags: &BTreeMap<String, String>,
) -> Result<Option<EgressPolicy>, BackendError> {
    tags.get(tag::EGRESS)
        .map(|text| {
            EgressPolicy::from_label(text)
                .map_err(|e| BackendError::Provider(format!("computer '{}': {e}", id.slug())))
        })
        .transpose()
}

/// The error texts of docs/decisions.md, "Modal sandboxes" for statuses that mean "cannot talk to Modal at all".
fn connection_error(error: &ApiError) -> Option<BackendError> {
    match error.code {
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => Some(BackendError::Unavailable(
            "Modal authentication failed. Either:\n  - Set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET environment variables\n  - Run 'modal token set' to configure credentials\n  - Pass --modal-token-id and --modal-token-secret".to_owned(),
        )),
        tonic::Code::Unavailable => Some(BackendError::Unavailable(
            "Cannot connect to Modal. Check your network connection and Modal service status at https://status.modal.com".to_owned(),
        )),
        _ => None,
    }
}

/// Maps any API failure: connection problems get their fixed texts, the rest names the call
/// and what it was about.
fn failure(error: &ApiError, context: impl std::fmt::Display) -> BackendError {
    connection_error(error)
        .unwrap_or_else(|| BackendError::Provider(format!("{context}: {}", error.detail())))
}

/// How long Modal may take to report a new sandbox's tunnels.
const TUNNELS_WAIT: Duration = Duration::from_secs(30);

/// A tunnel's public HTTPS URL, from what Modal reports (a host name and a TLS port); a host
/// that is not a plain DNS name is refused rather than put into a link.
fn tunnel_url(host: &str, port: u32) -> Result<String, BackendError> {
    let plain = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if !plain || port == 0 || port > 65535 {
        return Err(BackendError::Provider(format!(
            "Modal reported a tunnel this server cannot use (host {:?}, port {port}).",
            host.chars().take(80).collect::<String>()
        )));
    }
    Ok(if port == 443 {
        format!("https://{host}/")
    } else {
        format!("https://{host}:{port}/")
    })
}

fn tags_map(tags: &[pb::SandboxTag]) -> BTreeMap<String, String> {
    tags.iter()
        .map(|t| (t.tag_name.clone(), t.tag_value.clone()))
        .collect()
}

/// `SandboxInfo.created_at` (Unix seconds) as RFC 3339 UTC; `None` when Modal left it unset.
fn rfc3339(unix: f64) -> Option<String> {
    (unix.is_finite() && unix > 0.0)
        .then(|| kilntainers_backend::clock::rfc3339_utc(unix.floor() as i64))
}

/// `--gpu` as Modal's clients parse it: `TYPE` or `TYPE:COUNT`.
fn gpu_config(gpu: Option<&str>) -> Option<pb::GpuConfig> {
    let gpu = gpu?.trim();
    let (kind, count) = match gpu.split_once(':') {
        Some((kind, count)) => (kind, count.trim().parse::<u32>().ok().filter(|c| *c > 0)?),
        None => (gpu, 1),
    };
    Some(pb::GpuConfig {
        count,
        gpu_type: kind.trim().to_uppercase(),
    })
}

impl ModalInner {
    async fn api(&self) -> Result<Arc<Api>, BackendError> {
        self.api
            .get_or_try_init(|| async {
                let credentials = auth::resolve(&self.config).map_err(BackendError::Unavailable)?;
                Api::new(credentials)
                    .map(Arc::new)
                    .map_err(BackendError::Unavailable)
            })
            .await
            .cloned()
    }

    /// `AppGetOrCreate`: the app that owns our sandboxes (also the validation call).
    async fn app_id(&self) -> Result<String, BackendError> {
        let api = self.api().await?;
        self.app_id
            .get_or_try_init(|| async {
                let answer = api
                    .app_get_or_create(pb::AppGetOrCreateRequest {
                        app_name: self.config.app_name.clone(),
                        environment_name: api.environment().to_owned(),
                        object_creation_type: pb::ObjectCreationType::CreateIfMissing as i32,
                    })
                    .await
                    .map_err(|e| {
                        failure(
                            &e,
                            format!("Modal app lookup of '{}' failed", self.config.app_name),
                        )
                    })?;
                Ok(answer.app_id)
            })
            .await
            .cloned()
    }

    /// `ImageGetOrCreate` from `FROM <image>` and, until built, `ImageJoinStreaming`.
    async fn image_id(&self, image: &str, progress: &dyn Progress) -> Result<String, BackendError> {
        let mut images = self.images.lock().await;
        if let Some(id) = images.get(image) {
            return Ok(id.clone());
        }
        let api = self.api().await?;
        let app_id = self.app_id().await?;
        let not_found = || {
            BackendError::Provider(format!(
                "Modal image not found: '{image}'. Check that the image name is correct and the registry is accessible."
            ))
        };
        let answer = api
            .image_get_or_create(pb::ImageGetOrCreateRequest {
                image: Some(pb::Image {
                    dockerfile_commands: vec![format!("FROM {image}")],
                }),
                app_id,
                builder_version: api.image_builder_version().to_owned(),
            })
            .await
            .map_err(|e| match e.code {
                tonic::Code::NotFound | tonic::Code::InvalidArgument => not_found(),
                _ => failure(&e, format!("Modal ImageGetOrCreate for '{image}' failed")),
            })?;
        let mut result = answer.result;
        let deadline = Instant::now() + IMAGE_BUILD_DEADLINE;
        let mut last_entry_id = String::new();
        while result.as_ref().is_none_or(|r| r.status == 0) {
            if Instant::now() >= deadline {
                return Err(BackendError::Provider(format!(
                    "Modal image '{image}' ({}) was not built within {}s",
                    answer.image_id,
                    IMAGE_BUILD_DEADLINE.as_secs()
                )));
            }
            progress.report(1.0, None, format!("Building Modal image {image}…"));
            let mut stream = api
                .image_join_streaming(pb::ImageJoinStreamingRequest {
                    image_id: answer.image_id.clone(),
                    timeout: IMAGE_POLL_SECS,
                    last_entry_id: last_entry_id.clone(),
                })
                .await
                .map_err(|e| {
                    failure(&e, format!("Modal ImageJoinStreaming for '{image}' failed"))
                })?;
            loop {
                match stream.message().await {
                    Ok(Some(item)) => {
                        if !item.entry_id.is_empty() {
                            last_entry_id = item.entry_id;
                        }
                        if item.result.as_ref().is_some_and(|r| r.status != 0) {
                            result = item.result;
                            break;
                        }
                        if item.eof {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(status) => {
                        return Err(BackendError::Provider(format!(
                            "Modal ImageJoinStreaming for '{image}' failed: {:?}: {}",
                            status.code(),
                            status.message()
                        )));
                    }
                }
            }
        }
        match result {
            Some(r) if r.status == pb::generic_result::GenericStatus::Success as i32 => {
                images.insert(image.to_owned(), answer.image_id.clone());
                Ok(answer.image_id)
            }
            Some(r) => {
                warn!(image, exception = %r.exception, "Modal image build failed");
                Err(not_found())
            }
            None => Err(not_found()),
        }
    }

    fn cached_task(&self, sandbox_id: &str) -> Option<String> {
        self.tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(sandbox_id)
            .cloned()
    }

    fn forget_task(&self, sandbox_id: &str) {
        self.tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(sandbox_id);
    }

    /// The error for a sandbox whose task has ended: lifetime expiry has its own text.
    fn ended(&self, sandbox: &SandboxRef, result: &pb::GenericResult) -> BackendError {
        self.forget_task(sandbox.sandbox_id.as_str());
        if result.status == pb::generic_result::GenericStatus::Timeout as i32 {
            BackendError::Provider(format!(
                "Sandbox {} lifetime timeout expired",
                sandbox.sandbox_id
            ))
        } else {
            BackendError::Vanished(sandbox.computer_id.clone())
        }
    }

    /// `SandboxGetTaskId` until the sandbox's container runs (`wait_until_ready`).
    /// Logs which exec path is in use whenever it changes: the command router (`None`), or the
    /// `ContainerExec*` fallback and why the router could not be used.
    fn note_exec_path(&self, router_error: Option<&ApiError>) {
        use std::sync::atomic::Ordering;
        let path = if router_error.is_some() { 2 } else { 1 };
        if self.exec_path.swap(path, Ordering::Relaxed) == path {
            return;
        }
        match router_error {
            None => info!("Modal exec goes through the task command router"),
            Some(error) => warn!(
                error = %error.detail(),
                "Modal task command router unavailable; exec falls back to ContainerExec"
            ),
        }
    }

    async fn task_id(&self, sandbox: &SandboxRef) -> Result<String, BackendError> {
        if let Some(task) = self.cached_task(sandbox.sandbox_id.as_str()) {
            return Ok(task);
        }
        let api = self.api().await?;
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            let answer = api
                .sandbox_get_task_id(pb::SandboxGetTaskIdRequest {
                    sandbox_id: sandbox.sandbox_id.as_str().to_owned(),
                    timeout: Some(TASK_POLL_SECS),
                    wait_until_ready: true,
                })
                .await
                .map_err(|e| match e.code {
                    tonic::Code::NotFound => BackendError::Vanished(sandbox.computer_id.clone()),
                    _ => failure(
                        &e,
                        format!(
                            "Modal SandboxGetTaskId for sandbox {} (computer '{}') failed",
                            sandbox.sandbox_id, sandbox.computer_id
                        ),
                    ),
                })?;
            if let Some(result) = &answer.task_result {
                return Err(self.ended(sandbox, result));
            }
            if let Some(task) = answer.task_id.filter(|t| !t.is_empty()) {
                self.tasks
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(sandbox.sandbox_id.as_str().to_owned(), task.clone());
                return Ok(task);
            }
            if Instant::now() >= deadline {
                return Err(BackendError::Provider(format!(
                    "Modal sandbox {} (computer '{}') did not start within {}s",
                    sandbox.sandbox_id,
                    sandbox.computer_id,
                    START_DEADLINE.as_secs()
                )));
            }
        }
    }

    /// Turns an exec-path failure into the right error: a sandbox that ended is reported as
    /// such (lifetime expiry, or died/vanished), anything else names the call.
    async fn exec_failure(&self, sandbox: &SandboxRef, error: &ApiError) -> BackendError {
        if let Some(e) = connection_error(error) {
            return e;
        }
        if let Ok(api) = self.api().await
            && let Ok(answer) = api
                .sandbox_get_task_id(pb::SandboxGetTaskIdRequest {
                    sandbox_id: sandbox.sandbox_id.as_str().to_owned(),
                    timeout: Some(0.0),
                    wait_until_ready: false,
                })
                .await
            && let Some(result) = &answer.task_result
        {
            self.forget_task(sandbox.sandbox_id.as_str());
            return match self.ended(sandbox, result) {
                BackendError::Vanished(_) => {
                    BackendError::DiedDuringExec(sandbox.sandbox_id.clone())
                }
                other => other,
            };
        }
        BackendError::Provider(format!(
            "Modal {} in sandbox {} (computer '{}') failed: {:?}: {}",
            error.call, sandbox.sandbox_id, sandbox.computer_id, error.code, error.message
        ))
    }

    /// `<shell> -c "echo kilntainers-ready"` must print the marker (docs/decisions.md, "Execution model").
    async fn readiness(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let argv = posix::readiness_argv(&self.shell);
        match exec::run_simple(self, sandbox, argv, READINESS_TIMEOUT).await {
            Ok(out) if posix::shows_ready(&out.stdout) => Ok(()),
            Ok(_) => Err(BackendError::Provider(format!(
                "Sandbox started but readiness check failed (unexpected output). Shell '{}' may not be available in the image. Use --shell /bin/sh for images without bash.",
                self.shell
            ))),
            Err(error @ (BackendError::Unavailable(_) | BackendError::Vanished(_))) => Err(error),
            Err(error) => Err(BackendError::Provider(format!(
                "Sandbox readiness check failed: {error}"
            ))),
        }
    }

    async fn tags(&self, sandbox_id: &str) -> Result<BTreeMap<String, String>, ApiError> {
        let api = self.api().await.map_err(|e| ApiError {
            call: "SandboxTagsGet",
            code: tonic::Code::Unavailable,
            message: e.to_string(),
        })?;
        let answer = api
            .sandbox_tags_get(pb::SandboxTagsGetRequest {
                sandbox_id: sandbox_id.to_owned(),
            })
            .await?;
        Ok(tags_map(&answer.tags))
    }

    /// Running sandboxes of our app carrying all of `filter`, newest first, all pages.
    async fn list_sandboxes(
        &self,
        filter: &[(&str, &str)],
    ) -> Result<Vec<pb::SandboxInfo>, BackendError> {
        let api = self.api().await?;
        let app_id = self.app_id().await?;
        let tags: Vec<pb::SandboxTag> = filter
            .iter()
            .map(|(k, v)| pb::SandboxTag {
                tag_name: (*k).to_owned(),
                tag_value: (*v).to_owned(),
            })
            .collect();
        let mut all = Vec::new();
        let mut before = 0.0;
        for _ in 0..MAX_LIST_PAGES {
            let page = api
                .sandbox_list(pb::SandboxListRequest {
                    app_id: app_id.clone(),
                    before_timestamp: before,
                    environment_name: api.environment().to_owned(),
                    include_finished: false,
                    tags: tags.clone(),
                })
                .await
                .map_err(|e| failure(&e, "Modal SandboxList failed"))?;
            let Some(last) = page.sandboxes.last() else {
                break;
            };
            before = last.created_at;
            all.extend(page.sandboxes);
        }
        Ok(all)
    }

    fn sandbox_from(
        &self,
        id: &ComputerId,
        sandbox_id: &str,
        tags: &BTreeMap<String, String>,
    ) -> SandboxRef {
        SandboxRef {
            computer_id: id.clone(),
            sandbox_id: SandboxId::new(sandbox_id.to_owned()),
            temporary: labels::parse_temporary(tags.get(tag::TEMPORARY).map(String::as_str)),
            image: tags
                .get(tag::IMAGE)
                .cloned()
                .unwrap_or_else(|| self.config.image.clone()),
        }
    }

    async fn find(
        &self,
        id: &ComputerId,
    ) -> Result<Option<(pb::SandboxInfo, SandboxRef)>, BackendError> {
        let found = self
            .list_sandboxes(&[(tag::MANAGED, "true"), (tag::COMPUTER_ID, id.as_str())])
            .await?;
        let Some(info) = found.into_iter().next() else {
            return Ok(None);
        };
        let tags = self.tags(&info.id).await.map_err(|e| {
            failure(
                &e,
                format!(
                    "Modal SandboxTagsGet for sandbox {} (computer '{id}') failed",
                    info.id
                ),
            )
        })?;
        let sandbox = self.sandbox_from(id, &info.id, &tags);
        Ok(Some((info, sandbox)))
    }

    /// Creates the computer of `spec` from its image, or from `snapshot` (a checkpoint's image
    /// id) with the image still recorded in its tags.
    async fn create(
        &self,
        spec: &CreateSpec,
        instance_tag: Option<String>,
        snapshot: Option<&str>,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let id = &spec.computer_id;
        progress.report(1.0, None, format!("Creating modal computer {id}…"));
        let image = spec
            .image
            .clone()
            .unwrap_or_else(|| self.config.image.clone());
        // Modal enforces the policy; recorded in the tags so a restart, a rollback or another
        // server process finds it again (docs/egress.md, "Modal").
        let policy = spec.egress.as_ref().unwrap_or(&self.egress_policy);
        let allowed = egress::allowed_cidrs(policy).map_err(|why| {
            BackendError::Provider(format!(
                "Cannot create computer '{}': Modal cannot enforce its egress policy: {why}.",
                id.slug()
            ))
        })?;
        let network_access_type = match &allowed {
            Some(cidrs) if !cidrs.is_empty() => pb::network_access::NetworkAccessType::Allowlist,
            Some(_) => pb::network_access::NetworkAccessType::Blocked,
            None if self.network => pb::network_access::NetworkAccessType::Open,
            None => pb::network_access::NetworkAccessType::Blocked,
        };
        let api = self.api().await?;
        let app_id = self.app_id().await?;
        let image_id = match snapshot {
            Some(image_id) => image_id.to_owned(),
            None => self.image_id(&image, progress).await?,
        };
        let definition = pb::Sandbox {
            entrypoint_args: posix::keep_alive_argv(&self.shell),
            image_id,
            resources: Some(pb::Resources {
                memory_mb: self.config.memory_mib,
                milli_cpu: self.config.milli_cpu,
                gpu_config: gpu_config(self.config.gpu.as_deref()),
            }),
            timeout_secs: self.config.sandbox_timeout_secs,
            scheduler_placement: self.config.region.as_ref().map(|r| pb::SchedulerPlacement {
                regions: vec![r.clone()],
            }),
            open_ports_oneof: (!self.config.ports.is_empty()).then(|| {
                pb::sandbox::OpenPortsOneof::OpenPorts(pb::PortSpecs {
                    ports: self
                        .config
                        .ports
                        .iter()
                        .map(|&port| pb::PortSpec {
                            port: u32::from(port),
                            unencrypted: false,
                        })
                        .collect(),
                })
            }),
            network_access: Some(pb::NetworkAccess {
                network_access_type: network_access_type as i32,
                allowed_cidrs: allowed.clone().unwrap_or_default(),
            }),
            verbose: false,
            name: Some(id.to_string()),
        };
        let created = api
            .sandbox_create(pb::SandboxCreateRequest {
                app_id,
                definition: Some(definition),
                environment_name: api.environment().to_owned(),
            })
            .await
            .map_err(|e| match e.code {
                tonic::Code::AlreadyExists => BackendError::Provider(format!(
                    "Computer '{id}' already exists in Modal (a sandbox named '{id}' is running in app '{}').",
                    self.config.app_name
                )),
                tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition => {
                    BackendError::Provider(format!("Failed to create Modal sandbox: {}", e.message))
                }
                _ => failure(&e, format!("Modal SandboxCreate for computer '{id}' failed")),
            })?;
        let sandbox = SandboxRef {
            computer_id: id.clone(),
            sandbox_id: SandboxId::new(created.sandbox_id.clone()),
            temporary: spec.temporary,
            image: image.clone(),
        };
        info!(computer_id = %id, sandbox = %sandbox.sandbox_id, "Modal sandbox created");
        progress.report(2.0, None, format!("Waiting for {id} to start…"));
        let mut tags = vec![
            (tag::MANAGED, "true".to_owned()),
            (tag::COMPUTER_ID, id.to_string()),
            (
                tag::TEMPORARY,
                labels::format_bool(spec.temporary).to_owned(),
            ),
            (tag::IMAGE, image),
        ];
        if let Some(owner) = &spec.owner {
            tags.push((tag::OWNER, owner.to_string()));
        }
        if let Some(instance) = instance_tag.filter(|_| spec.temporary) {
            tags.push((tag::INSTANCE, instance));
        }
        if allowed.is_some() {
            tags.push((tag::EGRESS, policy.to_label()));
        }
        let started = async {
            self.task_id(&sandbox).await?;
            api.sandbox_tags_set(pb::SandboxTagsSetRequest {
                environment_name: api.environment().to_owned(),
                sandbox_id: sandbox.sandbox_id.as_str().to_owned(),
                tags: tags
                    .iter()
                    .map(|(k, v)| pb::SandboxTag {
                        tag_name: (*k).to_owned(),
                        tag_value: v.clone(),
                    })
                    .collect(),
            })
            .await
            .map_err(|e| {
                failure(
                    &e,
                    format!(
                        "Modal SandboxTagsSet for sandbox {} (computer '{id}') failed",
                        sandbox.sandbox_id
                    ),
                )
            })?;
            self.readiness(&sandbox).await
        }
        .await;
        match started {
            Ok(()) => Ok(sandbox),
            Err(error) => {
                // Never leave a half-made computer behind, permanent ones included.
                if let Err(e) = self.terminate(&sandbox).await {
                    warn!(sandbox = %sandbox.sandbox_id, %e, "could not terminate a sandbox that failed to start");
                }
                Err(error)
            }
        }
    }

    async fn terminate(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let api = self.api().await?;
        self.forget_task(sandbox.sandbox_id.as_str());
        match api
            .sandbox_terminate(pb::SandboxTerminateRequest {
                sandbox_id: sandbox.sandbox_id.as_str().to_owned(),
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.code == tonic::Code::NotFound => Ok(()),
            Err(e) => Err(failure(
                &e,
                format!(
                    "Modal SandboxTerminate of sandbox {} (computer '{}') failed",
                    sandbox.sandbox_id, sandbox.computer_id
                ),
            )),
        }
    }
}

#[async_trait]
impl Backend for ModalBackend {
    fn kind(&self) -> &'static str {
        "modal"
    }

    fn tool_instructions(&self) -> String {
        let inner = &self.inner;
        let shell = shell_basename(&inner.shell);
        if inner.config.custom_image {
            kilntainers_backend::generic_description(
                &format!(
                    "an isolated Modal cloud sandbox built from image `{}`",
                    inner.config.image
                ),
                shell,
                inner.default_timeout_secs,
            )
        } else {
            format!(
                "{}\n\n{}",
                T_MODAL_FIRST.replace("{shell}", shell),
                kilntainers_backend::stdin_and_timeout_paragraph(inner.default_timeout_secs)
            )
        }
    }

    async fn validate(&self) -> Result<(), BackendError> {
        self.inner.app_id().await.map(drop)
    }

    async fn egress_policy(
        &self,
        sandbox: &SandboxRef,
    ) -> Result<Option<EgressPolicy>, BackendError> {
        let tags = self
            .inner
            .tags(sandbox.sandbox_id.as_str())
            .await
            .map_err(|e| {
                failure(
                    &e,
                    format!(
                        "Modal SandboxTagsGet for sandbox {} (computer '{}') failed",
                        sandbox.sandbox_id, sandbox.computer_id
                    ),
                )
            })?;
        recorded_policy(&sandbox.computer_id, &tags)
    }

    /// Filesystem snapshots as checkpoints ([`checkpoints`]).
    fn checkpoints(&self) -> Option<&dyn kilntainers_backend::checkpoints::Checkpoints> {
        Some(self)
    }

    /// Modal's tunnel for the port (docs/files.md, "Ports"): public, and only for the ports
    /// `--modal-ports` named when the sandbox was created.
    async fn port_route(&self, sandbox: &SandboxRef, port: u16) -> Result<PortRoute, BackendError> {
        let inner = &self.inner;
        let id = &sandbox.computer_id;
        if !inner.config.ports.contains(&port) {
            return Err(BackendError::Provider(format!(
                "Port {port} is not open on Modal computer '{id}': Modal opens ports only when it creates a sandbox, for the ports in --modal-ports. Start the server with --modal-ports {port} and use a new computer (or factory-reset this one)."
            )));
        }
        let api = inner.api().await?;
        let answer = api
            .sandbox_get_tunnels(pb::SandboxGetTunnelsRequest {
                sandbox_id: sandbox.sandbox_id.as_str().to_owned(),
                timeout: TUNNELS_WAIT.as_secs_f32(),
            })
            .await
            .map_err(|e| {
                failure(
                    &e,
                    format!("Modal SandboxGetTunnels for computer '{id}' failed"),
                )
            })?;
        let tunnel = answer
            .tunnels
            .iter()
            .find(|t| t.container_port == u32::from(port))
            .ok_or_else(|| {
                BackendError::Provider(format!(
                    "Modal reports no tunnel for port {port} of computer '{id}' (it was created before --modal-ports named the port). Factory-reset it or use a new computer."
                ))
            })?;
        Ok(PortRoute::Provider {
            url: tunnel_url(&tunnel.host, tunnel.port)?,
            public: true,
        })
    }

    async fn create(
        &self,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.inner
            .create(spec, Some(spec.instance.to_string()), None, progress)
            .await
    }

    async fn lookup(&self, id: &ComputerId) -> Result<Option<Found>, BackendError> {
        Ok(self.inner.find(id).await?.map(|(_, sandbox)| Found {
            sandbox,
            // Only unfinished sandboxes are listed; one that has ended is simply not found.
            running: true,
        }))
    }

    async fn ensure_running(&self, sandbox: &SandboxRef) -> Result<SandboxRef, BackendError> {
        self.inner.task_id(sandbox).await?;
        self.inner.readiness(sandbox).await?;
        Ok(sandbox.clone())
    }

    async fn list(&self) -> Result<Vec<ComputerInfo>, BackendError> {
        let inner = &self.inner;
        let mut out = Vec::new();
        for info in inner.list_sandboxes(&[(tag::MANAGED, "true")]).await? {
            let tags = match inner.tags(&info.id).await {
                Ok(tags) => tags,
                // Ended between the list and this call.
                Err(e) if e.code == tonic::Code::NotFound => continue,
                Err(e) => {
                    return Err(failure(
                        &e,
                        format!("Modal SandboxTagsGet for sandbox {} failed", info.id),
                    ));
                }
            };
            let Some(id) = tags
                .get(tag::COMPUTER_ID)
                .and_then(|i| ComputerId::parse_stored(i).ok())
            else {
                continue;
            };
            out.push(ComputerInfo {
                sandbox: inner.sandbox_from(&id, &info.id, &tags),
                state: "running".to_owned(),
                created_at: rfc3339(info.created_at),
            });
        }
        Ok(out)
    }

    fn idle_stop(&self) -> IdleStop {
        IdleStop::Refused(
            "--idle-stop is not available on the modal backend: a Modal sandbox cannot be stopped and resumed, only terminated.".to_owned(),
        )
    }

    async fn restart(&self, sandbox: &SandboxRef) -> Result<Restarted, BackendError> {
        let inner = &self.inner;
        // Keep the creating instance of a temporary computer, so crash GC still applies, and
        // the owner.
        let old_tags = inner.tags(sandbox.sandbox_id.as_str()).await.ok();
        let instance = old_tags
            .as_ref()
            .and_then(|t| t.get(tag::INSTANCE).cloned());
        let owner = old_tags
            .as_ref()
            .and_then(|t| t.get(tag::OWNER))
            .and_then(|o| Principal::parse(o));
        // A narrowed policy stays the computer's.
        let egress = match &old_tags {
            Some(tags) => recorded_policy(&sandbox.computer_id, tags)?,
            None => None,
        };
        inner.terminate(sandbox).await?;
        let spec = CreateSpec {
            computer_id: sandbox.computer_id.clone(),
            temporary: sandbox.temporary,
            image: Some(sandbox.image.clone()),
            // Unused: the instance tag is carried over (or stays absent) below.
            instance: InstanceId::random(),
            owner,
            egress,
        };
        let created = inner
            .create(&spec, instance, None, &kilntainers_backend::NoProgress)
            .await?;
        Ok(Restarted {
            sandbox: created,
            state_preserved: false,
        })
    }

    async fn remove(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        self.inner.terminate(sandbox).await
    }

    async fn exec(
        &self,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Result<ExecEnd, BackendError> {
        exec::run(
            &self.inner,
            sandbox,
            exec::tagged_argv(spec),
            spec.working_dir.as_deref(),
            spec.stdin.as_deref(),
            sink,
            cancel,
        )
        .await
    }

    async fn kill_exec(&self, sandbox: &SandboxRef, exec_id: &ExecId) -> Result<(), BackendError> {
        let argv = posix::kill_sweep_argv(&self.inner.shell, exec_id, SweepReach::Tagged);
        exec::run_simple(&self.inner, sandbox, argv, KILL_SWEEP_TIMEOUT)
            .await
            .map(drop)
    }

    async fn collect_orphans(
        &self,
        dead: &HashSet<InstanceId>,
    ) -> Result<Vec<ComputerId>, BackendError> {
        let inner = &self.inner;
        if dead.is_empty() {
            return Ok(Vec::new());
        }
        inner.records.collect_orphans(self, dead).await;
        let mut removed = Vec::new();
        for info in inner
            .list_sandboxes(&[(tag::MANAGED, "true"), (tag::TEMPORARY, "true")])
            .await?
        {
            let Ok(tags) = inner.tags(&info.id).await else {
                continue;
            };
            let orphaned = tags
                .get(tag::INSTANCE)
                .and_then(|i| InstanceId::parse(i))
                .is_some_and(|i| dead.contains(&i));
            let Some(id) = tags
                .get(tag::COMPUTER_ID)
                .and_then(|i| ComputerId::parse_stored(i).ok())
            else {
                continue;
            };
            if !orphaned {
                continue;
            }
            let sandbox = inner.sandbox_from(&id, &info.id, &tags);
            match inner.terminate(&sandbox).await {
                Ok(()) => removed.push(id),
                Err(e) => warn!(sandbox = %info.id, %e, "could not collect a sandbox"),
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_flag_is_parsed_like_modal_clients_do() {
        let g = gpu_config(Some("a10g")).unwrap();
        assert_eq!((g.gpu_type.as_str(), g.count), ("A10G", 1));
        let g = gpu_config(Some("H100:4")).unwrap();
        assert_eq!((g.gpu_type.as_str(), g.count), ("H100", 4));
        assert!(gpu_config(Some("H100:x")).is_none());
        assert!(gpu_config(None).is_none());
    }

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0.0), None);
        assert_eq!(
            rfc3339(1_700_000_000.5).as_deref(),
            Some("2023-11-14T22:13:20Z")
        );
        assert_eq!(
            rfc3339(951_782_400.0).as_deref(),
            Some("2000-02-29T00:00:00Z")
        );
    }
}
