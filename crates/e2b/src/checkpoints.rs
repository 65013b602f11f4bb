//! Checkpoints of E2B computers (docs/checkpoints.md, "E2B and Modal"): a checkpoint is a
//! persistent snapshot (`POST /sandboxes/{id}/snapshots`, a snapshot template); a rollback
//! creates a sandbox from it with the computer's metadata and then kills the old one, so a
//! failed creation leaves the computer as it was; a fork creates a sandbox from it under the
//! new id; deleting the last record of a snapshot deletes its template. The records themselves
//! are the backend API's `snapshots::SnapshotCheckpoints`, since a snapshot carries no metadata.
//!
//! A sandbox made from a snapshot may come back with the processes that ran when it was taken;
//! every process our commands started is killed before it is handed out, as restart does after
//! a resume, so a rollback ends commands and jobs and `memory` is `false`.

use async_trait::async_trait;
use kilntainers_backend::checkpoints::{
    CheckpointName, CheckpointRecord, CheckpointSet, Checkpoints, FromCheckpoint, NewCheckpoint,
};
use kilntainers_backend::ids::{ComputerId, InstanceId};
use kilntainers_backend::labels::e2b as meta;
use kilntainers_backend::snapshots::{Snapshot, Snapshots};
use kilntainers_backend::{BackendError, CreateSpec, Progress, SandboxRef};

use crate::E2bBackend;
use crate::api::{self, ApiError};

impl E2bBackend {
    /// A sandbox of `spec` from the snapshot, with no process of our commands left running.
    async fn create_from_snapshot(
        &self,
        reference: &str,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let sandbox = self
            .create_sandbox_from(spec, Some(reference), progress)
            .await?;
        if let Err(error) = self.kill_all_tagged(&sandbox).await {
            let _ = self.remove_sandbox(&sandbox).await;
            return Err(error);
        }
        Ok(sandbox)
    }
}

#[async_trait]
impl Snapshots for E2bBackend {
    async fn snapshot(&self, sandbox: &SandboxRef) -> Result<Snapshot, BackendError> {
        self.validated().await?;
        let info = self
            .api
            .snapshot(sandbox.sandbox_id.as_str())
            .await
            .map_err(|e| match e {
                ApiError::Auth { text, .. } => BackendError::Unavailable(text),
                e if e.status() == Some(404) => BackendError::Vanished(sandbox.computer_id.clone()),
                e => BackendError::Provider(format!(
                    "Cannot checkpoint computer '{}': E2B snapshot of sandbox {} failed: {}",
                    sandbox.computer_id.slug(),
                    sandbox.sandbox_id,
                    e.short()
                )),
            })?;
        let instance = match self.find(&sandbox.computer_id).await {
            Ok(Some(row)) => row.meta(meta::INSTANCE).and_then(InstanceId::parse),
            _ => None,
        };
        Ok(Snapshot {
            reference: info.snapshot_id,
            memory: false,
            size_bytes: None,
            instance,
        })
    }

    async fn create_from(
        &self,
        reference: &str,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.create_from_snapshot(reference, spec, progress).await
    }

    async fn replace_from(
        &self,
        sandbox: &SandboxRef,
        reference: &str,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let fresh = self.create_from_snapshot(reference, spec, progress).await?;
        if let Err(error) = self.remove_sandbox(sandbox).await {
            // Two sandboxes would carry the computer's id: give up the new one instead.
            let _ = self.remove_sandbox(&fresh).await;
            return Err(error);
        }
        Ok(fresh)
    }

    async fn delete_snapshot(&self, reference: &str) -> Result<(), BackendError> {
        self.validated().await?;
        self.api
            .delete_template(api::template_of(reference))
            .await
            .map_err(|e| e.into_backend(format!("E2B delete of snapshot {reference} failed")))
    }
}

#[async_trait]
impl Checkpoints for E2bBackend {
    async fn checkpoint(
        &self,
        sandbox: &SandboxRef,
        new: &NewCheckpoint,
    ) -> Result<CheckpointRecord, BackendError> {
        self.records.checkpoint(self, sandbox, new).await
    }

    async fn checkpoints(&self, id: &ComputerId) -> Result<CheckpointSet, BackendError> {
        self.records.checkpoints(self, id).await
    }

    async fn rollback(
        &self,
        sandbox: &SandboxRef,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.records
            .rollback(self, sandbox, from, spec, progress)
            .await
    }

    async fn fork(
        &self,
        _source: &SandboxRef,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.records.fork(self, from, spec, progress).await
    }

    async fn delete(&self, id: &ComputerId, name: &CheckpointName) -> Result<(), BackendError> {
        self.records.delete(self, id, name).await
    }

    async fn forget(&self, id: &ComputerId) -> Result<(), BackendError> {
        self.records.forget(self, id).await
    }
}
