//! Per-principal limits (docs/auth.md, "Quotas"): how many computers a principal may have, and
//! how many of them may run at once. Checked before a computer is created and before a stopped
//! one is started (by an attach, a restart, a factory reset or an exec's restart-once);
//! concurrent creations of one principal are counted while they are in flight, so a burst
//! cannot overshoot.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use super::{Registry, RegistryError, lock};
use crate::config::Quotas;
use crate::ids::{ComputerId, Principal};

/// The quota state shared by a registry's creations.
#[derive(Default)]
pub(super) struct QuotaGate {
    limits: Quotas,
    /// Serialises count-and-reserve, so two creations never both see the last free place.
    check: tokio::sync::Mutex<()>,
    /// Computers admitted and not yet finished creating or starting, per principal. Such a
    /// computer may already show in the provider's list, so counts take the union.
    pending: Mutex<HashMap<Principal, Vec<ComputerId>>>,
}

impl QuotaGate {
    pub(super) fn new(limits: Quotas) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }
}

/// An admitted creation or start; counts against the quota until dropped.
pub(super) struct Reservation<'a> {
    gate: &'a QuotaGate,
    principal: Principal,
    id: ComputerId,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut pending = lock(&self.gate.pending);
        if let Some(ids) = pending.get_mut(&self.principal) {
            if let Some(at) = ids.iter().position(|id| *id == self.id) {
                ids.swap_remove(at);
            }
            if ids.is_empty() {
                pending.remove(&self.principal);
            }
        }
    }
}

/// What is about to happen to one of the principal's computers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admission {
    /// A new computer, running once made.
    Create,
    /// An existing, stopped computer about to be started.
    Start,
}

impl Registry {
    /// Admits creating or starting `principal`'s computer `id`, or says which limit it would
    /// exceed. Without limits this costs nothing; with them, one provider listing.
    pub(super) async fn admit(
        &self,
        principal: &Principal,
        id: &ComputerId,
        admission: Admission,
    ) -> Result<Option<Reservation<'_>>, RegistryError> {
        let gate = &self.quotas;
        if !gate.limits.any() {
            return Ok(None);
        }
        let _check = gate.check.lock().await;
        let (rows, warning) = self.list(principal).await;
        if let Some(warning) = warning {
            return Err(RegistryError::QuotaUnknown(
                warning.trim_end_matches('.').to_owned(),
            ));
        }
        let pending: Vec<ComputerId> = lock(&gate.pending)
            .get(principal)
            .cloned()
            .unwrap_or_default();
        let mut all: HashSet<&ComputerId> = pending.iter().collect();
        let mut running = all.clone();
        for row in &rows {
            all.insert(&row.sandbox.computer_id);
            if row.state == "running" {
                running.insert(&row.sandbox.computer_id);
            }
        }
        // Starting a computer that already runs adds none.
        if admission == Admission::Start {
            running.remove(id);
        }
        let (total, running) = (all.len(), running.len());
        if admission == Admission::Create
            && let Some(max) = gate.limits.max_computers
            && total >= max
        {
            return Err(RegistryError::QuotaReached(format!(
                "Computer limit reached: you have {total} of {max} computers (--max-computers-per-user). Delete one with computer_delete, or end a session holding a temporary one, then try again."
            )));
        }
        if let Some(max) = gate.limits.max_running
            && running >= max
        {
            return Err(RegistryError::QuotaReached(format!(
                "Running computer limit reached: you have {running} of {max} computers running (--max-running-per-user). Delete one with computer_delete, or end a session holding a temporary one, then try again."
            )));
        }
        lock(&gate.pending)
            .entry(principal.clone())
            .or_default()
            .push(id.clone());
        Ok(Some(Reservation {
            gate,
            principal: principal.clone(),
            id: id.clone(),
        }))
    }

    /// Admits bringing `principal`'s computer `id` back up (restart, factory reset) when it is
    /// stopped now; a running one is counted already. One lookup, and only with a running limit.
    pub(super) async fn admit_if_stopped(
        &self,
        principal: &Principal,
        id: &ComputerId,
    ) -> Result<Option<Reservation<'_>>, RegistryError> {
        if self.quotas.limits.max_running.is_none() {
            return Ok(None);
        }
        match self.backend.lookup(id).await? {
            Some(found) if !found.running => self.admit(principal, id, Admission::Start).await,
            _ => Ok(None),
        }
    }
}
