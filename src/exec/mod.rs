//! Running one command under the server's policy: builds the [`ExecSpec`], joins the timeout
//! and the caller's cancellation into one expiry, enforces the output limit through
//! [`limits::LimitedSink`], and on any early end runs the backend's kill sweep before returning
//! (docs/decisions.md, "Killing a command" and "Command results"). Knows no provider: everything goes through `dyn Backend`.

pub mod limits;
mod progress;

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::backends::{Backend, BackendError, ExecEnd, ExecSpec, Progress, SandboxRef};
use crate::ids::ExecId;
use limits::LimitedSink;

/// The fixed stdin limit (docs/decisions.md, "terminal_execute validation"), independent of `--output-limit`.
pub const STDIN_LIMIT: usize = 2_097_152;

/// How long the kill sweep may take before we give up and still return the fixed result: the
/// sweep walks /proc three times, which is milliseconds on a normal computer.
const KILL_SWEEP_LIMIT: Duration = Duration::from_secs(10);

/// What to run, already validated (docs/decisions.md, "terminal_execute validation").
#[derive(Debug, Clone)]
pub enum Program {
    Shell(String),
    Args(Vec<String>),
}

#[derive(Debug, Clone)]
pub struct ExecRequest {
    pub program: Program,
    pub stdin: Option<String>,
    pub working_dir: Option<String>,
    pub timeout_secs: u64,
}

/// The policy-level result of one exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecOutcome {
    Completed {
        stdout: Vec<u8>,
        stderr: Vec<u8>,
        exit_code: i64,
        duration: Duration,
    },
    TimedOut {
        timeout_secs: u64,
        duration: Duration,
    },
    OutputLimitExceeded {
        limit: u64,
        duration: Duration,
    },
    /// A WASM guest used up `--wasm-fuel`.
    OutOfFuel {
        fuel: u64,
        duration: Duration,
    },
}

/// Why an exec ended without an outcome.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The caller cancelled (client cancel, or a lifecycle op interrupting); the tree was killed.
    #[error("cancelled")]
    Cancelled,
}

impl ExecOutcome {
    /// The fixed notices of docs/decisions.md, "Command results", identical on every backend.
    pub fn timeout_notice(timeout_secs: u64) -> String {
        format!("[kilntainers: command timed out after {timeout_secs}s]")
    }

    pub fn out_of_fuel_notice(fuel: u64) -> String {
        format!("[kilntainers: command ran out of fuel (--wasm-fuel {fuel})]")
    }

    pub fn output_limit_notice(limit: u64) -> String {
        format!(
            "[kilntainers: output limit exceeded ({limit} bytes). Command terminated. No output returned. Re-run with head, tail, or grep to manage output size.]"
        )
    }
}

/// Runs `request` in `sandbox` under `timeout_secs` and `output_limit`, killing the command's
/// process tree when it times out, overflows or is cancelled. While it runs, `progress` hears
/// once a second how long it has run and its last complete output line (docs/jobs.md,
/// "Progress of foreground calls").
#[allow(clippy::too_many_arguments)]
pub async fn run(
    backend: &dyn Backend,
    sandbox: &SandboxRef,
    shell: &str,
    request: &ExecRequest,
    exec_id: ExecId,
    output_limit: u64,
    progress: &dyn Progress,
    cancel: &CancellationToken,
) -> Result<ExecOutcome, ExecError> {
    let argv = match &request.program {
        Program::Shell(command) => vec![shell.to_owned(), "-c".to_owned(), command.clone()],
        Program::Args(args) => args.clone(),
    };
    let spec = ExecSpec {
        argv,
        stdin: request.stdin.as_ref().map(|s| s.as_bytes().to_vec()),
        working_dir: request.working_dir.clone(),
        exec_id,
        command: match &request.program {
            Program::Shell(command) => Some(command.clone()),
            Program::Args(_) => None,
        },
    };
    let mut sink = LimitedSink::new(output_limit);
    let started = Instant::now();
    let exec_cancel = cancel.child_token();
    let timeout = Duration::from_secs(request.timeout_secs);

    enum Early {
        Timeout,
        Cancelled,
    }
    let last_line = progress::LastLine::default();
    let ended = {
        let mut tap = progress::LineTap::new(&mut sink, &last_line);
        let exec = backend.exec(sandbox, &spec, &mut tap, &exec_cancel);
        tokio::pin!(exec);
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut ticks = tokio::time::interval_at(
            tokio::time::Instant::now() + progress::EVERY,
            progress::EVERY,
        );
        loop {
            tokio::select! {
                result = &mut exec => break Ok(result),
                () = &mut deadline => break Err(Early::Timeout),
                () = cancel.cancelled() => break Err(Early::Cancelled),
                _ = ticks.tick() => last_line.report(progress, started.elapsed()),
            }
        }
    };
    // Stop any backend-side reading that may still be in flight.
    exec_cancel.cancel();
    let duration = started.elapsed();
    match ended {
        Ok(Ok(ExecEnd::Exited(exit_code))) if !sink.overflowed() => {
            let (stdout, stderr) = sink.into_output();
            Ok(ExecOutcome::Completed {
                stdout,
                stderr,
                exit_code,
                duration,
            })
        }
        Ok(Ok(ExecEnd::OutOfFuel(fuel))) => Ok(ExecOutcome::OutOfFuel { fuel, duration }),
        // The backend saw the cancellation before our own select did: still a cancellation,
        // not an overflow.
        Ok(Ok(ExecEnd::StoppedBySink)) if !sink.overflowed() && cancel.is_cancelled() => {
            kill_tree(backend, sandbox, &spec.exec_id).await;
            Err(ExecError::Cancelled)
        }
        Ok(Ok(_)) => {
            kill_tree(backend, sandbox, &spec.exec_id).await;
            Ok(ExecOutcome::OutputLimitExceeded {
                limit: output_limit,
                duration,
            })
        }
        Ok(Err(error)) => {
            // A broken stream may leave the command running; a computer that is gone or
            // stopped has nothing left to kill.
            if matches!(error, BackendError::Provider(_)) {
                kill_tree(backend, sandbox, &spec.exec_id).await;
            }
            Err(ExecError::Backend(error))
        }
        Err(Early::Timeout) => {
            kill_tree(backend, sandbox, &spec.exec_id).await;
            Ok(ExecOutcome::TimedOut {
                timeout_secs: request.timeout_secs,
                duration,
            })
        }
        Err(Early::Cancelled) => {
            kill_tree(backend, sandbox, &spec.exec_id).await;
            Err(ExecError::Cancelled)
        }
    }
}

/// Best effort: a failed sweep is logged, and the caller still gets the fixed result.
pub async fn kill_tree(backend: &dyn Backend, sandbox: &SandboxRef, exec_id: &ExecId) {
    match tokio::time::timeout(KILL_SWEEP_LIMIT, backend.kill_exec(sandbox, exec_id)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => warn!(computer_id = %sandbox.computer_id, %error, "kill sweep failed"),
        Err(_) => warn!(computer_id = %sandbox.computer_id, "kill sweep did not finish in time"),
    }
}

#[cfg(test)]
mod tests;
