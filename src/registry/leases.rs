//! Leases of sessionless holders (docs/decisions.md, "Sessions, holders and leases"): renewed on every use, and reaped once
//! expired when no exec is in flight.

use std::sync::Arc;
use std::time::Instant;

use tracing::info;

use super::slots::Slot;
use super::{Registry, Session, lock};
use crate::ids::ComputerId;

impl Registry {
    /// Extends the lease of `slot` to at least now + `ttl` (sessionless holders only).
    pub(super) fn renew_lease(slot: &Slot, session: &Session) {
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
}
