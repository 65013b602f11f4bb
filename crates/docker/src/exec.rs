//! Command execution: through the computer's resident helper ([`super::helper`]) when it has
//! one, else through the exec API — create the exec with the exec tag, attach, feed stdin and
//! half-close it, demultiplex stdout/stderr into the sink, then read the exit code. Both paths
//! end in the same check for a container that died under the command. Docker has no
//! kill-exec call; killing is the helper's `Kill` or the sweep in
//! [`kilntainers_backend::posix::kill_sweep_script`].

use std::time::Duration;

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use super::helper::{DockerTransport, INTERNAL_OUTPUT_CAP, Lost};
use super::{DockerBackend, describe, status_of};
use kilntainers_backend::{
    BackendError, ExecEnd, ExecSpec, OutputSink, SandboxRef, SinkControl, Stream,
};

/// After the output stream ends the exec can still read as running for a moment; this bounds
/// how long we wait for the engine to record the exit code.
const EXIT_CODE_WAIT: Duration = Duration::from_secs(5);
/// How long a signal-killed exec waits for the engine to report the container's own death
/// (`docker kill` ends the exec stream a moment before the container reads as exited).
const DEATH_SETTLE: Duration = Duration::from_millis(500);
/// Read buffer for the attached stream; larger than bollard's default to cut frame overhead.
const OUTPUT_BUFFER: usize = 64 * 1024;

/// Why an attach failed, before any output.
fn create_error(sandbox: &SandboxRef, error: &bollard::errors::Error) -> BackendError {
    match status_of(error) {
        Some(404) => BackendError::Vanished(sandbox.computer_id.clone()),
        Some(409) => BackendError::NotRunning(sandbox.sandbox_id.clone()),
        _ => BackendError::Provider(format!(
            "Docker exec in container {} failed: {}",
            sandbox.sandbox_id,
            describe(error)
        )),
    }
}

pub(super) async fn exec(
    backend: &DockerBackend,
    sandbox: &SandboxRef,
    spec: &ExecSpec,
    sink: &mut dyn OutputSink,
    cancel: &CancellationToken,
) -> Result<ExecEnd, BackendError> {
    let docker = backend.client().await?;
    let env = backend.command_env(sandbox);
    let exit_code = match backend
        .helpers
        .run(&DockerTransport(docker), sandbox, spec, &env, sink, cancel)
        .await
    {
        Some(Ok(ExecEnd::Exited(code))) => Some(code),
        Some(Ok(other)) => return Ok(other),
        Some(Err(Lost(reason))) => {
            // `docker kill` ends the helper's stream a moment before the engine reports the
            // container dead, so a lost connection gets the same grace as a signal death.
            if container_died(backend, sandbox, None).await {
                return Err(BackendError::DiedDuringExec(sandbox.sandbox_id.clone()));
            }
            return Err(BackendError::Provider(format!(
                "The exec helper in container {} stopped during the command ({reason}); the command was interrupted. Running it again starts a new helper.",
                sandbox.sandbox_id
            )));
        }
        None => match engine_exec(backend, docker, sandbox, spec, &env, sink, cancel).await? {
            EngineEnd::Ended(exit_code) => exit_code,
            EngineEnd::Stopped => return Ok(ExecEnd::StoppedBySink),
        },
    };
    match exit_code {
        Some(code) if code == 0 => Ok(ExecEnd::Exited(code)),
        other => {
            // A non-zero or missing code may mean the container itself died.
            if container_died(backend, sandbox, other).await {
                return Err(BackendError::DiedDuringExec(sandbox.sandbox_id.clone()));
            }
            other.map(ExecEnd::Exited).ok_or_else(|| {
                BackendError::Provider(format!(
                    "Docker did not report an exit code for exec in container {}",
                    sandbox.sandbox_id
                ))
            })
        }
    }
}

/// How a plain Docker exec ended.
enum EngineEnd {
    /// The sink or the caller stopped it early.
    Stopped,
    /// The output ended; the engine's exit code, if it reported one.
    Ended(Option<i64>),
}

/// One command as one Docker exec: the fallback when the helper cannot run.
async fn engine_exec(
    backend: &DockerBackend,
    docker: &Docker,
    sandbox: &SandboxRef,
    spec: &ExecSpec,
    env: &[String],
    sink: &mut dyn OutputSink,
    cancel: &CancellationToken,
) -> Result<EngineEnd, BackendError> {
    let options = CreateExecOptions {
        cmd: Some(spec.argv.clone()),
        attach_stdin: Some(spec.stdin.is_some()),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        env: Some(
            std::iter::once(spec.exec_id.env_entry())
                .chain(env.iter().cloned())
                .collect(),
        ),
        working_dir: spec.working_dir.clone(),
        ..Default::default()
    };
    let created = docker
        .create_exec(sandbox.sandbox_id.as_str(), options)
        .await
        .map_err(|e| create_error(sandbox, &e))?;
    let start = StartExecOptions {
        detach: false,
        tty: false,
        output_capacity: Some(OUTPUT_BUFFER),
    };
    let started = docker
        .start_exec(&created.id, Some(start))
        .await
        .map_err(|e| create_error(sandbox, &e))?;
    let StartExecResults::Attached {
        mut output,
        mut input,
    } = started
    else {
        return Err(BackendError::Provider(format!(
            "Docker exec in container {} did not attach",
            sandbox.sandbox_id
        )));
    };

    // Stdin is written concurrently with reading output: a command that answers before it has
    // read all its input would otherwise deadlock against us.
    let stdin = spec.stdin.clone();
    let writer = async move {
        if let Some(data) = stdin {
            input.write_all(&data).await?;
            input.flush().await?;
            // Half-close so the command sees EOF.
            input.shutdown().await?;
        }
        // Keep the write half alive until reading ends: dropping it can close the stream.
        std::future::pending::<std::io::Result<()>>().await
    };
    tokio::pin!(writer);
    let mut writer_failed = None;
    loop {
        tokio::select! {
            written = &mut writer, if writer_failed.is_none() => {
                // The command may exit without reading stdin (broken pipe): not our error.
                writer_failed = Some(written.err());
            }
            item = output.next() => match item {
                Some(Ok(LogOutput::StdOut { message })) => {
                    if sink.push(Stream::Stdout, &message) == SinkControl::Stop {
                        return Ok(EngineEnd::Stopped);
                    }
                }
                Some(Ok(LogOutput::StdErr { message })) => {
                    if sink.push(Stream::Stderr, &message) == SinkControl::Stop {
                        return Ok(EngineEnd::Stopped);
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    return Err(died_or(backend, sandbox, format!("Docker exec stream from container {} broke: {e}", sandbox.sandbox_id)).await);
                }
                None => break,
            },
            () = cancel.cancelled() => return Ok(EngineEnd::Stopped),
        }
    }
    Ok(EngineEnd::Ended(exit_code_of(docker, &created.id).await))
}

/// Whether the container died under the exec. A signal death (code ≥ 128) or a missing code
/// can arrive before the engine has marked the container dead, so those are re-checked for a
/// short while; ordinary failures cost one inspect.
async fn container_died(
    backend: &DockerBackend,
    sandbox: &SandboxRef,
    exit_code: Option<i64>,
) -> bool {
    let signalled = exit_code.is_none_or(|code| code >= 128);
    let deadline = tokio::time::Instant::now()
        + if signalled {
            DEATH_SETTLE
        } else {
            Duration::ZERO
        };
    loop {
        if !backend_running(backend, sandbox).await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn backend_running(backend: &DockerBackend, sandbox: &SandboxRef) -> bool {
    matches!(backend.inspect(sandbox.sandbox_id.as_str()).await, Ok(Some(inspect)) if super::is_running(&inspect))
}

async fn died_or(backend: &DockerBackend, sandbox: &SandboxRef, message: String) -> BackendError {
    if backend_running(backend, sandbox).await {
        BackendError::Provider(message)
    } else {
        BackendError::DiedDuringExec(sandbox.sandbox_id.clone())
    }
}

/// Polls `inspect_exec` until the engine reports the exit code (bounded).
async fn exit_code_of(docker: &Docker, exec_id: &str) -> Option<i64> {
    let deadline = tokio::time::Instant::now() + EXIT_CODE_WAIT;
    let mut pause = Duration::from_millis(2);
    loop {
        match docker.inspect_exec(exec_id).await {
            Ok(inspect) if inspect.running != Some(true) => return inspect.exit_code,
            Ok(_) if tokio::time::Instant::now() < deadline => {}
            _ => return None,
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Runs a short internal command (readiness, kill sweep) and returns its exit code and stdout;
/// more than [`INTERNAL_OUTPUT_CAP`] of output (stdout and stderr together) is an error.
pub(super) async fn run_simple(
    docker: &Docker,
    container: &str,
    argv: Vec<String>,
    limit: Duration,
) -> Result<(i64, Vec<u8>), String> {
    run_simple_as(docker, container, None, argv, limit).await
}

/// [`run_simple`] as `user` (`None`: the container's).
pub(super) async fn run_simple_as(
    docker: &Docker,
    container: &str,
    user: Option<&str>,
    argv: Vec<String>,
    limit: Duration,
) -> Result<(i64, Vec<u8>), String> {
    run_simple_with(docker, container, user, Vec::new(), argv, limit).await
}

/// [`run_simple_as`] with `env` (`KEY=value`) added to the container's environment.
pub(super) async fn run_simple_with(
    docker: &Docker,
    container: &str,
    user: Option<&str>,
    env: Vec<String>,
    argv: Vec<String>,
    limit: Duration,
) -> Result<(i64, Vec<u8>), String> {
    let work = async {
        let options = CreateExecOptions {
            cmd: Some(argv),
            env: (!env.is_empty()).then_some(env),
            user: user.map(str::to_owned),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            ..Default::default()
        };
        let created = docker
            .create_exec(container, options)
            .await
            .map_err(|e| describe(&e))?;
        let started = docker
            .start_exec(&created.id, None)
            .await
            .map_err(|e| describe(&e))?;
        let mut stdout = Vec::new();
        let mut total = 0usize;
        if let StartExecResults::Attached { mut output, .. } = started {
            while let Some(item) = output.next().await {
                let (message, is_stdout) = match item {
                    Ok(LogOutput::StdOut { message }) => (message, true),
                    Ok(LogOutput::StdErr { message }) => (message, false),
                    _ => continue,
                };
                // What runs here may be hostile (a replaced shell): stop reading at the cap
                // rather than collect for the whole time limit. Dropping the stream ends the
                // attach; the flood then writes into a closed pipe.
                total = total.saturating_add(message.len());
                if total > INTERNAL_OUTPUT_CAP {
                    return Err(format!(
                        "it printed more than {} KiB",
                        INTERNAL_OUTPUT_CAP / 1024
                    ));
                }
                if is_stdout {
                    stdout.extend_from_slice(&message);
                }
            }
        }
        let code = exit_code_of(docker, &created.id)
            .await
            .ok_or("no exit code reported")?;
        Ok((code, stdout))
    };
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| format!("timed out after {}s", limit.as_secs()))?
}
