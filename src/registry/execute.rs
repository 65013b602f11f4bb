//! One command on an acquired computer: the computer's FIFO exec lock, the in-flight handle
//! lifecycle ops and shutdown interrupt, and the single restart of a stopped computer (docs/decisions.md, "Dead computers").

use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::slots::{InFlight, Slot};
use super::{Executed, Interruption, Registry, RegistryError, Session, Unnamed, lock};
use crate::backends::{BackendError, NoProgress, Progress, SandboxRef};
use crate::exec::{self, ExecError, ExecRequest};
use crate::ids::{ComputerId, ExecId};

impl Registry {
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
            .acquire(
                session,
                computer_id,
                temporary,
                Unnamed::SessionDefault,
                progress,
            )
            .await?;
        let id = acquired.computer_id.clone();
        let slot = self.slot(&id);
        Self::renew_lease(&slot, session);
        let _turn = Self::take_turn(&slot, &id).await?;
        let mut restarted_once = false;
        loop {
            let Some(sandbox) = lock(&slot.state).record.clone() else {
                // Deleted while we waited for our turn.
                return Err(RegistryError::Backend(BackendError::Vanished(id)));
            };
            let _awake = self.keep_awake(&sandbox);
            let exec_cancel = cancel.child_token();
            let exec_id = ExecId::random();
            Self::begin_in_flight(&slot, session, &sandbox, &exec_cancel, &exec_id);
            let result = exec::run(
                self.backend.as_ref(),
                &sandbox,
                &self.shell,
                request,
                exec_id,
                self.limits.output_limit,
                progress,
                &exec_cancel,
            )
            .await;
            let interrupted_by = Self::end_in_flight(&slot);
            Self::renew_lease(&slot, session);
            return match result {
                Ok(outcome) => Ok(Executed { sandbox, outcome }),
                Err(ExecError::Cancelled) => match interrupted_by {
                    Some(op) => Err(RegistryError::Interrupted { id, op }),
                    None => Err(RegistryError::Cancelled),
                },
                Err(ExecError::Backend(BackendError::NotRunning(_))) if !restarted_once => {
                    // docs/decisions.md, "Dead computers": a stopped or died computer that still exists is started again.
                    // No lifecycle lock here: we hold the exec lock, and the lock order is
                    // lifecycle before exec. Starting a container is idempotent anyway.
                    restarted_once = true;
                    match self.start_admitted(session.principal(), &sandbox).await {
                        Ok(fresh) => {
                            lock(&slot.state).record = Some(fresh);
                            continue;
                        }
                        Err(RegistryError::Backend(BackendError::Vanished(_))) => {
                            self.drop_everywhere(&id);
                            Err(BackendError::Vanished(id).into())
                        }
                        Err(other) => Err(other),
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

    /// Acquires the computer (created on first use, like [`Self::execute`]), then runs `work`
    /// on it under the exec lock, in the computer's FIFO turn. The file tools' operations run
    /// here: `work` gets a token that the caller's cancel and a lifecycle op interrupting
    /// both cancel, and must stop soon after it is cancelled.
    pub async fn with_turn<T>(
        &self,
        session: &Session,
        computer_id: Option<ComputerId>,
        temporary: bool,
        cancel: &CancellationToken,
        work: impl AsyncFnOnce(&SandboxRef, &CancellationToken) -> T,
    ) -> Result<(SandboxRef, T), RegistryError> {
        let acquired = self
            .acquire(
                session,
                computer_id,
                temporary,
                Unnamed::SessionDefault,
                &NoProgress,
            )
            .await?;
        let id = acquired.computer_id.clone();
        let slot = self.slot(&id);
        Self::renew_lease(&slot, session);
        let _turn = Self::take_turn(&slot, &id).await?;
        let Some(sandbox) = lock(&slot.state).record.clone() else {
            return Err(RegistryError::Backend(BackendError::Vanished(id)));
        };
        let _awake = self.keep_awake(&sandbox);
        let work_cancel = cancel.child_token();
        Self::begin_in_flight(&slot, session, &sandbox, &work_cancel, &ExecId::random());
        let answer = work(&sandbox, &work_cancel).await;
        let interrupted_by = Self::end_in_flight(&slot);
        Self::renew_lease(&slot, session);
        match interrupted_by {
            Some(op) => Err(RegistryError::Interrupted { id, op }),
            None if cancel.is_cancelled() => Err(RegistryError::Cancelled),
            None => Ok((sandbox, answer)),
        }
    }

    /// Waits for the computer's FIFO exec turn. Work that queued before a restart, factory
    /// reset or delete of the computer began does not run when its turn comes: it is
    /// interrupted like the work that was in flight (docs/decisions.md, "Lifecycle
    /// operations").
    async fn take_turn<'a>(
        slot: &'a Slot,
        id: &ComputerId,
    ) -> Result<tokio::sync::MutexGuard<'a, ()>, RegistryError> {
        let queued_at = Self::ops_begun(slot);
        let turn = match slot.exec.try_lock() {
            Ok(turn) => turn,
            Err(_) => {
                debug!(computer_id = %id, "queued for the computer's exec turn");
                slot.exec.lock().await
            }
        };
        match Self::interrupted_while_queued(slot, queued_at) {
            Some(op) => Err(RegistryError::Interrupted { id: id.clone(), op }),
            None => Ok(turn),
        }
    }

    /// Records the work now holding the computer's turn, so a lifecycle op or shutdown can
    /// cancel it (and kill what carries `exec_id`).
    fn begin_in_flight(
        slot: &Slot,
        session: &Session,
        sandbox: &SandboxRef,
        cancel: &CancellationToken,
        exec_id: &ExecId,
    ) {
        let mut state = lock(&slot.state);
        state.in_flight = Some(InFlight {
            cancel: cancel.clone(),
            exec_id: exec_id.clone(),
            sandbox: sandbox.clone(),
            session: session.id,
        });
        state.interrupted_by = None;
    }

    /// Clears the record of [`Self::begin_in_flight`]; the lifecycle op that interrupted the
    /// work, if one did.
    fn end_in_flight(slot: &Slot) -> Option<Interruption> {
        let mut state = lock(&slot.state);
        state.in_flight = None;
        state.interrupted_by.take()
    }
}
