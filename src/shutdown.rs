//! Graceful shutdown (`lifecycle.md` §8, D5): kill in-flight command trees, remove every
//! temporary computer this process holds, all within 20 s of the first trigger. A second
//! SIGINT/SIGTERM or the bound ends it at once with the spec's message and exit code 1.

use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};

use crate::ids::ComputerId;
use crate::registry::Registry;

/// The whole sequence is bounded so a hung engine cannot keep the process alive forever.
const SHUTDOWN_BOUND: Duration = Duration::from_secs(20);
/// In-flight execs get this long for their kill sweeps before removal starts.
const EXEC_KILL_BOUND: Duration = Duration::from_secs(3);

/// Waits for the first SIGINT or SIGTERM.
pub async fn signalled() {
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the process still ends on EOF; never resolve.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Cleans up and returns the exit code. Listens for a second signal while it works.
pub async fn drain(registry: &Registry) -> i32 {
    let work = async {
        let _ = tokio::time::timeout(EXEC_KILL_BOUND, registry.kill_all_in_flight()).await;
        registry.remove_all_temporary().await
    };
    let remaining: Vec<ComputerId> = tokio::select! {
        result = tokio::time::timeout(SHUTDOWN_BOUND, work) => match result {
            Ok(failed) => failed,
            Err(_) => registry.temporary_ids(),
        },
        () = signalled() => registry.temporary_ids(),
    };
    if remaining.is_empty() {
        return 0;
    }
    let ids: Vec<&str> = remaining.iter().map(ComputerId::as_str).collect();
    eprintln!(
        "kilntainers: error: shutdown cleanup did not finish within 20s; temporary computers may remain: {}",
        ids.join(", ")
    );
    1
}
