//! Checkpoints of Modal computers (docs/checkpoints.md, "E2B and Modal"): a checkpoint is the
//! sandbox's filesystem snapshot, an image (`SandboxSnapshotFs`); a rollback terminates the
//! sandbox and creates one from that image under the same name and tags (names are unique
//! among an app's running sandboxes, so the old one must end first); a fork creates a sandbox
//! from it under the new id; deleting the last record of an image deletes it (`ImageDelete`).
//! Images carry no tags of ours, so the records are the backend API's
//! `snapshots::SnapshotCheckpoints`. A filesystem snapshot holds no processes: `memory` is
//! `false`.

use async_trait::async_trait;

use kilntainers_backend::checkpoints::{
    CheckpointName, CheckpointRecord, CheckpointSet, Checkpoints, FromCheckpoint, NewCheckpoint,
};
use kilntainers_backend::ids::{ComputerId, InstanceId};
use kilntainers_backend::labels::modal as tag;
use kilntainers_backend::snapshots::{Snapshot, Snapshots};
use kilntainers_backend::{BackendError, CreateSpec, Progress, SandboxRef};

use crate::api::pb;
use crate::{ModalBackend, failure};

/// How long Modal may take to write the snapshot, asked of the server (its clients' default).
const SNAPSHOT_WAIT_SECS: f32 = 55.0;

#[async_trait]
impl Snapshots for ModalBackend {
    async fn snapshot(&self, sandbox: &SandboxRef) -> Result<Snapshot, BackendError> {
        let inner = &self.inner;
        let api = inner.api().await?;
        let id = &sandbox.computer_id;
        let answer = api
            .sandbox_snapshot_fs(pb::SandboxSnapshotFsRequest {
                sandbox_id: sandbox.sandbox_id.as_str().to_owned(),
                timeout: SNAPSHOT_WAIT_SECS,
            })
            .await
            .map_err(|e| match e.code {
                tonic::Code::NotFound => BackendError::Vanished(id.clone()),
                _ => failure(
                    &e,
                    format!(
                        "Cannot checkpoint computer '{}': Modal SandboxSnapshotFs of sandbox {} failed",
                        id.slug(),
                        sandbox.sandbox_id
                    ),
                ),
            })?;
        let succeeded = answer
            .result
            .as_ref()
            .is_some_and(|r| r.status == pb::generic_result::GenericStatus::Success as i32);
        if !succeeded || answer.image_id.is_empty() {
            let why = answer
                .result
                .map(|r| r.exception)
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "no image was made".to_owned());
            return Err(BackendError::Provider(format!(
                "Cannot checkpoint computer '{}': Modal's filesystem snapshot of sandbox {} failed: {why}",
                id.slug(),
                sandbox.sandbox_id
            )));
        }
        let instance = inner
            .tags(sandbox.sandbox_id.as_str())
            .await
            .ok()
            .and_then(|tags| tags.get(tag::INSTANCE).and_then(|i| InstanceId::parse(i)));
        Ok(Snapshot {
            reference: answer.image_id,
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
        self.inner
            .create(
                spec,
                Some(spec.instance.to_string()),
                Some(reference),
                progress,
            )
            .await
    }

    async fn replace_from(
        &self,
        sandbox: &SandboxRef,
        reference: &str,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let inner = &self.inner;
        // The creating instance of a temporary computer stays, so crash GC still applies.
        let instance = inner
            .tags(sandbox.sandbox_id.as_str())
            .await
            .ok()
            .and_then(|t| t.get(tag::INSTANCE).cloned())
            .unwrap_or_else(|| spec.instance.to_string());
        inner.terminate(sandbox).await?;
        inner
            .create(spec, Some(instance), Some(reference), progress)
            .await
    }

    async fn delete_snapshot(&self, reference: &str) -> Result<(), BackendError> {
        let api = self.inner.api().await?;
        match api
            .image_delete(pb::ImageDeleteRequest {
                image_id: reference.to_owned(),
            })
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if e.code == tonic::Code::NotFound => Ok(()),
            Err(e) => Err(failure(
                &e,
                format!("Modal ImageDelete of checkpoint image {reference} failed"),
            )),
        }
    }
}

#[async_trait]
impl Checkpoints for ModalBackend {
    async fn checkpoint(
        &self,
        sandbox: &SandboxRef,
        new: &NewCheckpoint,
    ) -> Result<CheckpointRecord, BackendError> {
        self.inner.records.checkpoint(self, sandbox, new).await
    }

    async fn checkpoints(&self, id: &ComputerId) -> Result<CheckpointSet, BackendError> {
        self.inner.records.checkpoints(self, id).await
    }

    async fn rollback(
        &self,
        sandbox: &SandboxRef,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        self.inner
            .records
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
        self.inner.records.fork(self, from, spec, progress).await
    }

    async fn delete(&self, id: &ComputerId, name: &CheckpointName) -> Result<(), BackendError> {
        self.inner.records.delete(self, id, name).await
    }

    async fn forget(&self, id: &ComputerId) -> Result<(), BackendError> {
        self.inner.records.forget(self, id).await
    }
}
