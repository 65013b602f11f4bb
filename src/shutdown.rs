//! Graceful shutdown (docs/decisions.md, "Shutdown"): kill in-flight command trees, remove every
//! temporary computer this process holds and every warm-pool spare, all within 20 s of the
//! first trigger. A second
//! SIGINT/SIGTERM or the bound ends it at once with the spec's message and exit code 1.
//!
//! When stdin EOF started the drain, the first signal that arrives during it is the *first*
//! signal, not the second: the Python MCP client closes stdin and sends SIGTERM 2 s later as a
//! matter of course, and treating that as "stop now" left computers behind.

use std::time::Duration;

use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::ids::ComputerId;
use crate::registry::Registry;

/// The whole sequence is bounded so a hung engine cannot keep the process alive forever.
const SHUTDOWN_BOUND: Duration = Duration::from_secs(20);
/// In-flight execs get this long for their kill sweeps before removal starts.
const EXEC_KILL_BOUND: Duration = Duration::from_secs(3);

/// SIGINT/SIGTERM listeners installed once, at startup, and kept until exit: a signal that
/// arrives between two waits is still counted (a listener created later would miss it).
pub struct Signals {
    listeners: Option<(Signal, Signal)>,
}

impl Signals {
    pub fn install() -> Self {
        let listeners = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Some((term, int)),
            _ => None,
        };
        Self { listeners }
    }

    /// Waits for the next SIGINT or SIGTERM.
    pub async fn next(&mut self) {
        let Some((term, int)) = self.listeners.as_mut() else {
            // Without signal handlers the process still ends on EOF; never resolve.
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}

/// What started the drain; decides how many further signals abort it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// SIGINT/SIGTERM: the next signal is the second one.
    Signal,
    /// The client went away (stdin EOF, HTTP service end): two signals are needed.
    ClientGone,
}

/// Cleans up and returns the exit code: 0 when every temporary computer is gone, 1 otherwise
/// (the caller then keeps its instance lock file so crash GC collects the rest).
pub async fn drain(registry: &Registry, trigger: Trigger, signals: &mut Signals) -> i32 {
    let abort = async {
        if trigger == Trigger::ClientGone {
            signals.next().await;
            tracing::info!("signal during shutdown cleanup; a second signal stops it");
        }
        signals.next().await;
    };
    tracing::info!(
        temporary = registry.temporary_ids().len(),
        ?trigger,
        "shutdown cleanup started"
    );
    let work = async {
        let _ = tokio::time::timeout(EXEC_KILL_BOUND, registry.kill_all_in_flight()).await;
        // Warm-pool spares go with the temporary computers (docs/warm-pool.md).
        let (failed, spares) = tokio::join!(
            registry.remove_all_temporary(),
            registry.backend().release_spares()
        );
        if let Err(error) = &spares {
            tracing::warn!(%error, "could not remove every warm-pool spare");
        }
        (failed, spares.is_ok())
    };
    // Cut short, the sweep may have left computers it had not recorded yet (creations in
    // progress), so an unfinished drain always counts as a failure.
    let remaining: Vec<ComputerId> = tokio::select! {
        result = tokio::time::timeout(SHUTDOWN_BOUND, work) => match result {
            Ok((failed, true)) if failed.is_empty() => return 0,
            Ok((failed, _)) => failed,
            Err(_) => registry.temporary_ids(),
        },
        () = abort => registry.temporary_ids(),
    };
    let ids: Vec<&str> = remaining.iter().map(ComputerId::as_str).collect();
    let ids = if ids.is_empty() {
        "(computers still being created, or warm-pool spares)".to_owned()
    } else {
        ids.join(", ")
    };
    eprintln!(
        "kilntainers: error: shutdown cleanup did not finish within 20s; temporary computers may remain: {ids}"
    );
    1
}
