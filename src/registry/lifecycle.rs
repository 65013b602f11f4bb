//! The lifecycle operations on one computer (docs/decisions.md, "Lifecycle operations"): list, restart, factory reset
//! and delete, each run under the computer's lifecycle and exec locks after interrupting the
//! exec in flight.

use std::collections::HashSet;

use super::slots::Slot;
use super::{Interruption, Registry, RegistryError, Removal, lock};
use crate::backends::egress::EgressPolicy;
use crate::backends::{ComputerInfo, CreateSpec, Progress, SandboxRef};
use crate::ids::{ComputerId, Principal};

/// The state listed for a record the provider did not return: a record exists only once its
/// computer was created or found and started, and nothing records a later provider state.
const RECORDED_STATE: &str = "running";

impl Registry {
    /// `principal`'s computers: provider inventory ∪ this process's records, provider entry
    /// winning, sorted by id (docs/decisions.md, "Listing computers"). A provider failure
    /// becomes a warning, not an error.
    pub async fn list(&self, principal: &Principal) -> (Vec<ComputerInfo>, Option<String>) {
        let (mut rows, warning) = match self.backend.list().await {
            Ok(rows) => (rows, None),
            Err(error) => (Vec::new(), Some(error.to_string())),
        };
        rows.retain(|row| row.sandbox.computer_id.belongs_to(principal));
        let listed: HashSet<ComputerId> =
            rows.iter().map(|r| r.sandbox.computer_id.clone()).collect();
        for slot in lock(&self.slots).values() {
            let state = lock(&slot.state);
            if let Some(record) = &state.record
                && record.computer_id.belongs_to(principal)
                && !listed.contains(&record.computer_id)
            {
                rows.push(ComputerInfo {
                    sandbox: record.clone(),
                    state: RECORDED_STATE.to_owned(),
                    created_at: None,
                });
            }
        }
        rows.sort_by(|a, b| {
            a.sandbox
                .computer_id
                .slug()
                .cmp(b.sandbox.computer_id.slug())
        });
        (rows, warning)
    }

    /// The computer as this process or the provider knows it, without holding or creating it.
    pub async fn find(&self, id: &ComputerId) -> Result<SandboxRef, RegistryError> {
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

    /// Runs a lifecycle op under the computer's locks after interrupting its exec in flight
    /// (and the work queued for its turn). When the op fails, the record is made to agree
    /// with the provider again before the locks are released: a computer the failed op left
    /// removed (a factory reset whose creation failed) is dropped as if deleted, so the next
    /// command creates it instead of finding a record of nothing.
    pub(super) async fn with_lifecycle<T>(
        &self,
        id: &ComputerId,
        op: Interruption,
        work: impl AsyncFnOnce(SandboxRef) -> Result<(T, Option<SandboxRef>), RegistryError>,
    ) -> Result<T, RegistryError> {
        let slot = self.slot(id);
        let mut gone = false;
        let result = async {
            let _lifecycle = slot.lifecycle.lock().await;
            Self::interrupt(&slot, op);
            let _exec = slot.exec.lock().await;
            let sandbox = self.find(id).await?;
            match work(sandbox).await {
                Ok((value, replacement)) => {
                    if let Some(running) = &replacement {
                        // A restart or reset is a use: the computer runs again from now.
                        self.touch(running);
                    }
                    let mut state = lock(&slot.state);
                    if state.record.is_some() {
                        state.record = replacement;
                    }
                    Ok(value)
                }
                Err(error) => {
                    gone = self.reconcile_after_failure(&slot, id).await;
                    Err(error)
                }
            }
        }
        .await;
        drop(slot);
        if gone {
            self.drop_everywhere(id);
            self.removed(id, Removal::Gone);
        }
        self.prune_slot(id);
        result
    }

    /// After a failed lifecycle op: the provider's word on the computer replaces the record.
    /// Returns whether the computer is gone. When the provider cannot be asked, the record is
    /// kept (a temporary computer's record is what the shutdown sweep removes it by).
    async fn reconcile_after_failure(&self, slot: &Slot, id: &ComputerId) -> bool {
        match self.backend.lookup(id).await {
            Ok(Some(found)) => {
                let mut state = lock(&slot.state);
                if state.record.is_some() {
                    state.record = Some(found.sandbox);
                }
                false
            }
            Ok(None) => true,
            Err(error) => {
                tracing::warn!(computer_id = %id, %error, "could not look the computer up after a failed lifecycle operation");
                false
            }
        }
    }

    /// Restarts `owner`'s computer `id`.
    pub async fn restart(
        &self,
        id: &ComputerId,
        owner: &Principal,
    ) -> Result<crate::backends::Restarted, RegistryError> {
        self.with_lifecycle(id, Interruption::Restart, async |sandbox| {
            let _admitted = self.admit_if_stopped(owner, id).await?;
            let restarted = self.backend.restart(&sandbox).await?;
            let replacement = restarted.sandbox.clone();
            Ok((restarted, Some(replacement)))
        })
        .await
    }

    /// Replaces `owner`'s computer `id` with a fresh one.
    pub async fn factory_reset(
        &self,
        id: &ComputerId,
        owner: &Principal,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, RegistryError> {
        self.with_lifecycle(id, Interruption::Reset, async |sandbox| {
            let _admitted = self.admit_if_stopped(owner, id).await?;
            let egress = self.egress_made_with(&sandbox).await?;
            self.backend.remove(&sandbox).await?;
            self.removed(id, Removal::Replaced);
            let spec = CreateSpec {
                computer_id: id.clone(),
                temporary: sandbox.temporary,
                image: Some(sandbox.image.clone()),
                instance: self.instance.clone(),
                owner: Some(owner.clone()),
                egress,
            };
            let fresh = self.backend.create(&spec, progress).await?;
            Ok((fresh.clone(), Some(fresh)))
        })
        .await
    }

    /// The egress policy `sandbox` was made with (docs/egress.md, "Policy model"): what a
    /// factory reset gives the fresh computer, so a narrowed policy stays narrowed (the model
    /// must not widen it by resetting). The hosts people allowed for the computer are not part
    /// of it: they go with the old computer, as on delete.
    async fn egress_made_with(
        &self,
        sandbox: &SandboxRef,
    ) -> Result<Option<EgressPolicy>, RegistryError> {
        let Some(mut policy) = self.backend.egress_policy(sandbox).await? else {
            return Ok(None);
        };
        if let Some(granted) = self.backend.egress_grants(sandbox).await? {
            policy.allow.retain(|pattern| !granted.contains(pattern));
        }
        Ok(Some(policy))
    }

    pub async fn delete(&self, id: &ComputerId) -> Result<(), RegistryError> {
        self.with_lifecycle(id, Interruption::Delete, async |sandbox| {
            self.backend.remove(&sandbox).await?;
            Ok(((), None))
        })
        .await?;
        self.drop_everywhere(id);
        self.removed(id, Removal::Gone);
        self.forget_checkpoints(id).await;
        Ok(())
    }
}
