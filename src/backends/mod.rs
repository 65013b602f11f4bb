//! The one seam between the server and the providers: the [`Backend`] trait, the plain data it
//! speaks in ([`SandboxRef`], [`CreateSpec`], [`ExecSpec`], [`ComputerInfo`]) and its typed
//! error. One module per provider implements it; [`build`] is the only function that names a
//! concrete backend.
//!
//! **Architecture invariant:** nothing here imports `mcp`, `registry`, `exec`, `transport`, rmcp
//! or axum. Backends push output into an [`OutputSink`] and stop when told; they never see the
//! output limit, and they never format user-facing results.

pub mod docker;
#[cfg(feature = "e2b")]
pub mod e2b;
#[cfg(test)]
pub mod fake;
#[cfg(feature = "fly")]
pub mod fly;
pub mod labels;
#[cfg(feature = "modal")]
pub mod modal;
#[cfg(feature = "wasm")]
pub mod wasm;

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::ids::{ComputerId, ExecId, InstanceId};

/// The provider's current incarnation of a computer, as plain data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRef {
    pub computer_id: ComputerId,
    /// Provider handle (12-char container id on Docker); changes on factory reset.
    pub sandbox_id: String,
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

/// One row of the inventory (`lifecycle.md` §5.5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputerInfo {
    pub sandbox: SandboxRef,
    pub state: String,
    pub created_at: Option<String>,
}

/// Restart result: the new incarnation and whether the writable state survived.
#[derive(Debug, Clone)]
pub struct Restarted {
    pub sandbox: SandboxRef,
    pub state_preserved: bool,
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
    #[error("Computer '{0}' no longer exists. Call again to create a new computer with this ID.")]
    Vanished(ComputerId),
    /// The computer exists but is not running (stopped or died); starting it may help.
    #[error("Sandbox {0} is not running")]
    NotRunning(String),
    /// The computer died while a command ran.
    #[error("Sandbox {0} died during command execution")]
    DiedDuringExec(String),
    /// Any other provider failure, already phrased for the user (names the computer and call).
    #[error("{0}")]
    Provider(String),
    #[error("{op} is not supported by the {backend} backend: {reason}")]
    Unsupported {
        backend: &'static str,
        op: &'static str,
        reason: &'static str,
    },
}

/// A provider of computers. Object-safe; the registry holds `Arc<dyn Backend>`.
#[async_trait]
pub trait Backend: Send + Sync {
    /// The `--backend` name reported as `ComputerInfo.backend`.
    fn kind(&self) -> &'static str;

    /// The backend's `terminal_execute` description (`mcp-surface.md` §6), before the
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

    /// Checks reachability once; callers cache success.
    async fn validate(&self) -> Result<(), BackendError>;

    /// Whether [`Backend::validate`] runs at startup, in the background, so the first tool
    /// call does not pay for connecting (`lifecycle.md` §9: Docker/Podman only).
    fn validates_eagerly(&self) -> bool {
        false
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

    /// Kills every process carrying `exec_id`'s tag (`backends.md` §1.3).
    async fn kill_exec(&self, sandbox: &SandboxRef, exec_id: &ExecId) -> Result<(), BackendError>;

    /// Removes temporary computers created by the `dead` instances; returns the ids removed.
    async fn collect_orphans(
        &self,
        dead: &HashSet<InstanceId>,
    ) -> Result<Vec<ComputerId>, BackendError>;
}

/// Which processes the kill sweep ends besides those carrying the exec tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepReach {
    /// Processes whose environment carries the tag (`backends.md` §1.3) and their
    /// descendants. For providers whose PID 1 is not ours, where an orphan of the command
    /// cannot be told from the provider's own processes.
    Tagged,
    /// Also orphans (parent PID 1) started no earlier than the command, unless their tag is
    /// one an older process carries: what a command leaves behind after dropping or forging
    /// the tag (`setsid env -i …`). Only where PID 1 is our keep-alive (Docker/Podman).
    TaggedAndOrphans,
}

/// The kill sweep of `backends.md` §1.3, widened as docs/reliability.md ("Kill tree") says:
/// three passes over /proc, each killing the processes whose environment carries the exec
/// tag, their descendants, and with [`SweepReach::TaggedAndOrphans`] the orphans started no
/// earlier than the oldest tagged process whose tag no older process carries. A later pass catches what an earlier
/// kill orphaned. Plain POSIX sh (BusyBox included).
pub fn kill_sweep_script(exec_id: &ExecId, reach: SweepReach) -> String {
    let orphans = match reach {
        SweepReach::Tagged => "0",
        SweepReach::TaggedAndOrphans => "1",
    };
    format!(
        r#"t='{tag}'; orphans={orphans}; since=''
for n in 1 2 3; do
  snap=''; kill=' '
  for d in /proc/[0-9]*; do
    p=${{d#/proc/}}
    [ "$p" = "$$" ] && continue
    {{ read -r s < "$d/stat"; }} 2>/dev/null || continue
    s=${{s##*) }}
    set -- $s
    e=$(tr '\0' '\n' 2>/dev/null < "$d/environ" | grep -m1 '^{name}=')
    if [ "$e" = "$t" ]; then
      kill="$kill$p "
      if [ -z "$since" ] || [ "${{20}}" -lt "$since" ]; then since=${{20}}; fi
    fi
    snap="$snap$p $2 ${{20}} $e
"
  done
  if [ "$orphans" = 1 ] && [ -n "$since" ]; then
    older=' '
    while read -r p pp st e; do
      if [ -n "$e" ] && [ "$st" -lt "$since" ]; then older="$older$e "; fi
    done <<SNAP
$snap
SNAP
    while read -r p pp st e; do
      [ -n "$p" ] && [ "$pp" = 1 ] && [ "$st" -ge "$since" ] || continue
      case "$older" in *" $e "*) [ -n "$e" ] && continue ;; esac
      kill="$kill$p "
    done <<SNAP
$snap
SNAP
  fi
  grew=1
  while [ "$grew" = 1 ]; do
    grew=0
    while read -r p pp st e; do
      [ -n "$p" ] || continue
      case "$kill" in *" $p "*) continue ;; esac
      case "$kill" in *" $pp "*) kill="$kill$p "; grew=1 ;; esac
    done <<SNAP
$snap
SNAP
  done
  for p in $kill; do kill -9 "$p" 2>/dev/null; done
done
true
"#,
        tag = exec_id.env_entry(),
        name = ExecId::ENV_NAME,
    )
}

/// The keep-alive PID 1 of `backends.md` §1.2: exits at once on SIGTERM, needs only the shell
/// and `sleep`.
pub fn keep_alive_argv(shell: &str) -> Vec<String> {
    vec![
        shell.to_owned(),
        "-c".to_owned(),
        "trap 'exit 0' TERM INT HUP; while :; do sleep 3600 & wait $!; done".to_owned(),
    ]
}

/// Readiness: the shell must echo this marker (`backends.md` §1.1).
pub const READY_MARKER: &str = "kilntainers-ready";

/// The second paragraph every container-like description shares (`mcp-surface.md` §6).
pub fn stdin_and_timeout_paragraph(timeout_secs: u64) -> String {
    format!(
        "To write files or pass data without shell escaping, use the stdin parameter (e.g., command=\"cat > file.txt\" with content in stdin). Commands time out after {timeout_secs} seconds by default (override with the timeout parameter for long-running operations)."
    )
}

/// T-GENERIC: a truthful description for any image or template other than the default.
pub fn generic_description(what: &str, shell: &str, timeout_secs: u64) -> String {
    format!(
        "Execute a shell command in {what}. Commands run in {shell}. Each call is independent — no state (shell variables, working directory) persists between calls (however filesystem does persist). Use the working_directory parameter or chain commands with && to control execution context.\n\n{}",
        stdin_and_timeout_paragraph(timeout_secs)
    )
}

/// Builds the backend `--backend` selected. The only place that names concrete backends.
pub fn build(config: &Config) -> Result<Arc<dyn Backend>, BackendError> {
    match config.backend {
        #[cfg(feature = "fly")]
        crate::cli::BackendChoice::Fly => Ok(Arc::new(fly::FlyBackend::new(config)?)),
        #[cfg(feature = "e2b")]
        crate::cli::BackendChoice::E2b => Ok(Arc::new(e2b::E2bBackend::new(config)?)),
        #[cfg(feature = "modal")]
        crate::cli::BackendChoice::Modal => Ok(Arc::new(modal::ModalBackend::new(config))),
        #[cfg(feature = "wasm")]
        crate::cli::BackendChoice::Wasm | crate::cli::BackendChoice::GoBusybox => {
            Ok(Arc::new(wasm::WasmBackend::new(config)?))
        }
        _ => Ok(Arc::new(docker::DockerBackend::new(config)?)),
    }
}
