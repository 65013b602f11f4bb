//! The warm pool (docs/warm-pool.md): started spare containers of the configured image, limits
//! and runtime, their exec helper already connected, handed out as temporary computers by a
//! rename. One keeper task refills the pool within the backend's limit on parallel starts; a
//! spare that stopped, was started again or changed name behind our back is removed, never
//! handed out.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bollard::models::ContainerInspectResponse;
use bollard::query_parameters::RenameContainerOptionsBuilder;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::create::{self, Made};
use super::{DockerBackend, describe, is_running, status_of};
use kilntainers_backend::ids::{ComputerId, InstanceId, Principal};
use kilntainers_backend::labels::docker as label;
use kilntainers_backend::{BackendError, SandboxRef, WarmPoolSize};

/// The first wait after a spare could not be made; doubled per failure in a row up to
/// [`MAX_RETRY_DELAY`], so a missing image or a stopped engine is not hammered.
const FIRST_RETRY_DELAY: Duration = Duration::from_secs(1);
const MAX_RETRY_DELAY: Duration = Duration::from_secs(60);

pub(super) struct WarmPool {
    target: usize,
    state: Mutex<PoolState>,
    /// Wakes the keeper: a spare was taken, or the pool is closing.
    wake: Notify,
    /// Held by the keeper while it runs, so [`WarmPool::release`] can wait for its last fills.
    keeper: tokio::sync::Mutex<()>,
    /// Computers being created because no spare was ready. While there are any, the keeper
    /// starts no new spare: a refill would only queue behind them for the engine, and make
    /// the waiting sessions wait longer.
    creating: AtomicUsize,
}

/// Counts one creation the pool could not serve, for as long as it lives.
pub(super) struct Creating<'a>(&'a WarmPool);

impl Drop for Creating<'_> {
    fn drop(&mut self) {
        if self.0.creating.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.wake.notify_one();
        }
    }
}

#[derive(Default)]
struct PoolState {
    ready: VecDeque<Made>,
    /// No more spares are made or handed out: shutdown, or an engine that cannot rename.
    closing: bool,
}

/// What became of a spare offered to a computer.
enum Adoption {
    Adopted(SandboxRef),
    /// The computer's name is taken (another server made it meanwhile); the spare is still good.
    NameTaken,
    /// The engine could not be asked; the spare may still be good.
    EngineTrouble,
    /// Not fit to be a computer; it is removed.
    Unfit(String),
    /// This engine cannot rename containers: the pool turns itself off.
    CannotRename(String),
}

impl WarmPool {
    pub(super) fn new(target: usize) -> Self {
        Self {
            target,
            state: Mutex::new(PoolState::default()),
            wake: Notify::new(),
            keeper: tokio::sync::Mutex::new(()),
            creating: AtomicUsize::new(0),
        }
    }

    /// Whether a creation the pool could not serve is under way.
    pub(super) fn is_busy(&self) -> bool {
        self.creating.load(Ordering::SeqCst) > 0
    }

    /// Marks a creation the pool could not serve; refills wait until the last one is done.
    pub(super) fn creating(&self) -> Creating<'_> {
        self.creating.fetch_add(1, Ordering::SeqCst);
        Creating(self)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `None` when there is no pool (`--warm-pool 0`).
    pub(super) fn size(&self) -> Option<WarmPoolSize> {
        (self.target > 0).then(|| WarmPoolSize {
            ready: self.state().ready.len(),
            target: self.target,
        })
    }

    /// Makes spares until the pool is full, again whenever one is taken and no creation is
    /// waiting, until the pool closes; then waits for the spares still being made.
    pub(super) async fn keep(&self, backend: &DockerBackend, instance: &InstanceId) {
        if self.target == 0 {
            return;
        }
        let _keeping = self.keeper.lock().await;
        let mut fills = FuturesUnordered::new();
        let mut failures: u32 = 0;
        let mut retry_at: Option<Instant> = None;
        loop {
            let (closing, ready) = {
                let state = self.state();
                (state.closing, state.ready.len())
            };
            if closing {
                break;
            }
            if !self.is_busy() && retry_at.is_none_or(|at| at <= Instant::now()) {
                retry_at = None;
                for _ in ready + fills.len()..self.target {
                    fills.push(create::spare(backend, instance));
                }
            }
            tokio::select! {
                Some(made) = fills.next() => match made {
                    // Deferred for a creation; its end wakes the keeper.
                    Ok(None) => {}
                    Ok(Some(spare)) => {
                        failures = 0;
                        debug!(container = %spare.sandbox.sandbox_id, "spare ready");
                        // Kept even when the pool just closed: `release` removes it and
                        // reports a failure, so a spare is never lost track of.
                        self.state().ready.push_back(spare);
                    }
                    Err(error) => {
                        failures = failures.saturating_add(1);
                        let delay = FIRST_RETRY_DELAY
                            .saturating_mul(1 << failures.min(6).saturating_sub(1))
                            .min(MAX_RETRY_DELAY);
                        warn!(%error, retry_in_secs = delay.as_secs(), "could not make a warm-pool spare");
                        retry_at = Some(Instant::now() + delay);
                    }
                },
                () = self.wake.notified() => {}
                () = sleep_until(retry_at), if retry_at.is_some() => {}
            }
        }
        // What is still being made joins the ready spares, which `release` removes.
        while let Some(made) = fills.next().await {
            if let Ok(Some(spare)) = made {
                self.state().ready.push_back(spare);
            }
        }
    }

    /// A ready spare made into computer `id` (renamed `kilntainer-<id>`), or `None` when no fit
    /// spare is ready; unfit ones met on the way are removed.
    pub(super) async fn take(
        &self,
        backend: &DockerBackend,
        id: &ComputerId,
        owner: &Principal,
    ) -> Option<SandboxRef> {
        loop {
            let spare = {
                let mut state = self.state();
                if state.closing {
                    return None;
                }
                state.ready.pop_front()?
            };
            self.wake.notify_one();
            match adopt(backend, &spare, id, owner).await {
                Adoption::Adopted(sandbox) => {
                    info!(computer_id = %id, sandbox_id = %sandbox.sandbox_id, "handed out a warm-pool spare");
                    return Some(sandbox);
                }
                Adoption::NameTaken | Adoption::EngineTrouble => {
                    self.state().ready.push_front(spare);
                    return None;
                }
                Adoption::Unfit(reason) => {
                    warn!(container = %spare.sandbox.sandbox_id, %reason, "warm-pool spare removed instead of handed out");
                    let _ = discard(backend, &spare).await;
                }
                Adoption::CannotRename(reason) => {
                    warn!(%reason, "the engine cannot rename containers; the warm pool is off");
                    let left: Vec<Made> = {
                        let mut state = self.state();
                        state.closing = true;
                        state.ready.drain(..).collect()
                    };
                    self.wake.notify_one();
                    for spare in std::iter::once(&spare).chain(&left) {
                        let _ = discard(backend, spare).await;
                    }
                    return None;
                }
            }
        }
    }

    /// Shutdown: no more spares; waits for the keeper's last fills, then removes every spare.
    /// Returns the first removal that failed.
    pub(super) async fn release(&self, backend: &DockerBackend) -> Result<(), BackendError> {
        if self.target == 0 {
            return Ok(());
        }
        self.state().closing = true;
        self.wake.notify_one();
        drop(self.keeper.lock().await);
        let left: Vec<Made> = self.state().ready.drain(..).collect();
        let mut outcome = Ok(());
        for spare in &left {
            outcome = outcome.and(discard(backend, spare).await);
        }
        outcome
    }
}

/// Checks that `spare` is still the container it was made as, moves it to its owner's network
/// (docs/auth.md, "Network"), then renames it to computer `id`.
async fn adopt(
    backend: &DockerBackend,
    spare: &Made,
    id: &ComputerId,
    owner: &Principal,
) -> Adoption {
    let container = &spare.sandbox.sandbox_id;
    let inspect = match backend.inspect(container.as_str()).await {
        Ok(Some(inspect)) => inspect,
        Ok(None) => return Adoption::Unfit("it no longer exists".to_owned()),
        Err(error) => {
            debug!(%error, "could not inspect a warm-pool spare");
            return Adoption::EngineTrouble;
        }
    };
    if let Err(reason) = still_as_made(&inspect, spare) {
        return Adoption::Unfit(reason);
    }
    let Ok(docker) = backend.client().await else {
        return Adoption::EngineTrouble;
    };
    if let Err(error) = backend
        .networks
        .hand_over(docker, container.as_str(), owner)
        .await
    {
        return Adoption::Unfit(error.to_string());
    }
    let options = RenameContainerOptionsBuilder::default()
        .name(&DockerBackend::container_name(id))
        .build();
    match docker.rename_container(container.as_str(), options).await {
        Ok(()) => {
            // Behind its owner's proxy now: the proxy learns its address and policy, and the
            // computer where its proxy is (docs/warm-pool.md, "Egress").
            if backend.networks.egress() {
                let attached = match backend.inspect(container.as_str()).await {
                    Ok(Some(inspect)) => backend.egress_attach(&inspect).await,
                    Ok(None) => return Adoption::Unfit("it vanished after the rename".to_owned()),
                    Err(error) => Err(error),
                };
                if let Err(error) = attached {
                    return Adoption::Unfit(error.to_string());
                }
            }
            Adoption::Adopted(SandboxRef {
                computer_id: id.clone(),
                sandbox_id: container.clone(),
                temporary: true,
                image: spare.sandbox.image.clone(),
            })
        }
        Err(e) => match status_of(&e) {
            Some(404) => Adoption::Unfit("it vanished before the rename".to_owned()),
            Some(409) => Adoption::NameTaken,
            Some(_) => Adoption::CannotRename(describe(&e)),
            None => Adoption::EngineTrouble,
        },
    }
}

/// The spare is running, was not started again, and still has its spare name and label.
fn still_as_made(inspect: &ContainerInspectResponse, spare: &Made) -> Result<(), String> {
    let state = inspect.state.as_ref();
    if !is_running(inspect) || state.and_then(|s| s.paused).unwrap_or(false) {
        return Err("it is not running".to_owned());
    }
    if state.and_then(|s| s.started_at.as_ref()) != spare.started_at.as_ref() {
        return Err("it was started again since it was made".to_owned());
    }
    if inspect.name.as_deref().map(|n| n.trim_start_matches('/')) != Some(spare.name.as_str()) {
        return Err("its name changed".to_owned());
    }
    let labels = inspect.config.as_ref().and_then(|c| c.labels.as_ref());
    if labels
        .and_then(|l| l.get(label::POOLED))
        .map(String::as_str)
        != Some("true")
    {
        return Err("it is not a spare".to_owned());
    }
    Ok(())
}

/// Removes a spare; a failure is logged and returned (shutdown reports it).
async fn discard(backend: &DockerBackend, spare: &Made) -> Result<(), BackendError> {
    backend.helpers.forget(spare.sandbox.sandbox_id.as_str());
    let removed = backend
        .remove_container(spare.sandbox.sandbox_id.as_str())
        .await;
    if let Err(error) = &removed {
        warn!(container = %spare.sandbox.sandbox_id, %error, "could not remove a warm-pool spare");
    }
    removed
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
