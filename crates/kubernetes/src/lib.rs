//! Kubernetes computers (docs/kubernetes.md) over kube-rs. In pod mode a computer is a Pod
//! named after its computer id, whose PID 1 is the POSIX keep-alive, plus, for a permanent
//! computer, a PersistentVolumeClaim of the same name mounted as its home. In sandbox mode it
//! is an agent-sandbox `Sandbox` of that name with the same Pod spec as its pod template (and
//! a `home` volume claim template), or, for a temporary computer with `--k8s-warm-pool`, a
//! `SandboxClaim`; once the Pod behind it is known, everything runs as in pod mode. Labels say which
//! objects are this server's (and, on temporary computers, which server instance made them,
//! for crash GC); annotations carry the computer id, image and owner, read back after a server
//! restart, so the cluster is the ground truth as the engine is on Docker.
//!
//! Restart deletes the Pod and makes it again (the home volume stays), in sandbox mode by
//! suspending and resuming the Sandbox; removal deletes everything. In pod mode `--warm-pool`
//! keeps spare Pods that become computers by a relabelling ([`pool`]); such a Pod keeps the
//! spare's name.
//! Commands run through the exec helper over one long-lived `pods/exec` per Pod ([`helper`]),
//! else as one `pods/exec` each ([`exec`]); ports through `pods/portforward`. Jobs and the file
//! tools come from the shared POSIX programs over that exec.
//!
//! Split: [`config`] (the section, quantities), [`checks`] (kubeconfig and startup checks),
//! [`objects`] (names, labels, the Pod and PVC), [`sandbox`] (the agent-sandbox resources),
//! [`helper`] (the exec helper's way in), [`exec`] (one exec stream per command), [`pool`]
//! (spare Pods). kube and k8s-openapi appear only in this crate.

mod checks;
pub mod config;
pub mod egress;
mod exec;
mod helper;
mod objects;
mod pool;
mod sandbox;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::{Api, Client};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::checks::Mode;
use crate::config::KubernetesConfig;
use crate::exec::{Collected, ExecError, cap};
use crate::helper::PodTransport;
use crate::objects::{HOME_VOLUME, Home, Recipe, TEMPORARY_DEADLINE_SECS, home_mount, object_name};
use crate::sandbox::{
    PodTemplate, RUNNING, SUSPENDED, Sandbox, SandboxClaim, claim_of_template,
    operating_mode_patch, shutdown_time_in,
};
use kilntainers_backend::egress::EgressPolicy;
use kilntainers_backend::ids::{ComputerId, ExecId, InstanceId, SandboxId};
use kilntainers_backend::labels::kubernetes as keys;
use kilntainers_backend::posix::{self, KILL_SWEEP_TIMEOUT, SweepReach, shell_basename};
use kilntainers_backend::{
    Backend, BackendError, Common, ComputerInfo, CreateSpec, ExecEnd, ExecSpec, Found, IdleStop,
    IdleStopped, OutputSink, PortRoute, PortStream, Progress, Restarted, SandboxRef, WarmPoolSize,
};
use kilntainers_helper_client::{Helpers, Lost};

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

/// The connected cluster: the client, the namespace's Pods and PVCs, and in sandbox mode its
/// Sandboxes and claims.
struct Cluster {
    url: String,
    namespace: String,
    mode: Mode,
    pods: Api<Pod>,
    claims: Api<PersistentVolumeClaim>,
    sandboxes: Api<Sandbox>,
    sandbox_claims: Api<SandboxClaim>,
    /// The computers' NetworkPolicies (docs/kubernetes.md, "Egress").
    network_policies: Api<NetworkPolicy>,
    /// `--k8s-template`'s pod template, read at startup.
    template: Option<PodTemplate>,
}

/// What sandbox mode knows of a computer: the recipe its object recorded, that object's
/// metadata, whether it is a claim, and the Sandbox behind it once there is one.
struct Backing {
    recipe: Recipe,
    meta: ObjectMeta,
    claimed: bool,
    sandbox: Option<Sandbox>,
}

pub struct KubernetesBackend {
    config: KubernetesConfig,
    shell: String,
    default_timeout_secs: u64,
    cluster: OnceCell<Cluster>,
    /// Ports (per Pod incarnation) a port-forward reached before; see `connect_port`.
    answered: std::sync::Mutex<HashSet<(SandboxId, u16)>>,
    /// The server's egress policy: new computers get it unless they narrow it.
    egress_policy: EgressPolicy,
    /// The resident exec helpers, one `pods/exec` connection per Pod (docs/kubernetes.md,
    /// "Exec").
    helpers: Helpers,
    /// Started spare Pods handed out as temporary computers (`--warm-pool`, pod mode).
    pool: pool::WarmPool,
    /// The Pod names of computers this process made from a spare (their Pods keep the spare's
    /// name), so commands find them without a lookup.
    adopted: std::sync::Mutex<HashMap<ComputerId, String>>,
}

impl KubernetesBackend {
    pub fn new(config: &KubernetesConfig, common: &Common) -> Result<Self, BackendError> {
        Ok(Self {
            config: config.clone(),
            shell: common.shell.clone(),
            default_timeout_secs: common.default_timeout_secs,
            cluster: OnceCell::new(),
            answered: std::sync::Mutex::new(HashSet::new()),
            egress_policy: common.egress.policy.clone(),
            helpers: Helpers::new(config.exec_helper, helper::PLAIN),
            pool: pool::WarmPool::new(spares(config, &common.egress.policy)),
            adopted: std::sync::Mutex::new(HashMap::new()),
        })
    }

    fn adopted_pods(&self) -> std::sync::MutexGuard<'_, HashMap<ComputerId, String>> {
        self.adopted.lock().unwrap_or_else(|p| p.into_inner())
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
                let mode = checks::mode(&client, &self.config)
                    .await
                    .map_err(unavailable)?;
                // Open without rules is the one policy that needs no NetworkPolicy.
                let network_policies = !self.egress_policy.is_unfiltered();
                checks::check(
                    &client,
                    &url,
                    &namespace,
                    &self.config,
                    mode,
                    network_policies,
                )
                .await
                .map_err(unavailable)?;
                let template = match mode {
                    Mode::Sandbox => {
                        checks::sandbox_sources(&client, &url, &namespace, &self.config)
                            .await
                            .map_err(unavailable)?
                    }
                    Mode::Pod => None,
                };
                info!(%url, %namespace, ?mode, "Kubernetes backend connected");
                Ok(Cluster {
                    url,
                    mode,
                    pods: Api::namespaced(client.clone(), &namespace),
                    claims: Api::namespaced(client.clone(), &namespace),
                    sandboxes: Api::namespaced(client.clone(), &namespace),
                    sandbox_claims: Api::namespaced(client.clone(), &namespace),
                    network_policies: Api::namespaced(client, &namespace),
                    template,
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

    /// The Pod of `id` when it is this computer's (the annotation names it; in sandbox mode,
    /// the Pod behind its Sandbox).
    async fn pod_of(&self, id: &ComputerId) -> Result<Option<(Pod, Recipe)>, BackendError> {
        let cluster = self.cluster().await?;
        if cluster.mode == Mode::Sandbox {
            let Some(backing) = self.backing(id).await? else {
                return Ok(None);
            };
            let Some(name) = backing.sandbox.as_ref().and_then(Sandbox::pod_name) else {
                return Ok(None);
            };
            let pod = cluster.pods.get_opt(&name).await.map_err(|e| {
                api_error(cluster, &format!("Reading the Pod of computer '{id}'"), e)
            })?;
            return Ok(pod.map(|pod| (pod, backing.recipe)));
        }
        let reading = |e| api_error(cluster, &format!("Reading the Pod of computer '{id}'"), e);
        let mine = |pod: Pod| {
            let recipe = Recipe::read(&pod.metadata, &self.config.image)?;
            (recipe.computer_id == *id).then_some((pod, recipe))
        };
        let adopted = self.adopted_pods().get(id).cloned();
        for name in adopted.into_iter().chain([object_name(id)]) {
            if let Some(found) = cluster
                .pods
                .get_opt(&name)
                .await
                .map_err(reading)?
                .and_then(mine)
            {
                return Ok(Some(found));
            }
        }
        // A computer born a warm-pool spare keeps the spare's Pod name; another server process
        // (crash GC) finds it by the labels the hand-over gave it.
        let born_spare = ListParams::default().labels(&format!(
            "{}=true,{}=true,{}={}",
            keys::MANAGED,
            keys::POOLED,
            keys::NAME,
            object_name(id)
        ));
        let listed = cluster.pods.list(&born_spare).await.map_err(reading)?;
        Ok(listed.items.into_iter().find_map(mine))
    }

    /// The name of the Pod `id` runs in (pod mode: its object name; sandbox mode: the Pod
    /// behind its Sandbox).
    async fn pod_name(&self, id: &ComputerId) -> Result<String, BackendError> {
        let cluster = self.cluster().await?;
        if cluster.mode == Mode::Pod {
            let adopted = self.adopted_pods().get(id).cloned();
            return Ok(adopted.unwrap_or_else(|| object_name(id)));
        }
        let Some(backing) = self.backing(id).await? else {
            return Err(BackendError::Vanished(id.clone()));
        };
        // A suspended Sandbox (restart, idle stop) or one whose Pod is not made yet: there,
        // but not running.
        backing
            .sandbox
            .as_ref()
            .and_then(Sandbox::pod_name)
            .ok_or_else(|| {
                BackendError::NotRunning(SandboxId::new(backing.meta.uid.unwrap_or_default()))
            })
    }

    /// Sandbox mode: the claim (with `--k8s-warm-pool`) or Sandbox named after `id` when it
    /// is this computer's, and the Sandbox behind it (a claim's once the controller bound one).
    async fn backing(&self, id: &ComputerId) -> Result<Option<Backing>, BackendError> {
        let cluster = self.cluster().await?;
        let name = object_name(id);
        let reading = |e| {
            api_error(
                cluster,
                &format!("Reading the sandbox of computer '{id}'"),
                e,
            )
        };
        if self.config.warm_pool.is_some()
            && let Some(claim) = cluster
                .sandbox_claims
                .get_opt(&name)
                .await
                .map_err(reading)?
            && let Some(recipe) = Recipe::read(&claim.metadata, &self.config.image)
            && recipe.computer_id == *id
        {
            let sandbox = match claim.sandbox_name() {
                Some(bound) => cluster.sandboxes.get_opt(bound).await.map_err(reading)?,
                None => None,
            };
            return Ok(Some(Backing {
                recipe,
                meta: claim.metadata,
                claimed: true,
                sandbox,
            }));
        }
        let Some(sandbox) = cluster.sandboxes.get_opt(&name).await.map_err(reading)? else {
            return Ok(None);
        };
        Ok(Recipe::read(&sandbox.metadata, &self.config.image)
            .filter(|recipe| recipe.computer_id == *id)
            .map(|recipe| Backing {
                recipe,
                meta: sandbox.metadata.clone(),
                claimed: false,
                sandbox: Some(sandbox),
            }))
    }

    /// The home PVC's name: the object name in pod mode, the name agent-sandbox gives the
    /// `home` volume claim template's PVC in sandbox mode.
    fn home_name(cluster: &Cluster, id: &ComputerId) -> String {
        match cluster.mode {
            Mode::Pod => object_name(id),
            Mode::Sandbox => claim_of_template(HOME_VOLUME, &object_name(id)),
        }
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
            .get_opt(&Self::home_name(cluster, id))
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
        // Before anything that runs: the Pod must never run without its policy.
        self.ensure_network_policy(cluster, recipe).await?;
        if cluster.mode == Mode::Sandbox {
            self.make_sandbox(cluster, recipe, with_home, progress)
                .await?;
            let sandbox = self.wait_running(id).await?;
            self.readiness(&sandbox).await?;
            return Ok(sandbox);
        }
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

    /// Makes the NetworkPolicy of `recipe`'s egress policy, when it has one (docs/kubernetes.md,
    /// "Egress"); one of this computer's that is there already (a restart) is kept.
    async fn ensure_network_policy(
        &self,
        cluster: &Cluster,
        recipe: &Recipe,
    ) -> Result<(), BackendError> {
        let id = &recipe.computer_id;
        let policy = recipe.egress_policy().map_err(|e| {
            BackendError::Provider(format!(
                "Computer '{id}' has an unreadable egress policy: {e}"
            ))
        })?;
        let Some(policy) = policy else {
            return Ok(());
        };
        let rules = egress::egress_rules(&policy).map_err(|why| {
            BackendError::Provider(format!(
                "Cannot create computer '{id}': a Kubernetes NetworkPolicy cannot enforce its egress policy: {why}."
            ))
        })?;
        let Some(rules) = rules else {
            return Ok(());
        };
        if cluster.mode == Mode::Sandbox && self.config.warm_pool.is_some() && recipe.temporary {
            // A warm pool's Pod runs before it is claimed, and what labels it gets then is the
            // controller's: no policy could be in place first.
            return Err(BackendError::Provider(format!(
                "Cannot create computer '{id}' with egress rules: it would be claimed from the warm pool, whose Pods run before any NetworkPolicy of ours; start the server without --k8s-warm-pool to use egress rules."
            )));
        }
        let meta = recipe.object_metadata();
        let name = object_name(id);
        let made = egress::network_policy(meta, &name, rules);
        match cluster
            .network_policies
            .create(&PostParams::default(), &made)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 => {
                let existing = cluster.network_policies.get(&name).await.map_err(|e| {
                    api_error(
                        cluster,
                        &format!("Reading the NetworkPolicy of computer '{id}'"),
                        e,
                    )
                })?;
                match Recipe::read(&existing.metadata, &self.config.image) {
                    Some(theirs) if theirs.computer_id == *id => Ok(()),
                    _ => Err(name_taken(cluster, id, "NetworkPolicy")),
                }
            }
            Err(e) => Err(api_error(
                cluster,
                &format!("Creating the NetworkPolicy of computer '{id}'"),
                e,
            )),
        }
    }

    /// Deletes the NetworkPolicy of `id`, after its Pods are gone. Not there is fine; so is a
    /// refusal (403) when the server's own policy needs none, since then the startup check
    /// never asked for the permission and no policy of this server's can be there unless a
    /// computer narrowed its egress, whose create would have failed on the same refusal.
    async fn delete_network_policy(&self, id: &ComputerId) -> Result<(), BackendError> {
        let cluster = self.cluster().await?;
        match cluster
            .network_policies
            .delete(&object_name(id), &delete_now())
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(kube::Error::Api(status))
                if status.code == 403 && self.egress_policy.is_unfiltered() =>
            {
                Ok(())
            }
            Err(e) => Err(api_error(
                cluster,
                &format!("Deleting the NetworkPolicy of computer '{id}'"),
                e,
            )),
        }
    }

    /// Sandbox mode: the Sandbox (or claim) of `recipe`, with pod mode's Pod spec (or
    /// `--k8s-template`'s) as its pod template.
    async fn make_sandbox(
        &self,
        cluster: &Cluster,
        recipe: &Recipe,
        with_home: bool,
        progress: &dyn Progress,
    ) -> Result<(), BackendError> {
        let id = &recipe.computer_id;
        progress.report(1.0, None, format!("Starting Kubernetes sandbox for {id}…"));
        let shutdown = || shutdown_time_in(TEMPORARY_DEADLINE_SECS);
        let (created, kind) = match (&self.config.warm_pool, recipe.temporary) {
            (Some(pool), true) => (
                cluster
                    .sandbox_claims
                    .create(&PostParams::default(), &recipe.claim(pool, shutdown()))
                    .await
                    .map(|_| ()),
                "SandboxClaim",
            ),
            _ => {
                let pod = match &cluster.template {
                    Some(template) => {
                        let mut spec = template.spec.clone();
                        // The template is the cluster's; the server's rule that no token
                        // reaches a computer holds on it too.
                        spec.automount_service_account_token = Some(false);
                        if with_home && let Some(main) = spec.containers.first_mut() {
                            main.volume_mounts
                                .get_or_insert_with(Vec::new)
                                .push(home_mount());
                        }
                        spec
                    }
                    None => recipe.pod_spec(
                        &self.config,
                        &self.shell,
                        if with_home {
                            Home::FromTemplate
                        } else {
                            Home::None
                        },
                    ),
                };
                let storage = self.config.storage.as_deref().filter(|_| with_home);
                let sandbox = recipe.sandbox(pod, storage, recipe.temporary.then(shutdown));
                (
                    cluster
                        .sandboxes
                        .create(&PostParams::default(), &sandbox)
                        .await
                        .map(|_| ()),
                    "Sandbox",
                )
            }
        };
        match created {
            Ok(()) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 => {
                if self.backing(id).await?.is_none() {
                    return Err(name_taken(cluster, id, kind));
                }
                Ok(())
            }
            Err(e) => Err(api_error(
                cluster,
                &format!("Creating the {kind} of computer '{id}'"),
                e,
            )),
        }
    }

    /// Sandbox mode: asks the Sandbox behind `id` to run or to be suspended.
    async fn set_operating_mode(&self, id: &ComputerId, mode: &str) -> Result<(), BackendError> {
        let cluster = self.cluster().await?;
        let Some(name) = self
            .backing(id)
            .await?
            .and_then(|b| b.sandbox)
            .and_then(|s| s.metadata.name)
        else {
            return Err(BackendError::Vanished(id.clone()));
        };
        cluster
            .sandboxes
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&operating_mode_patch(mode)),
            )
            .await
            .map_err(|e| {
                api_error(
                    cluster,
                    &format!("Setting the sandbox of computer '{id}' to {mode}"),
                    e,
                )
            })?;
        Ok(())
    }

    /// Polls the Pod of `id` until it runs; fails early on what waiting cannot fix. In
    /// sandbox mode the controller makes the Pod after the Sandbox, so a missing Pod is
    /// waited for while the Sandbox is there.
    async fn wait_running(&self, id: &ComputerId) -> Result<SandboxRef, BackendError> {
        let cluster = self.cluster().await?;
        let deadline = Instant::now() + POD_START_TIMEOUT;
        loop {
            let Some((pod, recipe)) = self.pod_of(id).await? else {
                if cluster.mode == Mode::Sandbox
                    && Instant::now() < deadline
                    && self.backing(id).await?.is_some()
                {
                    tokio::time::sleep(POLL).await;
                    continue;
                }
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

    /// The shell answers, and the exec helper is put in meanwhile (as on Docker, where it is
    /// uploaded during the start), so the first command only connects it.
    async fn readiness(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let transport = PodTransport(self);
        let (ready, ()) = tokio::join!(
            self.shell_answers(sandbox),
            self.helpers.install(&transport, sandbox)
        );
        ready
    }

    /// `<shell> -c 'echo <marker>'` must print the marker.
    async fn shell_answers(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        let cluster = self.cluster().await?;
        let name = self.pod_name(&sandbox.computer_id).await?;
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

    /// Sandbox mode: suspends the Sandbox of `id` and waits until the controller has ended its
    /// Pod (its PVCs stay).
    async fn suspend(&self, id: &ComputerId) -> Result<(), BackendError> {
        self.set_operating_mode(id, SUSPENDED).await?;
        self.wait_gone(id, "Pod", || async { Ok(self.pod_of(id).await?.is_some()) })
            .await
    }

    /// Deletes the Pod of `id` (no grace: the computer's processes are ours to end) and waits
    /// until it is gone, so its name can be used again.
    async fn delete_pod(&self, id: &ComputerId) -> Result<(), BackendError> {
        let cluster = self.cluster().await?;
        let Some(name) = self
            .pod_of(id)
            .await?
            .and_then(|(pod, _)| pod.metadata.name)
        else {
            return Ok(());
        };
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
            .await?;
        self.adopted_pods().remove(id);
        Ok(())
    }

    async fn delete_claim(&self, id: &ComputerId) -> Result<(), BackendError> {
        let cluster = self.cluster().await?;
        if self.claim_of(id).await?.is_none() {
            return Ok(());
        }
        match cluster
            .claims
            .delete(&Self::home_name(cluster, id), &delete_now())
            .await
        {
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
        let cluster = self.cluster().await?;
        if cluster.mode == Mode::Sandbox {
            let Some(backing) = self.backing(id).await? else {
                return Ok(None);
            };
            return Ok(Some(match self.pod_of(id).await? {
                Some((pod, _)) => {
                    let running =
                        pod_runs(&pod) && !backing.sandbox.as_ref().is_some_and(Sandbox::suspended);
                    (backing.recipe, pod.metadata, running)
                }
                None => (backing.recipe, backing.meta, false),
            }));
        }
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
            &self.pod_name(&sandbox.computer_id).await?,
            argv,
            None,
            &mut out,
            &CancellationToken::new(),
        )
        .await
        .map(|_| ())
        .map_err(|e| self.exec_failure(cluster, sandbox, e))
    }

    /// What a helper connection lost during a command means: the computer went away or
    /// stopped under it, or only the helper ended (the next command starts a new one).
    async fn helper_lost(&self, sandbox: &SandboxRef, reason: &str) -> BackendError {
        self.helpers.forget(sandbox.sandbox_id.as_str());
        match self.recipe_of(&sandbox.computer_id).await {
            Ok(None) => BackendError::Vanished(sandbox.computer_id.clone()),
            Ok(Some((_, _, false))) => BackendError::DiedDuringExec(sandbox.sandbox_id.clone()),
            _ => BackendError::Provider(format!(
                "The exec helper in the Pod of computer '{}' stopped during the command ({reason}); the command was interrupted. Running it again starts a new helper.",
                sandbox.computer_id
            )),
        }
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

impl KubernetesBackend {
    /// Deletes every object of `id` and waits until they are gone, so its name can be used
    /// again (factory reset makes the computer anew right after).
    async fn remove_computer(&self, id: &ComputerId) -> Result<(), BackendError> {
        let cluster = self.cluster().await?;
        if cluster.mode == Mode::Pod {
            self.delete_pod(id).await?;
            self.delete_claim(id).await?;
            return self.delete_network_policy(id).await;
        }
        if let Some(backing) = self.backing(id).await? {
            let name = object_name(id);
            let deleted = if backing.claimed {
                cluster
                    .sandbox_claims
                    .delete(&name, &delete_now())
                    .await
                    .map(|_| ())
            } else {
                cluster
                    .sandboxes
                    .delete(&name, &delete_now())
                    .await
                    .map(|_| ())
            };
            match deleted {
                Ok(()) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(e) => {
                    return Err(api_error(
                        cluster,
                        &format!("Deleting the sandbox of computer '{id}'"),
                        e,
                    ));
                }
            }
            self.wait_gone(id, "sandbox", || async {
                Ok(self.backing(id).await?.is_some())
            })
            .await?;
        }
        // agent-sandbox may keep a volume claim template's PVC after its Sandbox; the home is
        // the computer's, so it goes with it.
        self.delete_claim(id).await?;
        self.delete_network_policy(id).await
    }

    /// The recipe on `meta` when it is a temporary computer of a server instance in `dead`.
    fn orphan(&self, meta: &ObjectMeta, dead: &HashSet<InstanceId>) -> Option<Recipe> {
        let recipe = Recipe::read(meta, &self.config.image)?;
        let instance = recipe.instance.as_deref().and_then(InstanceId::parse)?;
        dead.contains(&instance).then_some(recipe)
    }

    /// The metadata a computer's sandbox id comes from, as lookup and create give it: its
    /// Pod's when there is one (an id per incarnation), else its own object's.
    async fn identity(
        &self,
        recipe: &Recipe,
        own: &ObjectMeta,
    ) -> Result<ObjectMeta, BackendError> {
        Ok(match self.pod_of(&recipe.computer_id).await? {
            Some((pod, _)) => pod.metadata,
            None => own.clone(),
        })
    }

    /// Sandbox mode's inventory: the Sandboxes and claims with our label.
    async fn list_sandboxes(
        &self,
        cluster: &Cluster,
        managed: &ListParams,
    ) -> Result<Vec<ComputerInfo>, BackendError> {
        let listing = |e| api_error(cluster, "Listing the computers' sandboxes", e);
        let mut rows = Vec::new();
        for sandbox in cluster
            .sandboxes
            .list(managed)
            .await
            .map_err(listing)?
            .items
        {
            let Some(recipe) = Recipe::read(&sandbox.metadata, &self.config.image) else {
                continue;
            };
            let ready = sandbox.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
            let identity = self.identity(&recipe, &sandbox.metadata).await?;
            rows.push(ComputerInfo {
                sandbox: Self::sandbox_of(&recipe, &identity),
                state: if sandbox.metadata.deletion_timestamp.is_some() {
                    "terminating"
                } else if sandbox.suspended() {
                    "stopped"
                } else if ready {
                    "running"
                } else {
                    "pending"
                }
                .to_owned(),
                created_at: created_at(&sandbox.metadata),
            });
        }
        if self.config.warm_pool.is_some() {
            for claim in cluster
                .sandbox_claims
                .list(managed)
                .await
                .map_err(listing)?
                .items
            {
                let Some(recipe) = Recipe::read(&claim.metadata, &self.config.image) else {
                    continue;
                };
                let identity = self.identity(&recipe, &claim.metadata).await?;
                rows.push(ComputerInfo {
                    sandbox: Self::sandbox_of(&recipe, &identity),
                    state: if claim.sandbox_name().is_some() {
                        "running"
                    } else {
                        "pending"
                    }
                    .to_owned(),
                    created_at: created_at(&claim.metadata),
                });
            }
        }
        Ok(rows)
    }
}

/// How many spares `--warm-pool` keeps: none when the server's egress policy has rules, since
/// a spare's NetworkPolicy could not be in place before it runs as the computer
/// (docs/kubernetes.md, "Warm pool").
fn spares(config: &KubernetesConfig, egress: &EgressPolicy) -> usize {
    if config.spares > 0 && !egress.is_unfiltered() {
        warn!(
            "--warm-pool is not used on the kubernetes backend with egress rules: a computer's NetworkPolicy must be in place before its Pod runs, and a spare runs before it is handed out; every computer is made when asked for"
        );
        return 0;
    }
    config.spares
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

    /// The policy recorded on the computer's objects (docs/kubernetes.md, "Egress").
    async fn egress_policy(
        &self,
        sandbox: &SandboxRef,
    ) -> Result<Option<EgressPolicy>, BackendError> {
        let id = &sandbox.computer_id;
        let Some((recipe, _, _)) = self.recipe_of(id).await? else {
            return Err(BackendError::Vanished(id.clone()));
        };
        recipe
            .egress_policy()
            .map_err(|e| BackendError::Provider(format!("computer '{id}': {e}")))
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
        let pod = self.pod_name(&sandbox.computer_id).await?;
        let mut forwarder = cluster
            .pods
            .portforward(&pod, &[port])
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
            // Recorded on every object of the computer, so a restart, a factory reset or
            // another server process makes the same NetworkPolicy (docs/egress.md, "Recorded").
            egress: Some(spec.egress.as_ref().unwrap_or(&self.egress_policy))
                .filter(|policy| !policy.is_unfiltered())
                .map(EgressPolicy::to_label),
        };
        if let Some(spare) = self.pool.take(self, &recipe).await {
            return Ok(spare);
        }
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
        // left: make the Pod again from what its objects recorded. In sandbox mode the
        // controller makes it again once the Sandbox runs and the ended Pod is gone.
        info!(computer_id = %id, "recreating the Pod of a computer that is not running");
        self.delete_pod(id).await?;
        if self.cluster().await?.mode == Mode::Sandbox {
            self.set_operating_mode(id, RUNNING).await?;
            let current = self.wait_running(id).await?;
            self.readiness(&current).await?;
            return Ok(current);
        }
        self.make(&recipe, &kilntainers_backend::NoProgress).await
    }

    async fn list(&self) -> Result<Vec<ComputerInfo>, BackendError> {
        let cluster = self.cluster().await?;
        let managed = ListParams::default().labels(&format!("{}=true", keys::MANAGED));
        if cluster.mode == Mode::Sandbox {
            return self.list_sandboxes(cluster, &managed).await;
        }
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
            if pool::is_waiting_spare(&recipe, pod.metadata.labels.as_ref()) {
                continue;
            }
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
        // The helper dies with the Pod; the next command connects a new one.
        self.helpers.forget(sandbox.sandbox_id.as_str());
        let Some((recipe, _, _)) = self.recipe_of(id).await? else {
            return Err(BackendError::Vanished(id.clone()));
        };
        let restarted = if self.cluster().await?.mode == Mode::Sandbox {
            // Suspend (the controller ends the Pod, the PVC stays), then run again.
            self.suspend(id).await?;
            self.set_operating_mode(id, RUNNING).await?;
            let current = self.wait_running(id).await?;
            self.readiness(&current).await?;
            current
        } else {
            self.delete_pod(id).await?;
            self.make(&recipe, &kilntainers_backend::NoProgress).await?
        };
        Ok(Restarted {
            sandbox: restarted,
            state_preserved: !recipe.temporary && self.config.storage.is_some(),
        })
    }

    async fn remove(&self, sandbox: &SandboxRef) -> Result<(), BackendError> {
        self.helpers.forget(sandbox.sandbox_id.as_str());
        self.remove_computer(&sandbox.computer_id).await
    }

    async fn exec(
        &self,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Result<ExecEnd, BackendError> {
        let cluster = self.cluster().await?;
        match self
            .helpers
            .run(&PodTransport(self), sandbox, spec, &[], sink, cancel)
            .await
        {
            Some(Ok(end)) => return Ok(end),
            Some(Err(Lost(reason))) => return Err(self.helper_lost(sandbox, &reason).await),
            None => {}
        }
        let argv = vec![
            self.shell.clone(),
            "-c".to_owned(),
            exec::wrapper_script(spec),
        ];
        let ran = exec::run(
            &cluster.pods,
            &self.pod_name(&sandbox.computer_id).await?,
            argv,
            spec.stdin.as_deref(),
            sink,
            cancel,
        )
        .await;
        match ran {
            Ok(end) => Ok(end),
            Err(error) => {
                // Tell a computer that went away or stopped from a failed stream. One whose
                // Pod is gone but whose volume or Sandbox is left (idle stop, a lost node) is
                // stopped, not gone: the registry starts it again.
                match self.recipe_of(&sandbox.computer_id).await {
                    Ok(None) => Err(BackendError::Vanished(sandbox.computer_id.clone())),
                    Ok(Some((_, _, false))) => {
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

    /// A stopped computer keeps only its home volume (docs/kubernetes.md, "Idle stop"), so
    /// without one (`--k8s-storage 0`) stopping it would lose all of it.
    fn idle_stop(&self) -> IdleStop {
        if self.config.storage.is_none() {
            return IdleStop::Refused(
                "--idle-stop is not available on the kubernetes backend without a home volume: a stopped computer keeps only its volume, and --k8s-storage 0 gives it none. Give --k8s-storage a size, or leave --idle-stop off."
                    .to_owned(),
            );
        }
        IdleStop::Stops
    }

    /// Ends the computer's Pod and keeps its objects: pod mode deletes the Pod (the PVC, the
    /// NetworkPolicy and their labels stay, and the next start makes the Pod again from them);
    /// sandbox mode suspends the Sandbox, as a restart does before it runs again.
    async fn stop_idle(&self, sandbox: &SandboxRef) -> Result<IdleStopped, BackendError> {
        let id = &sandbox.computer_id;
        if self.recipe_of(id).await?.is_none() {
            return Err(BackendError::Vanished(id.clone()));
        }
        self.helpers.forget(sandbox.sandbox_id.as_str());
        if self.cluster().await?.mode == Mode::Sandbox {
            self.suspend(id).await?;
        } else {
            self.delete_pod(id).await?;
        }
        info!(computer_id = %id, "Pod ended by idle stop; the home volume stays");
        Ok(IdleStopped::Stopped)
    }

    async fn keep_warm(&self, instance: &InstanceId) {
        self.pool.keep(self, instance).await;
    }

    fn warm_pool(&self) -> Option<WarmPoolSize> {
        self.pool.size()
    }

    async fn release_spares(&self) -> Result<(), BackendError> {
        self.pool.release(self).await
    }

    async fn kill_exec(&self, sandbox: &SandboxRef, exec_id: &ExecId) -> Result<(), BackendError> {
        if self
            .helpers
            .kill(sandbox, exec_id.env_entry())
            .await
            .is_some()
        {
            return Ok(());
        }
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
        let listing = |e| api_error(cluster, "Listing temporary computers for crash GC", e);
        let metas: Vec<ObjectMeta> = match cluster.mode {
            Mode::Pod => (cluster.pods.list(&temporary).await.map_err(listing)?.items)
                .into_iter()
                .map(|pod| pod.metadata)
                .collect(),
            Mode::Sandbox => {
                let mut metas: Vec<ObjectMeta> = (cluster.sandboxes.list(&temporary).await)
                    .map_err(listing)?
                    .items
                    .into_iter()
                    .map(|sandbox| sandbox.metadata)
                    .collect();
                if self.config.warm_pool.is_some() {
                    metas.extend(
                        (cluster.sandbox_claims.list(&temporary).await)
                            .map_err(listing)?
                            .items
                            .into_iter()
                            .map(|claim| claim.metadata),
                    );
                }
                metas
            }
        };
        let mut removed = Vec::new();
        for meta in metas {
            let Some(recipe) = self.orphan(&meta, dead) else {
                continue;
            };
            match self.remove_computer(&recipe.computer_id).await {
                Ok(()) => removed.push(recipe.computer_id),
                Err(e) => {
                    warn!(computer_id = %recipe.computer_id, error = %e, "crash GC could not delete a computer")
                }
            }
        }
        // A server that died between a computer's NetworkPolicy and its Pod left the policy
        // alone; listed only when this server makes policies (and may list them).
        if !self.egress_policy.is_unfiltered() {
            let policies = (cluster.network_policies.list(&temporary).await)
                .map_err(|e| api_error(cluster, "Listing NetworkPolicies for crash GC", e))?;
            for policy in policies.items {
                let Some(recipe) = self.orphan(&policy.metadata, dead) else {
                    continue;
                };
                if !removed.contains(&recipe.computer_id)
                    && let Err(e) = self.delete_network_policy(&recipe.computer_id).await
                {
                    warn!(computer_id = %recipe.computer_id, error = %e, "crash GC could not delete a NetworkPolicy");
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
