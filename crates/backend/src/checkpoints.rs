//! The checkpoint vocabulary (docs/checkpoints.md): a validated [`CheckpointName`], what a
//! provider records about one checkpoint ([`CheckpointRecord`]) and about a computer's present
//! state ([`CheckpointSet::lineage`]), and [`Checkpoints`], the provider side of
//! `computer_checkpoint`, `computer_rollback`, `computer_fork`, `checkpoint_list` and
//! `checkpoint_delete`, which a backend offers through [`crate::Backend::checkpoints`].
//!
//! Providers store records and never decide: names, limits, parents and the tree are the
//! server's (`registry::checkpoints`). Records never change after they are written, because
//! image labels cannot; a parent that was deleted is skipped by reading the *lineage* (every
//! ancestor's name, nearest first) up to the first one that still exists.

use std::fmt;

use async_trait::async_trait;
use rand::RngExt;

use crate::ids::{ComputerId, Principal};
use crate::{BackendError, CreateSpec, Progress, SandboxRef};

/// The exact message for a malformed checkpoint name (the `computer_id` slug rule).
pub const INVALID_CHECKPOINT_NAME: &str = "checkpoint must be 1-63 lowercase letters, numbers, or hyphens; it must start and end with a letter or number.";

/// Ancestors kept in a lineage: a chain longer than this has lost its oldest names, which
/// only matters when all of the nearer ones were deleted. Labels stay well under a kilobyte.
pub const MAX_LINEAGE: usize = 32;

/// A checkpoint's name: the `computer_id` slug rule (1-63 of `[a-z0-9-]`, alphanumeric ends).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CheckpointName(String);

/// A name that breaks the slug rule; its `Display` is [`INVALID_CHECKPOINT_NAME`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{INVALID_CHECKPOINT_NAME}")]
pub struct InvalidCheckpointName;

impl CheckpointName {
    /// A client's name, trimmed.
    pub fn parse(raw: &str) -> Result<Self, InvalidCheckpointName> {
        let name = raw.trim();
        let bytes = name.as_bytes();
        let edge_ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        let valid = !bytes.is_empty()
            && bytes.len() <= 63
            && bytes.iter().all(|&b| edge_ok(b) || b == b'-')
            && bytes.first().copied().is_some_and(edge_ok)
            && bytes.last().copied().is_some_and(edge_ok);
        if valid {
            Ok(Self(name.to_owned()))
        } else {
            Err(InvalidCheckpointName)
        }
    }

    /// `<prefix>-` and 8 random hex digits (`c-…` for a checkpoint without a name, `fork-…`
    /// for the implicit checkpoint of a fork of the present state).
    pub fn random(prefix: &str) -> Self {
        let suffix: u32 = rand::rng().random();
        Self(format!("{prefix}-{suffix:08x}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for CheckpointName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One checkpoint as its provider recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRecord {
    pub name: CheckpointName,
    /// The computer's lineage when it was taken, nearest first: its parent is the first of
    /// these that still exists.
    pub lineage: Vec<CheckpointName>,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// What the checkpoint adds on the provider, when it says.
    pub size_bytes: Option<u64>,
    /// Whether running processes were captured.
    pub memory: bool,
    pub note: Option<String>,
}

/// A computer's checkpoints and where its present state comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointSet {
    /// Oldest first.
    pub checkpoints: Vec<CheckpointRecord>,
    /// The checkpoints the present state descends from, nearest first (the last one taken
    /// since the computer was made, else the one it was rolled back to or forked from, and
    /// that one's lineage).
    pub lineage: Vec<CheckpointName>,
}

/// What [`Checkpoints::checkpoint`] is asked to record.
#[derive(Debug, Clone)]
pub struct NewCheckpoint {
    pub name: CheckpointName,
    /// The computer's lineage now; the provider records it on the checkpoint, and afterwards
    /// the computer's lineage starts with `name`.
    pub lineage: Vec<CheckpointName>,
    pub note: Option<String>,
    /// The computer's owner, recorded with the checkpoint (docs/auth.md).
    pub owner: Principal,
}

/// Where a rollback or a fork starts from.
#[derive(Debug, Clone)]
pub struct FromCheckpoint<'a> {
    /// The computer whose checkpoint it is.
    pub source: &'a ComputerId,
    pub checkpoint: &'a CheckpointRecord,
}

/// The provider side of checkpoints. Every method is called under the computer's lifecycle
/// lock by the registry, after it checked names, limits and ownership.
#[async_trait]
pub trait Checkpoints: Send + Sync {
    /// Records the computer's state now, pausing it at most while the provider copies it.
    /// Commands keep running.
    async fn checkpoint(
        &self,
        sandbox: &SandboxRef,
        new: &NewCheckpoint,
    ) -> Result<CheckpointRecord, BackendError>;

    /// The computer's checkpoints (oldest first) and its present lineage.
    async fn checkpoints(&self, id: &ComputerId) -> Result<CheckpointSet, BackendError>;

    /// Replaces the computer by one made from the checkpoint, under the same id, mode and
    /// owner (`spec`); the old incarnation and its processes are gone afterwards.
    async fn rollback(
        &self,
        sandbox: &SandboxRef,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError>;

    /// A new computer `spec.computer_id` made from the checkpoint, with its own copy of the
    /// checkpoint as the first of its history. Fails without leaving anything behind.
    async fn fork(
        &self,
        source: &SandboxRef,
        from: FromCheckpoint<'_>,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError>;

    /// Removes one checkpoint; the others keep working.
    async fn delete(&self, id: &ComputerId, name: &CheckpointName) -> Result<(), BackendError>;

    /// Removes every checkpoint of a computer that was deleted (or let go, when temporary).
    async fn forget(&self, id: &ComputerId) -> Result<(), BackendError>;
}

/// A lineage that starts with `first`, capped at [`MAX_LINEAGE`].
pub fn lineage_after(first: &CheckpointName, rest: &[CheckpointName]) -> Vec<CheckpointName> {
    std::iter::once(first.clone())
        .chain(rest.iter().filter(|name| *name != first).cloned())
        .take(MAX_LINEAGE)
        .collect()
}

/// A lineage as one label value (`a,b,c`), and back; names never hold a comma.
pub fn lineage_label(lineage: &[CheckpointName]) -> String {
    lineage
        .iter()
        .map(CheckpointName::as_str)
        .collect::<Vec<_>>()
        .join(",")
}

pub fn parse_lineage(raw: &str) -> Vec<CheckpointName> {
    raw.split(',')
        .filter_map(|name| CheckpointName::parse(name).ok())
        .take(MAX_LINEAGE)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_slug_rule() {
        assert!(CheckpointName::parse(" before-upgrade ").is_ok());
        assert!(CheckpointName::parse("c1").is_ok());
        for bad in ["", "-a", "a-", "Upper", "a_b", "a.b", &"x".repeat(64)] {
            assert_eq!(
                CheckpointName::parse(bad),
                Err(InvalidCheckpointName),
                "{bad}"
            );
        }
        let random = CheckpointName::random("c");
        assert_eq!(random.as_str().len(), 10);
        assert!(CheckpointName::parse(random.as_str()).is_ok());
    }

    #[test]
    fn a_lineage_round_trips_and_stays_bounded() {
        let names: Vec<CheckpointName> = (0..40)
            .map(|i| CheckpointName::parse(&format!("c{i}")).unwrap_or_else(|_| unreachable!()))
            .collect();
        let first = CheckpointName::parse("top").unwrap_or_else(|_| unreachable!());
        let lineage = lineage_after(&first, &names);
        assert_eq!(lineage.len(), MAX_LINEAGE);
        assert_eq!(lineage[0], first);
        assert_eq!(parse_lineage(&lineage_label(&lineage)), lineage);
        assert!(parse_lineage("").is_empty());
    }
}
