//! The computer registry: which computers this process holds, for whom, and the per-computer
//! locks that order lifecycle operations and execs (docs/decisions.md, "Acquiring a computer").
//!
//! Provider labels are the ground truth; a record here is a cache that exists only while some
//! session holds the computer (no zero-owner records, docs/decisions.md, "Sessions, holders and leases"). No global lock is held across
//! provider I/O: the map lock is synchronous and short, and each computer has its own slot.
//!
//! **Architecture invariant:** no MCP types and no provider names; everything provider-side
//! goes through `dyn Backend`, everything about running a command through [`crate::exec`].
//!
//! Files: `slots.rs` (a computer's locks and state, the slot map), `acquire.rs` (session default,
//! named and random ids, attach or create), `execute.rs` (the FIFO exec turn, restart-once on a
//! stopped computer), `lifecycle.rs` (list, restart, reset, delete), `checkpoints.rs`
//! (checkpoint, rollback, fork), `leases.rs` (sessionless
//! holds), `shutdown.rs` (session close, shutdown sweep), `quotas.rs` (per-principal limits),
//! `sessions.rs`, `orphans.rs`.
//!
//! Computers are per principal (docs/auth.md): every id handled here is already scoped to its
//! owner, and a session acts only on ids of its own principal.

mod acquire;
pub mod checkpoints;
mod execute;
mod idle;
mod leases;
mod lifecycle;
pub mod orphans;
mod quotas;
mod sessions;
mod shutdown;
mod slots;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

pub use acquire::Unnamed;
pub use idle::{AwakeGuard, BusyCheck};
pub use sessions::Session;

use crate::backends::{Backend, BackendError, NoProgress, Progress, SandboxRef};
use crate::config::{ExecLimits, Quotas};
use crate::exec::ExecOutcome;
use crate::ids::{ComputerId, InstanceId, Principal};
use slots::{Slot, lock};

/// A lifecycle operation that interrupts an exec in flight (docs/decisions.md, "Lifecycle operations").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interruption {
    Restart,
    Reset,
    Delete,
    /// `computer_rollback` (docs/checkpoints.md).
    Rollback,
}

impl Interruption {
    fn verb(self) -> &'static str {
        match self {
            Self::Restart => "restarted",
            Self::Reset => "reset",
            Self::Delete => "deleted",
            Self::Rollback => "rolled back",
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum RegistryError {
    #[error("Computer '{}' is already attached with temporary={temporary}.", .id.slug())]
    AlreadyAttached { id: ComputerId, temporary: bool },
    #[error(
        "Computer '{}' already exists with temporary={temporary}; lifecycle mode cannot be changed without a factory reset or delete.",
        .id.slug()
    )]
    ModeFixed { id: ComputerId, temporary: bool },
    #[error(
        "Computer '{}' already exists with temporary={actual}; requested temporary={requested}.",
        .id.slug()
    )]
    ModeConflict {
        id: ComputerId,
        actual: bool,
        requested: bool,
    },
    /// A per-principal limit; the message names it and what to do.
    #[error("{0}")]
    QuotaReached(String),
    /// The provider could not list the principal's computers, so a limit cannot be checked;
    /// the creation or start is refused rather than let past the limit.
    #[error(
        "Cannot check your computer limits now, so nothing was created or started: {0}. Try again shortly."
    )]
    QuotaUnknown(String),
    #[error("Could not generate an unused computer_id; pass one explicitly.")]
    NoFreeId,
    #[error("The server is shutting down; computer '{}' was not started.", .0.slug())]
    ShuttingDown(ComputerId),
    #[error("Computer '{}' was not found.", .0.slug())]
    NotFound(ComputerId),
    #[error(
        "Computer '{}' already exists; its egress policy was fixed when it was created, so computer_create's egress cannot change it.",
        .0.slug()
    )]
    EgressFixed(ComputerId),
    #[error("Command interrupted because computer '{}' is being {}.", .id.slug(), .op.verb())]
    Interrupted { id: ComputerId, op: Interruption },
    /// The client cancelled the call; no result is expected.
    #[error("cancelled")]
    Cancelled,
    /// A checkpoint tool's refusal (docs/checkpoints.md), already phrased for the user.
    #[error("{0}")]
    Checkpoint(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// A successful exec together with the computer it ran on.
pub struct Executed {
    pub sandbox: SandboxRef,
    pub outcome: ExecOutcome,
}

pub struct Registry {
    backend: Arc<dyn Backend>,
    instance: InstanceId,
    shell: String,
    limits: ExecLimits,
    slots: Mutex<HashMap<ComputerId, Arc<Slot>>>,
    sessions: Mutex<HashMap<u64, Weak<Session>>>,
    next_session: std::sync::atomic::AtomicU64,
    /// Set when shutdown starts: no computer is created or attached after that.
    closing: std::sync::atomic::AtomicBool,
    /// Called with the id of every computer this process removed provider-side.
    removal_hooks: Mutex<Vec<RemovalHook>>,
    quotas: quotas::QuotaGate,
    /// `--max-checkpoints` (docs/checkpoints.md).
    max_checkpoints: std::sync::atomic::AtomicUsize,
    /// `--checkpoint-tools`: a removed computer's checkpoints go with it.
    checkpoints_on: std::sync::atomic::AtomicBool,
    /// Set by `--idle-stop` (docs/idle-stop.md).
    idle: std::sync::OnceLock<Arc<idle::IdleClock>>,
}

/// See [`Registry::on_removed`].
pub type RemovalHook = Box<dyn Fn(&ComputerId, Removal) + Send + Sync>;

/// What happened to a computer's provider object, for [`Registry::on_removed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// Deleted, or a temporary computer let go: the id is free.
    Gone,
    /// Factory reset: the same id, a new computer with none of the old one's processes or
    /// files.
    Replaced,
    /// Rollback to a checkpoint (docs/checkpoints.md): the same id, a new computer with the
    /// checkpoint's files and none of the old one's processes; port forwards close.
    RolledBack,
}

impl Registry {
    pub fn new(
        backend: Arc<dyn Backend>,
        instance: InstanceId,
        shell: String,
        limits: ExecLimits,
        quotas: Quotas,
    ) -> Arc<Self> {
        Arc::new(Self {
            backend,
            instance,
            shell,
            limits,
            slots: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            next_session: std::sync::atomic::AtomicU64::new(1),
            closing: std::sync::atomic::AtomicBool::new(false),
            removal_hooks: Mutex::new(Vec::new()),
            quotas: quotas::QuotaGate::new(quotas),
            max_checkpoints: std::sync::atomic::AtomicUsize::new(
                checkpoints::DEFAULT_MAX_CHECKPOINTS,
            ),
            checkpoints_on: std::sync::atomic::AtomicBool::new(false),
            idle: std::sync::OnceLock::new(),
        })
    }

    /// Registers `hook` to run, synchronously and briefly, after this process removes a
    /// computer provider-side (delete, a temporary computer let go, or a factory reset's old
    /// incarnation): what lives as long as a computer (a port forwarder) or as its processes
    /// (its jobs) ends with it.
    pub fn on_removed(&self, hook: RemovalHook) {
        lock(&self.removal_hooks).push(hook);
    }

    fn removed(&self, id: &ComputerId, how: Removal) {
        if let Some(clock) = self.idle.get() {
            clock.forget(id);
        }
        for hook in lock(&self.removal_hooks).iter() {
            hook(id, how);
        }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn limits(&self) -> ExecLimits {
        self.limits
    }

    /// The shell commands run under (`--shell`).
    pub fn shell(&self) -> &str {
        &self.shell
    }

    /// Opens a session acting for `principal`; call [`Registry::close_session`] when it ends.
    pub fn open_session(&self, principal: Principal) -> Arc<Session> {
        let id = self
            .next_session
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let session = Arc::new(Session::new(id, None, principal));
        lock(&self.sessions).insert(id, Arc::downgrade(&session));
        session
    }

    /// The sessions an egress question about computer `id` may go to, best first
    /// (docs/egress.md, "Ask-to-allow"): the session whose call runs on it now; then the live
    /// sessions holding it, most recently opened first; then the other live sessions of its
    /// owner, most recently opened first.
    pub fn egress_audience(&self, id: &ComputerId) -> Vec<u64> {
        let mut audience = Vec::new();
        let slot = lock(&self.slots).get(id).cloned();
        if let Some(slot) = slot {
            let state = lock(&slot.state);
            audience.extend(state.in_flight.as_ref().map(|f| f.session));
            let mut holders: Vec<u64> = state.owners.iter().copied().collect();
            holders.sort_unstable_by(|a, b| b.cmp(a));
            audience.extend(holders);
        }
        let mut owners: Vec<u64> = lock(&self.sessions)
            .iter()
            .filter_map(|(sid, weak)| {
                let session = weak.upgrade()?;
                (session.lease_ttl.is_none() && id.belongs_to(session.principal())).then_some(*sid)
            })
            .collect();
        owners.sort_unstable_by(|a, b| b.cmp(a));
        audience.extend(owners);
        let mut seen = std::collections::HashSet::new();
        audience.retain(|sid| seen.insert(*sid));
        audience
    }

    /// A holder for one sessionless request: computers it touches are kept alive by a lease of
    /// `ttl`, renewed on every use (docs/decisions.md, "Sessions, holders and leases"). Nothing needs closing afterwards.
    pub fn sessionless(&self, ttl: Duration, principal: Principal) -> Arc<Session> {
        let id = self
            .next_session
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Arc::new(Session::new(id, Some(ttl), principal))
    }

    /// For callers without progress reporting.
    pub fn no_progress() -> &'static dyn Progress {
        &NoProgress
    }
}
