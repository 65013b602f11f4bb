//! Checkpoints on Docker and Podman (docs/checkpoints.md): a checkpoint is a local image made
//! by the engine's commit (the container paused only during the commit), tagged
//! `kilntainers-checkpoint/<computer>:<checkpoint>` and labelled with the computer, checkpoint,
//! lineage, source container and owner. The tags say which checkpoints a computer has — a
//! fork's first checkpoint is one more tag on the same image, and a delete removes one tag —
//! and the labels carry the rest, so a restarted server or a second one finds them all.
//! A rollback replaces the container like a factory reset, from the checkpoint's image; a
//! fork creates a computer from it. Images left without a tag (deleted checkpoints that a
//! container still ran from) are removed once nothing uses them.
//!
//! **Never pushed**: nothing here talks to a registry.

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use bollard::models::ContainerConfig;
use bollard::query_parameters::{
    CommitContainerOptionsBuilder, ListImagesOptionsBuilder, RemoveImageOptionsBuilder,
    TagImageOptionsBuilder,
};
use kilntainers_backend::checkpoints::{
    CheckpointName, CheckpointRecord, CheckpointSet, Checkpoints, FromCheckpoint, NewCheckpoint,
    lineage_after, lineage_label, parse_lineage,
};
use kilntainers_backend::ids::{ComputerId, InstanceId};
use kilntainers_backend::labels::{self, docker as computer_label};
use kilntainers_backend::{BackendError, CreateSpec, Progress, SandboxRef};
use tracing::{debug, info};

use super::create::{self, LocalImage};
use super::{DockerBackend, describe, status_of};

/// The repository of a computer's checkpoint images (`<repo>:<checkpoint>`).
const REPOSITORY: &str = "kilntainers-checkpoint";

/// Image label keys (new, additive to docs/decisions.md, "Labels and metadata").
pub mod label {
    /// Present on every checkpoint image: the checkpoint's name.
    pub const CHECKPOINT: &str = "kilntainers.checkpoint";
    pub const COMPUTER_ID: &str = "kilntainers.checkpoint.computer-id";
    /// The computer's lineage when the checkpoint was taken, nearest first, comma-separated.
    pub const LINEAGE: &str = "kilntainers.checkpoint.lineage";
    /// The container (first 12 hex digits) it was committed from.
    pub const SANDBOX: &str = "kilntainers.checkpoint.sandbox";
    pub const OWNER: &str = "kilntainers.checkpoint.owner";
    pub const CREATED_AT: &str = "kilntainers.checkpoint.created-at";
    /// The note, hex-encoded (a label value is one line of the commit's `LABEL` change).
    pub const NOTE: &str = "kilntainers.checkpoint.note";
    /// What the commit added, in bytes.
    pub const SIZE: &str = "kilntainers.checkpoint.size";
    /// Nanoseconds since the epoch, zero-padded: the creation order.
    pub const ORDER: &str = "kilntainers.checkpoint.order";
    /// On containers: the lineage a rollback or fork started the container with.
    pub const CONTAINER_LINEAGE: &str = "kilntainers.lineage";
}

fn repository(id: &ComputerId) -> String {
    format!("{REPOSITORY}/{id}")
}

fn reference(id: &ComputerId, name: &CheckpointName) -> String {
    format!("{}:{name}", repository(id))
}

/// A tag as we wrote it: Podman lists ours under `docker.io/` (or `localhost/`).
fn local_tag(tag: &str) -> &str {
    tag.strip_prefix("docker.io/")
        .or_else(|| tag.strip_prefix("localhost/"))
        .unwrap_or(tag)
}

fn hex(text: &str) -> String {
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(raw: &str) -> Option<String> {
    let bytes: Option<Vec<u8>> = (0..raw.len())
        .step_by(2)
        .map(|i| {
            raw.get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        })
        .collect();
    bytes.and_then(|b| String::from_utf8(b).ok())
}

/// A `LABEL "key"="value"` change line, quoted the way a Dockerfile reads it.
fn label_change(key: &str, value: &str) -> String {
    let quoted = value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', " ");
    format!("LABEL \"{key}\"=\"{quoted}\"")
}

fn provider(what: &str, id: &ComputerId, error: &bollard::errors::Error) -> BackendError {
    BackendError::Provider(format!(
        "Docker could not {what} for computer '{}': {}",
        id.slug(),
        describe(error)
    ))
}

impl DockerBackend {
    /// Refuses a computer whose data would not be in a commit: volumes and bind mounts.
    async fn check_committable(&self, sandbox: &SandboxRef) -> Result<String, BackendError> {
        let inspect = self
            .inspect(sandbox.sandbox_id.as_str())
            .await?
            .ok_or_else(|| BackendError::Vanished(sandbox.computer_id.clone()))?;
        for mount in inspect.mounts.iter().flatten() {
            if let Some(path) = &mount.destination {
                return Err(BackendError::Provider(format!(
                    "Cannot checkpoint computer '{}': the volume at {path} cannot be checkpointed (its files are not part of the computer's image); nothing was recorded.",
                    sandbox.computer_id.slug()
                )));
            }
        }
        Ok(inspect.image.unwrap_or_default())
    }

    /// Every live checkpoint image of `id`: (checkpoint name, image id, labels).
    async fn checkpoint_images(
        &self,
        id: &ComputerId,
    ) -> Result<Vec<(CheckpointName, String, HashMap<String, String>)>, BackendError> {
        let docker = self.client().await?;
        let repo = repository(id);
        let filters = HashMap::from([("reference".to_owned(), vec![repo.clone()])]);
        let options = ListImagesOptionsBuilder::default()
            .filters(&filters)
            .build();
        let images = docker
            .list_images(Some(options))
            .await
            .map_err(|e| provider("list checkpoints", id, &e))?;
        let prefix = format!("{repo}:");
        let mut found = Vec::new();
        for image in images {
            for tag in &image.repo_tags {
                let Some(name) = local_tag(tag)
                    .strip_prefix(&prefix)
                    .and_then(|raw| CheckpointName::parse(raw).ok())
                else {
                    continue;
                };
                found.push((name, image.id.clone(), image.labels.clone()));
            }
        }
        Ok(found)
    }

    /// Removes checkpoint images no tag names any more, when nothing uses them.
    async fn sweep_untagged(&self) {
        let Ok(docker) = self.client().await else {
            return;
        };
        let filters = HashMap::from([
            ("label".to_owned(), vec![label::CHECKPOINT.to_owned()]),
            ("dangling".to_owned(), vec!["true".to_owned()]),
        ]);
        let options = ListImagesOptionsBuilder::default()
            .filters(&filters)
            .build();
        let Ok(images) = docker.list_images(Some(options)).await else {
            return;
        };
        for image in images {
            let options = RemoveImageOptionsBuilder::default().build();
            match docker.remove_image(&image.id, Some(options), None).await {
                Ok(_) => debug!(image = %image.id, "removed an untagged checkpoint image"),
                // In use by a container (a rollback or a fork still runs from it).
                Err(error) => {
                    debug!(image = %image.id, error = %describe(&error), "untagged checkpoint image kept")
                }
            }
        }
    }

    /// Crash GC (docs/checkpoints.md, "Docker and Podman"): removes the checkpoints of
    /// temporary computers that a dead server made and that no longer exist. The image carries
    /// the labels of the container it was committed from, mode and instance included. A
    /// computer without a container is not enough on its own: a rollback in progress (here or
    /// in another server) has removed the old container and not yet made the new one.
    pub(super) async fn collect_orphan_checkpoints(&self, dead: &HashSet<InstanceId>) {
        let Ok(docker) = self.client().await else {
            return;
        };
        let filters = HashMap::from([("label".to_owned(), vec![label::CHECKPOINT.to_owned()])]);
        let options = ListImagesOptionsBuilder::default()
            .filters(&filters)
            .build();
        let Ok(images) = docker.list_images(Some(options)).await else {
            return;
        };
        let prefix = format!("{REPOSITORY}/");
        for image in images {
            let labels = &image.labels;
            let temporary =
                labels::parse_temporary(labels.get(computer_label::TEMPORARY).map(String::as_str));
            let instance = labels
                .get(computer_label::INSTANCE)
                .and_then(|i| InstanceId::parse(i));
            if !(temporary && instance.is_some_and(|i| dead.contains(&i))) {
                continue;
            }
            for tag in &image.repo_tags {
                let tag = local_tag(tag);
                let Some((raw_id, _)) = tag
                    .strip_prefix(&prefix)
                    .and_then(|rest| rest.split_once(':'))
                else {
                    continue;
                };
                let Ok(id) = ComputerId::parse_stored(raw_id) else {
                    continue;
                };
                if matches!(self.inspect(&Self::container_name(&id)).await, Ok(None)) {
                    let options = RemoveImageOptionsBuilder::default().force(true).build();
                    let _ = docker.remove_image(tag, Some(options), None).await;
                    info!(computer_id = %id, "removed a checkpoint of a temporary computer left by a dead server");
                }
            }
        }
        self.sweep_untagged().await;
    }
}

fn record_from(name: CheckpointName, labels: &HashMap<String, String>) -> CheckpointRecord {
    CheckpointRecord {
        lineage: labels
            .get(label::LINEAGE)
            .map(|raw| parse_lineage(raw))
            .unwrap_or_default(),
        created_at: labels.get(label::CREATED_AT).cloned().unwrap_or_default(),
        size_bytes: labels.get(label::SIZE).and_then(|s| s.parse().ok()),
        memory: false,
        note: labels
            .get(label::NOTE)
            .filter(|n| !n.is_empty())
            .and_then(|n| unhex(n)),
        name,
    }
}

/// When a checkpoint was taken: RFC 3339 for people, and nanoseconds since the epoch, which
/// order the checkpoints of one second.
fn now() -> (String, String) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    (
        kilntainers_backend::clock::now_rfc3339(),
        format!("{nanos:024}"),
    )
}

#[async_trait]
impl Checkpoints for DockerBackend {
    async fn checkpoint(
        &self,
        sandbox: &SandboxRef,
        new: &NewCheckpoint,
    ) -> Result<CheckpointRecord, BackendError> {
        let id = &sandbox.computer_id;
        let docker = self.client().await?;
        let base_image = self.check_committable(sandbox).await?;
        let (created_at, order) = now();
        let note = new.note.as_deref().map(hex).unwrap_or_default();
        let lineage = lineage_label(&new.lineage);
        let owner = new.owner.to_string();
        // Every key is set, so nothing is inherited from the image the container came from.
        let changes = [
            (label::CHECKPOINT, new.name.as_str()),
            (label::COMPUTER_ID, id.as_str()),
            (label::LINEAGE, lineage.as_str()),
            (label::SANDBOX, sandbox.sandbox_id.as_str()),
            (label::OWNER, owner.as_str()),
            (label::CREATED_AT, created_at.as_str()),
            (label::ORDER, order.as_str()),
            (label::NOTE, note.as_str()),
        ]
        .iter()
        .map(|(k, v)| label_change(k, v))
        .collect::<Vec<_>>()
        .join("\n");
        let options = CommitContainerOptionsBuilder::default()
            .container(sandbox.sandbox_id.as_str())
            .repo(&repository(id))
            .tag(new.name.as_str())
            .pause(true)
            .changes(&changes)
            .build();
        let committed = docker
            .commit_container(options, ContainerConfig::default())
            .await
            .map_err(|e| provider("commit a checkpoint", id, &e))?;
        let size = match (
            docker.inspect_image(&committed.id).await,
            docker.inspect_image(&base_image).await,
        ) {
            (Ok(image), Ok(base)) => Some(
                image
                    .size
                    .unwrap_or_default()
                    .saturating_sub(base.size.unwrap_or_default())
                    .max(0) as u64,
            ),
            _ => None,
        };
        info!(computer_id = %id, checkpoint = %new.name, ?size, "checkpoint committed");
        Ok(CheckpointRecord {
            name: new.name.clone(),
            lineage: new.lineage.clone(),
            created_at,
            size_bytes: size,
            memory: false,
            note: new.note.clone(),
        })
    }

    async fn checkpoints(&self, id: &ComputerId) -> Result<CheckpointSet, BackendError> {
        let images = self.checkpoint_images(id).await?;
        let mut ordered: Vec<(String, CheckpointRecord, Option<String>)> = images
            .iter()
            .map(|(name, _, labels)| {
                (
                    labels.get(label::ORDER).cloned().unwrap_or_default(),
                    record_from(name.clone(), labels),
                    labels.get(label::SANDBOX).cloned(),
                )
            })
            .collect();
        ordered.sort_by(|a, b| (&a.0, a.1.name.as_str()).cmp(&(&b.0, b.1.name.as_str())));
        let checkpoints: Vec<(CheckpointRecord, Option<String>)> =
            ordered.into_iter().map(|(_, r, s)| (r, s)).collect();
        // The present lineage: the newest checkpoint committed from this container, else the
        // lineage the container was started with.
        let lineage = match self.inspect(&Self::container_name(id)).await? {
            Some(inspect) => {
                let container = inspect.id.unwrap_or_default();
                let from_here = checkpoints.iter().rev().find(|(_, sandbox)| {
                    sandbox
                        .as_deref()
                        .is_some_and(|s| !s.is_empty() && container.starts_with(s))
                });
                match from_here {
                    Some((record, _)) => lineage_after(&record.name, &record.lineage),
                    None => inspect
                        .config
                        .and_then(|c| c.labels)
                        .and_then(|l| l.get(label::CONTAINER_LINEAGE).cloned())
                        .map(|raw| parse_lineage(&raw))
                        .unwrap_or_default(),
                }
            }
            None => Vec::new(),
        };
        Ok(CheckpointSet {
            checkpoints: checkpoints.into_iter().map(|(r, _)| r).collect(),
            lineage,
        })
    }

    async fn rollback(
        &self,
        sandbox: &SandboxRef,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        use kilntainers_backend::Backend as _;
        let image = reference(from.source, &from.checkpoint.name);
        let lineage = lineage_after(&from.checkpoint.name, &from.checkpoint.lineage);
        self.remove(sandbox).await?;
        let local = LocalImage {
            reference: image,
            labels: HashMap::from([(label::CONTAINER_LINEAGE.to_owned(), lineage_label(&lineage))]),
        };
        let fresh = create::create_from(self, spec, Some(local), progress).await?;
        self.sweep_untagged().await;
        Ok(fresh)
    }

    async fn fork(
        &self,
        _source: &SandboxRef,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let docker = self.client().await?;
        let id = &spec.computer_id;
        let name = &from.checkpoint.name;
        // The fork's own first checkpoint: one more tag on the same image.
        let options = TagImageOptionsBuilder::default()
            .repo(&repository(id))
            .tag(name.as_str())
            .build();
        docker
            .tag_image(&reference(from.source, name), Some(options))
            .await
            .map_err(|e| provider("tag the fork's checkpoint", id, &e))?;
        let local = LocalImage {
            reference: reference(id, name),
            labels: HashMap::from([(label::CONTAINER_LINEAGE.to_owned(), name.to_string())]),
        };
        match create::create_from(self, spec, Some(local), progress).await {
            Ok(sandbox) => Ok(sandbox),
            Err(error) => {
                // No partial computer: the tag goes too.
                let options = RemoveImageOptionsBuilder::default().force(true).build();
                let _ = docker
                    .remove_image(&reference(id, name), Some(options), None)
                    .await;
                Err(error)
            }
        }
    }

    async fn delete(&self, id: &ComputerId, name: &CheckpointName) -> Result<(), BackendError> {
        let docker = self.client().await?;
        // Force: only this tag goes; an image a container still runs from stays, untagged,
        // until the sweep finds it unused.
        let options = RemoveImageOptionsBuilder::default().force(true).build();
        match docker
            .remove_image(&reference(id, name), Some(options), None)
            .await
        {
            Ok(_) => {}
            Err(e) if status_of(&e) == Some(404) => {}
            Err(e) => return Err(provider("delete a checkpoint", id, &e)),
        }
        self.sweep_untagged().await;
        Ok(())
    }

    async fn forget(&self, id: &ComputerId) -> Result<(), BackendError> {
        let docker = self.client().await?;
        for (name, _, _) in self.checkpoint_images(id).await? {
            let options = RemoveImageOptionsBuilder::default().force(true).build();
            match docker
                .remove_image(&reference(id, &name), Some(options), None)
                .await
            {
                Ok(_) => {}
                Err(e) if status_of(&e) == Some(404) => {}
                Err(e) => return Err(provider("remove a checkpoint", id, &e)),
            }
        }
        self.sweep_untagged().await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_survive_the_label_encoding() {
        let note = "before \"apt upgrade\"\nüñí";
        assert_eq!(unhex(&hex(note)).as_deref(), Some(note));
        assert_eq!(label_change("k", "a\"b\\c"), "LABEL \"k\"=\"a\\\"b\\\\c\"");
    }
}
