//! Acquiring a computer for a call (docs/decisions.md, "Acquiring a computer"): the session default, named and random
//! ids, mode checks, and attach-or-create under the computer's lifecycle lock.

use tracing::{info, instrument};

use super::quotas::Admission;
use super::{Registry, RegistryError, Session, lock};
use crate::backends::egress::EgressPolicy;
use crate::backends::{BackendError, CreateSpec, Progress, SandboxRef};
use crate::ids::ComputerId;

/// Random slugs drawn before giving up (docs/decisions.md, "Computer ids").
const RANDOM_ID_TRIES: usize = 8;

/// Where a computer id came from, which decides whether the provider must be asked for it.
#[derive(Clone, Copy)]
enum Origin {
    /// Named by the caller (or remembered): it may exist provider-side; look it up.
    Named,
    /// Freshly drawn and just looked up as unused: go straight to create. A racing creator
    /// still ends in an attach through the backend's name conflict handling.
    CheckedFree,
}

/// What a call that names no computer gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unnamed {
    /// The session's default computer, made on its first use (`terminal_execute`, the job
    /// tools, `port_url`). A sessionless request has no default and gets a new computer.
    SessionDefault,
    /// A new computer under a fresh random id (`computer_create`).
    Fresh,
}

impl Registry {
    /// Resolves the target computer for a call and makes `session` one of its holders
    /// (docs/decisions.md, "Acquiring a computer"). `computer_id: None` means what `unnamed` says.
    #[instrument(skip_all, fields(computer_id))]
    pub async fn acquire(
        &self,
        session: &Session,
        computer_id: Option<ComputerId>,
        temporary: bool,
        unnamed: Unnamed,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, RegistryError> {
        if let Some(id) = computer_id {
            tracing::Span::current().record("computer_id", id.as_str());
            return self
                .acquire_for(session, &id, temporary, Origin::Named, None, progress)
                .await;
        }
        // Sessionless requests have no default: each omitted-id call gets a new computer.
        if unnamed == Unnamed::Fresh || session.lease_ttl.is_some() {
            let id = self.unused_random_id(session).await?;
            return self
                .acquire_for(session, &id, temporary, Origin::Named, None, progress)
                .await;
        }
        // Concurrent omitted-id calls of one session must create exactly one default.
        let _assigning = session.default_lock.lock().await;
        if let Some(id) = session.default_id() {
            let recorded = session.owned_mode(&id).unwrap_or(temporary);
            return self
                .acquire_for(session, &id, recorded, Origin::Named, None, progress)
                .await;
        }
        let id = self.unused_random_id(session).await?;
        let sandbox = self
            .acquire_for(session, &id, temporary, Origin::CheckedFree, None, progress)
            .await?;
        session.set_default(Some(id));
        Ok(sandbox)
    }

    /// An existing computer for a call that must not create one (the job tools): this
    /// process's record, else the provider's, attached in the mode it was created with.
    pub async fn attach_existing(
        &self,
        session: &Session,
        id: &ComputerId,
    ) -> Result<SandboxRef, RegistryError> {
        if !id.belongs_to(session.principal()) {
            return Err(RegistryError::NotFound(id.clone()));
        }
        if let Some(slot) = self.existing_slot(id) {
            let record = lock(&slot.state).record.clone();
            if let Some(sandbox) = record {
                // A job or task read is use: a sessionless holder's lease goes on.
                Self::renew_lease(&slot, session);
                return Ok(sandbox);
            }
        }
        let Some(found) = self.backend.lookup(id).await? else {
            return Err(RegistryError::NotFound(id.clone()));
        };
        self.acquire_for(
            session,
            id,
            found.sandbox.temporary,
            Origin::Named,
            None,
            &crate::backends::NoProgress,
        )
        .await
    }

    /// Starts a computer that work on it found stopped (the job tools, whose scripts do not
    /// take the exec turn): once, under the computer's lifecycle lock, through the same
    /// admission against the running limit as every other start. A computer removed or
    /// replaced meanwhile is not started: the caller gets it gone, or the new incarnation.
    pub async fn start_stopped(
        &self,
        session: &Session,
        stopped: &SandboxRef,
    ) -> Result<SandboxRef, RegistryError> {
        let id = &stopped.computer_id;
        if !id.belongs_to(session.principal()) {
            return Err(RegistryError::NotFound(id.clone()));
        }
        let slot = self.slot(id);
        let result = async {
            let _lifecycle = slot.lifecycle.lock().await;
            let current = lock(&slot.state).record.clone();
            match current {
                None => Err(BackendError::Vanished(id.clone()).into()),
                Some(current) if current != *stopped => Ok(current),
                Some(current) => match self.start_admitted(session.principal(), &current).await {
                    Ok(fresh) => {
                        let mut state = lock(&slot.state);
                        if state.record.is_some() {
                            state.record = Some(fresh.clone());
                        }
                        Ok(fresh)
                    }
                    Err(RegistryError::Backend(BackendError::Vanished(_))) => {
                        self.drop_everywhere(id);
                        Err(BackendError::Vanished(id.clone()).into())
                    }
                    Err(error) => Err(error),
                },
            }
        }
        .await;
        drop(slot);
        self.prune_slot(id);
        result
    }

    /// The one way a stopped computer of `principal` is started: admitted against the running
    /// limit (docs/auth.md, "Quotas"), then started by the backend.
    pub(super) async fn start_admitted(
        &self,
        principal: &crate::ids::Principal,
        sandbox: &SandboxRef,
    ) -> Result<SandboxRef, RegistryError> {
        let _admitted = self
            .admit(principal, &sandbox.computer_id, Admission::Start)
            .await?;
        Ok(self.backend.ensure_running(sandbox).await?)
    }

    /// A random id checked free by one provider lookup; creating it needs no second one.
    async fn unused_random_id(&self, session: &Session) -> Result<ComputerId, RegistryError> {
        for _ in 0..RANDOM_ID_TRIES {
            let id = ComputerId::random().owned_by(session.principal());
            let known = self
                .existing_slot(&id)
                .is_some_and(|s| lock(&s.state).record.is_some());
            if !known && self.backend.lookup(&id).await?.is_none() {
                return Ok(id);
            }
        }
        Err(RegistryError::NoFreeId)
    }

    /// `computer_create` with `egress`: a new computer under its own, narrower policy
    /// (docs/egress.md, "Per computer"), checked against the server's by the caller. A computer
    /// that exists already keeps the policy it was made with, so naming one is refused.
    pub async fn create_narrowed(
        &self,
        session: &Session,
        computer_id: Option<ComputerId>,
        temporary: bool,
        egress: &EgressPolicy,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, RegistryError> {
        let id = match computer_id {
            Some(id) => id,
            None => self.unused_random_id(session).await?,
        };
        self.acquire_for(
            session,
            &id,
            temporary,
            Origin::Named,
            Some(egress),
            progress,
        )
        .await
    }

    async fn acquire_for(
        &self,
        session: &Session,
        id: &ComputerId,
        temporary: bool,
        origin: Origin,
        egress: Option<&EgressPolicy>,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, RegistryError> {
        // Callers scope ids to the session's principal; anything else is somebody else's.
        if !id.belongs_to(session.principal()) {
            return Err(RegistryError::NotFound(id.clone()));
        }
        if let Some(recorded) = session.owned_mode(id) {
            if egress.is_some() {
                return Err(RegistryError::EgressFixed(id.clone()));
            }
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
                Some(_) if egress.is_some() => {
                    return Err(RegistryError::EgressFixed(id.clone()));
                }
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
                    self.attach_or_create(session, id, temporary, origin, egress, progress)
                        .await?
                }
            };
            let mut state = lock(&slot.state);
            state.record = Some(sandbox.clone());
            if session.lease_ttl.is_none() {
                state.owners.insert(session.id);
            }
            drop(state);
            self.touch(&sandbox);
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
        session: &Session,
        id: &ComputerId,
        temporary: bool,
        origin: Origin,
        egress: Option<&EgressPolicy>,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, RegistryError> {
        let found = match origin {
            Origin::Named => self.backend.lookup(id).await?,
            Origin::CheckedFree => None,
        };
        match found {
            Some(_) if egress.is_some() => Err(RegistryError::EgressFixed(id.clone())),
            Some(found) if found.sandbox.temporary != temporary => {
                Err(RegistryError::ModeConflict {
                    id: id.clone(),
                    actual: found.sandbox.temporary,
                    requested: temporary,
                })
            }
            Some(found) => {
                info!(target: "kilntainers::audit", principal = %session.principal(), computer_id = %id, sandbox_id = %found.sandbox.sandbox_id, "attaching");
                if found.running {
                    Ok(self.backend.ensure_running(&found.sandbox).await?)
                } else {
                    self.start_admitted(session.principal(), &found.sandbox)
                        .await
                }
            }
            None => {
                let _admitted = self
                    .admit(session.principal(), id, Admission::Create)
                    .await?;
                let spec = CreateSpec {
                    computer_id: id.clone(),
                    temporary,
                    image: None,
                    instance: self.instance.clone(),
                    owner: Some(session.principal().clone()),
                    egress: egress.cloned(),
                };
                let sandbox = self.backend.create(&spec, progress).await?;
                info!(target: "kilntainers::audit", principal = %session.principal(), computer_id = %id, sandbox_id = %sandbox.sandbox_id, temporary, "created");
                Ok(sandbox)
            }
        }
    }
}
