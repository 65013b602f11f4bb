//! Container creation (docs/decisions.md, "Docker and Podman"): pull when missing (single-flight per image, with
//! progress), create with our labels and limits, start, check it stayed up, readiness. Any
//! failure after the container exists removes it, temporary or permanent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, StartContainerOptions,
};
use futures_util::StreamExt;
use tracing::info;

use super::{DockerBackend, describe, is_running, status_of};
use crate::backends::labels::{docker as label, format_bool};
use crate::backends::posix::keep_alive_argv;
use crate::backends::{Backend, BackendError, CreateSpec, Progress, SandboxRef};

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
    let image = spec
        .image
        .clone()
        .unwrap_or_else(|| backend.config.image.clone());
    ensure_image(backend, &image, progress).await?;
    // The semaphore is never closed, so acquiring only waits.
    let _turn = backend.starts.acquire().await.ok();
    let docker = backend.client().await?;
    let name = DockerBackend::container_name(&spec.computer_id);
    let mut options = CreateContainerOptionsBuilder::default().name(&name);
    if let Some(platform) = &backend.config.run_flags.platform {
        options = options.platform(platform);
    }
    let created = match docker
        .create_container(Some(options.build()), container_body(backend, spec, &image))
        .await
    {
        Ok(created) => created,
        Err(e) if status_of(&e) == Some(409) => {
            // Another server created it between our lookup and create: attach instead.
            let found = backend
                .lookup(&spec.computer_id)
                .await?
                .ok_or_else(|| BackendError::Vanished(spec.computer_id.clone()))?;
            return backend.ensure_running(&found.sandbox).await;
        }
        Err(e) => {
            return Err(BackendError::Provider(format!(
                "Docker could not create a container for computer '{}': {}",
                spec.computer_id,
                describe(&e)
            )));
        }
    };
    let sandbox = SandboxRef {
        computer_id: spec.computer_id.clone(),
        sandbox_id: created.id.chars().take(12).collect(),
        temporary: spec.temporary,
        image,
    };
    match start(backend, &sandbox).await {
        Ok(()) => Ok(sandbox),
        Err(error) => {
            // Never leave a half-made computer behind, permanent ones included.
            backend.helpers.forget(&sandbox.sandbox_id);
            let _ = backend.remove_container(&created.id).await;
            Err(error)
        }
    }
}

async fn start(backend: &DockerBackend, sandbox: &SandboxRef) -> Result<(), BackendError> {
    let docker = backend.client().await?;
    // The exec helper's upload (~1.5 MB) overlaps the start: readiness needs both, and neither
    // needs the other.
    let (started, ()) = tokio::join!(
        docker.start_container(&sandbox.sandbox_id, None::<StartContainerOptions>),
        backend.helpers.install(docker, sandbox),
    );
    started.map_err(|e| {
        BackendError::Provider(format!(
            "Docker start of container {} failed: {}",
            sandbox.sandbox_id,
            describe(&e)
        ))
    })?;
    match backend.inspect(&sandbox.sandbox_id).await? {
        Some(inspect) if is_running(&inspect) => backend.readiness(sandbox).await,
        _ => Err(backend.exited_immediately(&sandbox.sandbox_id)),
    }
}

fn container_body(backend: &DockerBackend, spec: &CreateSpec, image: &str) -> ContainerCreateBody {
    let config = &backend.config;
    let mut labels = HashMap::from([
        (label::MANAGED.to_owned(), "true".to_owned()),
        (label::COMPUTER_ID.to_owned(), spec.computer_id.to_string()),
        (
            label::TEMPORARY.to_owned(),
            format_bool(spec.temporary).to_owned(),
        ),
        (label::IMAGE.to_owned(), image.to_owned()),
    ]);
    if spec.temporary {
        labels.insert(label::INSTANCE.to_owned(), spec.instance.to_string());
    }
    let mut body = ContainerCreateBody {
        image: Some(image.to_owned()),
        cmd: Some(keep_alive_argv(&backend.shell)),
        // An image entrypoint must not wrap or replace the keep-alive.
        entrypoint: Some(vec![String::new()]),
        labels: Some(labels),
        tty: Some(false),
        open_stdin: Some(false),
        host_config: Some(HostConfig {
            auto_remove: Some(spec.temporary),
            network_mode: (!backend.network).then(|| "none".to_owned()),
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
    body
}

/// Inspects the image and pulls it when missing, once per image however many callers wait.
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
    let options = CreateImageOptionsBuilder::default()
        .from_image(image)
        .build();
    let mut stream = docker.create_image(Some(options), None, None);
    let mut layers: HashMap<String, Layer> = HashMap::new();
    while let Some(item) = stream.next().await {
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
        let done = layers.values().filter(|l| l.complete).count();
        let current: i64 = layers.values().map(|l| l.current).sum();
        let total: i64 = layers.values().map(|l| l.total).sum();
        progress.report(
            current as f64,
            (total > 0).then_some(total as f64),
            format!("Pulling {image}: {done}/{} layers complete", layers.len()),
        );
    }
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

/// Pull state of one layer, for progress totals and one log line per status change.
#[derive(Default)]
struct Layer {
    status: String,
    current: i64,
    total: i64,
    complete: bool,
}
