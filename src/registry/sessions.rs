//! Per-session state: the session's default computer and the computers it holds, with the
//! mode it holds each in (docs/decisions.md, "Sessions, holders and leases"). Mutated only by the registry.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::ids::{ComputerId, Principal};

use super::lock;

pub struct Session {
    pub(super) id: u64,
    /// Serialises default assignment only, so concurrent omitted-id calls create one default.
    pub(super) default_lock: tokio::sync::Mutex<()>,
    default_id: Mutex<Option<ComputerId>>,
    owned: Mutex<HashMap<ComputerId, bool>>,
    /// `Some(ttl)` for a sessionless (2026-07-28) request: it holds temporary computers by a
    /// lease renewed on use instead of as an owner, and has no default computer.
    pub(super) lease_ttl: Option<Duration>,
    /// Who the session acts for: it sees and touches only this principal's computers.
    principal: Principal,
}

impl Session {
    pub(super) fn new(id: u64, lease_ttl: Option<Duration>, principal: Principal) -> Self {
        Self {
            lease_ttl,
            principal,
            id,
            default_lock: tokio::sync::Mutex::new(()),
            default_id: Mutex::new(None),
            owned: Mutex::new(HashMap::new()),
        }
    }

    /// Unique among the sessions of this process.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn principal(&self) -> &Principal {
        &self.principal
    }

    /// The computers this session holds.
    pub fn held(&self) -> Vec<ComputerId> {
        lock(&self.owned).keys().cloned().collect()
    }

    pub fn default_id(&self) -> Option<ComputerId> {
        lock(&self.default_id).clone()
    }

    pub(super) fn set_default(&self, id: Option<ComputerId>) {
        *lock(&self.default_id) = id;
    }

    /// The mode this session holds `id` in, if it holds it.
    pub(super) fn owned_mode(&self, id: &ComputerId) -> Option<bool> {
        lock(&self.owned).get(id).copied()
    }

    pub(super) fn own(&self, id: ComputerId, temporary: bool) {
        lock(&self.owned).insert(id, temporary);
    }

    /// Drops the hold and clears the default if it pointed at `id` (deletion, vanishing).
    pub(super) fn forget(&self, id: &ComputerId) {
        lock(&self.owned).remove(id);
        let mut default_id = lock(&self.default_id);
        if default_id.as_ref() == Some(id) {
            *default_id = None;
        }
    }

    pub(super) fn take_owned(&self) -> HashMap<ComputerId, bool> {
        std::mem::take(&mut *lock(&self.owned))
    }
}
