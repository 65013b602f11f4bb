//! Kubernetes computers (docs/kubernetes.md) over kube-rs, in pod mode: a computer is a Pod
//! named after its computer id, whose PID 1 is the POSIX keep-alive, plus, for a permanent
//! computer, a PersistentVolumeClaim of the same name mounted as its home. Labels say which
//! objects are this server's (and, on temporary computers, which server instance made them,
//! for crash GC); annotations carry the computer id, image and owner, read back after a server
//! restart, so the cluster is the ground truth as the engine is on Docker.
//!
//! Restart deletes the Pod and makes it again (the home volume stays); removal deletes both.
//! Commands run as one `pods/exec` each ([`exec`]); ports through `pods/portforward`. Jobs and
//! the file tools come from the shared POSIX programs over that exec. Sandbox mode (the
//! agent-sandbox CRDs) is not built yet: [`config::ModeChoice`] has no variant for it, and
//! [`checks::sandbox_crd_served`] is where it will be chosen.
//!
//! Split: [`config`] (the section, quantities), [`checks`] (kubeconfig and startup checks),
//! [`objects`] (names, labels, the Pod and PVC), [`exec`] (the exec stream). kube and
//! k8s-openapi appear only in this crate.

mod checks;
pub mod config;
mod exec;
mod objects;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, PostParams, PropagationPolicy};
use kube::{Api, Client};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{KubernetesConfig, ModeChoice};
use crate::exec::{Collected, ExecError, cap};
use crate::objects::{Recipe, object_name};
use kilntainers_backend::ids::{ComputerId, ExecId, InstanceId, SandboxId};
use kilntainers_backend::labels::kubernetes as keys;
use kilntainers_backend::posix::{self, KILL_SWEEP_TIMEOUT, SweepReach, shell_basename};
use kilntainers_backend::{
    Backend, BackendError, Common, ComputerInfo, CreateSpec, ExecEnd, ExecSpec, Found, OutputSink,
    PortRoute, PortStream, Progress, Restarted, SandboxRef,
};

/// How long a new Pod may take to run, image pull included, before create gives up.
const POD_START_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a deleted Pod or PVC may take to go (its finalizers and grace period) before a
/// restart or factory reset gives up making it again under the same name.
const DELETE_TIMEOUT: Duration = Duration::from_secs(120);
/// Pause between reads of an object while waiting for it to run or to go.
const POLL: Duration = Duration::from_millis(250);
/// Readiness exec after a Pod runs (docs/decisions.md, "Execution model").
const READINESS_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the first port-forward to a port waits for the kubelet's refusal.
const PORT_REFUSAL_WAIT: Duration = Duration::from_millis(500);
/// Bound of the set of ports known to answer; cleared when full (they then wait once more).
const MAX_ANSWERED_PORTS: usize = 4096;
/// Container waiting reasons that will not resolve by waiting: the create fails at once.
const HOPELESS_WAITING: [&str; 5] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
];

/// The connected cluster: the client, the namespace's Pods and PVCs.
struct Cluster {
    url: String,
    namespace: String,
    pods: Api<Pod>,
    claims: Api<PersistentVolumeClaim>,
}

pub struct KubernetesBackend {
    config: KubernetesConfig,
    shell: String,
    default_timeout_secs: u64,
    cluster: OnceCell<Cluster>,
    /// Ports (per Pod incarnation) a port-forward reached before; see `connect_port`.
    answered: std::sync::Mutex<HashSet<(SandboxId, u16)>>,
}

impl KubernetesBackend {
    pub fn new(config: &KubernetesConfig, common: &Common) -> Result<Self, BackendError> {
        Ok(Self {
            config: config.clone(),
            shell: common.shell.clone(),
            default_timeout_secs: common.default_timeout_secs,
            cluster: OnceCell::new(),
            answered: std::sync::Mutex::new(HashSet::new()),
        })
    }

    fn answered_ports(&self) -> std::sync::MutexGuard<'_, HashSet<(SandboxId, u16)>> {
        self.answered.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cluster, connected and checked once (docs/kubernetes.md, "Startup checks").
    async fn cluster(&self) -> Result<&Cluster, BackendError> {
        self.cluster
            .get_or_try_init(|| async {
                let loaded = checks::load(&self.config).await.map_err(unavailable)?;
                let url = loaded.cluster_url.to_string();
                let namespace = self
                    .config
                    .namespace
                    .clone()
                    .unwrap_or_else(|| loaded.default_namespace.clone());
                let client = Client::try_from(loaded).map_err(|e| {
                    BackendError::Unavailable(format!(
                        "Cannot set up the Kubernetes client for {url}: {}",
                        cap(&e.to_string())
                    ))
                })?;
                checks::check(&client, &url, &namespace, &self.config)
                    .await
                    .map_err(unavailable)?;
                if self.config.mode == ModeChoice::Auto && checks::sandbox_crd_served(&client).await
                {
                    info!(
                        "the agent-sandbox Sandbox CRD is served; sandbox mode is not built yet, so computers are plain Pods (pod mode)"
                    );
                }
                info!(%url, %namespace, "Kubernetes backend connected (pod mode)");
                Ok(Cluster {
                    url,
                    pods: Api::namespaced(client.clone(), &namespace),
                    claims: Api::namespaced(client, &namespace),
                    namespace,
                })
            })
            .await
    }

    fn sandbox_of(recipe: &Recipe, meta: &ObjectMeta) -> SandboxRef {
        SandboxRef {
            computer_id: recipe.computer_id.clone(),
            sandbox_id: SandboxId::new(meta.uid.clone().unwrap_or_default()),
            temporary: recipe.temporary,
            image: recipe.image.clone(),
        }
    }

    /// The Pod of `id` when it is this computer's (the annotation names it).
    async fn pod_of(&self, id: &ComputerId) -> Result<Option<(Pod, Recipe)>, BackendError> {
        let cluster = self.cluster().await?;
        let pod =
            cluster.pods.get_opt(&object_name(id)).await.map_err(|e| {
                api_error(cluster, &format!("Reading the Pod of computer '{id}'"), e)
            })?;
        Ok(pod.and_then(|pod| {
            let recipe = Recipe::read(&pod.metadata, &self.config.image)?;
            (recipe.computer_id == *id).then_some((pod, recipe))
        }))
    }

    /// The home PVC of `id` when it is this computer's.
    async fn claim_of(
        &self,
        id: &ComputerId,
    ) -> Result<Option<(PersistentVolumeClaim, Recipe)>, BackendError> {
        if self.config.storage.is_none() {
            return Ok(None);
        }
        let cluster = self.cluster().await?;
        let claim = cluster
            .claims
            .get_opt(&object_name(id))
            .await
            .map_err(|e| {
                api_error(
                    cluster,
                    &format!("Reading the volume of computer '{id}'"),
                    e,
                )
            })?;
        Ok(claim.and_then(|claim| {
            let recipe = Recipe::read(&claim.metadata, &self.config.image)?;
            (recipe.computer_id == *id).then_some((claim, recipe))
        }))
    }

    /// Makes the Pod of `recipe` (and its home PVC when permanent and storage is on), waits
    /// until it runs and its shell answers.
    async fn make(
        &self,
        recipe: &Recipe,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let cluster = self.cluster().await?;
        let id = &recipe.computer_id;
        let with_home = !recipe.temporary && self.config.storage.is_some();
        if let (true, Some(size)) = (with_home, &self.config.storage) {
            match cluster
                .claims
                .create(&PostParams::default(), &recipe.home_claim(size))
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    // Kept from an earlier incarnation (restart) or made by another server
                    // at the same moment: fine when it is this computer's.
                    if self.claim_of(id).await?.is_none() {
                        return Err(name_taken(cluster, id, "PersistentVolumeClaim"));
                    }
                }
                Err(e) => {
                    return Err(api_error(
                        cluster,
                        &format!("Creating the volume of computer '{id}'"),
                        e,
                    ));
                }
            }
        }
        progress.report(1.0, None, format!("Starting Kubernetes pod for {id}…"));
        let pod = recipe.pod(&self.config, &self.shell, with_home);
        match cluster.pods.create(&PostParams::default(), &pod).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {
                if self.pod_of(id).await?.is_none() {
                    return Err(name_taken(cluster, id, "Pod"));
                }
            }
            Err(e) => {
                return Err(api_error(
                    cluster,
                    &format!("Creating the Pod of computer '{id}'"),
                    e,
                ));
            }
        }
        let sandbox = self.wait_running(id).await?;
        self.readiness(&sandbox).await?;
        Ok(sandbox)
    }

    /// Polls the Pod of `id` until it runs; fails early on what waiting cannot fix.
    async fn wait_running(&self, id: &ComputerId) -> Result<SandboxRef, BackendError> {
        let deadline = Instant::now() + POD_START_TIMEOUT;
        loop {
            let Some((pod, recipe)) = self.pod_of(id).await? else {
                return Err(BackendError::Vanished(id.clone()));
            };
            let status = pod.status.as_ref();
            match status.and_then(|s| s.phase.as_deref()) {
                Some("Running") => return Ok(Self::sandbox_of(&recipe, &pod.metadata)),
                Some(phase @ ("Failed" | "Succeeded")) => {
                    return Err(BackendError::Provider(format!(
                        "The Pod of computer '{id}' ended ({phase}) before it ran: {}",
                        cap(status
                            .and_then(|s| s.message.as_deref())
                            .unwrap_or("no message"))
                    )));
                }
                _ => {}
            }
            let waiting = status
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|c| c.first())
                .and_then(|c| c.state.as_ref())
                .and_then(|s| s.waiting.as_ref());
            if let Some(waiting) = waiting
                && let Some(reason) = waiting.reason.as_deref()
                && HOPELESS_WAITING.contains(&reason)
            {
                return Err(BackendError::Provider(format!(
                    "The Pod of computer '{id}' cannot start ({reason}): {}",
                    cap(waiting.message.as_deref().unwrap_or("no message"))
                )));
            }
            if Instant::now() >= deadline {
                return Err(BackendError::Provider(format!(
                    "The Pod of computer '{id}' did not run within {}s (Kubernetes watch timeout); check the cluster's events for it.",
                    POD_START_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// `<shell> -c 'echo <marker>'` must print the marker.
    async fn readiness(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let cluster = self.cluster().await?;
        let name = object_name(&sandbox.computer_id);
        let deadline = Instant::now() + READINESS_TIMEOUT;
        loop {
            let mut out = Collected::default();
            let ran = tokio::time::timeout(
                READINESS_TIMEOUT,
                exec::run(
                    &cluster.pods,
                    &name,
                    posix::readiness_argv(&self.shell),
                    None,
                    &mut out,
                    &CancellationToken::new(),
                ),
            )
            .await;
            match ran {
                Ok(Ok(_)) if posix::shows_ready(&out.stdout) => return Ok(()),
                Ok(Ok(_)) => {
                    return Err(BackendError::Provider(format!(
                        "Pod started but readiness check failed (unexpected output). Shell '{}' may not be available in the image. Use --shell /bin/sh for images without bash.",
                        self.shell
                    )));
                }
                _ if Instant::now() + POLL >= deadline => {
                    return Err(BackendError::Provider(format!(
                        "The Pod of computer '{}' runs but its shell did not answer within {}s.",
                        sandbox.computer_id,
                        READINESS_TIMEOUT.as_secs()
                    )));
                }
                _ => tokio::time::sleep(POLL).await,
            }
        }
    }

    /// Deletes the Pod of `id` (no grace: the computer's processes are ours to end) and waits
    /// until it is gone, so its name can be used again.
    async fn delete_pod(&self, id: &ComputerId) -> Result<(), BackendError> {
        let cluster = self.cluster().await?;
        let name = object_name(id);
        if self.pod_of(id).await?.is_none() {
            return Ok(());
        }
        match cluster.pods.delete(&name, &delete_now()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
            Err(e) => {
                return Err(api_error(
                    cluster,
                    &format!("Deleting the Pod of computer '{id}'"),
                    e,
                ));
            }
        }
        self.wait_gone(id, "Pod", || async { Ok(self.pod_of(id).await?.is_some()) })
            .await
    }

    async fn delete_claim(&self, id: &ComputerId) -> Result<(), BackendError> {
        let cluster = self.cluster().await?;
        if self.claim_of(id).await?.is_none() {
            return Ok(());
        }
        match cluster.claims.delete(&object_name(id), &delete_now()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
            Err(e) => {
                return Err(api_error(
                    cluster,
                    &format!("Deleting the volume of computer '{id}'"),
                    e,
                ));
            }
        }
        self.wait_gone(id, "volume", || async {
            Ok(self.claim_of(id).await?.is_some())
        })
        .await
    }

    async fn wait_gone<F, Fut>(
        &self,
        id: &ComputerId,
        what: &str,
        exists: F,
    ) -> Result<(), BackendError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<bool, BackendError>>,
    {
        let deadline = Instant::now() + DELETE_TIMEOUT;
        while exists().await? {
            if Instant::now() >= deadline {
                return Err(BackendError::Provider(format!(
                    "The {what} of computer '{id}' was deleted but is still there after {}s (a finalizer may hold it).",
                    DELETE_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }

    /// What is known of `id`: its Pod, else (a permanent computer whose Pod is gone) its PVC.
    async fn recipe_of(
        &self,
        id: &ComputerId,
    ) -> Result<Option<(Recipe, ObjectMeta, bool)>, BackendError> {
        if let Some((pod, recipe)) = self.pod_of(id).await? {
            let running = pod_runs(&pod);
            return Ok(Some((recipe, pod.metadata, running)));
        }
        Ok(self
            .claim_of(id)
            .await?
            .map(|(claim, recipe)| (recipe, claim.metadata, false)))
    }

    /// Runs a command of the backend's own (a kill sweep), output dropped.
    async fn run_own(&self, sandbox: &SandboxRef, argv: Vec<String>) -> Result<(), BackendError> {
        let cluster = self.cluster().await?;
        let mut out = Collected::default();
        exec::run(
            &cluster.pods,
            &object_name(&sandbox.computer_id),
            argv,
            None,
            &mut out,
            &CancellationToken::new(),
        )
        .await
        .map(|_| ())
        .map_err(|e| self.exec_failure(cluster, sandbox, e))
    }

    fn exec_failure(
        &self,
        cluster: &Cluster,
        sandbox: &SandboxRef,
        error: ExecError,
    ) -> BackendError {
        match error {
            ExecError::Connect(kube::Error::Api(status)) if status.code == 404 => {
                BackendError::Vanished(sandbox.computer_id.clone())
            }
            ExecError::Connect(e) => api_error(
                cluster,
                &format!("Exec in the Pod of computer '{}'", sandbox.computer_id),
                e,
            ),
            other => BackendError::Provider(format!(
                "Command in the Pod of computer '{}' failed: {other}",
                sandbox.computer_id
            )),
        }
    }
}

/// Whether a Pod is up for commands: running and not being deleted.
fn pod_runs(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// Delete at once, dependents in the background.
fn delete_now() -> DeleteParams {
    DeleteParams {
        grace_period_seconds: Some(0),
        propagation_policy: Some(PropagationPolicy::Background),
        ..DeleteParams::default()
    }
}

fn unavailable(error: checks::StartupError) -> BackendError {
    BackendError::Unavailable(error.to_string())
}

fn name_taken(cluster: &Cluster, id: &ComputerId, kind: &str) -> BackendError {
    BackendError::Provider(format!(
        "Cannot create computer '{}': a {kind} named '{}' that is not this computer's already exists in Kubernetes namespace '{}'.",
        id.slug(),
        object_name(id),
        cluster.namespace
    ))
}

/// An API error as the user's message: what was being done, and the API server's own words
/// (capped) for refusals, never the raw Status object.
fn api_error(cluster: &Cluster, doing: &str, error: kube::Error) -> BackendError {
    api_error_at(&cluster.url, doing, error)
}

fn api_error_at(url: &str, doing: &str, error: kube::Error) -> BackendError {
    match error {
        kube::Error::Api(status) => {
            let message = cap(&status.message);
            match status.code {
                403 => BackendError::Provider(format!(
                    "{doing} was refused by Kubernetes (forbidden): {message}. The server's account needs the Role in deploy/kubernetes/rbac.yaml."
                )),
                409 => BackendError::Provider(format!(
                    "{doing} conflicted with another change in Kubernetes: {message}. Try again."
                )),
                422 => BackendError::Provider(format!(
                    "{doing}: Kubernetes refused the object as invalid: {message}"
                )),
                404 => {
                    BackendError::Provider(format!("{doing}: not found in Kubernetes: {message}"))
                }
                code => BackendError::Provider(format!(
                    "{doing} failed: Kubernetes answered {code}: {message}"
                )),
            }
        }
        other => BackendError::Unavailable(format!(
            "{doing} failed: cannot reach the Kubernetes API server at {url}: {}",
            cap(&other.to_string())
        )),
    }
}

#[async_trait]
impl Backend for KubernetesBackend {
    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    fn tool_instructions(&self) -> String {
        kilntainers_backend::generic_description(
            &format!("a sandboxed Kubernetes pod ({})", self.config.image),
            shell_basename(&self.shell),
            self.default_timeout_secs,
        )
    }

    async fn check_startup(&self) -> Result<(), BackendError> {
        self.cluster().await.map(|_| ())
    }

    async fn validate(&self) -> Result<(), BackendError> {
        self.cluster().await.map(|_| ())
    }

    async fn port_route(
        &self,
        _sandbox: &SandboxRef,
        _port: u16,
    ) -> Result<PortRoute, BackendError> {
        Ok(PortRoute::Forwarded)
    }

    async fn connect_port(
        &self,
        sandbox: &SandboxRef,
        port: u16,
    ) -> Result<Box<dyn PortStream>, BackendError> {
        let cluster = self.cluster().await?;
        let mut forwarder = cluster
            .pods
            .portforward(&object_name(&sandbox.computer_id), &[port])
            .await
            .map_err(|e| match e {
                kube::Error::Api(status) if status.code == 404 => {
                    BackendError::Vanished(sandbox.computer_id.clone())
                }
                other => api_error(
                    cluster,
                    &format!(
                        "Port-forward to port {port} of computer '{}'",
                        sandbox.computer_id
                    ),
                    other,
                ),
            })?;
        // The forwarder's task carries the stream; it ends when the stream is dropped.
        let stream = forwarder.take_stream(port).ok_or_else(|| {
            BackendError::Provider(format!(
                "Port-forward to port {port} of computer '{}' opened no stream.",
                sandbox.computer_id
            ))
        })?;
        // The protocol never says a connection was accepted, only (on the port's error
        // stream) that it was refused, which the kubelet does as soon as its dial fails. The
        // first connection to a port waits a moment for that refusal, so `port_url` can say
        // nothing listens; later ones to a port that answered before do not wait.
        let key = (sandbox.sandbox_id.clone(), port);
        let known = self.answered_ports().contains(&key);
        if !known && let Some(refusal) = forwarder.take_error(port) {
            match tokio::time::timeout(PORT_REFUSAL_WAIT, refusal).await {
                Ok(Some(why)) => {
                    return Err(BackendError::Provider(format!(
                        "Nothing accepts connections on port {port} in computer '{}' ({}). Start a server listening on that port first.",
                        sandbox.computer_id.slug(),
                        cap(&why)
                    )));
                }
                Ok(None) | Err(_) => {
                    let mut answered = self.answered_ports();
                    if answered.len() >= MAX_ANSWERED_PORTS {
                        answered.clear();
                    }
                    answered.insert(key);
                }
            }
        }
        Ok(Box::new(stream))
    }

    async fn create(
        &self,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let recipe = Recipe {
            computer_id: spec.computer_id.clone(),
            temporary: spec.temporary,
            image: spec
                .image
                .clone()
                .unwrap_or_else(|| self.config.image.clone()),
            instance: spec.temporary.then(|| spec.instance.as_str().to_owned()),
            owner: spec.owner.as_ref().map(|o| o.as_str().to_owned()),
        };
        self.make(&recipe, progress).await
    }

    async fn lookup(&self, id: &ComputerId) -> Result<Option<Found>, BackendError> {
        Ok(self
            .recipe_of(id)
            .await?
            .map(|(recipe, meta, running)| Found {
                sandbox: Self::sandbox_of(&recipe, &meta),
                running,
            }))
    }

    async fn ensure_running(&self, sandbox: &SandboxRef) -> Result<SandboxRef, BackendError> {
        let id = &sandbox.computer_id;
        let Some((recipe, meta, running)) = self.recipe_of(id).await? else {
            return Err(BackendError::Vanished(id.clone()));
        };
        if running {
            let current = Self::sandbox_of(&recipe, &meta);
            self.readiness(&current).await?;
            return Ok(current);
        }
        // The Pod ended (its node went away, its deadline passed) or only the home volume is
        // left: make the Pod again from what its objects recorded.
        info!(computer_id = %id, "recreating the Pod of a computer that is not running");
        self.delete_pod(id).await?;
        self.make(&recipe, &kilntainers_backend::NoProgress).await
    }

    async fn list(&self) -> Result<Vec<ComputerInfo>, BackendError> {
        let cluster = self.cluster().await?;
        let managed = ListParams::default().labels(&format!("{}=true", keys::MANAGED));
        let pods = cluster
            .pods
            .list(&managed)
            .await
            .map_err(|e| api_error(cluster, "Listing the computers' Pods", e))?;
        let mut rows = Vec::new();
        let mut seen = HashSet::new();
        for pod in &pods.items {
            let Some(recipe) = Recipe::read(&pod.metadata, &self.config.image) else {
                continue;
            };
            seen.insert(recipe.computer_id.clone());
            let phase = pod
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .unwrap_or("Unknown");
            rows.push(ComputerInfo {
                sandbox: Self::sandbox_of(&recipe, &pod.metadata),
                state: if pod.metadata.deletion_timestamp.is_some() {
                    "terminating".to_owned()
                } else {
                    phase.to_ascii_lowercase()
                },
                created_at: created_at(&pod.metadata),
            });
        }
        if self.config.storage.is_some() {
            let claims = cluster
                .claims
                .list(&managed)
                .await
                .map_err(|e| api_error(cluster, "Listing the computers' volumes", e))?;
            for claim in &claims.items {
                let Some(recipe) = Recipe::read(&claim.metadata, &self.config.image) else {
                    continue;
                };
                if seen.insert(recipe.computer_id.clone()) {
                    rows.push(ComputerInfo {
                        sandbox: Self::sandbox_of(&recipe, &claim.metadata),
                        state: "stopped".to_owned(),
                        created_at: created_at(&claim.metadata),
                    });
                }
            }
        }
        Ok(rows)
    }

    async fn restart(&self, sandbox: &SandboxRef) -> Result<Restarted, BackendError> {
        let id = &sandbox.computer_id;
        let Some((recipe, _, _)) = self.recipe_of(id).await? else {
            return Err(BackendError::Vanished(id.clone()));
        };
        self.delete_pod(id).await?;
        let restarted = self.make(&recipe, &kilntainers_backend::NoProgress).await?;
        Ok(Restarted {
            sandbox: restarted,
            state_preserved: !recipe.temporary && self.config.storage.is_some(),
        })
    }

    async fn remove(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        self.delete_pod(&sandbox.computer_id).await?;
        self.delete_claim(&sandbox.computer_id).await
    }

    async fn exec(
        &self,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Result<ExecEnd, BackendError> {
        let cluster = self.cluster().await?;
        let argv = vec![
            self.shell.clone(),
            "-c".to_owned(),
            exec::wrapper_script(spec),
        ];
        let ran = exec::run(
            &cluster.pods,
            &object_name(&sandbox.computer_id),
            argv,
            spec.stdin.as_deref(),
            sink,
            cancel,
        )
        .await;
        match ran {
            Ok(end) => Ok(end),
            Err(error) => {
                // Tell a Pod that went away or stopped from a failed stream.
                match self.pod_of(&sandbox.computer_id).await {
                    Ok(None) => Err(BackendError::Vanished(sandbox.computer_id.clone())),
                    Ok(Some((pod, _))) if !pod_runs(&pod) => {
                        if matches!(error, ExecError::Connect(_)) {
                            Err(BackendError::NotRunning(sandbox.sandbox_id.clone()))
                        } else {
                            Err(BackendError::DiedDuringExec(sandbox.sandbox_id.clone()))
                        }
                    }
                    _ => Err(self.exec_failure(cluster, sandbox, error)),
                }
            }
        }
    }

    async fn kill_exec(&self, sandbox: &SandboxRef, exec_id: &ExecId) -> Result<(), BackendError> {
        // PID 1 is our keep-alive, so orphans of the command are told apart as on Docker.
        let argv = posix::kill_sweep_argv(&self.shell, exec_id, SweepReach::TaggedAndOrphans);
        match tokio::time::timeout(KILL_SWEEP_TIMEOUT, self.run_own(sandbox, argv)).await {
            Ok(result) => result,
            Err(_) => Err(BackendError::Provider(format!(
                "The kill sweep in computer '{}' did not finish within {}s.",
                sandbox.computer_id,
                KILL_SWEEP_TIMEOUT.as_secs()
            ))),
        }
    }

    async fn collect_orphans(
        &self,
        dead: &HashSet<InstanceId>,
    ) -> Result<Vec<ComputerId>, BackendError> {
        let cluster = self.cluster().await?;
        let temporary = ListParams::default().labels(&format!(
            "{}=true,{}=true",
            keys::MANAGED,
            keys::TEMPORARY
        ));
        let pods = cluster
            .pods
            .list(&temporary)
            .await
            .map_err(|e| api_error(cluster, "Listing temporary computers for crash GC", e))?;
        let mut removed = Vec::new();
        for pod in pods.items {
            let Some(recipe) = Recipe::read(&pod.metadata, &self.config.image) else {
                continue;
            };
            let orphaned = recipe
                .instance
                .as_deref()
                .and_then(InstanceId::parse)
                .is_some_and(|instance| dead.contains(&instance));
            if !orphaned {
                continue;
            }
            match self.delete_pod(&recipe.computer_id).await {
                Ok(()) => removed.push(recipe.computer_id),
                Err(e) => {
                    warn!(computer_id = %recipe.computer_id, error = %e, "crash GC could not delete a Pod")
                }
            }
        }
        Ok(removed)
    }
}

/// The object's creation time as RFC 3339 text.
fn created_at(meta: &ObjectMeta) -> Option<String> {
    let time = meta.creation_timestamp.as_ref()?;
    serde_json::to_value(time).ok()?.as_str().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "Reason")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn api_errors_read_as_sentences_with_the_servers_words_capped() {
        let forbidden = api_error_at(
            "https://k8s",
            "Creating the Pod of computer 'a'",
            refused(403, "no"),
        );
        assert_eq!(
            forbidden.to_string(),
            "Creating the Pod of computer 'a' was refused by Kubernetes (forbidden): no. The server's account needs the Role in deploy/kubernetes/rbac.yaml."
        );
        let invalid = api_error_at("https://k8s", "Creating", refused(422, &"x".repeat(5000)));
        let text = invalid.to_string();
        assert!(
            text.starts_with("Creating: Kubernetes refused the object as invalid: xxx"),
            "{text}"
        );
        assert!(text.len() < 700, "capped: {}", text.len());
        assert!(!text.contains("Status"), "{text}");
        let conflict = api_error_at("https://k8s", "Deleting", refused(409, "changed"));
        assert!(conflict.to_string().contains("conflicted"), "{conflict}");
    }
}
