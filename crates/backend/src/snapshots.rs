//! Checkpoints for providers that snapshot a computer into a provider object and make new
//! computers from it (E2B's snapshot templates, Modal's filesystem-snapshot images), but keep
//! no labels of ours on that object: [`Snapshots`] is what such a provider does, and
//! [`SnapshotCheckpoints`] is the rest of [`crate::checkpoints::Checkpoints`] over it, with the records kept in
//! the server's state directory (docs/checkpoints.md, "E2B and Modal").
//!
//! The records of one computer are one JSON file, `<state>/checkpoints/<backend>/<computer>.json`
//! (the computer's provider-side id, owner tag included; the directory 0700, the files 0600):
//! each checkpoint's name, lineage,
//! time, note and the provider's id of its snapshot, and the present incarnation's lineage,
//! keyed by its sandbox id so a factory reset (a new sandbox) starts with none. Every change is
//! a rewrite through a temporary file under an exclusive lock on `.lock`, so a second server
//! process of the same user, and a restarted one, read the same records. A fork's first
//! checkpoint is a second record of the same snapshot; a snapshot is deleted on the provider
//! when no record of any computer names it any more. Crash GC removes the records and snapshots
//! of temporary computers whose creating server died.

use std::collections::HashSet;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::checkpoints::{
    CheckpointName, CheckpointRecord, CheckpointSet, FromCheckpoint, NewCheckpoint, lineage_after,
    lineage_label, parse_lineage,
};
use crate::ids::{ComputerId, InstanceId};
use crate::{Backend, BackendError, CreateSpec, Progress, SandboxRef};

/// What one snapshot call gave.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The provider's id of the snapshot (an E2B template id, a Modal image id).
    pub reference: String,
    /// Whether running processes come back from it.
    pub memory: bool,
    pub size_bytes: Option<u64>,
    /// The creating server of a temporary computer, from the provider's metadata.
    pub instance: Option<InstanceId>,
}

/// What a snapshotting provider does; [`SnapshotCheckpoints`] decides the rest.
#[async_trait]
pub trait Snapshots: Backend {
    /// Takes a snapshot of the computer's present state.
    async fn snapshot(&self, sandbox: &SandboxRef) -> Result<Snapshot, BackendError>;

    /// A new computer `spec` made from the snapshot; fails without leaving a sandbox.
    async fn create_from(
        &self,
        reference: &str,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError>;

    /// Replaces `sandbox` by one made from the snapshot under the same computer id.
    async fn replace_from(
        &self,
        sandbox: &SandboxRef,
        reference: &str,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError>;

    /// Deletes the snapshot on the provider; one already gone counts as deleted.
    async fn delete_snapshot(&self, reference: &str) -> Result<(), BackendError>;
}

/// One checkpoint in the records file.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Stored {
    name: String,
    lineage: String,
    created_at: String,
    note: Option<String>,
    reference: String,
    memory: bool,
    size_bytes: Option<u64>,
}

/// The records file of one computer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Computer {
    temporary: bool,
    /// The creating server of a temporary computer (crash GC).
    instance: Option<String>,
    /// The sandbox whose lineage `lineage` is.
    sandbox: Option<String>,
    lineage: String,
    checkpoints: Vec<Stored>,
}

impl Stored {
    fn record(&self) -> Option<CheckpointRecord> {
        Some(CheckpointRecord {
            name: CheckpointName::parse(&self.name).ok()?,
            lineage: parse_lineage(&self.lineage),
            created_at: self.created_at.clone(),
            size_bytes: self.size_bytes,
            memory: self.memory,
            note: self.note.clone(),
        })
    }
}

/// The records of one backend kind, under the state directory.
#[derive(Debug, Clone)]
pub struct SnapshotCheckpoints {
    /// `<state>/checkpoints/<backend>`; `None` without a home directory.
    dir: Option<PathBuf>,
}

fn io_error(what: &str, error: &std::io::Error) -> BackendError {
    BackendError::Provider(format!("Could not {what} the checkpoint records: {error}"))
}

/// Holds the exclusive lock of the records directory while it lives.
struct Locked {
    _file: std::fs::File,
}

impl SnapshotCheckpoints {
    /// Records of backend `kind` under `state_dir` (the server's state directory).
    pub fn new(state_dir: Option<&Path>, kind: &str) -> Self {
        Self {
            dir: state_dir.map(|d| d.join("checkpoints").join(kind)),
        }
    }

    fn dir(&self) -> Result<&Path, BackendError> {
        self.dir.as_deref().ok_or_else(|| {
            BackendError::Provider(
                "Checkpoints need a home directory for their records (HOME is unset).".to_owned(),
            )
        })
    }

    fn lock(&self) -> Result<(Locked, &Path), BackendError> {
        let dir = self.dir()?;
        // Notes are the user's words: the records are the owner's alone.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| io_error("create the directory of", &e))?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(".lock"))
            .map_err(|e| io_error("lock", &e))?;
        file.lock().map_err(|e| io_error("lock", &e))?;
        Ok((Locked { _file: file }, dir))
    }

    fn path(dir: &Path, id: &ComputerId) -> PathBuf {
        dir.join(format!("{}.json", id.as_str()))
    }

    fn read(dir: &Path, id: &ComputerId) -> Computer {
        std::fs::read_to_string(Self::path(dir, id))
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok())
            .unwrap_or_default()
    }

    fn write(dir: &Path, id: &ComputerId, computer: &Computer) -> Result<(), BackendError> {
        let path = Self::path(dir, id);
        if computer.checkpoints.is_empty() && computer.sandbox.is_none() {
            return match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_error("remove", &e)),
                _ => Ok(()),
            };
        }
        let text = serde_json::to_string_pretty(computer)
            .map_err(|e| io_error("write", &std::io::Error::other(e)))?;
        let staged = dir.join(format!(".{}.json.new", id.as_str()));
        let _ = std::fs::remove_file(&staged);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&staged)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .and_then(|()| std::fs::rename(&staged, &path))
            .map_err(|e| io_error("write", &e))
    }

    /// Every computer with records, with them.
    fn all(dir: &Path) -> Vec<(ComputerId, Computer)> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let id = ComputerId::parse_stored(name.strip_suffix(".json")?).ok()?;
                let computer = Self::read(dir, &id);
                Some((id, computer))
            })
            .collect()
    }

    /// Which of `references` no record names any more.
    fn unreferenced(dir: &Path, references: Vec<String>) -> Vec<String> {
        let named: HashSet<String> = Self::all(dir)
            .into_iter()
            .flat_map(|(_, c)| c.checkpoints.into_iter().map(|s| s.reference))
            .collect();
        let mut left: Vec<String> = references
            .into_iter()
            .filter(|r| !named.contains(r))
            .collect();
        left.sort();
        left.dedup();
        left
    }

    async fn delete_snapshots(provider: &dyn Snapshots, references: Vec<String>) {
        for reference in references {
            if let Err(error) = provider.delete_snapshot(&reference).await {
                warn!(reference, %error, "could not delete a checkpoint's snapshot");
            }
        }
    }

    /// `Checkpoints::checkpoint`: the snapshot first, then its record.
    pub async fn checkpoint(
        &self,
        provider: &dyn Snapshots,
        sandbox: &SandboxRef,
        new: &NewCheckpoint,
    ) -> Result<CheckpointRecord, BackendError> {
        self.dir()?;
        let snapshot = provider.snapshot(sandbox).await?;
        let stored = Stored {
            name: new.name.as_str().to_owned(),
            lineage: lineage_label(&new.lineage),
            created_at: crate::clock::now_rfc3339(),
            note: new.note.clone(),
            reference: snapshot.reference.clone(),
            memory: snapshot.memory,
            size_bytes: snapshot.size_bytes,
        };
        let written = (|| {
            let (_lock, dir) = self.lock()?;
            let id = &sandbox.computer_id;
            let mut computer = Self::read(dir, id);
            computer.temporary = sandbox.temporary;
            if let Some(instance) = &snapshot.instance {
                computer.instance = Some(instance.to_string());
            }
            computer.checkpoints.retain(|s| s.name != stored.name);
            computer.checkpoints.push(stored.clone());
            computer.sandbox = Some(sandbox.sandbox_id.as_str().to_owned());
            computer.lineage = lineage_label(&lineage_after(&new.name, &new.lineage));
            Self::write(dir, id, &computer)
        })();
        if let Err(error) = written {
            Self::delete_snapshots(provider, vec![snapshot.reference]).await;
            return Err(error);
        }
        stored
            .record()
            .ok_or_else(|| BackendError::Provider("The checkpoint's record is invalid.".into()))
    }

    /// `Checkpoints::checkpoints`: the records, and the present lineage when the computer's
    /// sandbox is the one it was recorded for.
    pub async fn checkpoints(
        &self,
        provider: &dyn Snapshots,
        id: &ComputerId,
    ) -> Result<CheckpointSet, BackendError> {
        let Some(dir) = self.dir.as_deref() else {
            return Ok(CheckpointSet::default());
        };
        let computer = Self::read(dir, id);
        let lineage = match (&computer.sandbox, provider.lookup(id).await?) {
            (Some(recorded), Some(found)) if found.sandbox.sandbox_id.as_str() == recorded => {
                parse_lineage(&computer.lineage)
            }
            _ => Vec::new(),
        };
        Ok(CheckpointSet {
            checkpoints: computer
                .checkpoints
                .iter()
                .filter_map(Stored::record)
                .collect(),
            lineage,
        })
    }

    fn reference(&self, id: &ComputerId, name: &CheckpointName) -> Result<String, BackendError> {
        let dir = self.dir()?;
        Self::read(dir, id)
            .checkpoints
            .into_iter()
            .find(|s| s.name == name.as_str())
            .map(|s| s.reference)
            .ok_or_else(|| {
                BackendError::Provider(format!(
                    "No checkpoint {name} on {}; checkpoint_list shows them.",
                    id.slug()
                ))
            })
    }

    /// Records `sandbox` as the present incarnation of its computer, descending from `from`.
    fn set_present(
        &self,
        sandbox: &SandboxRef,
        instance: &InstanceId,
        lineage: &[CheckpointName],
        own_first: Option<Stored>,
    ) -> Result<(), BackendError> {
        let (_lock, dir) = self.lock()?;
        let id = &sandbox.computer_id;
        let mut computer = Self::read(dir, id);
        computer.temporary = sandbox.temporary;
        if sandbox.temporary {
            computer.instance = Some(instance.to_string());
        }
        if let Some(first) = own_first {
            computer.checkpoints.retain(|s| s.name != first.name);
            computer.checkpoints.push(first);
        }
        computer.sandbox = Some(sandbox.sandbox_id.as_str().to_owned());
        computer.lineage = lineage_label(lineage);
        Self::write(dir, id, &computer)
    }

    /// `Checkpoints::rollback`.
    pub async fn rollback(
        &self,
        provider: &dyn Snapshots,
        sandbox: &SandboxRef,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let reference = self.reference(from.source, &from.checkpoint.name)?;
        let fresh = provider
            .replace_from(sandbox, &reference, spec, progress)
            .await?;
        let lineage = lineage_after(&from.checkpoint.name, &from.checkpoint.lineage);
        self.set_present(&fresh, &spec.instance, &lineage, None)?;
        Ok(fresh)
    }

    /// `Checkpoints::fork`: a computer from the snapshot, whose first checkpoint is a second
    /// record of the same snapshot.
    pub async fn fork(
        &self,
        provider: &dyn Snapshots,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError> {
        let dir = self.dir()?;
        let original = Self::read(dir, from.source)
            .checkpoints
            .into_iter()
            .find(|s| s.name == from.checkpoint.name.as_str())
            .ok_or_else(|| {
                BackendError::Provider(format!(
                    "No checkpoint {} on {}; checkpoint_list shows them.",
                    from.checkpoint.name,
                    from.source.slug()
                ))
            })?;
        let sandbox = provider
            .create_from(&original.reference, spec, progress)
            .await?;
        let lineage = vec![from.checkpoint.name.clone()];
        if let Err(error) = self.set_present(&sandbox, &spec.instance, &lineage, Some(original)) {
            let _ = provider.remove(&sandbox).await;
            if let Ok((_lock, dir)) = self.lock() {
                let _ = std::fs::remove_file(Self::path(dir, &spec.computer_id));
            }
            return Err(error);
        }
        Ok(sandbox)
    }

    /// `Checkpoints::delete`: the record, then the snapshot if no record names it.
    pub async fn delete(
        &self,
        provider: &dyn Snapshots,
        id: &ComputerId,
        name: &CheckpointName,
    ) -> Result<(), BackendError> {
        let orphaned = {
            let (_lock, dir) = self.lock()?;
            let mut computer = Self::read(dir, id);
            let (gone, kept): (Vec<Stored>, Vec<Stored>) = computer
                .checkpoints
                .into_iter()
                .partition(|s| s.name == name.as_str());
            computer.checkpoints = kept;
            Self::write(dir, id, &computer)?;
            Self::unreferenced(dir, gone.into_iter().map(|s| s.reference).collect())
        };
        Self::delete_snapshots(provider, orphaned).await;
        Ok(())
    }

    /// `Checkpoints::forget`: every record of the computer, and the snapshots no other
    /// computer's record names.
    pub async fn forget(
        &self,
        provider: &dyn Snapshots,
        id: &ComputerId,
    ) -> Result<(), BackendError> {
        let Some(dir) = self.dir.as_deref() else {
            return Ok(());
        };
        if !Self::path(dir, id).exists() {
            return Ok(());
        }
        let orphaned = {
            let (_lock, dir) = self.lock()?;
            let computer = Self::read(dir, id);
            std::fs::remove_file(Self::path(dir, id))
                .or_else(|e| {
                    if e.kind() == std::io::ErrorKind::NotFound {
                        Ok(())
                    } else {
                        Err(e)
                    }
                })
                .map_err(|e| io_error("remove", &e))?;
            Self::unreferenced(
                dir,
                computer
                    .checkpoints
                    .into_iter()
                    .map(|s| s.reference)
                    .collect(),
            )
        };
        Self::delete_snapshots(provider, orphaned).await;
        Ok(())
    }

    /// Crash GC: forgets the temporary computers whose creating server is in `dead`.
    pub async fn collect_orphans(&self, provider: &dyn Snapshots, dead: &HashSet<InstanceId>) {
        let Some(dir) = self.dir.as_deref() else {
            return;
        };
        for (id, computer) in Self::all(dir) {
            let orphaned = computer.temporary
                && computer
                    .instance
                    .as_deref()
                    .and_then(InstanceId::parse)
                    .is_some_and(|i| dead.contains(&i));
            if orphaned && let Err(error) = self.forget(provider, &id).await {
                warn!(computer_id = %id, %error, "could not collect a computer's checkpoints");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::NoProgress;
    use crate::fake::FakeBackend;
    use crate::ids::Principal;

    /// References `delete_snapshot` was called with (each test's are told apart by prefix).
    static DELETED: Mutex<Vec<String>> = Mutex::new(Vec::new());

    #[async_trait]
    impl Snapshots for FakeBackend {
        async fn snapshot(&self, sandbox: &SandboxRef) -> Result<Snapshot, BackendError> {
            Ok(Snapshot {
                reference: format!("snap-{}-{}", sandbox.computer_id, rand::random::<u32>()),
                memory: false,
                size_bytes: None,
                instance: None,
            })
        }

        async fn create_from(
            &self,
            _reference: &str,
            spec: &CreateSpec,
            progress: &dyn Progress,
        ) -> Result<SandboxRef, BackendError> {
            self.create(spec, progress).await
        }

        async fn replace_from(
            &self,
            sandbox: &SandboxRef,
            _reference: &str,
            spec: &CreateSpec,
            progress: &dyn Progress,
        ) -> Result<SandboxRef, BackendError> {
            self.remove(sandbox).await?;
            self.create(spec, progress).await
        }

        async fn delete_snapshot(&self, reference: &str) -> Result<(), BackendError> {
            DELETED
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(reference.to_owned());
            Ok(())
        }
    }

    fn deleted(prefix: &str) -> usize {
        DELETED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|r| r.starts_with(prefix))
            .count()
    }

    struct Dir(PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn state_dir() -> Dir {
        Dir(std::env::temp_dir().join(format!(
            "kt-snapshots-test-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        )))
    }

    fn id(raw: &str) -> ComputerId {
        ComputerId::parse(&format!("{raw}-{}", rand::random::<u32>())).unwrap()
    }

    fn name(raw: &str) -> CheckpointName {
        CheckpointName::parse(raw).unwrap()
    }

    fn new(raw: &str, lineage: Vec<CheckpointName>) -> NewCheckpoint {
        NewCheckpoint {
            name: name(raw),
            lineage,
            note: Some(format!("note {raw}")),
            owner: Principal::default_principal(),
        }
    }

    fn spec(id: &ComputerId, temporary: bool, instance: &InstanceId) -> CreateSpec {
        CreateSpec {
            computer_id: id.clone(),
            temporary,
            image: None,
            instance: instance.clone(),
            owner: Some(Principal::default_principal()),
            egress: None,
        }
    }

    #[tokio::test]
    async fn records_are_shared_through_the_state_directory() {
        let dir = state_dir();
        let backend = FakeBackend::new();
        let records = SnapshotCheckpoints::new(Some(&dir.0), "fake");
        let other = SnapshotCheckpoints::new(Some(&dir.0), "fake");
        let cid = id("shared");
        let sandbox = backend.insert(&cid, false, true);
        records
            .checkpoint(&*backend, &sandbox, &new("a", Vec::new()))
            .await
            .unwrap();
        records
            .checkpoint(&*backend, &sandbox, &new("b", vec![name("a")]))
            .await
            .unwrap();
        use std::os::unix::fs::PermissionsExt;
        let records_dir = dir.0.join("checkpoints").join("fake");
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&records_dir), 0o700);
        assert_eq!(
            mode(&records_dir.join(format!("{}.json", cid.as_str()))),
            0o600
        );
        let set = other.checkpoints(&*backend, &cid).await.unwrap();
        let names: Vec<&str> = set.checkpoints.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(set.checkpoints[1].lineage, vec![name("a")]);
        assert_eq!(set.checkpoints[1].note.as_deref(), Some("note b"));
        assert_eq!(set.lineage, vec![name("b"), name("a")]);
        // A rollback makes a new sandbox whose lineage starts at the checkpoint.
        let from = FromCheckpoint {
            source: &cid,
            checkpoint: &set.checkpoints[0],
        };
        let instance = InstanceId::random();
        let rolled = records
            .rollback(
                &*backend,
                &sandbox,
                from,
                &spec(&cid, false, &instance),
                &NoProgress,
            )
            .await
            .unwrap();
        assert_ne!(rolled.sandbox_id, sandbox.sandbox_id);
        assert_eq!(
            other.checkpoints(&*backend, &cid).await.unwrap().lineage,
            vec![name("a")]
        );
        // Another incarnation (a factory reset) descends from nothing.
        backend.remove(&rolled).await.unwrap();
        backend.insert(&cid, false, true);
        assert!(
            other
                .checkpoints(&*backend, &cid)
                .await
                .unwrap()
                .lineage
                .is_empty()
        );
    }

    #[tokio::test]
    async fn a_snapshot_goes_with_the_last_record_naming_it() {
        let dir = state_dir();
        let backend = FakeBackend::new();
        let records = SnapshotCheckpoints::new(Some(&dir.0), "fake");
        let source = id("source");
        let fork = id("fork");
        let sandbox = backend.insert(&source, false, true);
        let record = records
            .checkpoint(&*backend, &sandbox, &new("a", Vec::new()))
            .await
            .unwrap();
        let prefix = format!("snap-{source}-");
        let from = FromCheckpoint {
            source: &source,
            checkpoint: &record,
        };
        let instance = InstanceId::random();
        records
            .fork(&*backend, from, &spec(&fork, false, &instance), &NoProgress)
            .await
            .unwrap();
        let fork_set = records.checkpoints(&*backend, &fork).await.unwrap();
        assert_eq!(fork_set.checkpoints, vec![record.clone()]);
        assert_eq!(fork_set.lineage, vec![name("a")]);
        records
            .delete(&*backend, &source, &name("a"))
            .await
            .unwrap();
        assert_eq!(deleted(&prefix), 0, "the fork still names the snapshot");
        assert!(
            records
                .checkpoints(&*backend, &source)
                .await
                .unwrap()
                .checkpoints
                .is_empty()
        );
        records.forget(&*backend, &fork).await.unwrap();
        assert_eq!(deleted(&prefix), 1);
    }

    #[tokio::test]
    async fn crash_gc_takes_only_temporary_computers_of_dead_servers() {
        let dir = state_dir();
        let backend = FakeBackend::new();
        let records = SnapshotCheckpoints::new(Some(&dir.0), "fake");
        let dead = InstanceId::random();
        let alive = InstanceId::random();
        let mut made = Vec::new();
        for (raw, temporary, instance) in [
            ("gone", true, &dead),
            ("live", true, &alive),
            ("kept", false, &dead),
        ] {
            let cid = id(raw);
            let sandbox = backend.insert(&cid, temporary, true);
            // Records of a computer made from a checkpoint carry its creating server.
            records.set_present(&sandbox, instance, &[], None).unwrap();
            records
                .checkpoint(&*backend, &sandbox, &new("a", Vec::new()))
                .await
                .unwrap();
            made.push(cid);
        }
        records
            .collect_orphans(&*backend, &HashSet::from([dead]))
            .await;
        let counts: Vec<usize> = {
            let mut counts = Vec::new();
            for cid in &made {
                counts.push(
                    records
                        .checkpoints(&*backend, cid)
                        .await
                        .unwrap()
                        .checkpoints
                        .len(),
                );
            }
            counts
        };
        assert_eq!(counts, [0, 1, 1]);
    }

    #[tokio::test]
    async fn without_a_home_nothing_is_recorded() {
        let backend = FakeBackend::new();
        let records = SnapshotCheckpoints::new(None, "fake");
        let cid = id("homeless");
        let sandbox = backend.insert(&cid, false, true);
        let error = records
            .checkpoint(&*backend, &sandbox, &new("a", Vec::new()))
            .await
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "Checkpoints need a home directory for their records (HOME is unset)."
        );
        assert_eq!(
            records.checkpoints(&*backend, &cid).await.unwrap(),
            CheckpointSet::default()
        );
    }
}
