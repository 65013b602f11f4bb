//! The resident exec helper (`docs/exec-helper.md`): instead of one Docker exec per command,
//! each computer gets one long-lived exec of a small static helper, and commands travel over
//! its stdin/stdout. A warm command then costs a pipe round trip instead of the engine's exec
//! create/start/inspect calls.
//!
//! This module decides, per container, whether that path is usable and keeps its connection:
//! the binary is uploaded with the Engine API's archive call (before start for new computers,
//! and again before every later connection, remote engines included: a root user in the
//! computer may have replaced the file, and the upload puts ours back), and any computer where
//! it cannot run (read-only root filesystem, another architecture, noexec, a helper that keeps
//! dying) falls back to plain Docker exec for the rest of this server's life, with the reason
//! logged once. A helper that breaks the protocol or its limits (see [`connection`]) counts as
//! broken at once: that fallback is also said once in the next command's stderr.
//!
//! Nothing here decides policy: timeouts, limits and kill-on-early-end stay in the exec policy
//! layer (`src/exec/`); the helper only carries them out (its `Kill` is the kill sweep).

pub(super) mod binary;
pub(super) mod broker;
mod connection;
mod untrusted;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bollard::Docker;
use bollard::query_parameters::UploadToContainerOptionsBuilder;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub(super) use connection::Lost;
use connection::{ConnectError, Connection};
use kilntainers_backend::ids::ExecId;
use kilntainers_backend::{ExecEnd, ExecSpec, OutputSink, SandboxRef, SinkControl, Stream};
use untrusted::printable;

/// After this many lost connections in a row (no command finished in between), a computer
/// stops trying the helper: a helper that keeps dying must not cost every call a reconnect.
const MAX_LOSSES: u32 = 3;
/// Bound for the helper's own kill; past it the Docker exec sweep runs instead.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// Output an internal command (readiness) may print, stdout and stderr together, before it is
/// stopped: the readiness marker is one line, and what runs it may be hostile (the other
/// backends keep the same 64 KiB).
pub(super) const INTERNAL_OUTPUT_CAP: usize = 64 * 1024;
/// The byte with which the helper's `connect` mode says the connection is open.
pub(super) const PORT_CONNECTED: u8 = kilntainers_helper::forward::CONNECTED;
/// Longest reason quoted in the fallback notice; reasons may quote the computer's own text.
const NOTICE_REASON_KEPT: usize = 300;

/// Per-container helper state.
enum State {
    /// No live connection. `uploaded` = this server put the binary there and nothing has run
    /// in the computer since (a freshly created one); otherwise it is uploaded again first.
    Idle { losses: u32, uploaded: bool },
    /// `losses` = connections lost in a row before this one.
    Ready {
        connection: Arc<Connection>,
        losses: u32,
    },
    /// Plain Docker exec from now on; the reason was logged when this was decided. `notice` =
    /// the line the next command's stderr carries (only for a broken helper), taken once.
    Fallback { notice: Option<String> },
}

pub(super) struct Helpers {
    /// `Err(reason)` = never use the helper (turned off, or not in this build).
    enabled: Result<(), String>,
    containers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<State>>>>,
}

impl Helpers {
    pub(super) fn new(turned_on: bool) -> Self {
        let enabled = if turned_on {
            binary::available()
        } else {
            Err("turned off with --exec-helper off".to_owned())
        };
        match &enabled {
            Ok(()) => {}
            Err(reason) if turned_on => {
                warn!("exec helper unavailable, every command uses Docker exec: {reason}")
            }
            Err(reason) => info!("exec helper {reason}"),
        }
        Self {
            enabled,
            containers: Mutex::new(HashMap::new()),
        }
    }

    fn slot(&self, container: &str) -> Arc<tokio::sync::Mutex<State>> {
        let mut containers = self
            .containers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        containers
            .entry(container.to_owned())
            .or_insert_with(|| {
                Arc::new(tokio::sync::Mutex::new(State::Idle {
                    losses: 0,
                    uploaded: false,
                }))
            })
            .clone()
    }

    /// Puts the helper into a container this server just created (while it starts), so its
    /// first command needs no extra round trip. A failure only means this computer uses
    /// Docker exec.
    pub(super) async fn install(&self, docker: &Docker, sandbox: &SandboxRef) {
        if self.enabled.is_err() {
            return;
        }
        let slot = self.slot(sandbox.sandbox_id.as_str());
        let mut state = slot.lock().await;
        *state = match upload(docker, sandbox.sandbox_id.as_str()).await {
            Ok(()) => State::Idle {
                losses: 0,
                uploaded: true,
            },
            Err(reason) => fall_back(sandbox, &reason),
        };
    }

    /// The live connection for this container, connecting (and uploading) when needed;
    /// `None` = use Docker exec.
    async fn connection(&self, docker: &Docker, sandbox: &SandboxRef) -> Option<Arc<Connection>> {
        self.enabled.as_ref().ok()?;
        let slot = self.slot(sandbox.sandbox_id.as_str());
        let mut state = slot.lock().await;
        let (losses, uploaded) = match &*state {
            State::Ready { connection, .. } if !connection.is_lost() => {
                return Some(connection.clone());
            }
            State::Ready { connection, .. } if connection.broken().is_some() => {
                let reason = connection.broken().unwrap_or_default();
                *state = fall_back_broken(sandbox, &reason);
                return None;
            }
            // Whoever notices a lost connection first counts it, here, once. The file is
            // uploaded again: whatever ended the helper may also have replaced it.
            State::Ready { losses, .. } => (losses + 1, false),
            State::Idle { losses, uploaded } => (*losses, *uploaded),
            State::Fallback { .. } => return None,
        };
        if losses >= MAX_LOSSES {
            *state = fall_back(
                sandbox,
                &format!("the helper stopped unexpectedly {losses} times in a row"),
            );
            return None;
        }
        let mut uploaded = uploaded;
        loop {
            if !uploaded {
                // Before every connection but a fresh computer's first: the file may have been
                // replaced by a root user in the computer, and ours is put back (the engine
                // unlinks the old file first, so a copy another connection runs is not
                // disturbed).
                if let Err(reason) = upload(docker, sandbox.sandbox_id.as_str()).await {
                    *state = fall_back(sandbox, &reason);
                    return None;
                }
            }
            match Connection::open(docker, sandbox.sandbox_id.as_str(), &binary::PATH).await {
                Ok(connection) => {
                    *state = State::Ready {
                        connection: connection.clone(),
                        losses,
                    };
                    return Some(connection);
                }
                // The plain path reports a vanished or stopped computer in its usual words.
                Err(ConnectError::Engine(error)) => {
                    debug!(container = %sandbox.sandbox_id, %error, "the engine refused the helper's exec");
                    *state = State::Idle {
                        losses,
                        uploaded: true,
                    };
                    return None;
                }
                Err(ConnectError::Unusable {
                    reason,
                    broken: true,
                }) => {
                    *state = fall_back_broken(sandbox, &reason);
                    return None;
                }
                // The copy put in before start may be hidden (a mount over its directory):
                // one more try with a fresh upload.
                Err(ConnectError::Unusable { .. }) if uploaded => uploaded = false,
                Err(ConnectError::Unusable { reason, .. }) => {
                    *state = fall_back(sandbox, &reason);
                    return None;
                }
            }
        }
    }

    /// The helper's path in this container, once a connection shows it runs there (uploaded
    /// again when needed), for its `connect` mode (docs/files.md, "Ports"); `Err` says why
    /// this computer has none.
    pub(super) async fn runnable_path(
        &self,
        docker: &Docker,
        sandbox: &SandboxRef,
    ) -> Result<&'static str, String> {
        if let Err(reason) = &self.enabled {
            return Err(format!("the exec helper is not available ({reason})"));
        }
        match self.connection(docker, sandbox).await {
            Some(_) => Ok(binary::PATH.as_str()),
            None => Err("the exec helper cannot run in this computer".to_owned()),
        }
    }

    /// The fallback notice for this container, once: `Some` only the first time it is asked
    /// after a broken helper was given up.
    async fn take_notice(&self, container: &str) -> Option<String> {
        let slot = self.slot(container);
        let mut state = slot.lock().await;
        match &mut *state {
            State::Fallback { notice } => notice.take(),
            _ => None,
        }
    }

    /// Runs `spec` (with `env` added) through the helper when this container has one;
    /// `None` = use Docker exec.
    pub(super) async fn run(
        &self,
        docker: &Docker,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        env: &[String],
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Option<Result<ExecEnd, Lost>> {
        if !fits_in_a_frame(spec) {
            // Far beyond what the kernel accepts as arguments anyway: Docker exec reports it.
            return None;
        }
        let Some(connection) = self.connection(docker, sandbox).await else {
            if let Some(notice) = self.take_notice(sandbox.sandbox_id.as_str()).await {
                // The caller runs the command through Docker exec into the same sink.
                let _ = sink.push(Stream::Stderr, notice.as_bytes());
            }
            return None;
        };
        let outcome = connection.run(spec, env, sink, cancel).await;
        if matches!(outcome, Ok(ExecEnd::Exited(_))) {
            self.finished(sandbox.sandbox_id.as_str(), &connection)
                .await;
        }
        Some(outcome)
    }

    /// Runs a short internal command (readiness) through the helper and returns its exit code
    /// and stdout; `None` = no usable helper here, or it broke: use Docker exec. Output past
    /// [`INTERNAL_OUTPUT_CAP`] stops the command and is an error.
    pub(super) async fn run_collected(
        &self,
        docker: &Docker,
        sandbox: &SandboxRef,
        argv: Vec<String>,
        limit: Duration,
    ) -> Option<Result<(i64, Vec<u8>), String>> {
        let spec = ExecSpec {
            argv,
            stdin: None,
            working_dir: None,
            exec_id: ExecId::random(),
            command: None,
        };
        let work = async {
            // Never the notice: that is for the next command a user runs.
            let connection = self.connection(docker, sandbox).await?;
            let mut collected = Collected::default();
            let cancel = CancellationToken::new();
            match connection.run(&spec, &[], &mut collected, &cancel).await {
                Ok(ExecEnd::Exited(code)) => {
                    self.finished(sandbox.sandbox_id.as_str(), &connection)
                        .await;
                    Some(Ok((code, collected.stdout)))
                }
                Ok(_) if collected.overflowed => {
                    let tag = spec.exec_id.env_entry();
                    let _ = tokio::time::timeout(KILL_TIMEOUT, connection.kill(tag)).await;
                    Some(Err(format!(
                        "it printed more than {} KiB",
                        INTERNAL_OUTPUT_CAP / 1024
                    )))
                }
                Ok(_) | Err(_) => None,
            }
        };
        match tokio::time::timeout(limit, work).await {
            Ok(outcome) => outcome,
            Err(_) => Some(Err(format!("timed out after {}s", limit.as_secs()))),
        }
    }

    /// A command completed normally: the losses in a row start again from zero.
    async fn finished(&self, container: &str, connection: &Arc<Connection>) {
        let slot = self.slot(container);
        let mut state = slot.lock().await;
        if let State::Ready {
            connection: current,
            losses,
        } = &mut *state
            && Arc::ptr_eq(current, connection)
        {
            *losses = 0;
        }
    }

    /// Kills tagged processes through a live helper; `None` = no live helper here (or it did
    /// not answer), so the caller runs the Docker exec sweep.
    pub(super) async fn kill(&self, sandbox: &SandboxRef, tag: String) -> Option<()> {
        let slot = {
            let containers = self
                .containers
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            containers.get(sandbox.sandbox_id.as_str())?.clone()
        };
        let connection = match &*slot.lock().await {
            State::Ready { connection, .. } if !connection.is_lost() => connection.clone(),
            _ => return None,
        };
        match tokio::time::timeout(KILL_TIMEOUT, connection.kill(tag)).await {
            Ok(Ok(())) => Some(()),
            Ok(Err(_)) => None,
            // The kill is the liveness probe that matters: a helper that cannot answer it
            // (stopped, wedged, or a fake that only said Hello) would make every later
            // command on this computer time out and blame the command.
            Err(_) => {
                connection.give_up(&format!(
                    "it did not answer a kill within {} s",
                    KILL_TIMEOUT.as_secs()
                ));
                None
            }
        }
    }

    /// Drops what is known about a container (removed, restarted or reset): its helper dies
    /// with it, and a restarted container gets a new connection on its next command.
    pub(super) fn forget(&self, container: &str) {
        self.containers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(container);
    }
}

/// Whether the command's `Start` frame stays under the protocol's limit (a bigger one would be
/// a protocol error that ends the connection for every command on it).
fn fits_in_a_frame(spec: &ExecSpec) -> bool {
    let strings: usize = spec
        .argv
        .iter()
        .chain(spec.working_dir.iter())
        .map(|s| s.len() + 4)
        .sum();
    strings + 1024 < kilntainers_helper::wire::MAX_PAYLOAD
}

/// Keeps stdout, counts stderr (internal commands report through their exit code), and stops
/// the command at [`INTERNAL_OUTPUT_CAP`].
#[derive(Default)]
struct Collected {
    stdout: Vec<u8>,
    total: usize,
    overflowed: bool,
}

impl OutputSink for Collected {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        self.total = self.total.saturating_add(bytes.len());
        if self.total > INTERNAL_OUTPUT_CAP {
            self.overflowed = true;
            return SinkControl::Stop;
        }
        if stream == Stream::Stdout {
            self.stdout.extend_from_slice(bytes);
        }
        SinkControl::Continue
    }
}

fn fall_back(sandbox: &SandboxRef, reason: &str) -> State {
    warn!(
        computer_id = %sandbox.computer_id,
        container = %sandbox.sandbox_id,
        "exec helper cannot run here, this computer uses Docker exec: {reason}"
    );
    State::Fallback { notice: None }
}

/// Gives up a helper that broke the protocol or its limits: logged, and said once in the next
/// command's stderr (the user sees why that computer's commands got slower, and that its
/// helper misbehaved).
fn fall_back_broken(sandbox: &SandboxRef, reason: &str) -> State {
    let reason = printable(reason.as_bytes(), NOTICE_REASON_KEPT);
    warn!(
        computer_id = %sandbox.computer_id,
        container = %sandbox.sandbox_id,
        "exec helper broken, this computer uses Docker exec: {reason}"
    );
    State::Fallback {
        notice: Some(format!(
            "[kilntainers: exec helper unavailable in this computer ({reason}); using docker exec]\n"
        )),
    }
}

/// Puts the helper binary into `container` at [`binary::PATH`] for a mode other than the exec
/// helper (the egress relay), whether or not the exec helper is turned on.
pub(super) async fn put_binary(docker: &Docker, container: &str) -> Result<&'static str, String> {
    binary::available()?;
    upload(docker, container).await?;
    Ok(binary::PATH.as_str())
}

/// Extracts the helper archive at `/` through the Engine API (works on remote engines, and on
/// created-but-not-started containers).
async fn upload(docker: &Docker, container: &str) -> Result<(), String> {
    let archive = binary::archive().map_err(|e| format!("cannot build the helper archive: {e}"))?;
    let options = UploadToContainerOptionsBuilder::default()
        .path("/")
        .no_overwrite_dir_non_dir("true")
        .build();
    docker
        .upload_to_container(container, Some(options), bollard::body_full(archive.into()))
        .await
        .map_err(|e| format!("uploading the helper failed: {}", super::describe(&e)))
}
