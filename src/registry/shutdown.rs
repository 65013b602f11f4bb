//! Letting go of computers: a session's close, the shutdown sweep of every temporary computer
//! (docs/decisions.md, "Shutdown".) and the kill of every exec in flight. A temporary computer stays
//! recorded until its removal has finished, so a close and the sweep never both remove it.

use std::sync::Arc;
use std::time::Instant;

use tracing::{instrument, warn};

use super::slots::{InFlight, Slot};
use super::{Interruption, Registry, Removal, Session, lock};
use crate::backends::SandboxRef;
use crate::exec;
use crate::ids::ComputerId;

/// Temporary computers removed at once during shutdown (docs/decisions.md, "Shutdown".).
const SHUTDOWN_PARALLEL_REMOVALS: usize = 16;

impl Registry {
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

    /// Removes a temporary computer provider-side, then drops its record. On failure the record
    /// stays, so the shutdown sweep tries again.
    pub(super) async fn remove_then_forget(&self, slot: &Slot, sandbox: &SandboxRef) {
        match self.backend.remove(sandbox).await {
            Ok(()) => {
                {
                    let mut state = lock(&slot.state);
                    if state.record.as_ref() == Some(sandbox) && state.owners.is_empty() {
                        state.record = None;
                    }
                }
                self.removed(&sandbox.computer_id, Removal::Gone);
                self.forget_checkpoints(&sandbox.computer_id).await;
            }
            Err(error) => {
                warn!(computer_id = %sandbox.computer_id, %error, "could not remove temporary computer");
            }
        }
    }

    /// Removes every temporary computer this process holds (shutdown, docs/decisions.md, "Shutdown".),
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
                        self.removed(&sandbox.computer_id, Removal::Gone);
                        self.forget_checkpoints(&sandbox.computer_id).await;
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
}
