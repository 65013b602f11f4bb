//! The backend API of the server: the one seam between it and the providers. The [`Backend`]
//! trait, the plain data it speaks in ([`SandboxRef`], [`CreateSpec`], [`ExecSpec`],
//! [`ComputerInfo`]), its typed error, and what every provider shares: ids, the file
//! vocabulary, POSIX shell snippets, label names, the REST client of the HTTP providers
//! (feature `rest`) and a scripted fake (feature `test-support`). One crate per provider
//! implements the trait; the server's `providers` module is the only place that names one.
//!
//! **Architecture invariant (the manifest enforces it):** this crate depends on no other crate
//! of the workspace, nor on rmcp or axum. Backends push output into an [`OutputSink`] and stop
//! when told; they never see the output limit, and they never format user-facing results.

pub mod brokering;
pub mod checkpoints;
pub mod clock;
pub mod egress;
#[cfg(any(test, feature = "test-support"))]
pub mod fake;
pub mod files;
pub mod ids;
pub mod labels;
pub mod posix;
#[cfg(feature = "rest")]
pub mod rest;
pub mod secret;
pub mod snapshots;

use std::collections::HashSet;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::ids::{ComputerId, ExecId, InstanceId, Principal, SandboxId};
use checkpoints::Checkpoints;
use files::FileSystem;

/// The image every default configuration uses, and the one the exact reference tool text
/// describes (docs/decisions.md, "Tool descriptions").
pub const DEFAULT_IMAGE: &str = "debian:bookworm-slim";

/// What every backend is told besides its own section: the flags that apply to all of them.
#[derive(Debug, Clone)]
pub struct Common {
    /// `--shell`: what `command` runs under.
    pub shell: String,
    /// `--network` (on) or `--no-network`.
    pub network: bool,
    /// `--timeout`: a command's default time limit.
    pub default_timeout_secs: u64,
    /// `--egress*` (docs/egress.md): the policy new computers get and how its enforcement
    /// resolves and connects. Open without rules by default.
    pub egress: egress::EgressSettings,
    /// `--secret*` (docs/secrets.md): the secrets computers use through the egress proxy
    /// without seeing them. Empty unless brokering is on; only Docker/Podman brokers (the
    /// configuration refuses it for the others).
    pub secrets: brokering::SecretBook,
}

/// The provider's current incarnation of a computer, as plain data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRef {
    pub computer_id: ComputerId,
    /// Provider handle (12-char container id on Docker); changes on factory reset.
    pub sandbox_id: SandboxId,
    pub temporary: bool,
    /// The base image recorded on the computer (label), used again by factory reset.
    pub image: String,
}

/// What [`Backend::lookup`] found: the computer and whether it is currently running.
#[derive(Debug, Clone)]
pub struct Found {
    pub sandbox: SandboxRef,
    pub running: bool,
}

/// Everything needed to create a computer.
#[derive(Debug, Clone)]
pub struct CreateSpec {
    pub computer_id: ComputerId,
    pub temporary: bool,
    /// `None` = the configured image; factory reset passes the computer's recorded image.
    pub image: Option<String>,
    /// The creating server, recorded on temporary computers for crash GC.
    pub instance: InstanceId,
    /// Recorded as the owner label or metadata (docs/auth.md); `computer_id` is already
    /// scoped. `None` only when re-creating a computer that had no owner label.
    pub owner: Option<Principal>,
    /// The computer's own egress policy when it narrows the server's (docs/egress.md, "Per
    /// computer"); `None` = the server's, as [`Common::egress`] has it.
    pub egress: Option<egress::EgressPolicy>,
}

/// One command to run. Built by `exec` from a validated request; backends only translate it.
#[derive(Debug, Clone)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    pub stdin: Option<Vec<u8>>,
    pub working_dir: Option<String>,
    pub exec_id: ExecId,
    /// The raw `command` string in command mode (`argv` is then `<shell> -c <command>`), for
    /// backends without a shell that interpret it themselves (go_busybox).
    pub command: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// What the sink wants after a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkControl {
    Continue,
    /// Stop reading: the output limit was crossed. The caller kills the process tree.
    Stop,
}

/// Receives a command's output as it streams.
pub trait OutputSink: Send {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl;
}

/// How an exec ended, as far as the backend can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecEnd {
    Exited(i64),
    /// The sink asked to stop; the process may still be running.
    StoppedBySink,
    /// A WASM guest used up its `--wasm-fuel` budget (the value is that budget).
    OutOfFuel(u64),
}

/// One row of the inventory (docs/decisions.md, "Listing computers").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputerInfo {
    pub sandbox: SandboxRef,
    pub state: String,
    pub created_at: Option<String>,
}

/// What [`Backend::stop_idle`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleStopped {
    Stopped,
    /// Left running: another server's work is on it (Docker: an exec of another process).
    InUseElsewhere,
}

/// How a backend's computers stop when idle (`--idle-stop`, docs/idle-stop.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdleStop {
    /// [`Backend::stop_idle`] stops them; their files stay.
    Stops,
    /// Nothing runs between commands, so there is nothing to stop (WASM).
    NothingToStop,
    /// The option is refused at startup with this message.
    Refused(String),
}

/// Restart result: the new incarnation and whether the writable state survived.
#[derive(Debug, Clone)]
pub struct Restarted {
    pub sandbox: SandboxRef,
    pub state_preserved: bool,
}

/// A byte stream to a TCP port inside a computer (docs/files.md, "Ports").
pub trait PortStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> PortStream for T {}

/// How a port in a computer is reached from outside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortRoute {
    /// Through this server, one [`Backend::connect_port`] per connection.
    Forwarded,
    /// The provider's own URL for the port; `public` = anyone who has the URL reaches it.
    Provider { url: String, public: bool },
}

/// The warm pool's fill level (docs/warm-pool.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WarmPoolSize {
    /// Spares started and ready to be handed out now.
    pub ready: usize,
    /// How many spares the pool keeps (`--warm-pool`).
    pub target: usize,
}

/// Progress reports while a backend waits on its provider (image pulls, machine starts).
pub trait Progress: Send + Sync {
    fn report(&self, progress: f64, total: Option<f64>, message: String);
}

/// A [`Progress`] that drops everything.
pub struct NoProgress;

impl Progress for NoProgress {
    fn report(&self, _: f64, _: Option<f64>, _: String) {}
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    /// The provider cannot be reached or refused our credentials; the text says what to do.
    #[error("{0}")]
    Unavailable(String),
    /// The computer is gone provider-side.
    #[error(
        "Computer '{}' no longer exists. Call again to create a new computer with this ID.",
        .0.slug()
    )]
    Vanished(ComputerId),
    /// The computer exists but is not running (stopped or died); starting it may help.
    #[error("Sandbox {0} is not running")]
    NotRunning(SandboxId),
    /// The computer died while a command ran.
    #[error("Sandbox {0} died during command execution")]
    DiedDuringExec(SandboxId),
    /// Any other provider failure, already phrased for the user (names the computer and call).
    #[error("{0}")]
    Provider(String),
}

/// A provider of computers. Object-safe; the registry holds `Arc<dyn Backend>`.
#[async_trait]
pub trait Backend: Send + Sync {
    /// The `--backend` name reported as `ComputerInfo.backend`.
    fn kind(&self) -> &'static str;

    /// The backend's `terminal_execute` description (docs/decisions.md, "Tool descriptions"), before the
    /// override/extended rules are applied.
    fn tool_instructions(&self) -> String;

    /// One-time work before [`Backend::tool_instructions`] can describe the backend (go_busybox
    /// reads its applet list from the module). Failures are reported by the backend itself.
    async fn prepare(&self) {}

    /// Refuses, once at startup, a setup that would hand the server's own secrets to the
    /// computers (Fly: sandbox Machines in an app with secrets). What cannot be decided yet
    /// (provider unreachable, no credentials) is `Ok` here and checked again at first use.
    async fn check_startup(&self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Whether jobs run inside the server process instead of in the computer (docs/jobs.md,
    /// "Backends"): backends without a POSIX shell in the computer.
    fn runs_jobs_in_server(&self) -> bool {
        false
    }

    /// Whether the computer has a POSIX `sh` with the usual tools, which the file tools' programs
    /// need (docs/files.md, "Backends").
    fn has_posix_shell(&self) -> bool {
        !self.runs_jobs_in_server()
    }

    /// Whether a command's output reaches the sink byte for byte. False where the provider
    /// carries it as text (Fly's exec answers JSON strings, so bytes that are not UTF-8 come
    /// back replaced): the file tools then read files as base64 (docs/files.md, "How it works
    /// inside a computer").
    fn exec_output_is_binary(&self) -> bool {
        true
    }

    /// Direct access to the computer's files, for a backend that has it (docs/files.md,
    /// "Backends"). `None`: the file tools run their POSIX `sh` programs through
    /// [`Backend::exec`] (when [`Backend::has_posix_shell`]).
    fn file_system(&self) -> Option<&dyn FileSystem> {
        None
    }

    /// The provider side of checkpoints, rollback and fork (docs/checkpoints.md), for a
    /// backend that has them. `None`: the checkpoint tools refuse with
    /// [`Backend::no_checkpoints`] before they touch (or create) a computer.
    fn checkpoints(&self) -> Option<&dyn Checkpoints> {
        None
    }

    /// The refusal of a backend without checkpoints.
    fn no_checkpoints(&self) -> BackendError {
        BackendError::Provider(format!(
            "Checkpoints are not available on the {} backend.",
            self.kind()
        ))
    }

    /// Whether [`Backend::port_route`] can ever answer; `false` lets `port_url` refuse with
    /// [`Backend::no_ports`] before it touches (or creates) a computer.
    fn has_ports(&self) -> bool {
        true
    }

    /// How `port` of the computer is reached (docs/files.md, "Ports"). Backends without ports
    /// keep the default refusal.
    async fn port_route(
        &self,
        _sandbox: &SandboxRef,
        _port: u16,
    ) -> Result<PortRoute, BackendError> {
        Err(self.no_ports())
    }

    /// One TCP connection to `port` in the computer, for a [`PortRoute::Forwarded`] backend.
    async fn connect_port(
        &self,
        _sandbox: &SandboxRef,
        _port: u16,
    ) -> Result<Box<dyn PortStream>, BackendError> {
        Err(self.no_ports())
    }

    /// The refusal of a backend that has no ports.
    fn no_ports(&self) -> BackendError {
        BackendError::Provider(format!(
            "Ports are not available on the {} backend.",
            self.kind()
        ))
    }

    /// Keeps a warm pool of started spare computers full until [`Backend::release_spares`]
    /// (docs/warm-pool.md); [`Backend::create`] hands a spare out as a temporary computer when
    /// one is ready. Returns at once on a backend without a pool. Spares carry `instance`, so
    /// crash GC collects them like the temporary computers of that instance.
    async fn keep_warm(&self, _instance: &InstanceId) {}

    /// The pool's fill level, when this backend keeps a warm pool.
    fn warm_pool(&self) -> Option<WarmPoolSize> {
        None
    }

    /// Shutdown: stops refilling, waits for spares being made, and removes every spare.
    async fn release_spares(&self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Checks reachability once; callers cache success.
    async fn validate(&self) -> Result<(), BackendError>;

    /// Whether [`Backend::validate`] runs at startup, in the background, so the first tool
    /// call does not pay for connecting (docs/decisions.md, "Crash recovery": Docker/Podman only).
    fn validates_eagerly(&self) -> bool {
        false
    }

    /// The egress policy recorded on `sandbox` (docs/egress.md, "Recorded"); `None` when this
    /// backend records none, or the computer has none (open without rules).
    async fn egress_policy(
        &self,
        _sandbox: &SandboxRef,
    ) -> Result<Option<egress::EgressPolicy>, BackendError> {
        Ok(None)
    }

    /// The refusals recorded for `sandbox` by the enforcement of its egress policy, the last
    /// 100 distinct ones, oldest first (docs/egress.md, "Docker wiring"); `None` when this
    /// backend records none.
    async fn egress_denials(
        &self,
        _sandbox: &SandboxRef,
    ) -> Result<Option<Vec<egress::DeniedEntry>>, BackendError> {
        Ok(None)
    }

    /// The refusals recorded for `sandbox` from `from_ms` to `to_ms` (Unix milliseconds, both
    /// included), oldest first: a job's, which ran past the exec that appends a command's
    /// (docs/egress.md, "Docker wiring"). Empty when this backend records none.
    async fn egress_denials_between(
        &self,
        _sandbox: &SandboxRef,
        _from_ms: u64,
        _to_ms: u64,
    ) -> Vec<egress::Denial> {
        Vec::new()
    }

    /// The allow rules people added for `sandbox` (ask-to-allow's `allow for this computer`,
    /// the dashboard's; docs/egress.md, "Dashboard"), already among
    /// [`Backend::egress_policy`]'s allow rules; `None` when this backend keeps none.
    async fn egress_grants(
        &self,
        _sandbox: &SandboxRef,
    ) -> Result<Option<Vec<egress::Pattern>>, BackendError> {
        Ok(None)
    }

    /// Adds (`granted`) or removes a person's allow rule for `sandbox`, kept outside the
    /// computer and given to its enforcement at once when it runs; whether anything changed.
    /// The caller has checked the rule against the server's bounds.
    async fn set_egress_grant(
        &self,
        _sandbox: &SandboxRef,
        _pattern: &egress::Pattern,
        _granted: bool,
    ) -> Result<bool, BackendError> {
        Err(BackendError::Provider(format!(
            "the {} backend keeps no egress rules for a computer",
            self.kind()
        )))
    }

    /// The shared [`brokering::SecretBook`] changed (a principal entered a secret): give the
    /// enforcement of every running computer its secrets again, so the new one works without
    /// a restart (docs/secrets.md). Backends that broker nothing ignore it.
    async fn secrets_changed(&self) {}

    /// The questions of ask-to-allow (docs/egress.md, "Ask-to-allow"): connections held until
    /// the server answers each. The receiving end is handed out once (to the server); `None`
    /// when this backend never asks, or it was taken already.
    fn egress_questions(&self) -> Option<tokio::sync::mpsc::Receiver<egress::EgressQuestion>> {
        None
    }

    async fn create(
        &self,
        spec: &CreateSpec,
        progress: &dyn Progress,
    ) -> Result<SandboxRef, BackendError>;

    /// Finds a computer by id without changing it (mode checks happen before any start).
    async fn lookup(&self, id: &ComputerId) -> Result<Option<Found>, BackendError>;

    /// Starts a stopped computer and checks readiness; a no-op beyond readiness when running.
    async fn ensure_running(&self, sandbox: &SandboxRef) -> Result<SandboxRef, BackendError>;

    async fn list(&self) -> Result<Vec<ComputerInfo>, BackendError>;

    async fn restart(&self, sandbox: &SandboxRef) -> Result<Restarted, BackendError>;

    /// Deletes the provider object and all its writable state, without a stop grace.
    async fn remove(&self, sandbox: &SandboxRef) -> Result<(), BackendError>;

    /// Runs one command, pushing output into `sink` until it ends or the sink says stop.
    /// Dropping the future stops reading; killing the process tree is [`Backend::kill_exec`].
    async fn exec(
        &self,
        sandbox: &SandboxRef,
        spec: &ExecSpec,
        sink: &mut dyn OutputSink,
        cancel: &CancellationToken,
    ) -> Result<ExecEnd, BackendError>;

    /// Kills every process carrying `exec_id`'s tag (docs/decisions.md, "Killing a command").
    async fn kill_exec(&self, sandbox: &SandboxRef, exec_id: &ExecId) -> Result<(), BackendError>;

    /// What `--idle-stop` does on this backend (docs/idle-stop.md). The default refuses, so a
    /// backend says how its computers stop before the option is offered on it.
    fn idle_stop(&self) -> IdleStop {
        IdleStop::Refused(format!(
            "--idle-stop is not available on the {} backend.",
            self.kind()
        ))
    }

    /// Stops an idle permanent computer so it costs nothing until its next use, which starts
    /// it again through the path of any stopped computer ([`BackendError::NotRunning`], then
    /// [`Backend::ensure_running`]). Only called when [`Backend::idle_stop`] is
    /// [`IdleStop::Stops`], with no work of this server's on the computer; a backend that can
    /// see another server's work on it leaves it running.
    async fn stop_idle(&self, _sandbox: &SandboxRef) -> Result<IdleStopped, BackendError> {
        Ok(IdleStopped::Stopped)
    }

    /// Removes temporary computers created by the `dead` instances; returns the ids removed.
    async fn collect_orphans(
        &self,
        dead: &HashSet<InstanceId>,
    ) -> Result<Vec<ComputerId>, BackendError>;
}

/// The second paragraph every container-like description shares (docs/decisions.md, "Tool descriptions").
pub fn stdin_and_timeout_paragraph(timeout_secs: u64) -> String {
    format!(
        "To write files or pass data without shell escaping, use the stdin parameter (e.g., command=\"cat > file.txt\" with content in stdin). Commands time out after {timeout_secs} seconds by default (override with the timeout parameter for long-running operations)."
    )
}

/// The generic text (docs/decisions.md, "Tool descriptions"): a truthful description for any image or template other than the default.
pub fn generic_description(what: &str, shell: &str, timeout_secs: u64) -> String {
    format!(
        "Execute a shell command in {what}. Commands run in {shell}. Each call is independent — no state (shell variables, working directory) persists between calls (however filesystem does persist). Use the working_directory parameter or chain commands with && to control execution context.\n\n{}",
        stdin_and_timeout_paragraph(timeout_secs)
    )
}
