//! The server's side of the resident exec helper (`docs/exec-helper.md`): instead of one exec
//! per command, each computer gets one long-lived exec of a small static helper, and commands
//! travel over its stdin/stdout. A warm command then costs a pipe round trip instead of the
//! backend's exec calls. Docker and Kubernetes both use it; each supplies a [`Transport`]
//! (how to put the binary in and start an attached process), and nothing else here knows
//! which backend it runs on.
//!
//! [`Helpers`] decides, per computer, whether that path is usable and keeps its connection:
//! the binary is uploaded before the first connection and again before every later one (a
//! root user in the computer may have replaced the file, and the upload puts ours back), and
//! any computer where it cannot run (read-only root filesystem, another architecture, noexec,
//! a helper that keeps dying) falls back to the backend's plain exec for the rest of this
//! server's life, with the reason logged once. A helper that breaks the protocol or its
//! limits (see [`connection`]) counts as broken at once: that fallback is also said once in
//! the next command's stderr.
//!
//! Nothing here decides policy: timeouts, limits and kill-on-early-end stay in the exec policy
//! layer (`src/exec/`); the helper only carries them out (its `Kill` is the kill sweep).

pub mod binary;
mod connection;
mod untrusted;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub use connection::{Attached, Chunk, Lost};
use connection::{ConnectError, Connection};
use kilntainers_backend::ids::ExecId;
use kilntainers_backend::{ExecEnd, ExecSpec, OutputSink, SandboxRef, SinkControl, Stream};
pub use untrusted::printable;

/// Why the helper could not be put into a computer.
#[derive(Debug)]
pub enum UploadError {
    /// The computer cannot take it (read-only filesystem, no room, no shell): it uses the
    /// plain path from now on.
    Impossible(String),
    /// The backend could not reach the computer this time (it stopped, a connection broke):
    /// this command takes the plain path, which reports a gone computer in its usual words,
    /// and the next one tries again.
    Unreached(String),
}

/// How a backend reaches into its computers for the helper: it puts the binary there and
/// starts an attached process. Everything else (the protocol, its limits, the fallback) is
/// the same on every backend and lives here.
#[async_trait]
pub trait Transport: Send + Sync {
    /// Puts the helper at [`binary::PATH`] in the computer, replacing what is there.
    async fn upload(&self, sandbox: &SandboxRef) -> Result<(), UploadError>;
    /// Starts `argv` in the computer with stdin, stdout and stderr attached; `Err(reason)` =
    /// the backend refused the process itself (the computer is gone or stopped), which the
    /// plain path then reports in its usual words.
    async fn attach(&self, sandbox: &SandboxRef, argv: Vec<String>) -> Result<Attached, String>;
}

/// After this many lost connections in a row (no command finished in between), a computer
/// stops trying the helper: a helper that keeps dying must not cost every call a reconnect.
const MAX_LOSSES: u32 = 3;
/// Bound for the helper's own kill; past it the backend's own kill sweep runs instead.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// Output an internal command (readiness) may print, stdout and stderr together, before it is
/// stopped: the readiness marker is one line, and what runs it may be hostile (the other
/// backends keep the same 64 KiB).
pub const INTERNAL_OUTPUT_CAP: usize = 64 * 1024;
/// The byte with which the helper's `connect` mode says the connection is open.
pub const PORT_CONNECTED: u8 = kilntainers_helper::forward::CONNECTED;
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
    /// The plain exec path from now on; the reason was logged when this was decided. `notice` =
    /// the line the next command's stderr carries (only for a broken helper), taken once.
    Fallback { notice: Option<String> },
}

pub struct Helpers {
    /// The backend's plain exec path, as the fallback notice and the log name it.
    plain: &'static str,
    /// `Err(reason)` = never use the helper (turned off, or not in this build).
    enabled: Result<(), String>,
    containers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<State>>>>,
}

impl Helpers {
    /// `plain` names the path used when the helper is not: "Docker exec", "pods/exec".
    pub fn new(turned_on: bool, plain: &'static str) -> Self {
        let enabled = if turned_on {
            binary::available()
        } else {
            Err("turned off with --exec-helper off".to_owned())
        };
        match &enabled {
            Ok(()) => {}
            Err(reason) if turned_on => {
                warn!("exec helper unavailable, every command uses {plain}: {reason}")
            }
            Err(reason) => info!("exec helper {reason}"),
        }
        Self {
            plain,
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

    /// Puts the helper into a computer this server just created or started (while it starts),
    /// so its first command needs no extra round trip. An impossible upload means this
    /// computer uses the plain exec path; one that did not reach it is tried again by the
    /// first command. A computer that already has a connection, or has fallen back, is left
    /// as it is.
    pub async fn install(&self, transport: &dyn Transport, sandbox: &SandboxRef) {
        if self.enabled.is_err() {
            return;
        }
        let slot = self.slot(sandbox.sandbox_id.as_str());
        let mut state = slot.lock().await;
        if !matches!(*state, State::Idle { .. }) {
            return;
        }
        *state = match transport.upload(sandbox).await {
            Ok(()) => State::Idle {
                losses: 0,
                uploaded: true,
            },
            Err(UploadError::Impossible(reason)) => self.fall_back(sandbox, &reason),
            Err(UploadError::Unreached(_)) => State::Idle {
                losses: 0,
                uploaded: false,
            },
        };
    }

    /// The live connection for this container, connecting (and uploading) when needed;
    /// `None` = use the plain path.
    async fn connection(
        &self,
        transport: &dyn Transport,
        sandbox: &SandboxRef,
    ) -> Option<Arc<Connection>> {
        self.enabled.as_ref().ok()?;
        let slot = self.slot(sandbox.sandbox_id.as_str());
        let mut state = slot.lock().await;
        let (losses, uploaded) = match &*state {
            State::Ready { connection, .. } if !connection.is_lost() => {
                return Some(connection.clone());
            }
            State::Ready { connection, .. } if connection.broken().is_some() => {
                let reason = connection.broken().unwrap_or_default();
                *state = self.fall_back_broken(sandbox, &reason);
                return None;
            }
            // Whoever notices a lost connection first counts it, here, once. The file is
            // uploaded again: whatever ended the helper may also have replaced it.
            State::Ready { losses, .. } => (losses + 1, false),
            State::Idle { losses, uploaded } => (*losses, *uploaded),
            State::Fallback { .. } => return None,
        };
        if losses >= MAX_LOSSES {
            *state = self.fall_back(
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
                match transport.upload(sandbox).await {
                    Ok(()) => {}
                    Err(UploadError::Impossible(reason)) => {
                        *state = self.fall_back(sandbox, &reason);
                        return None;
                    }
                    Err(UploadError::Unreached(reason)) => {
                        debug!(sandbox = %sandbox.sandbox_id, %reason, "the helper's upload did not reach the computer");
                        *state = State::Idle {
                            losses,
                            uploaded: false,
                        };
                        return None;
                    }
                }
            }
            let argv = vec![binary::PATH.clone(), "serve".to_owned()];
            let opened = match transport.attach(sandbox, argv).await {
                Ok(attached) => Connection::over(attached, sandbox.sandbox_id.as_str()).await,
                Err(reason) => Err(ConnectError::Refused(reason)),
            };
            match opened {
                Ok(connection) => {
                    *state = State::Ready {
                        connection: connection.clone(),
                        losses,
                    };
                    return Some(connection);
                }
                // The plain path reports a vanished or stopped computer in its usual words.
                Err(ConnectError::Refused(reason)) => {
                    debug!(sandbox = %sandbox.sandbox_id, %reason, "the backend refused the helper's exec");
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
                    *state = self.fall_back_broken(sandbox, &reason);
                    return None;
                }
                // The copy put in before start may be hidden (a mount over its directory):
                // one more try with a fresh upload.
                Err(ConnectError::Unusable { .. }) if uploaded => uploaded = false,
                Err(ConnectError::Unusable { reason, .. }) => {
                    *state = self.fall_back(sandbox, &reason);
                    return None;
                }
            }
        }
    }

    /// The helper's path in this container, once a connection shows it runs there (uploaded
    /// again when needed), for its `connect` mode (docs/files.md, "Ports"); `Err` says why
    /// this computer has none.
    pub async fn runnable_path(
        &self,
        transport: &dyn Transport,
        sandbox: &SandboxRef,
    ) -> Result<&'static str, String> {
        if let Err(reason) = &self.enabled {
            return Err(format!("the exec helper is not available ({reason})"));
        }
        match self.connection(transport, sandbox).await {
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
    /// `None` = use the plain path.
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        &self,
        transport: &dyn Transport,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        env: &[String],
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Option<Result<ExecEnd, Lost>> {
        if !fits_in_a_frame(spec) {
            // Far beyond what the kernel accepts as arguments anyway: the plain path reports it.
            return None;
        }
        let Some(connection) = self.connection(transport, sandbox).await else {
            if let Some(notice) = self.take_notice(sandbox.sandbox_id.as_str()).await {
                // The caller runs the command through the plain path into the same sink.
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
    /// and stdout; `None` = no usable helper here, or it broke: use the plain path. Output past
    /// [`INTERNAL_OUTPUT_CAP`] stops the command and is an error.
    pub async fn run_collected(
        &self,
        transport: &dyn Transport,
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
            let connection = self.connection(transport, sandbox).await?;
            let mut collected = Collected::default();
            let cancel = CancellationToken::new();
            match connection.run(&spec, &[], &mut collected, &cancel).await {
                // First: a flood that also ended by itself (its exit raced the stop; on a busy
                // machine it can win) is still a flood.
                Ok(_) if collected.overflowed => {
                    let tag = spec.exec_id.env_entry();
                    let _ = tokio::time::timeout(KILL_TIMEOUT, connection.kill(tag)).await;
                    Some(Err(format!(
                        "it printed more than {} KiB",
                        INTERNAL_OUTPUT_CAP / 1024
                    )))
                }
                Ok(ExecEnd::Exited(code)) => {
                    self.finished(sandbox.sandbox_id.as_str(), &connection)
                        .await;
                    Some(Ok((code, collected.stdout)))
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
    /// not answer), so the caller runs its own kill sweep.
    pub async fn kill(&self, sandbox: &SandboxRef, tag: String) -> Option<()> {
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
    pub fn forget(&self, container: &str) {
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

impl Helpers {
    fn fall_back(&self, sandbox: &SandboxRef, reason: &str) -> State {
        warn!(
            computer_id = %sandbox.computer_id,
            sandbox = %sandbox.sandbox_id,
            "exec helper cannot run here, this computer uses {}: {reason}",
            self.plain
        );
        State::Fallback { notice: None }
    }

    /// Gives up a helper that broke the protocol or its limits: logged, and said once in the
    /// next command's stderr (the user sees why that computer's commands got slower, and that
    /// its helper misbehaved).
    fn fall_back_broken(&self, sandbox: &SandboxRef, reason: &str) -> State {
        let reason = printable(reason.as_bytes(), NOTICE_REASON_KEPT);
        warn!(
            computer_id = %sandbox.computer_id,
            sandbox = %sandbox.sandbox_id,
            "exec helper broken, this computer uses {}: {reason}",
            self.plain
        );
        State::Fallback {
            notice: Some(format!(
                "[kilntainers: exec helper unavailable in this computer ({reason}); using {}]\n",
                self.plain.to_ascii_lowercase()
            )),
        }
    }
}
