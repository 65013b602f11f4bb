//! Container creation (docs/decisions.md, "Docker and Podman"): pull when missing (single-flight per image, with
//! progress), create with our labels and limits, start, check it stayed up, readiness. Any
//! failure after the container exists removes it, temporary or permanent. A temporary computer
//! of the configured image is a warm-pool spare renamed when one is ready ([`super::pool`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bollard::models::{ContainerCreateBody, HostConfig, Mount, MountType};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, StartContainerOptions,
};
use futures_util::StreamExt;
use tracing::{info, warn};

use super::helper::DockerTransport;
use super::{DockerBackend, describe, is_running, status_of};
use kilntainers_backend::ids::{ComputerId, InstanceId, Principal, SandboxId};
use kilntainers_backend::labels::{docker as label, format_bool};
use kilntainers_backend::posix::keep_alive_argv;
use kilntainers_backend::{Backend, BackendError, CreateSpec, NoProgress, Progress, SandboxRef};

/// Container creations that talk to the engine at once. Two hundred simultaneous first calls
/// (the HTTP bench) made dockerd take longer than the 30 s API timeout for single starts on a
/// 2-core host, failing most of them; queued here, they wait their turn and succeed.
pub(super) const PARALLEL_STARTS: usize = 8;

/// One lock per image reference so concurrent creates pull once (docs/decisions.md, "Concurrency").
#[derive(Default)]
pub(super) struct PullGate {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl PullGate {
    fn lock_for(&self, image: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self
            .locks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        locks.entry(image.to_owned()).or_default().clone()
    }
}

pub(super) async fn create(
    backend: &DockerBackend,
    spec: &CreateSpec,
    progress: &dyn Progress,
) -> Result<SandboxRef, BackendError> {
    create_from(backend, spec, None, progress).await
}

/// A computer made from a local image other than its base image (a checkpoint's,
/// docs/checkpoints.md), with extra labels; the base image stays recorded for a factory reset.
pub(super) struct LocalImage {
    pub reference: String,
    pub labels: HashMap<String, String>,
}

/// [`create`], or with `local` a computer of a checkpoint image: never a spare, never pulled.
pub(super) async fn create_from(
    backend: &DockerBackend,
    spec: &CreateSpec,
    local: Option<LocalImage>,
    progress: &dyn Progress,
) -> Result<SandboxRef, BackendError> {
    let image = spec
        .image
        .clone()
        .unwrap_or_else(|| backend.config.image.clone());
    // Spares are temporary containers of the configured image with the server's egress
    // policy, which their labels record from birth (docs/warm-pool.md).
    let from_pool =
        spec.temporary && image == backend.config.image && local.is_none() && spec.egress.is_none();
    let owner = spec
        .owner
        .clone()
        .unwrap_or_else(Principal::default_principal);
    if from_pool && let Some(sandbox) = backend.pool.take(backend, &spec.computer_id, &owner).await
    {
        return Ok(sandbox);
    }
    // Refills wait while sessions wait for creations (a burst): they would compete with them.
    let _creating = from_pool.then(|| backend.pool.creating());
    if local.is_none() {
        ensure_image(backend, &image, progress).await?;
    }
    // The semaphore is never closed, so acquiring only waits.
    let _turn = backend.starts.acquire().await.ok();
    // A spare may have become ready while this waited for its turn.
    if from_pool && let Some(sandbox) = backend.pool.take(backend, &spec.computer_id, &owner).await
    {
        return Ok(sandbox);
    }
    let mut labels = HashMap::from([
        (label::MANAGED.to_owned(), "true".to_owned()),
        (label::COMPUTER_ID.to_owned(), spec.computer_id.to_string()),
        (
            label::TEMPORARY.to_owned(),
            format_bool(spec.temporary).to_owned(),
        ),
        (label::IMAGE.to_owned(), image.clone()),
    ]);
    if let Some(owner) = &spec.owner {
        labels.insert(label::OWNER.to_owned(), owner.to_string());
    }
    if spec.temporary {
        labels.insert(label::INSTANCE.to_owned(), spec.instance.to_string());
    }
    let run_image = match local {
        Some(local) => {
            labels.extend(local.labels);
            Some(local.reference)
        }
        None => None,
    };
    if backend.networks.egress() {
        // Recorded so that the proxy gets it again after a restart (docs/egress.md, "Recorded").
        let policy = spec.egress.as_ref().unwrap_or(&backend.egress_policy);
        labels.insert(label::EGRESS.to_owned(), policy.to_label());
    }
    let name = DockerBackend::container_name(&spec.computer_id);
    let docker = backend.client().await?;
    // Another server on the engine may remove the owner's network between our finding it
    // and the container's creation, when it removed that owner's last computer: ask again.
    let mut attempts = 0;
    let made = loop {
        attempts += 1;
        let placement = backend
            .networks
            .place(docker, &owner, &spec.instance)
            .await?;
        let proxy = match (&placement.proxy, &placement.socket_volume) {
            (Some(_), Some(volume)) => Some(ProxyAt::Socket(volume.clone())),
            (Some(proxy), None) if placement.also_join.is_some() => {
                Some(ProxyAt::Beside(proxy.address))
            }
            (Some(proxy), None) => Some(ProxyAt::Address(proxy.address)),
            (None, _) => None,
        };
        let mut labels = labels.clone();
        if placement.socket_volume.is_some() {
            labels.insert(
                super::egress::TOKEN_LABEL.to_owned(),
                super::egress::new_token(),
            );
        }
        let wanted = Wanted {
            name: &name,
            computer_id: &spec.computer_id,
            temporary: spec.temporary,
            image: image.clone(),
            run_image: run_image.clone(),
            labels,
            network_mode: placement.network_mode.clone(),
            also_join: placement.also_join.clone(),
            proxy,
        };
        match new_container(backend, wanted).await {
            Err(Refused::NetworkMissing(_)) if attempts < 2 => continue,
            other => break other,
        }
    };
    match made {
        Ok(made) => Ok(made.sandbox),
        Err(Refused::NameTaken) => {
            // Another server created it between our lookup and create: attach instead.
            let found = backend
                .lookup(&spec.computer_id)
                .await?
                .ok_or_else(|| BackendError::Vanished(spec.computer_id.clone()))?;
            backend.ensure_running(&found.sandbox).await
        }
        Err(Refused::Failed(error) | Refused::NetworkMissing(error)) => Err(error),
    }
}

/// A started container that is not a computer yet: a warm-pool spare of the configured image,
/// labelled as a temporary container of `instance` without a computer id, and named so that no
/// computer lookup finds it (docs/warm-pool.md, "Labels"). `None`: not made, because a
/// computer's creation was waiting when this one's turn came.
pub(super) async fn spare(
    backend: &DockerBackend,
    instance: &InstanceId,
) -> Result<Option<Made>, BackendError> {
    let image = backend.config.image.clone();
    ensure_image(backend, &image, &NoProgress).await?;
    let _turn = backend.starts.acquire().await.ok();
    if backend.pool.is_busy() {
        return Ok(None);
    }
    let suffix = InstanceId::random();
    let name = format!("{}{suffix}", label::SPARE_NAME_PREFIX);
    // Only for log lines and messages about the spare; the container carries no id.
    let placeholder = ComputerId::parse(&format!("spare-{suffix}"))
        .map_err(|e| BackendError::Provider(e.to_string()))?;
    let mut labels = HashMap::from([
        (label::MANAGED.to_owned(), "true".to_owned()),
        (label::TEMPORARY.to_owned(), format_bool(true).to_owned()),
        (label::IMAGE.to_owned(), image.clone()),
        (label::INSTANCE.to_owned(), instance.to_string()),
        (label::POOLED.to_owned(), "true".to_owned()),
    ]);
    // Behind the proxy once handed out, with the server's policy (docs/warm-pool.md, "Egress").
    let egress = backend.networks.egress();
    if egress {
        labels.insert(label::EGRESS.to_owned(), backend.egress_policy.to_label());
    }
    let docker = backend.client().await?;
    let placement = backend.networks.place_spare(docker, instance).await?;
    let wanted = Wanted {
        name: &name,
        computer_id: &placeholder,
        temporary: true,
        image,
        run_image: None,
        labels,
        network_mode: placement.network_mode.clone(),
        also_join: None,
        proxy: egress.then_some(ProxyAt::Named),
    };
    let made = new_container(backend, wanted).await;
    drop(placement);
    match made {
        Ok(made) => Ok(Some(made)),
        Err(Refused::NameTaken) => Err(BackendError::Provider(format!(
            "Docker name '{name}' is already in use."
        ))),
        Err(Refused::Failed(error) | Refused::NetworkMissing(error)) => Err(error),
    }
}

/// The container [`new_container`] makes.
struct Wanted<'a> {
    name: &'a str,
    computer_id: &'a ComputerId,
    /// Removed by the engine when it stops (`AutoRemove`), and in crash GC's reach.
    temporary: bool,
    image: String,
    /// The image the container runs when it is not `image` (a checkpoint's).
    run_image: Option<String>,
    labels: HashMap<String, String>,
    /// `HostConfig.NetworkMode` ([`super::networks::Placement`]).
    network_mode: Option<String>,
    /// A second network joined before the start: the proxy's, in open mode with secrets.
    also_join: Option<String>,
    /// Where the computer finds its egress proxy: its DNS server and HTTP proxy.
    proxy: Option<ProxyAt>,
}

/// How a new container is told where its egress proxy is.
enum ProxyAt {
    /// The proxy's address on the network it is made on.
    Address(std::net::IpAddr),
    /// A warm-pool spare's: [`super::egress::PROXY_HOST`], pointed at the proxy of its owner's
    /// network when it is handed out (docs/warm-pool.md, "Egress").
    Named,
    /// Socket wiring: the volume of the proxy's socket, mounted read-only; the computer has no
    /// network, and its relay listens on its loopback (docs/egress.md, "Socket wiring").
    Socket(String),
    /// Open mode with secrets: the proxy's address on its network, which the computer joins
    /// beside its own; only the proxy settings name it, and names resolve as without it
    /// (docs/secrets.md, "Egress modes").
    Beside(std::net::IpAddr),
}

/// A container made and started, with its readiness checked.
pub(super) struct Made {
    pub sandbox: SandboxRef,
    pub name: String,
    /// `State.StartedAt` after the start: a spare started again since is not handed out.
    pub started_at: Option<String>,
}

enum Refused {
    /// The name belongs to another container.
    NameTaken,
    /// The network it was to join is gone (removed by another server since it was found).
    NetworkMissing(BackendError),
    Failed(BackendError),
}

/// The engine's refusal `e`, told as `error`: [`Refused::NetworkMissing`] when the network it
/// names is not there (another server removed it meanwhile), so the computer is placed again.
fn refused(e: &bollard::errors::Error, error: BackendError) -> Refused {
    if status_of(e) == Some(404) && describe(e).contains("network") {
        Refused::NetworkMissing(error)
    } else {
        Refused::Failed(error)
    }
}

/// Creates and starts one container; any failure after it exists removes it.
async fn new_container(backend: &DockerBackend, wanted: Wanted<'_>) -> Result<Made, Refused> {
    let docker = backend.client().await.map_err(Refused::Failed)?;
    let mut options = CreateContainerOptionsBuilder::default().name(wanted.name);
    if let Some(platform) = &backend.config.run_flags.platform {
        options = options.platform(platform);
    }
    let body = container_body(backend, &wanted);
    let created = match docker.create_container(Some(options.build()), body).await {
        Ok(created) => created,
        Err(e) if status_of(&e) == Some(409) => return Err(Refused::NameTaken),
        Err(e) => {
            let error = BackendError::Provider(format!(
                "Docker could not create a container for computer '{}': {}",
                wanted.computer_id,
                describe(&e)
            ));
            return Err(refused(&e, error));
        }
    };
    if let Some(network) = &wanted.also_join {
        let joined = docker
            .connect_network(
                network,
                bollard::models::NetworkConnectRequest {
                    container: created.id.clone(),
                    ..Default::default()
                },
            )
            .await;
        if let Err(e) = joined {
            let _ = backend.remove_container(&created.id).await;
            let error = BackendError::Provider(format!(
                "Docker could not join computer '{}' to its egress proxy's network: {}",
                wanted.computer_id,
                describe(&e)
            ));
            return Err(refused(&e, error));
        }
    }
    let sandbox = SandboxRef {
        computer_id: wanted.computer_id.clone(),
        sandbox_id: SandboxId::new(created.id.chars().take(12).collect::<String>()),
        temporary: wanted.temporary,
        image: wanted.image,
    };
    match start(backend, &sandbox).await {
        Ok(started_at) => Ok(Made {
            sandbox,
            name: wanted.name.to_owned(),
            started_at,
        }),
        Err(refused) => {
            // Never leave a half-made computer behind, permanent ones included.
            backend.helpers.forget(sandbox.sandbox_id.as_str());
            let _ = backend.remove_container(&created.id).await;
            Err(refused)
        }
    }
}

/// Starts a created container and checks readiness; returns its `State.StartedAt`. The
/// engine starts a container on the networks it names only then, so another server's removal
/// of the owner's network after the creation shows here, as [`Refused::NetworkMissing`].
async fn start(backend: &DockerBackend, sandbox: &SandboxRef) -> Result<Option<String>, Refused> {
    let docker = backend.client().await.map_err(Refused::Failed)?;
    // The exec helper's upload (~1.5 MB) overlaps the start: readiness needs both, and neither
    // needs the other.
    let transport = DockerTransport(docker);
    let (started, ()) = tokio::join!(
        docker.start_container(sandbox.sandbox_id.as_str(), None::<StartContainerOptions>),
        backend.helpers.install(&transport, sandbox),
    );
    if let Err(e) = started {
        let error = BackendError::Provider(format!(
            "Docker start of container {} failed: {}",
            sandbox.sandbox_id,
            describe(&e)
        ));
        return Err(refused(&e, error));
    }
    let ready = async {
        match backend.inspect(sandbox.sandbox_id.as_str()).await? {
            Some(inspect) if is_running(&inspect) => {
                backend.egress_attach(&inspect).await?;
                backend.readiness(sandbox).await?;
                Ok(inspect.state.and_then(|s| s.started_at))
            }
            _ => Err(backend.exited_immediately(sandbox.sandbox_id.as_str())),
        }
    };
    ready.await.map_err(Refused::Failed)
}

fn container_body(backend: &DockerBackend, wanted: &Wanted<'_>) -> ContainerCreateBody {
    let config = &backend.config;
    let mut body = ContainerCreateBody {
        image: Some(
            wanted
                .run_image
                .clone()
                .unwrap_or_else(|| wanted.image.clone()),
        ),
        cmd: Some(keep_alive_argv(&backend.shell)),
        // An image entrypoint must not wrap or replace the keep-alive.
        entrypoint: Some(vec![String::new()]),
        labels: Some(wanted.labels.clone()),
        tty: Some(false),
        open_stdin: Some(false),
        host_config: Some(HostConfig {
            auto_remove: Some(wanted.temporary),
            network_mode: wanted.network_mode.clone(),
            // Raw sockets let a computer forge ARP and take over a neighbour's address
            // (docs/auth.md, "Network"); the run flags can give the capability back.
            cap_drop: (!config.run_flags.grants_net_raw()).then(|| vec!["NET_RAW".to_owned()]),
            nano_cpus: config.nano_cpus,
            memory: config.memory_bytes,
            pids_limit: config.pids_limit,
            security_opt: Some(config.security_opts.clone()),
            runtime: config.runtime.clone(),
            ..Default::default()
        }),
        ..Default::default()
    };
    super::run_flags_api::apply_run_flags(&config.run_flags, &mut body);
    // After the run flags, so that none of them points the computer elsewhere.
    match &wanted.proxy {
        Some(ProxyAt::Address(proxy)) => {
            if let Some(host) = body.host_config.as_mut() {
                host.dns = Some(vec![proxy.to_string()]);
                host.dns_search = Some(Vec::new());
            }
            body.env
                .get_or_insert_default()
                .extend(super::egress::proxy_env(&super::egress::proxy_url_host(
                    *proxy,
                )));
        }
        Some(ProxyAt::Beside(proxy)) => {
            body.env
                .get_or_insert_default()
                .extend(super::egress::proxy_env(&super::egress::proxy_url_host(
                    *proxy,
                )));
        }
        Some(ProxyAt::Named) => {
            body.env
                .get_or_insert_default()
                .extend(super::egress::proxy_env(super::egress::PROXY_HOST));
        }
        Some(ProxyAt::Socket(volume)) => {
            if let Some(host) = body.host_config.as_mut() {
                // No network whatever the run flags said: the relay is the only way out.
                host.network_mode = Some("none".to_owned());
                host.mounts.get_or_insert_default().push(Mount {
                    target: Some(super::egress::SOCKET_DIR.to_owned()),
                    source: Some(volume.clone()),
                    typ: Some(MountType::VOLUME),
                    read_only: Some(true),
                    ..Default::default()
                });
            }
            body.env
                .get_or_insert_default()
                .extend(super::egress::proxy_env(super::egress::RELAY_HOST));
        }
        None => {}
    }
    body
}

/// Inspects the image and pulls it when missing, once per image however many callers wait. A
/// pull the engine reports no progress of for `--pull-timeout` is given up (a registry that
/// accepts connections and never answers would otherwise hold the call for good); dropping the
/// stream closes the request, and the engine abandons the pull.
async fn ensure_image(
    backend: &DockerBackend,
    image: &str,
    progress: &dyn Progress,
) -> Result<(), BackendError> {
    let docker = backend.client().await?;
    if docker.inspect_image(image).await.is_ok() {
        return Ok(());
    }
    let gate = backend.pulls.lock_for(image);
    let _pulling = gate.lock().await;
    // Someone else may have pulled it while we waited.
    if docker.inspect_image(image).await.is_ok() {
        return Ok(());
    }
    let pull_failed = |detail: String| {
        BackendError::Provider(format!(
            "Failed to pull image '{image}'. Check that the image name is correct and the registry is reachable.\n{detail}\n\
             To use another image, start the server with --image <name> (any image with a POSIX shell; one already on the engine is used without a pull)."
        ))
    };
    eprintln!("kilntainers: image {image} is not on the engine yet; pulling it (first use only)");
    let started = std::time::Instant::now();
    let idle = backend.config.pull_timeout;
    let options = CreateImageOptionsBuilder::default()
        .from_image(image)
        .build();
    let mut stream = docker.create_image(Some(options), None, None);
    let mut layers: HashMap<String, Layer> = HashMap::new();
    loop {
        let item = match tokio::time::timeout(idle, stream.next()).await {
            Ok(Some(item)) => item,
            Ok(None) => break,
            Err(_) => {
                let secs = idle.as_secs();
                eprintln!("kilntainers: pull of {image} given up: no progress for {secs} s");
                warn!(image, secs, "pull stalled");
                return Err(pull_failed(format!(
                    "The engine reported no progress for {secs} s (--pull-timeout); the registry may be unreachable or too slow."
                )));
            }
        };
        let info = item.map_err(|e| pull_failed(describe(&e)))?;
        if let Some(detail) = info.error_detail.and_then(|d| d.message) {
            return Err(pull_failed(detail));
        }
        let (Some(layer_id), Some(status)) = (info.id, info.status) else {
            continue;
        };
        // "Pulling from <repository>" carries the tag as its id: not a layer.
        if status.starts_with("Pulling from") {
            continue;
        }
        let layer = layers.entry(layer_id.clone()).or_default();
        if let Some(detail) = info.progress_detail {
            layer.current = detail.current.unwrap_or(layer.current);
            layer.total = detail.total.unwrap_or(layer.total);
        }
        if layer.status != status {
            eprintln!("kilntainers: pulling {image}: {layer_id} {status}");
            layer.complete =
                status.starts_with("Pull complete") || status.starts_with("Already exists");
            layer.status = status;
        }
        report_pull(progress, image, &layers);
    }
    // Podman ends its layers at "Download complete", Docker at "Pull complete": once the
    // engine ends the stream without an error, every layer is in.
    for layer in layers.values_mut() {
        layer.complete = true;
    }
    report_pull(progress, image, &layers);
    eprintln!(
        "kilntainers: pulled {image} ({} layers) in {:.1} s",
        layers.len(),
        started.elapsed().as_secs_f64()
    );
    info!(image, "pulled");
    docker
        .inspect_image(image)
        .await
        .map(drop)
        .map_err(|e| pull_failed(describe(&e)))
}

/// One progress report of a pull: bytes so far over the known total, and layers complete.
fn report_pull(progress: &dyn Progress, image: &str, layers: &HashMap<String, Layer>) {
    let done = layers.values().filter(|l| l.complete).count();
    let current: i64 = layers.values().map(|l| l.current).sum();
    let total: i64 = layers.values().map(|l| l.total).sum();
    progress.report(
        current as f64,
        (total > 0).then_some(total as f64),
        format!("Pulling {image}: {done}/{} layers complete", layers.len()),
    );
}

/// Pull state of one layer, for progress totals and one log line per status change.
#[derive(Default)]
struct Layer {
    status: String,
    current: i64,
    total: i64,
    complete: bool,
}
