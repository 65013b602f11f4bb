//! Idle stop (docs/idle-stop.md): a permanent computer nobody has used for `--idle-stop` is
//! stopped, and started again by its next use through the path of any stopped computer.
//!
//! Only *use* resets a computer's clock: a command or file operation (the exec turn), a job
//! start, an open port forward, a lifecycle operation. Listing, `computer_network`, dashboard
//! polling and `job_list` read without touching, so a client that polls every second does not
//! keep a forgotten computer running. What is in progress holds the computer awake: work in
//! its exec turn and open port forwards through [`AwakeGuard`], running jobs through the check
//! the caller of [`Registry::stop_idle_computers`] passes in. Times are tokio's, so the unit
//! tests run under paused time.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use tracing::{info, warn};

use super::{Registry, lock};
use crate::backends::{BackendError, IdleStopped, SandboxRef};
use crate::ids::ComputerId;
use crate::jobs::Jobs;

/// Whether a computer has work the registry cannot see (a running job); see
/// [`Registry::stop_idle_computers`].
pub type BusyCheck = dyn Fn(SandboxRef) -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync;

/// The clocks of the permanent computers this process has seen, by id.
pub(super) struct IdleClock {
    after: Duration,
    marks: Mutex<HashMap<ComputerId, Mark>>,
}

struct Mark {
    sandbox: SandboxRef,
    last_use: Instant,
    /// Work holding the computer awake now ([`AwakeGuard`]s alive).
    awake: u32,
}

impl IdleClock {
    pub(super) fn new(after: Duration) -> Arc<Self> {
        Arc::new(Self {
            after,
            marks: Mutex::new(HashMap::new()),
        })
    }

    fn touch(&self, sandbox: &SandboxRef) {
        if sandbox.temporary {
            return;
        }
        let now = Instant::now();
        let mut marks = lock(&self.marks);
        let mark = marks
            .entry(sandbox.computer_id.clone())
            .or_insert_with(|| Mark {
                sandbox: sandbox.clone(),
                last_use: now,
                awake: 0,
            });
        mark.sandbox = sandbox.clone();
        mark.last_use = now;
    }

    /// Starts the clock of a running permanent computer first seen now, without resetting
    /// one that runs already: seeing a computer is not using it.
    fn notice(&self, sandbox: &SandboxRef) {
        if sandbox.temporary {
            return;
        }
        lock(&self.marks)
            .entry(sandbox.computer_id.clone())
            .or_insert_with(|| Mark {
                sandbox: sandbox.clone(),
                last_use: Instant::now(),
                awake: 0,
            });
    }

    pub(super) fn forget(&self, id: &ComputerId) {
        lock(&self.marks).remove(id);
    }

    /// The computers whose time is up, nothing holding them awake.
    fn expired(&self) -> Vec<SandboxRef> {
        let now = Instant::now();
        lock(&self.marks)
            .values()
            .filter(|mark| mark.awake == 0 && mark.last_use + self.after <= now)
            .map(|mark| mark.sandbox.clone())
            .collect()
    }

    fn deadline(&self, id: &ComputerId) -> Option<SystemTime> {
        let marks = lock(&self.marks);
        let mark = marks.get(id)?;
        let left = (mark.last_use + self.after).saturating_duration_since(Instant::now());
        Some(SystemTime::now() + left)
    }
}

/// Holds a computer awake while alive; its drop counts as use. Inert without `--idle-stop`
/// and for temporary computers.
pub struct AwakeGuard {
    hold: Option<(Arc<IdleClock>, SandboxRef)>,
}

impl Drop for AwakeGuard {
    fn drop(&mut self) {
        if let Some((clock, sandbox)) = self.hold.take() {
            if let Some(mark) = lock(&clock.marks).get_mut(&sandbox.computer_id) {
                mark.awake = mark.awake.saturating_sub(1);
            }
            clock.touch(&sandbox);
        }
    }
}

impl Registry {
    /// Turns idle stop on (`--idle-stop`); once, at startup.
    pub fn enable_idle_stop(&self, after: Duration) {
        let _ = self.idle.set(IdleClock::new(after));
    }

    /// Turns idle stop on and runs its rounds in the background until the server shuts down.
    /// With `jobs`, a computer with a running job is busy (docs/jobs.md: jobs outlive calls).
    pub fn start_idle_stop(self: &Arc<Self>, after: Duration, jobs: Option<Arc<Jobs>>) {
        self.enable_idle_stop(after);
        let Some(tick) = self.idle_tick() else {
            return;
        };
        let registry = Arc::downgrade(self);
        let busy: Box<BusyCheck> = Box::new(move |sandbox| {
            let jobs = jobs.clone();
            Box::pin(async move { runs_a_job(jobs.as_deref(), &sandbox).await })
        });
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(tick).await;
                let Some(registry) = registry.upgrade() else {
                    return;
                };
                if registry.closing.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
                registry.stop_idle_computers(&busy).await;
            }
        });
    }

    /// How often [`Self::stop_idle_computers`] should run: often enough that a computer is
    /// stopped within its duration plus 10 s (docs/idle-stop.md), rarely enough to cost nothing.
    pub fn idle_tick(&self) -> Option<Duration> {
        let after = self.idle.get()?.after;
        Some((after / 4).clamp(Duration::from_millis(250), Duration::from_secs(5)))
    }

    /// Records a use of the computer now (a no-op without `--idle-stop`).
    pub fn touch(&self, sandbox: &SandboxRef) {
        if let Some(clock) = self.idle.get() {
            clock.touch(sandbox);
        }
    }

    /// Holds the computer awake until the guard drops (then counts as a use).
    pub fn keep_awake(&self, sandbox: &SandboxRef) -> AwakeGuard {
        let Some(clock) = self.idle.get().filter(|_| !sandbox.temporary) else {
            return AwakeGuard { hold: None };
        };
        clock.touch(sandbox);
        if let Some(mark) = lock(&clock.marks).get_mut(&sandbox.computer_id) {
            mark.awake += 1;
        }
        AwakeGuard {
            hold: Some((clock.clone(), sandbox.clone())),
        }
    }

    /// When the computer will be stopped if nobody uses it, for `computer_list`'s
    /// `idle_stop_at`; `None` without `--idle-stop`, for a temporary computer, or one whose
    /// clock this process has not started.
    pub fn idle_stop_at(&self, id: &ComputerId) -> Option<SystemTime> {
        self.idle.get()?.deadline(id)
    }

    /// One round of idle stop: starts the clocks of the running permanent computers the
    /// provider lists that this process has not seen, then stops those whose time is up.
    /// `busy` answers whether a computer still has work the registry cannot see (a running
    /// job); a busy computer's clock starts again. A computer whose locks are taken (a
    /// command, a lifecycle operation) is left for the next round.
    pub async fn stop_idle_computers(&self, busy: &BusyCheck) {
        let Some(clock) = self.idle.get() else {
            return;
        };
        match self.backend.list().await {
            Ok(rows) => {
                for row in rows.iter().filter(|row| row.state == "running") {
                    clock.notice(&row.sandbox);
                }
            }
            Err(error) => warn!(%error, "idle stop: cannot list computers"),
        }
        for sandbox in clock.expired() {
            self.stop_if_still_idle(clock, &sandbox, busy).await;
        }
    }

    async fn stop_if_still_idle(&self, clock: &IdleClock, sandbox: &SandboxRef, busy: &BusyCheck) {
        let id = &sandbox.computer_id;
        let slot = self.slot(id);
        let stopped = async {
            let Ok(_lifecycle) = slot.lifecycle.try_lock() else {
                return None;
            };
            let Ok(_exec) = slot.exec.try_lock() else {
                return None;
            };
            // Used while we took the locks, or held awake since.
            if !clock.expired().iter().any(|s| &s.computer_id == id) {
                return None;
            }
            if busy(sandbox.clone()).await {
                clock.touch(sandbox);
                return None;
            }
            Some(self.backend.stop_idle(sandbox).await)
        }
        .await;
        drop(slot);
        self.prune_slot(id);
        match stopped {
            None => {}
            Some(Ok(IdleStopped::Stopped)) => {
                clock.forget(id);
                info!(computer_id = %id, "stopped after {:?} without use (--idle-stop)", clock.after);
            }
            Some(Ok(IdleStopped::InUseElsewhere)) => {
                // Another server's work: a full period again before the next look.
                clock.touch(sandbox);
                info!(computer_id = %id, "not stopped: another server is using it");
            }
            Some(Err(BackendError::Vanished(_))) => clock.forget(id),
            Some(Err(error)) => {
                // Tried again after another full period rather than every round.
                clock.touch(sandbox);
                warn!(computer_id = %id, %error, "idle stop failed");
            }
        }
    }
}

/// Whether a job runs in the computer, as its own ledger says. A computer that cannot be asked
/// counts as busy: stopping it would end whatever job it might be running.
async fn runs_a_job(jobs: Option<&Jobs>, sandbox: &SandboxRef) -> bool {
    let Some(jobs) = jobs else {
        return false;
    };
    match jobs
        .list(sandbox, &tokio_util::sync::CancellationToken::new())
        .await
    {
        Ok(listing) => listing.jobs.iter().any(|job| job.running),
        Err(error) => {
            warn!(computer_id = %sandbox.computer_id, %error, "idle stop: cannot list the computer's jobs; not stopping it");
            true
        }
    }
}
