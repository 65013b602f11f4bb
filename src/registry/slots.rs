//! One computer's slot: the lifecycle lock, the FIFO exec lock and the state behind them, the
//! map of slots and the short synchronous lock all registry state is read through. Lock order:
//! `lifecycle` before `exec` before `state`; the map lock is never held across an await.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::{Interruption, Registry, Session};
use crate::backends::SandboxRef;
use crate::ids::{ComputerId, ExecId};

/// One computer's locks and state. Lock order: `lifecycle` before `exec` before `state`.
#[derive(Default)]
pub(super) struct Slot {
    /// Held across create/attach/restart/reset/delete/remove of this computer only.
    pub(super) lifecycle: tokio::sync::Mutex<()>,
    /// One exec at a time per computer; tokio's mutex is fair, so execs run FIFO.
    pub(super) exec: tokio::sync::Mutex<()>,
    pub(super) state: Mutex<SlotState>,
}

#[derive(Default)]
pub(super) struct SlotState {
    pub(super) record: Option<SandboxRef>,
    pub(super) owners: HashSet<u64>,
    /// The exec in flight, if one runs.
    pub(super) in_flight: Option<InFlight>,
    /// Why the in-flight exec was cancelled by a lifecycle op, if it was.
    pub(super) interrupted_by: Option<Interruption>,
    /// Lifecycle ops begun on this computer, and the last one: work that queued for the exec
    /// turn before an op began is interrupted by it like the work in flight.
    pub(super) ops_begun: u64,
    pub(super) last_op: Option<Interruption>,
    /// Held by sessionless requests until this instant.
    pub(super) lease_until: Option<Instant>,
}

/// The exec running on a computer, so lifecycle ops and shutdown can stop it.
#[derive(Clone)]
pub(super) struct InFlight {
    pub(super) cancel: CancellationToken,
    pub(super) exec_id: ExecId,
    pub(super) sandbox: SandboxRef,
    /// The session whose call runs it: the one an egress question goes to first.
    pub(super) session: u64,
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these short locks leaves plain data behind; keep serving.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Registry {
    pub(super) fn slot(&self, id: &ComputerId) -> Arc<Slot> {
        lock(&self.slots).entry(id.clone()).or_default().clone()
    }

    pub(super) fn existing_slot(&self, id: &ComputerId) -> Option<Arc<Slot>> {
        lock(&self.slots).get(id).cloned()
    }

    /// Forgets a slot nobody uses any more, so the map does not grow forever.
    pub(super) fn prune_slot(&self, id: &ComputerId) {
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

    /// Removes the computer's record and every session's hold on it.
    pub(super) fn drop_everywhere(&self, id: &ComputerId) {
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

    /// Cancels the exec in flight on `slot`, telling its caller why, and marks the work queued
    /// for the computer's turn as interrupted too ([`Self::interrupted_while_queued`]).
    pub(super) fn interrupt(slot: &Slot, op: Interruption) {
        let mut state = lock(&slot.state);
        state.ops_begun += 1;
        state.last_op = Some(op);
        if let Some(in_flight) = state.in_flight.take() {
            state.interrupted_by = Some(op);
            in_flight.cancel.cancel();
        }
    }

    /// Where the lifecycle ops of `slot` stand; taken before queueing for its exec turn.
    pub(super) fn ops_begun(slot: &Slot) -> u64 {
        lock(&slot.state).ops_begun
    }

    /// The lifecycle op that began on `slot` since `queued_at` (from [`Self::ops_begun`]), if
    /// one did: the work that waited for the turn through it must not run on a computer being
    /// restarted, reset or deleted, and gets the message of a command in flight.
    pub(super) fn interrupted_while_queued(slot: &Slot, queued_at: u64) -> Option<Interruption> {
        let state = lock(&slot.state);
        if state.ops_begun == queued_at {
            None
        } else {
            state.last_op
        }
    }

    /// Forgets a permanent record at once; returns a temporary one, which stays recorded until
    /// it is really gone so a concurrent shutdown sweep still sees (and removes) it.
    pub(super) fn release_record(state: &mut SlotState) -> Option<SandboxRef> {
        match &state.record {
            Some(record) if record.temporary => Some(record.clone()),
            _ => {
                state.record = None;
                None
            }
        }
    }
}
