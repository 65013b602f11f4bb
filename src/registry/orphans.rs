//! Crash recovery at startup (docs/decisions.md, "Crash recovery"): temporary computers whose creating server
//! died without cleaning up are removed, in the background, never delaying MCP traffic.
//! Computers without an instance marker (the Python reference's, other hosts') are never
//! touched, and neither are those of an instance whose lock is still held.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use tracing::{debug, warn};

use crate::backends::Backend;
use crate::ids::{ComputerId, InstanceId};
use crate::state;

/// Validates an eagerly validated backend, then removes the temporary computers of dead
/// instances and deletes their lock files. Returns the ids removed (also logged on stderr in
/// the spec's words).
pub async fn collect(
    backend: Arc<dyn Backend>,
    state_dir: &Path,
    me: &InstanceId,
) -> Vec<ComputerId> {
    let dead = state::dead_instances(state_dir, me);
    if dead.is_empty() && !backend.validates_eagerly() {
        return Vec::new();
    }
    if let Err(error) = backend.validate().await {
        // The first tool call reports an unreachable backend in full; here it is only news
        // when there is garbage to collect.
        if dead.is_empty() {
            debug!(%error, "backend not reachable at startup");
        } else {
            warn!(%error, "crash GC skipped: backend unavailable");
        }
        return Vec::new();
    }
    if dead.is_empty() {
        return Vec::new();
    }
    let dead_ids: HashSet<InstanceId> = dead.iter().map(|d| d.id.clone()).collect();
    match backend.collect_orphans(&dead_ids).await {
        Ok(removed) => {
            if !removed.is_empty() {
                let ids: Vec<&str> = removed.iter().map(ComputerId::as_str).collect();
                eprintln!(
                    "kilntainers: removed {} temporary computer(s) left by a previous server: {}",
                    removed.len(),
                    ids.join(", ")
                );
            }
            dead.into_iter().for_each(state::DeadInstance::forget);
            removed
        }
        Err(error) => {
            // Keep the lock files: the next start tries again.
            warn!(%error, "crash GC failed");
            Vec::new()
        }
    }
}
