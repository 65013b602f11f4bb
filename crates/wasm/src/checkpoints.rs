//! Checkpoints of WASM computers (docs/checkpoints.md, "Other backends"): a checkpoint is a
//! copy of the computer's `root/` with a `record.json`, kept outside the computer's directory
//! so a factory reset keeps it — under the state directory for permanent computers
//! (`wasm/<backend>-checkpoints/<computer>/<checkpoint>/`), in the private directory for
//! temporary ones (`kilntainers-ckpt-<computer>/<checkpoint>/`). The computer's present lineage
//! is the `lineage` file next to its `meta.json`. A rollback copies the checkpoint over the
//! root; a fork creates a computer and does the same, and copies the checkpoint as its first.
//!
//! Copies never follow a symlink: links are copied as links, so nothing outside the computer is
//! ever read or written.

use std::path::{Path, PathBuf};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use kilntainers_backend::checkpoints::{
    CheckpointName, CheckpointRecord, CheckpointSet, Checkpoints, FromCheckpoint, NewCheckpoint,
    lineage_after, lineage_label, parse_lineage,
};
use kilntainers_backend::ids::ComputerId;
use kilntainers_backend::{Backend, BackendError, CreateSpec, Progress, SandboxRef};

use crate::{WasmBackend, provider};

/// The private directory's entries that hold a temporary computer's checkpoints.
pub(crate) const TEMP_CHECKPOINTS_PREFIX: &str = "kilntainers-ckpt-";

/// `record.json` of one checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    lineage: String,
    created_at: String,
    /// Nanoseconds since the epoch, zero-padded: the creation order.
    order: String,
    note: Option<String>,
    size_bytes: u64,
}

/// Copies `from` to `to` (which must not exist): directories, files with their modes, and
/// symlinks as symlinks. Returns the bytes of the files copied.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<u64> {
    let meta = std::fs::symlink_metadata(from)?;
    let kind = meta.file_type();
    if kind.is_symlink() {
        std::os::unix::fs::symlink(std::fs::read_link(from)?, to)?;
        return Ok(0);
    }
    if kind.is_file() {
        return std::fs::copy(from, to);
    }
    if !kind.is_dir() {
        // Sockets, fifos and devices are not part of a computer's files.
        return Ok(0);
    }
    std::fs::create_dir(to)?;
    let mut bytes = 0;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        bytes += copy_tree(&entry.path(), &to.join(entry.file_name()))?;
    }
    std::fs::set_permissions(to, meta.permissions())?;
    Ok(bytes)
}

/// Removes `path` without following a symlink in its place.
fn remove_tree(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn io(what: &str, id: &ComputerId, error: &std::io::Error) -> BackendError {
    provider(format!(
        "Could not {what} of WASM computer '{}': {error}",
        id.slug()
    ))
}

impl WasmBackend {
    /// Where the checkpoints of computer `id` live, for each mode.
    fn checkpoint_base(&self, id: &ComputerId, temporary: bool) -> Option<PathBuf> {
        if temporary {
            Some(
                self.private_dir
                    .join(format!("{TEMP_CHECKPOINTS_PREFIX}{}", id.as_str())),
            )
        } else {
            self.config.state_dir.as_ref().map(|dir| {
                dir.join("wasm")
                    .join(format!("{}-checkpoints", self.kind))
                    .join(id.as_str())
            })
        }
    }

    /// The base of an existing computer (its mode decides), or of either mode.
    async fn bases(&self, id: &ComputerId) -> Vec<PathBuf> {
        match self.lookup(id).await {
            Ok(Some(found)) => self
                .checkpoint_base(id, found.sandbox.temporary)
                .into_iter()
                .collect(),
            _ => [true, false]
                .into_iter()
                .filter_map(|t| self.checkpoint_base(id, t))
                .collect(),
        }
    }

    fn write_lineage(
        &self,
        sandbox: &SandboxRef,
        lineage: &[CheckpointName],
    ) -> Result<(), BackendError> {
        let dir = self.dir_of(sandbox)?;
        std::fs::write(dir.join("lineage"), lineage_label(lineage))
            .map_err(|e| io("record the lineage", &sandbox.computer_id, &e))
    }

    /// Replaces the computer's root by a copy of the checkpoint's.
    fn restore_root(&self, sandbox: &SandboxRef, from: &Path) -> Result<(), BackendError> {
        let dir = self.dir_of(sandbox)?;
        let id = &sandbox.computer_id;
        let staged = dir.join("root.restoring");
        remove_tree(&staged).map_err(|e| io("restore the files", id, &e))?;
        copy_tree(&from.join("root"), &staged).map_err(|e| io("restore the files", id, &e))?;
        remove_tree(&dir.join("root")).map_err(|e| io("restore the files", id, &e))?;
        std::fs::rename(&staged, dir.join("root")).map_err(|e| io("restore the files", id, &e))
    }

    /// Removes the checkpoints of temporary computers that no longer exist (crash GC).
    pub(crate) fn collect_orphan_checkpoints(&self, living: &[ComputerId]) {
        let Ok(entries) = std::fs::read_dir(&self.private_dir) else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(raw) = name.strip_prefix(TEMP_CHECKPOINTS_PREFIX) else {
                continue;
            };
            if !living.iter().any(|id| id.as_str() == raw) {
                let _ = remove_tree(&entry.path());
            }
        }
    }
}

fn read_record(dir: &Path, name: CheckpointName) -> Option<(String, CheckpointRecord)> {
    let text = std::fs::read_to_string(dir.join("record.json")).ok()?;
    let record: Record = serde_json::from_str(&text).ok()?;
    Some((
        record.order,
        CheckpointRecord {
            name,
            lineage: parse_lineage(&record.lineage),
            created_at: record.created_at,
            size_bytes: Some(record.size_bytes),
            memory: false,
            note: record.note,
        },
    ))
}

#[async_trait]
impl Checkpoints for WasmBackend {
    async fn checkpoint(
        &self,
        sandbox: &SandboxRef,
        new: &NewCheckpoint,
    ) -> Result<CheckpointRecord, BackendError> {
        let id = &sandbox.computer_id;
        let base = self.checkpoint_base(id, sandbox.temporary).ok_or_else(|| {
            provider("Permanent WASM computers need a home directory (HOME is unset).")
        })?;
        let dir = base.join(new.name.as_str());
        let root = self.dir_of(sandbox)?.join("root");
        let made = (|| -> std::io::Result<u64> {
            std::fs::create_dir_all(&base)?;
            std::fs::create_dir(&dir)?;
            let bytes = copy_tree(&root, &dir.join("root"))?;
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            let record = Record {
                lineage: lineage_label(&new.lineage),
                created_at: kilntainers_backend::clock::now_rfc3339(),
                order: format!("{nanos:024}"),
                note: new.note.clone(),
                size_bytes: bytes,
            };
            let text = serde_json::to_string_pretty(&record).map_err(std::io::Error::other)?;
            std::fs::write(dir.join("record.json"), text)?;
            Ok(bytes)
        })();
        if let Err(error) = made {
            let _ = remove_tree(&dir);
            return Err(io("copy the files", id, &error));
        }
        self.write_lineage(sandbox, &lineage_after(&new.name, &new.lineage))?;
        read_record(&dir, new.name.clone())
            .map(|(_, record)| record)
            .ok_or_else(|| provider("The checkpoint's record could not be read back."))
    }

    async fn checkpoints(&self, id: &ComputerId) -> Result<CheckpointSet, BackendError> {
        let mut found = Vec::new();
        for base in self.bases(id).await {
            let Ok(entries) = std::fs::read_dir(&base) else {
                continue;
            };
            for entry in entries.filter_map(Result::ok) {
                let Ok(name) = CheckpointName::parse(&entry.file_name().to_string_lossy()) else {
                    continue;
                };
                if let Some(pair) = read_record(&entry.path(), name) {
                    found.push(pair);
                }
            }
        }
        found.sort_by(|a, b| (&a.0, a.1.name.as_str()).cmp(&(&b.0, b.1.name.as_str())));
        let lineage = match self.lookup(id).await? {
            Some(found) => std::fs::read_to_string(self.dir_of(&found.sandbox)?.join("lineage"))
                .map(|raw| parse_lineage(raw.trim()))
                .unwrap_or_default(),
            None => Vec::new(),
        };
        Ok(CheckpointSet {
            checkpoints: found.into_iter().map(|(_, record)| record).collect(),
            lineage,
        })
    }

    async fn rollback(
        &self,
        sandbox: &SandboxRef,
        from: FromCheckpoint<'_>,
        _spec: &CreateSpec,
        _progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let base = self
            .checkpoint_base(from.source, sandbox.temporary)
            .ok_or_else(|| {
                provider("Permanent WASM computers need a home directory (HOME is unset).")
            })?;
        self.restore_root(sandbox, &base.join(from.checkpoint.name.as_str()))?;
        self.write_lineage(
            sandbox,
            &lineage_after(&from.checkpoint.name, &from.checkpoint.lineage),
        )?;
        Ok(sandbox.clone())
    }

    async fn fork(
        &self,
        source: &SandboxRef,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let name = &from.checkpoint.name;
        let checkpoint = self
            .checkpoint_base(from.source, source.temporary)
            .ok_or_else(|| {
                provider("Permanent WASM computers need a home directory (HOME is unset).")
            })?
            .join(name.as_str());
        let sandbox = self.create(spec, progress).await?;
        let own = self.checkpoint_base(&spec.computer_id, spec.temporary);
        let made = async {
            self.restore_root(&sandbox, &checkpoint)?;
            if let Some(own) = &own {
                std::fs::create_dir_all(own)
                    .and_then(|()| copy_tree(&checkpoint, &own.join(name.as_str())))
                    .map_err(|e| io("copy the checkpoint", &spec.computer_id, &e))?;
            }
            self.write_lineage(&sandbox, std::slice::from_ref(name))
        }
        .await;
        match made {
            Ok(()) => Ok(sandbox),
            Err(error) => {
                let _ = self.remove(&sandbox).await;
                if let Some(own) = &own {
                    let _ = remove_tree(own);
                }
                Err(error)
            }
        }
    }

    async fn delete(&self, id: &ComputerId, name: &CheckpointName) -> Result<(), BackendError> {
        for base in self.bases(id).await {
            remove_tree(&base.join(name.as_str()))
                .map_err(|e| io("delete a checkpoint", id, &e))?;
        }
        Ok(())
    }

    async fn forget(&self, id: &ComputerId) -> Result<(), BackendError> {
        for temporary in [true, false] {
            if let Some(base) = self.checkpoint_base(id, temporary) {
                remove_tree(&base).map_err(|e| io("remove the checkpoints", id, &e))?;
            }
        }
        self.tidy_private_dir();
        Ok(())
    }
}
