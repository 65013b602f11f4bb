//! The computer registry: which computers this process holds, for whom, and the per-computer
//! locks that order lifecycle operations and execs (`lifecycle.md` §3, §5, §7).
//!
//! Provider labels are the ground truth; a record here is a cache that exists only while some
//! session holds the computer (no zero-owner records, D9). No global lock is held across
//! provider I/O: the map lock is synchronous and short, and each computer has its own slot.
//!
//! **Architecture invariant:** no MCP types and no provider names; everything provider-side
//! goes through `dyn Backend`, everything about running a command through [`crate::exec`].

pub mod orphans;
mod sessions;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{info, instrument, warn};

pub use sessions::Session;

use crate::backends::{
    Backend, BackendError, ComputerInfo, CreateSpec, NoProgress, Progress, SandboxRef,
};
use crate::config::ExecLimits;
use crate::exec::{self, ExecError, ExecOutcome, ExecRequest};
use crate::ids::{ComputerId, ExecId, InstanceId};

/// Random slugs drawn before giving up (`lifecycle.md` §1).
const RANDOM_ID_TRIES: usize = 8;
/// Temporary computers removed at once during shutdown (`lifecycle.md` §8).
const SHUTDOWN_PARALLEL_REMOVALS: usize = 16;

/// Where a computer id came from, which decides whether the provider must be asked for it.
#[derive(Clone, Copy)]
enum Origin {
    /// Named by the caller (or remembered): it may exist provider-side; look it up.
    Named,
    /// Freshly drawn and just looked up as unused: go straight to create. A racing creator
    /// still ends in an attach through the backend's name conflict handling.
    CheckedFree,
}

/// A lifecycle operation that interrupts an exec in flight (`lifecycle.md` §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interruption {
    Restart,
    Reset,
    Delete,
}

impl Interruption {
    fn verb(self) -> &'static str {
        match self {
            Self::Restart => "restarted",
            Self::Reset => "reset",
            Self::Delete => "deleted",
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum RegistryError {
    #[error("Computer '{id}' is already attached with temporary={temporary}.")]
    AlreadyAttached { id: ComputerId, temporary: bool },
    #[error(
        "Computer '{id}' already exists with temporary={temporary}; lifecycle mode cannot be changed without a factory reset or delete."
    )]
    ModeFixed { id: ComputerId, temporary: bool },
    #[error(
        "Computer '{id}' already exists with temporary={actual}; requested temporary={requested}."
    )]
    ModeConflict {
        id: ComputerId,
        actual: bool,
        requested: bool,
    },
    #[error("Could not generate an unused computer_id; pass one explicitly.")]
    NoFreeId,
    #[error("The server is shutting down; computer '{0}' was not started.")]
    ShuttingDown(ComputerId),
    #[error("Computer '{0}' was not found.")]
    NotFound(ComputerId),
    #[error("Command interrupted because computer '{id}' is being {}.", .op.verb())]
    Interrupted { id: ComputerId, op: Interruption },
    /// The client cancelled the call; no result is expected.
    #[error("cancelled")]
    Cancelled,
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// One computer's locks and state. Lock order: `lifecycle` before `exec` before `state`.
#[derive(Default)]
struct Slot {
    /// Held across create/attach/restart/reset/delete/remove of this computer only.
    lifecycle: tokio::sync::Mutex<()>,
    /// One exec at a time per computer; tokio's mutex is fair, so execs run FIFO.
    exec: tokio::sync::Mutex<()>,
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    record: Option<SandboxRef>,
    /// Last provider state seen, for listings of records the provider did not return.
    last_state: Option<String>,
    owners: HashSet<u64>,
    /// The exec in flight, if one runs.
    in_flight: Option<InFlight>,
    /// Why the in-flight exec was cancelled by a lifecycle op, if it was.
    interrupted_by: Option<Interruption>,
    /// Held by sessionless requests until this instant.
    lease_until: Option<Instant>,
}

/// The exec running on a computer, so lifecycle ops and shutdown can stop it.
#[derive(Clone)]
struct InFlight {
    cancel: CancellationToken,
    exec_id: ExecId,
    sandbox: SandboxRef,
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
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these short locks leaves plain data behind; keep serving.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Registry {
    pub fn new(
        backend: Arc<dyn Backend>,
        instance: InstanceId,
        shell: String,
        limits: ExecLimits,
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
        })
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn limits(&self) -> ExecLimits {
        self.limits
    }

    /// Opens a session; call [`Registry::close_session`] when it ends.
    pub fn open_session(&self) -> Arc<Session> {
        let id = self
            .next_session
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let session = Arc::new(Session::new(id, None));
        lock(&self.sessions).insert(id, Arc::downgrade(&session));
        session
    }

    /// A holder for one sessionless request: computers it touches are kept alive by a lease of
    /// `ttl`, renewed on every use (`lifecycle.md` §2). Nothing needs closing afterwards.
    pub fn sessionless(&self, ttl: Duration) -> Arc<Session> {
        let id = self
            .next_session
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Arc::new(Session::new(id, Some(ttl)))
    }

    /// Extends the lease of `slot` to at least now + `ttl` (sessionless holders only).
    fn renew_lease(slot: &Slot, session: &Session) {
        if let Some(ttl) = session.lease_ttl {
            let until = Instant::now() + ttl;
            let mut state = lock(&slot.state);
            if state.lease_until.is_none_or(|current| current < until) {
                state.lease_until = Some(until);
            }
        }
    }

    /// Drops computers held only by an expired lease and with no exec in flight; temporary
    /// ones are removed provider-side. Run periodically by transports with sessionless clients.
    pub async fn reap_expired_leases(&self) {
        let now = Instant::now();
        let candidates: Vec<(ComputerId, Arc<Slot>)> = lock(&self.slots)
            .iter()
            .filter(|(_, slot)| {
                let state = lock(&slot.state);
                state.owners.is_empty() && state.lease_until.is_some_and(|until| until <= now)
            })
            .map(|(id, slot)| (id.clone(), slot.clone()))
            .collect();
        for (id, slot) in candidates {
            self.reap_if_expired(&slot).await;
            drop(slot);
            self.prune_slot(&id);
        }
    }

    /// Holds the computer's lifecycle lock through removal so no acquire can pick up a
    /// computer that is being removed.
    async fn reap_if_expired(&self, slot: &Slot) {
        let Ok(_lifecycle) = slot.lifecycle.try_lock() else {
            return;
        };
        let expired = {
            let Ok(_exec) = slot.exec.try_lock() else {
                return;
            };
            let mut state = lock(&slot.state);
            let still_expired = state.owners.is_empty()
                && state
                    .lease_until
                    .is_some_and(|until| until <= Instant::now());
            if !still_expired {
                return;
            }
            state.lease_until = None;
            Self::release_record(&mut state)
        };
        if let Some(sandbox) = expired {
            info!(computer_id = %sandbox.computer_id, "lease expired; removing temporary computer");
            self.remove_then_forget(slot, &sandbox).await;
        }
    }

    fn slot(&self, id: &ComputerId) -> Arc<Slot> {
        lock(&self.slots).entry(id.clone()).or_default().clone()
    }

    fn existing_slot(&self, id: &ComputerId) -> Option<Arc<Slot>> {
        lock(&self.slots).get(id).cloned()
    }

    /// Forgets a slot nobody uses any more, so the map does not grow forever.
    fn prune_slot(&self, id: &ComputerId) {
        let mut slots = lock(&self.slots);
        if let Some(slot) = slots.get(id) {
            let idle = {
                let state = lock(&slot.state);
                state.record.is_none() && state.owners.is_empty() && state.lease_until.is_none()
            };
            if idle && Arc::strong_count(slot) == 1 {
                slots.remove(id);
            }
        }
    }

    /// Resolves the target computer for a call and makes `session` one of its holders
    /// (`lifecycle.md` §3). `computer_id: None` means the session default (created on first
    /// use when `use_default` is set) or, for `computer_create`, a fresh random id.
    #[instrument(skip_all, fields(computer_id))]
    pub async fn acquire(
        &self,
        session: &Session,
        computer_id: Option<ComputerId>,
        temporary: bool,
        use_default: bool,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, RegistryError> {
        if let Some(id) = computer_id {
            tracing::Span::current().record("computer_id", id.as_str());
            return self
                .acquire_for(session, &id, temporary, Origin::Named, progress)
                .await;
        }
        // Sessionless requests have no default: each omitted-id call gets a new computer.
        if !use_default || session.lease_ttl.is_some() {
            let id = self.unused_random_id().await?;
            return self
                .acquire_for(session, &id, temporary, Origin::Named, progress)
                .await;
        }
        // Concurrent omitted-id calls of one session must create exactly one default.
        let _assigning = session.default_lock.lock().await;
        if let Some(id) = session.default_id() {
            let recorded = session.owned_mode(&id).unwrap_or(temporary);
            return self
                .acquire_for(session, &id, recorded, Origin::Named, progress)
                .await;
        }
        let id = self.unused_random_id().await?;
        let sandbox = self
            .acquire_for(session, &id, temporary, Origin::CheckedFree, progress)
            .await?;
        session.set_default(Some(id));
        Ok(sandbox)
    }

    /// A random id checked free by one provider lookup; creating it needs no second one.
    async fn unused_random_id(&self) -> Result<ComputerId, RegistryError> {
        for _ in 0..RANDOM_ID_TRIES {
            let id = ComputerId::random();
            let known = self
                .existing_slot(&id)
                .is_some_and(|s| lock(&s.state).record.is_some());
            if !known && self.backend.lookup(&id).await?.is_none() {
                return Ok(id);
            }
        }
        Err(RegistryError::NoFreeId)
    }

    async fn acquire_for(
        &self,
        session: &Session,
        id: &ComputerId,
        temporary: bool,
        origin: Origin,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, RegistryError> {
        if let Some(recorded) = session.owned_mode(id) {
            if recorded != temporary {
                return Err(RegistryError::AlreadyAttached {
                    id: id.clone(),
                    temporary: recorded,
                });
            }
            if let Some(sandbox) = self
                .existing_slot(id)
                .and_then(|s| lock(&s.state).record.clone())
            {
                return Ok(sandbox);
            }
            // The record went away (deleted elsewhere); fall through and attach or create anew.
            session.forget(id);
        }
        let slot = self.slot(id);
        let result = async {
            let _lifecycle = slot.lifecycle.lock().await;
            let existing = lock(&slot.state).record.clone();
            let sandbox = match existing {
                Some(sandbox) if sandbox.temporary != temporary => {
                    return Err(RegistryError::ModeFixed {
                        id: id.clone(),
                        temporary: sandbox.temporary,
                    });
                }
                Some(sandbox) => sandbox,
                // Checked under the lifecycle lock, after the slot is in the map: the shutdown
                // sweep sets `closing` before it lists the slots, so a creation is either
                // refused here or seen (and waited for) by the sweep.
                None if self.closing.load(std::sync::atomic::Ordering::SeqCst) => {
                    return Err(RegistryError::ShuttingDown(id.clone()));
                }
                None => {
                    self.attach_or_create(id, temporary, origin, progress)
                        .await?
                }
            };
            let mut state = lock(&slot.state);
            state.record = Some(sandbox.clone());
            state.last_state.get_or_insert_with(|| "running".to_owned());
            if session.lease_ttl.is_none() {
                state.owners.insert(session.id);
            }
            drop(state);
            Self::renew_lease(&slot, session);
            session.own(id.clone(), sandbox.temporary);
            Ok(sandbox)
        }
        .await;
        drop(slot);
        if result.is_err() {
            self.prune_slot(id);
        }
        result
    }

    async fn attach_or_create(
        &self,
        id: &ComputerId,
        temporary: bool,
        origin: Origin,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, RegistryError> {
        let found = match origin {
            Origin::Named => self.backend.lookup(id).await?,
            Origin::CheckedFree => None,
        };
        match found {
            Some(found) if found.sandbox.temporary != temporary => {
                Err(RegistryError::ModeConflict {
                    id: id.clone(),
                    actual: found.sandbox.temporary,
                    requested: temporary,
                })
            }
            Some(found) => {
                info!(computer_id = %id, sandbox_id = %found.sandbox.sandbox_id, "attaching");
                Ok(self.backend.ensure_running(&found.sandbox).await?)
            }
            None => {
                let spec = CreateSpec {
                    computer_id: id.clone(),
                    temporary,
                    image: None,
                    instance: self.instance.clone(),
                };
                let sandbox = self.backend.create(&spec, progress).await?;
                info!(computer_id = %id, sandbox_id = %sandbox.sandbox_id, temporary, "created");
                Ok(sandbox)
            }
        }
    }

    /// Acquires the computer, then runs one command on it under the exec lock.
    pub async fn execute(
        &self,
        session: &Session,
        computer_id: Option<ComputerId>,
        temporary: bool,
        request: &ExecRequest,
        progress: &dyn Progress,
        cancel: &CancellationToken,
    ) -> Result<Executed, RegistryError> {
        let acquired = self
            .acquire(session, computer_id, temporary, true, progress)
            .await?;
        let id = acquired.computer_id.clone();
        let slot = self.slot(&id);
        Self::renew_lease(&slot, session);
        let _turn = slot.exec.lock().await;
        let mut restarted_once = false;
        loop {
            let Some(sandbox) = lock(&slot.state).record.clone() else {
                // Deleted while we waited for our turn.
                return Err(RegistryError::Backend(BackendError::Vanished(id)));
            };
            let exec_cancel = cancel.child_token();
            let exec_id = ExecId::random();
            {
                let mut state = lock(&slot.state);
                state.in_flight = Some(InFlight {
                    cancel: exec_cancel.clone(),
                    exec_id: exec_id.clone(),
                    sandbox: sandbox.clone(),
                });
                state.interrupted_by = None;
            }
            let result = exec::run(
                self.backend.as_ref(),
                &sandbox,
                &self.shell,
                request,
                exec_id,
                self.limits.output_limit,
                &exec_cancel,
            )
            .await;
            let interrupted_by = {
                let mut state = lock(&slot.state);
                state.in_flight = None;
                state.interrupted_by.take()
            };
            Self::renew_lease(&slot, session);
            return match result {
                Ok(outcome) => Ok(Executed { sandbox, outcome }),
                Err(ExecError::Cancelled) => match interrupted_by {
                    Some(op) => Err(RegistryError::Interrupted { id, op }),
                    None => Err(RegistryError::Cancelled),
                },
                Err(ExecError::Backend(BackendError::NotRunning(_))) if !restarted_once => {
                    // D18: a stopped or died computer that still exists is started again.
                    // No lifecycle lock here: we hold the exec lock, and the lock order is
                    // lifecycle before exec. Starting a container is idempotent anyway.
                    restarted_once = true;
                    match self.backend.ensure_running(&sandbox).await {
                        Ok(fresh) => {
                            lock(&slot.state).record = Some(fresh);
                            continue;
                        }
                        Err(BackendError::Vanished(_)) => {
                            self.drop_everywhere(&id);
                            Err(BackendError::Vanished(id).into())
                        }
                        Err(other) => Err(other.into()),
                    }
                }
                Err(ExecError::Backend(BackendError::Vanished(_))) => {
                    self.drop_everywhere(&id);
                    Err(BackendError::Vanished(id).into())
                }
                Err(ExecError::Backend(error)) => Err(error.into()),
            };
        }
    }

    /// Removes the computer's record and every session's hold on it.
    fn drop_everywhere(&self, id: &ComputerId) {
        if let Some(slot) = self.existing_slot(id) {
            let mut state = lock(&slot.state);
            state.record = None;
            state.owners.clear();
            state.lease_until = None;
        }
        let sessions: Vec<Arc<Session>> = lock(&self.sessions)
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for session in sessions {
            session.forget(id);
        }
        self.prune_slot(id);
    }

    /// Cancels the exec in flight on `slot`, telling its caller why.
    fn interrupt(slot: &Slot, op: Interruption) {
        let mut state = lock(&slot.state);
        if let Some(in_flight) = state.in_flight.take() {
            state.interrupted_by = Some(op);
            in_flight.cancel.cancel();
        }
    }

    /// Ends a session: drops its holds and removes temporary computers nobody holds any more.
    #[instrument(skip_all, fields(session = session.id))]
    pub async fn close_session(&self, session: &Session) {
        if session.lease_ttl.is_some() {
            // Sessionless holds are leases; they expire on their own.
            return;
        }
        lock(&self.sessions).remove(&session.id);
        session.set_default(None);
        for (id, _) in session.take_owned() {
            let Some(slot) = self.existing_slot(&id) else {
                continue;
            };
            let _lifecycle = slot.lifecycle.lock().await;
            let to_remove = {
                let mut state = lock(&slot.state);
                state.owners.remove(&session.id);
                let leased = state
                    .lease_until
                    .is_some_and(|until| until > Instant::now());
                if state.owners.is_empty() && !leased {
                    Self::release_record(&mut state)
                } else {
                    None
                }
            };
            if let Some(sandbox) = to_remove {
                Self::interrupt(&slot, Interruption::Delete);
                self.remove_then_forget(&slot, &sandbox).await;
            }
            drop(_lifecycle);
            drop(slot);
            self.prune_slot(&id);
        }
    }

    /// Forgets a permanent record at once; returns a temporary one, which stays recorded until
    /// it is really gone so a concurrent shutdown sweep still sees (and removes) it.
    fn release_record(state: &mut SlotState) -> Option<SandboxRef> {
        match &state.record {
            Some(record) if record.temporary => Some(record.clone()),
            _ => {
                state.record = None;
                None
            }
        }
    }

    /// Removes a temporary computer provider-side, then drops its record. On failure the record
    /// stays, so the shutdown sweep tries again.
    async fn remove_then_forget(&self, slot: &Slot, sandbox: &SandboxRef) {
        match self.backend.remove(sandbox).await {
            Ok(()) => {
                let mut state = lock(&slot.state);
                if state.record.as_ref() == Some(sandbox) && state.owners.is_empty() {
                    state.record = None;
                }
            }
            Err(error) => {
                warn!(computer_id = %sandbox.computer_id, %error, "could not remove temporary computer");
            }
        }
    }

    /// Removes every temporary computer this process holds (shutdown, `lifecycle.md` §8),
    /// including those still being created or reset: each candidate's lifecycle lock is taken
    /// first, so the sweep waits for the operation in progress (a session close removing it,
    /// a creation, a factory reset) and then removes whatever temporary computer is recorded.
    /// No computer is created after the sweep starts. Returns the ids that could not be removed.
    pub async fn remove_all_temporary(&self) -> Vec<ComputerId> {
        self.closing
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Permanent records cannot turn temporary; every other slot may hold or get one.
        let candidates: Vec<Arc<Slot>> = lock(&self.slots)
            .values()
            .filter(|slot| {
                lock(&slot.state)
                    .record
                    .as_ref()
                    .is_none_or(|record| record.temporary)
            })
            .cloned()
            .collect();
        for slot in &candidates {
            Self::interrupt(slot, Interruption::Delete);
        }
        use futures_util::StreamExt;
        let failed: Vec<Option<ComputerId>> = futures_util::stream::iter(candidates)
            .map(|slot| async move {
                let _lifecycle = slot.lifecycle.lock().await;
                let sandbox = lock(&slot.state)
                    .record
                    .clone()
                    .filter(|record| record.temporary)?;
                // An exec that started while the lock was awaited.
                Self::interrupt(&slot, Interruption::Delete);
                match self.backend.remove(&sandbox).await {
                    Ok(()) => {
                        lock(&slot.state).record = None;
                        None
                    }
                    Err(error) => {
                        warn!(computer_id = %sandbox.computer_id, %error, "could not remove temporary computer");
                        Some(sandbox.computer_id)
                    }
                }
            })
            .buffer_unordered(SHUTDOWN_PARALLEL_REMOVALS)
            .collect()
            .await;
        failed.into_iter().flatten().collect()
    }

    /// Shutdown step 2: cancels every exec in flight and kills the process trees of those on
    /// permanent computers (temporary ones are about to be removed whole).
    pub async fn kill_all_in_flight(&self) {
        let in_flight: Vec<InFlight> = lock(&self.slots)
            .values()
            .filter_map(|slot| {
                let mut state = lock(&slot.state);
                let in_flight = state.in_flight.take()?;
                state.interrupted_by = Some(Interruption::Delete);
                in_flight.cancel.cancel();
                Some(in_flight)
            })
            .collect();
        let kills = in_flight
            .iter()
            .filter(|f| !f.sandbox.temporary)
            .map(|f| exec::kill_tree(self.backend.as_ref(), &f.sandbox, &f.exec_id));
        futures_util::future::join_all(kills).await;
    }

    /// Ids of the temporary computers this process still holds.
    pub fn temporary_ids(&self) -> Vec<ComputerId> {
        let mut ids: Vec<ComputerId> = lock(&self.slots)
            .iter()
            .filter(|(_, slot)| {
                lock(&slot.state)
                    .record
                    .as_ref()
                    .is_some_and(|r| r.temporary)
            })
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// Provider inventory ∪ this process's records, provider entry winning, sorted by id
    /// (`lifecycle.md` §5.5). A provider failure becomes a warning, not an error.
    pub async fn list(&self) -> (Vec<ComputerInfo>, Option<String>) {
        let (mut rows, warning) = match self.backend.list().await {
            Ok(rows) => (rows, None),
            Err(error) => (Vec::new(), Some(error.to_string())),
        };
        let listed: HashSet<ComputerId> =
            rows.iter().map(|r| r.sandbox.computer_id.clone()).collect();
        for slot in lock(&self.slots).values() {
            let state = lock(&slot.state);
            if let Some(record) = &state.record
                && !listed.contains(&record.computer_id)
            {
                rows.push(ComputerInfo {
                    sandbox: record.clone(),
                    state: state
                        .last_state
                        .clone()
                        .unwrap_or_else(|| "running".to_owned()),
                    created_at: None,
                });
            }
        }
        rows.sort_by(|a, b| {
            a.sandbox
                .computer_id
                .as_str()
                .cmp(b.sandbox.computer_id.as_str())
        });
        (rows, warning)
    }

    /// The computer as this process or the provider knows it.
    async fn find(&self, id: &ComputerId) -> Result<SandboxRef, RegistryError> {
        if let Some(record) = self
            .existing_slot(id)
            .and_then(|s| lock(&s.state).record.clone())
        {
            return Ok(record);
        }
        match self.backend.lookup(id).await? {
            Some(found) => Ok(found.sandbox),
            None => Err(RegistryError::NotFound(id.clone())),
        }
    }

    /// Runs a lifecycle op under the computer's locks after interrupting its exec in flight.
    async fn with_lifecycle<T>(
        &self,
        id: &ComputerId,
        op: Interruption,
        work: impl AsyncFnOnce(SandboxRef) -> Result<(T, Option<SandboxRef>), RegistryError>,
    ) -> Result<T, RegistryError> {
        let slot = self.slot(id);
        let result = async {
            let _lifecycle = slot.lifecycle.lock().await;
            Self::interrupt(&slot, op);
            let _exec = slot.exec.lock().await;
            let sandbox = self.find(id).await?;
            let (value, replacement) = work(sandbox).await?;
            let mut state = lock(&slot.state);
            if state.record.is_some() {
                state.record = replacement;
            }
            Ok(value)
        }
        .await;
        drop(slot);
        self.prune_slot(id);
        result
    }

    pub async fn restart(
        &self,
        id: &ComputerId,
    ) -> Result<crate::backends::Restarted, RegistryError> {
        self.with_lifecycle(id, Interruption::Restart, async |sandbox| {
            let restarted = self.backend.restart(&sandbox).await?;
            let replacement = restarted.sandbox.clone();
            Ok((restarted, Some(replacement)))
        })
        .await
    }

    pub async fn factory_reset(
        &self,
        id: &ComputerId,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, RegistryError> {
        self.with_lifecycle(id, Interruption::Reset, async |sandbox| {
            self.backend.remove(&sandbox).await?;
            let spec = CreateSpec {
                computer_id: id.clone(),
                temporary: sandbox.temporary,
                image: Some(sandbox.image.clone()),
                instance: self.instance.clone(),
            };
            let fresh = self.backend.create(&spec, progress).await?;
            Ok((fresh.clone(), Some(fresh)))
        })
        .await
    }

    pub async fn delete(&self, id: &ComputerId) -> Result<(), RegistryError> {
        self.with_lifecycle(id, Interruption::Delete, async |sandbox| {
            self.backend.remove(&sandbox).await?;
            Ok(((), None))
        })
        .await?;
        self.drop_everywhere(id);
        Ok(())
    }

    /// For callers without progress reporting.
    pub fn no_progress() -> &'static dyn Progress {
        &NoProgress
    }
}
