//! Checkpoints, rollback and fork (docs/checkpoints.md): the server's rules over the
//! provider's records — names unique per computer, `--max-checkpoints`, parents and the
//! present state read from lineages (so a deleted checkpoint's children hang from its parent),
//! fork ids and their admission by the quotas — and the locks each operation takes.
//!
//! A checkpoint takes the computer's lifecycle lock and not its exec turn: commands and jobs
//! keep running while the provider copies the computer. A rollback is a lifecycle operation
//! like a factory reset (the command in flight is interrupted, queued work does not run, jobs
//! and port forwards end). Every refusal is decided before anything changes.

use std::sync::atomic::Ordering;

use tracing::info;

use super::quotas::Admission;
use super::{Interruption, Registry, RegistryError, Removal, Session, lock};
use crate::backends::checkpoints::{
    CheckpointName, CheckpointRecord, CheckpointSet, Checkpoints, FromCheckpoint, NewCheckpoint,
};
use crate::backends::{CreateSpec, Progress, SandboxRef};
use crate::ids::{ComputerId, Principal};

/// `--max-checkpoints`' default (docs/checkpoints.md, "Limits").
pub const DEFAULT_MAX_CHECKPOINTS: usize = 20;

/// The most computers one `computer_fork` makes (the `count` range's top).
pub const MAX_FORK_COUNT: usize = 8;

/// `-f<n>` suffixes tried for fork ids before giving up: enough for every fork a computer can
/// have under any sane quota, and bounded so a crowded name space cannot loop.
const FORK_SUFFIX_TRIES: usize = 256;

/// A checkpoint with the parent the server reads from its lineage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointEntry {
    pub record: CheckpointRecord,
    /// The nearest ancestor that still exists.
    pub parent: Option<CheckpointName>,
}

/// `checkpoint_list`'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointTree {
    /// The checkpoint the present state descends from, when it still exists.
    pub current: Option<CheckpointName>,
    /// Oldest first.
    pub entries: Vec<CheckpointEntry>,
}

impl CheckpointTree {
    fn from_set(set: CheckpointSet) -> Self {
        let exists = |name: &CheckpointName| set.checkpoints.iter().any(|c| &c.name == name);
        let nearest = |lineage: &[CheckpointName]| lineage.iter().find(|n| exists(n)).cloned();
        let current = nearest(&set.lineage);
        let entries = set
            .checkpoints
            .iter()
            .map(|record| CheckpointEntry {
                parent: nearest(&record.lineage),
                record: record.clone(),
            })
            .collect();
        Self { current, entries }
    }

    fn find(&self, name: &CheckpointName) -> Option<&CheckpointEntry> {
        self.entries.iter().find(|e| &e.record.name == name)
    }
}

/// Which computers a fork makes.
#[derive(Debug, Clone)]
pub enum ForkTargets {
    /// `new_computer_id` (with `count` 1).
    Named(ComputerId),
    /// `count` computers named `<source>-f<n>`, the next free `n`.
    Numbered(usize),
}

/// What a fork made.
#[derive(Debug, Clone)]
pub struct Forked {
    pub checkpoint: CheckpointName,
    pub computers: Vec<SandboxRef>,
    /// The fork that failed, and why, after `computers` were made.
    pub failed: Option<(ComputerId, RegistryError)>,
}

fn unknown(id: &ComputerId, name: &CheckpointName) -> RegistryError {
    RegistryError::Checkpoint(format!(
        "No checkpoint {name} on {}; checkpoint_list shows them.",
        id.slug()
    ))
}

impl Registry {
    /// `--max-checkpoints`.
    pub fn set_max_checkpoints(&self, max: usize) {
        self.max_checkpoints.store(max, Ordering::Relaxed);
    }

    /// The provider's checkpoints, or the backend's refusal.
    fn provider_checkpoints(&self) -> Result<&dyn Checkpoints, RegistryError> {
        self.backend
            .checkpoints()
            .ok_or_else(|| self.backend.no_checkpoints().into())
    }

    /// Refuses before anything is touched on a backend without checkpoints (Fly).
    pub fn check_checkpoints_available(&self) -> Result<(), RegistryError> {
        self.provider_checkpoints().map(drop)
    }

    /// The computer's checkpoints, with parents and the present state's checkpoint.
    pub async fn checkpoint_tree(&self, id: &ComputerId) -> Result<CheckpointTree, RegistryError> {
        let set = self.provider_checkpoints()?.checkpoints(id).await?;
        Ok(CheckpointTree::from_set(set))
    }

    /// Records the state of `owner`'s computer now (`sandbox`, acquired by the caller).
    pub async fn checkpoint(
        &self,
        sandbox: &SandboxRef,
        owner: &Principal,
        name: Option<CheckpointName>,
        note: Option<String>,
    ) -> Result<CheckpointEntry, RegistryError> {
        let provider = self.provider_checkpoints()?;
        let id = &sandbox.computer_id;
        let slot = self.slot(id);
        let result = async {
            let _lifecycle = slot.lifecycle.lock().await;
            let sandbox = lock(&slot.state)
                .record
                .clone()
                .unwrap_or_else(|| sandbox.clone());
            // docs/idle-stop.md: a checkpoint operation is use.
            let _awake = self.keep_awake(&sandbox);
            let tree = self.checkpoint_tree(id).await?;
            let name = match name {
                Some(name) => name,
                None => loop {
                    let name = CheckpointName::random("c");
                    if tree.find(&name).is_none() {
                        break name;
                    }
                },
            };
            self.admit_checkpoint(id, &tree, &name)?;
            let set = provider.checkpoints(id).await?;
            let new = NewCheckpoint {
                name,
                lineage: set.lineage,
                note,
                owner: owner.clone(),
            };
            let record = provider.checkpoint(&sandbox, &new).await?;
            info!(target: "kilntainers::audit", principal = %owner, computer_id = %id, checkpoint = %record.name, "checkpoint");
            Ok(CheckpointEntry {
                parent: tree.current.clone(),
                record,
            })
        }
        .await;
        drop(slot);
        self.prune_slot(id);
        result
    }

    /// A new name's checks: unique on the computer, and room under `--max-checkpoints`.
    fn admit_checkpoint(
        &self,
        id: &ComputerId,
        tree: &CheckpointTree,
        name: &CheckpointName,
    ) -> Result<(), RegistryError> {
        if tree.find(name).is_some() {
            return Err(RegistryError::Checkpoint(format!(
                "Checkpoint {name} already exists on {}.",
                id.slug()
            )));
        }
        let max = self.max_checkpoints.load(Ordering::Relaxed);
        if tree.entries.len() >= max {
            return Err(RegistryError::Checkpoint(format!(
                "Computer {} already has {} checkpoints, the most allowed (--max-checkpoints {max}); delete one with checkpoint_delete, then try again.",
                id.slug(),
                tree.entries.len()
            )));
        }
        Ok(())
    }

    /// Returns `owner`'s computer `id` to checkpoint `name`, under the same id, mode and owner.
    pub async fn rollback(
        &self,
        id: &ComputerId,
        owner: &Principal,
        name: &CheckpointName,
        progress: &dyn Progress,
    ) -> Result<(SandboxRef, CheckpointEntry), RegistryError> {
        let provider = self.provider_checkpoints()?;
        // Refused before the command in flight is interrupted.
        if self.checkpoint_tree(id).await?.find(name).is_none() {
            return Err(unknown(id, name));
        }
        let rolled = self
            .with_lifecycle(id, Interruption::Rollback, async |sandbox| {
                let tree = self.checkpoint_tree(id).await?;
                let entry = tree.find(name).cloned().ok_or_else(|| unknown(id, name))?;
                let _admitted = self.admit_if_stopped(owner, id).await?;
                let spec = CreateSpec {
                    computer_id: id.clone(),
                    temporary: sandbox.temporary,
                    image: Some(sandbox.image.clone()),
                    instance: self.instance.clone(),
                    owner: Some(owner.clone()),
                    // The same policy (docs/checkpoints.md): the one recorded on the computer.
                    egress: self.backend.egress_policy(&sandbox).await?,
                };
                let from = FromCheckpoint {
                    source: id,
                    checkpoint: &entry.record,
                };
                let fresh = provider.rollback(&sandbox, from, &spec, progress).await?;
                self.removed(id, Removal::RolledBack);
                info!(target: "kilntainers::audit", principal = %owner, computer_id = %id, checkpoint = %name, "rollback");
                Ok(((fresh.clone(), entry), Some(fresh)))
            })
            .await?;
        Ok(rolled)
    }

    /// Removes checkpoint `name` of computer `id`.
    pub async fn delete_checkpoint(
        &self,
        id: &ComputerId,
        name: &CheckpointName,
    ) -> Result<(), RegistryError> {
        let provider = self.provider_checkpoints()?;
        let slot = self.slot(id);
        let result = async {
            let _lifecycle = slot.lifecycle.lock().await;
            if self.checkpoint_tree(id).await?.find(name).is_none() {
                return Err(unknown(id, name));
            }
            provider.delete(id, name).await?;
            Ok(())
        }
        .await;
        drop(slot);
        self.prune_slot(id);
        result
    }

    /// New computers of `session`'s principal from checkpoint `name` of `source` (or from its
    /// present state, through an implicit `fork-<hex>` checkpoint). Ids and the checkpoint are
    /// checked before anything is made; each fork is admitted by the quotas like a creation.
    pub async fn fork(
        &self,
        session: &Session,
        source: &SandboxRef,
        name: Option<CheckpointName>,
        targets: ForkTargets,
        temporary: Option<bool>,
        progress: &dyn Progress,
    ) -> Result<Forked, RegistryError> {
        let provider = self.provider_checkpoints()?;
        let owner = session.principal();
        let id = &source.computer_id;
        // docs/idle-stop.md: a checkpoint operation is use, of the source too.
        let _awake = self.keep_awake(source);
        let ids = self.fork_ids(id, targets).await?;
        let entry = match name {
            Some(name) => self
                .checkpoint_tree(id)
                .await?
                .find(&name)
                .cloned()
                .ok_or_else(|| unknown(id, &name))?,
            None => {
                let implicit = CheckpointName::random("fork");
                self.checkpoint(source, owner, Some(implicit), None).await?
            }
        };
        let temporary = temporary.unwrap_or(source.temporary);
        let mut forked = Forked {
            checkpoint: entry.record.name.clone(),
            computers: Vec::new(),
            failed: None,
        };
        for new_id in ids {
            match self
                .fork_one(
                    session, source, &entry, &new_id, temporary, provider, progress,
                )
                .await
            {
                Ok(sandbox) => forked.computers.push(sandbox),
                Err(error) => {
                    forked.failed = Some((new_id, error));
                    break;
                }
            }
        }
        Ok(forked)
    }

    /// The ids of the computers a fork makes, each free now.
    async fn fork_ids(
        &self,
        source: &ComputerId,
        targets: ForkTargets,
    ) -> Result<Vec<ComputerId>, RegistryError> {
        match targets {
            ForkTargets::Named(id) => {
                if self.is_taken(&id).await? {
                    return Err(RegistryError::Checkpoint(format!(
                        "Computer '{}' already exists; choose another new_computer_id.",
                        id.slug()
                    )));
                }
                Ok(vec![id])
            }
            ForkTargets::Numbered(count) => {
                let owner_tag = source.as_str().strip_prefix(source.slug());
                let mut ids = Vec::new();
                for n in 1..=FORK_SUFFIX_TRIES {
                    if ids.len() == count {
                        break;
                    }
                    let raw = format!("{}-f{n}", source.slug());
                    let Ok(slug) = ComputerId::parse(&raw) else {
                        return Err(RegistryError::Checkpoint(format!(
                            "The fork ids of '{}' would be longer than 63 characters; pass new_computer_id with count 1.",
                            source.slug()
                        )));
                    };
                    let full = format!("{}{}", slug.as_str(), owner_tag.unwrap_or_default());
                    let candidate = ComputerId::parse_stored(&full).unwrap_or(slug);
                    if !self.is_taken(&candidate).await? {
                        ids.push(candidate);
                    }
                }
                if ids.len() < count {
                    return Err(RegistryError::NoFreeId);
                }
                Ok(ids)
            }
        }
    }

    /// Whether a computer `id` exists here or at the provider.
    async fn is_taken(&self, id: &ComputerId) -> Result<bool, RegistryError> {
        let recorded = self
            .existing_slot(id)
            .is_some_and(|s| lock(&s.state).record.is_some());
        Ok(recorded || self.backend.lookup(id).await?.is_some())
    }

    /// One fork, made under its own lifecycle lock and held by `session` like a created one.
    #[allow(clippy::too_many_arguments)]
    async fn fork_one(
        &self,
        session: &Session,
        source: &SandboxRef,
        entry: &CheckpointEntry,
        new_id: &ComputerId,
        temporary: bool,
        provider: &dyn Checkpoints,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, RegistryError> {
        let slot = self.slot(new_id);
        let result = async {
            let _lifecycle = slot.lifecycle.lock().await;
            if self.closing.load(Ordering::SeqCst) {
                return Err(RegistryError::ShuttingDown(new_id.clone()));
            }
            if self.is_taken(new_id).await? {
                return Err(RegistryError::Checkpoint(format!(
                    "Computer '{}' already exists; choose another new_computer_id.",
                    new_id.slug()
                )));
            }
            let _admitted = self
                .admit(session.principal(), new_id, Admission::Create)
                .await?;
            let spec = CreateSpec {
                computer_id: new_id.clone(),
                temporary,
                image: Some(source.image.clone()),
                instance: self.instance.clone(),
                owner: Some(session.principal().clone()),
                // A fork has the source's policy (docs/checkpoints.md).
                egress: self.backend.egress_policy(source).await?,
            };
            let from = FromCheckpoint {
                source: &source.computer_id,
                checkpoint: &entry.record,
            };
            let sandbox = provider.fork(source, from, &spec, progress).await?;
            info!(target: "kilntainers::audit", principal = %session.principal(), computer_id = %new_id, source = %source.computer_id, checkpoint = %entry.record.name, "fork");
            self.touch(&sandbox);
            let mut state = lock(&slot.state);
            state.record = Some(sandbox.clone());
            if session.lease_ttl.is_none() {
                state.owners.insert(session.id);
            }
            drop(state);
            Self::renew_lease(&slot, session);
            session.own(new_id.clone(), sandbox.temporary);
            Ok(sandbox)
        }
        .await;
        drop(slot);
        if result.is_err() {
            self.prune_slot(new_id);
        }
        result
    }

    /// Removes the checkpoints of a computer this process removed for good; a failure is
    /// logged and left to crash GC.
    pub(super) async fn forget_checkpoints(&self, id: &ComputerId) {
        if !self.checkpoints_on.load(Ordering::Relaxed) {
            return;
        }
        if let Some(provider) = self.backend.checkpoints()
            && let Err(error) = provider.forget(id).await
        {
            tracing::warn!(computer_id = %id, %error, "could not remove the checkpoints of a removed computer");
        }
    }

    /// Turns the checkpoint tools' bookkeeping on (`--checkpoint-tools`): a removed
    /// computer's checkpoints are removed with it.
    pub fn enable_checkpoints(&self) {
        self.checkpoints_on.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
#[path = "checkpoints_tests.rs"]
mod tests;
