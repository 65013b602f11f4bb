//! Commands in a Modal sandbox (docs/decisions.md, "Modal sandboxes" exec row), two ways:
//!
//! * **Through the task command router**, as both official SDKs do since 2026 (the normal path):
//!   `TaskExecStart` with an exec id of our own, stdin through `TaskExecStdinWrite` (byte
//!   offsets, then EOF; without stdin just EOF), stdout and stderr each through their own
//!   `TaskExecStdioRead` stream (resumed from the byte offset when a stream breaks), the exit
//!   status from `TaskExecWait` ([`super::router`]).
//! * **Through `ContainerExec*`** on the control plane, only when the router is unavailable for
//!   the task (`TaskGetCommandRouterAccess` fails, or its answer is unusable); the server logs
//!   the fallback and why, once per process. Stdin through `ContainerExecPutInput`, output
//!   through `ContainerExecGetOutput` (raw bytes, resumed from the last batch index), the exit
//!   code from `ContainerExecWait`.
//!
//! The exec tag travels in the argv — `env KILNTAINERS_EXEC_ID=<uuid> <argv…>` — on both paths
//! (`ContainerExec` has no environment field); `env` execs the command, so the whole tree carries
//! the tag the kill sweep looks for. Output is pushed into the sink as it arrives; a bounded
//! channel between the two stream readers and the sink keeps memory at a few chunks.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::ModalInner;
use super::api::{ApiError, pb};
use super::router::{Router, rpb};
use kilntainers_backend::{
    BackendError, ExecEnd, ExecSpec, OutputSink, SandboxRef, SinkControl, Stream,
};

/// Server-side bound sent with every user command. `ExecSpec` does not carry the call's timeout
/// (the exec layer owns that timer and then runs the kill sweep), so this only stops a command
/// that outlives every client: one hour, above any sensible call timeout. Because our timer
/// always fires first, Modal's "−1 after the server timeout" never reaches a result.
pub(super) const EXEC_SERVER_TIMEOUT_SECS: u32 = 3600;
/// Stdin goes in pieces of this size (Modal's clients use 64 KiB writes too).
const STDIN_CHUNK: usize = 64 * 1024;
/// Server-side wait of one `ContainerExecGetOutput` stream before it ends and is resumed.
const OUTPUT_POLL_SECS: f32 = 55.0;
/// Server-side wait of one `ContainerExecWait` round.
const WAIT_POLL_SECS: f32 = 10.0;
/// Streams that end without output or an exit code are resumed at most this often in a row,
/// so a server that keeps closing them cannot make us spin.
const MAX_EMPTY_RESUMES: u32 = 20;
/// Chunks in flight between the stream readers and the sink.
const CHANNEL_CHUNKS: usize = 4;

/// The argv actually sent for a user command (see the module text).
pub(super) fn tagged_argv(spec: &ExecSpec) -> Vec<String> {
    let mut argv = vec!["env".to_owned(), spec.exec_id.env_entry()];
    argv.extend(spec.argv.iter().cloned());
    argv
}

enum Event {
    Output(Stream, Vec<u8>),
    Done(Option<i32>),
    Failed(ApiError),
}

/// Aborts the stream readers when the exec ends early (sink stop, cancel, error).
struct Readers(Vec<JoinHandle<()>>);

impl Drop for Readers {
    fn drop(&mut self) {
        for handle in &self.0 {
            handle.abort();
        }
    }
}

async fn read_fd(
    api: std::sync::Arc<super::api::Api>,
    exec_id: String,
    stream: Stream,
    tx: mpsc::Sender<Event>,
) {
    let fd = match stream {
        Stream::Stdout => pb::FileDescriptor::Stdout,
        Stream::Stderr => pb::FileDescriptor::Stderr,
    };
    let mut last_batch_index = 0u64;
    let mut empty_resumes = 0u32;
    loop {
        let request = pb::ContainerExecGetOutputRequest {
            exec_id: exec_id.clone(),
            timeout: OUTPUT_POLL_SECS,
            last_batch_index,
            file_descriptor: fd as i32,
            get_raw_bytes: true,
        };
        let mut batches = match api.container_exec_get_output(request).await {
            Ok(batches) => batches,
            Err(error) => {
                let _ = tx.send(Event::Failed(error)).await;
                return;
            }
        };
        let mut progressed = false;
        loop {
            match batches.message().await {
                Ok(Some(batch)) => {
                    progressed = true;
                    last_batch_index = batch.batch_index;
                    for item in batch.items {
                        let bytes = if item.message_bytes.is_empty() {
                            item.message.into_bytes()
                        } else {
                            item.message_bytes
                        };
                        if !bytes.is_empty() && tx.send(Event::Output(stream, bytes)).await.is_err()
                        {
                            return;
                        }
                    }
                    if batch.exit_code.is_some() {
                        let _ = tx.send(Event::Done(batch.exit_code)).await;
                        return;
                    }
                }
                Ok(None) => break,
                Err(status) => {
                    let _ = tx
                        .send(Event::Failed(ApiError {
                            call: "ContainerExecGetOutput",
                            code: status.code(),
                            message: status.message().to_owned(),
                        }))
                        .await;
                    return;
                }
            }
        }
        empty_resumes = if progressed { 0 } else { empty_resumes + 1 };
        if empty_resumes > MAX_EMPTY_RESUMES {
            let _ = tx.send(Event::Done(None)).await;
            return;
        }
    }
}

/// Sends stdin in chunks with consecutive indexes, then EOF.
async fn send_stdin(
    api: &super::api::Api,
    exec_id: &str,
    stdin: Option<&[u8]>,
) -> Result<(), ApiError> {
    let mut index = 0u64;
    for chunk in stdin.unwrap_or_default().chunks(STDIN_CHUNK) {
        index += 1;
        api.container_exec_put_input(pb::ContainerExecPutInputRequest {
            exec_id: exec_id.to_owned(),
            input: Some(pb::RuntimeInputMessage {
                message: chunk.to_vec(),
                message_index: index,
                eof: false,
            }),
        })
        .await?;
    }
    api.container_exec_put_input(pb::ContainerExecPutInputRequest {
        exec_id: exec_id.to_owned(),
        input: Some(pb::RuntimeInputMessage {
            message: Vec::new(),
            message_index: index + 1,
            eof: true,
        }),
    })
    .await
}

/// Runs `argv` (already final: tagged or not) and streams its output into `sink`: through the
/// task's command router, or through `ContainerExec*` when the router is unavailable.
pub(super) async fn run(
    backend: &ModalInner,
    sandbox: &SandboxRef,
    argv: Vec<String>,
    working_dir: Option<&str>,
    stdin: Option<&[u8]>,
    sink: &mut dyn OutputSink,
    cancel: &CancellationToken,
) -> Result<ExecEnd, BackendError> {
    let api = backend.api().await?;
    let task_id = backend.task_id(sandbox).await?;
    match backend.routers.get(&api, &task_id).await {
        Ok(router) => {
            backend.note_exec_path(None);
            let ended = run_routed(
                backend,
                sandbox,
                &router,
                argv,
                working_dir,
                stdin,
                sink,
                cancel,
            )
            .await;
            if let Err(BackendError::Provider(_)) = &ended {
                // A refused JWT or a moved router: ask for access again next time.
                backend.routers.forget(&task_id).await;
            }
            ended
        }
        Err(error) => {
            backend.note_exec_path(Some(&error));
            run_container_exec(
                backend,
                sandbox,
                task_id,
                argv,
                working_dir,
                stdin,
                sink,
                cancel,
            )
            .await
        }
    }
}

/// Server-side wait of one `TaskExecWait` round before we ask again (and look at `cancel`).
const ROUTED_WAIT_ROUND: Duration = Duration::from_secs(55);

async fn read_routed(router: Router, exec_id: String, stream: Stream, tx: mpsc::Sender<Event>) {
    let fd = match stream {
        Stream::Stdout => rpb::TaskExecStdioFileDescriptor::Stdout,
        Stream::Stderr => rpb::TaskExecStdioFileDescriptor::Stderr,
    };
    let mut offset = 0u64;
    let mut broken = 0u32;
    loop {
        let request = rpb::TaskExecStdioReadRequest {
            task_id: router.task_id.clone(),
            exec_id: exec_id.clone(),
            offset,
            file_descriptor: fd as i32,
        };
        let mut chunks = match router.stdio_read(request).await {
            Ok(chunks) => chunks,
            Err(error) => {
                let _ = tx.send(Event::Failed(error)).await;
                return;
            }
        };
        loop {
            match chunks.message().await {
                Ok(Some(chunk)) => {
                    broken = 0;
                    offset += chunk.data.len() as u64;
                    if !chunk.data.is_empty()
                        && tx.send(Event::Output(stream, chunk.data)).await.is_err()
                    {
                        return;
                    }
                }
                // The stream ends when the command's side of the pipe is closed.
                Ok(None) => {
                    let _ = tx.send(Event::Done(None)).await;
                    return;
                }
                Err(status)
                    if matches!(
                        status.code(),
                        tonic::Code::Unavailable | tonic::Code::Internal
                    ) && broken < MAX_EMPTY_RESUMES =>
                {
                    // A broken stream is resumed from the offset already read.
                    broken += 1;
                    break;
                }
                Err(status) => {
                    let _ = tx
                        .send(Event::Failed(ApiError::new("TaskExecStdioRead", &status)))
                        .await;
                    return;
                }
            }
        }
    }
}

/// Stdin in chunks at consecutive byte offsets, then EOF (alone when there is no stdin).
async fn send_routed_stdin(
    router: &Router,
    exec_id: &str,
    stdin: Option<&[u8]>,
) -> Result<(), ApiError> {
    let mut offset = 0u64;
    for chunk in stdin.unwrap_or_default().chunks(STDIN_CHUNK) {
        router
            .stdin_write(rpb::TaskExecStdinWriteRequest {
                task_id: router.task_id.clone(),
                exec_id: exec_id.to_owned(),
                offset,
                data: chunk.to_vec(),
                eof: false,
            })
            .await?;
        offset += chunk.len() as u64;
    }
    router
        .stdin_write(rpb::TaskExecStdinWriteRequest {
            task_id: router.task_id.clone(),
            exec_id: exec_id.to_owned(),
            offset,
            data: Vec::new(),
            eof: true,
        })
        .await
}

#[allow(clippy::too_many_arguments)]
async fn run_routed(
    backend: &ModalInner,
    sandbox: &SandboxRef,
    router: &Router,
    argv: Vec<String>,
    working_dir: Option<&str>,
    stdin: Option<&[u8]>,
    sink: &mut dyn OutputSink,
    cancel: &CancellationToken,
) -> Result<ExecEnd, BackendError> {
    let exec_id = uuid::Uuid::new_v4().to_string();
    let started = router
        .start(rpb::TaskExecStartRequest {
            task_id: router.task_id.clone(),
            exec_id: exec_id.clone(),
            command_args: argv,
            stdout_config: rpb::TaskExecStdoutConfig::Pipe as i32,
            stderr_config: rpb::TaskExecStderrConfig::Pipe as i32,
            timeout_secs: Some(EXEC_SERVER_TIMEOUT_SECS),
            workdir: working_dir.map(str::to_owned),
        })
        .await;
    if let Err(error) = started {
        return Err(backend.exec_failure(sandbox, &error).await);
    }
    let (tx, mut rx) = mpsc::channel(CHANNEL_CHUNKS);
    let _readers = Readers(
        [Stream::Stdout, Stream::Stderr]
            .into_iter()
            .map(|s| tokio::spawn(read_routed(router.clone(), exec_id.clone(), s, tx.clone())))
            .collect(),
    );
    drop(tx);
    let stdin_done = send_routed_stdin(router, &exec_id, stdin);
    tokio::pin!(stdin_done);
    let mut stdin_pending = true;
    let mut open = 2;
    while open > 0 {
        tokio::select! {
            () = cancel.cancelled() => return Ok(ExecEnd::StoppedBySink),
            result = &mut stdin_done, if stdin_pending => {
                stdin_pending = false;
                if let Err(error) = result {
                    // A process that exits before reading its stdin closes it; that is not a
                    // failure of the command.
                    if error.code != tonic::Code::FailedPrecondition {
                        return Err(backend.exec_failure(sandbox, &error).await);
                    }
                }
            }
            event = rx.recv() => match event {
                Some(Event::Output(stream, bytes)) => {
                    if sink.push(stream, &bytes) == SinkControl::Stop {
                        return Ok(ExecEnd::StoppedBySink);
                    }
                }
                Some(Event::Done(_)) => open -= 1,
                Some(Event::Failed(error)) => return Err(backend.exec_failure(sandbox, &error).await),
                None => break,
            },
        }
    }
    loop {
        let waited = tokio::select! {
            () = cancel.cancelled() => return Ok(ExecEnd::StoppedBySink),
            waited = tokio::time::timeout(
                ROUTED_WAIT_ROUND,
                router.wait(rpb::TaskExecWaitRequest {
                    task_id: router.task_id.clone(),
                    exec_id: exec_id.clone(),
                }),
            ) => waited,
        };
        match waited {
            Err(_) => {}
            Ok(Err(error)) if error.code == tonic::Code::DeadlineExceeded => {}
            Ok(Err(error)) => return Err(backend.exec_failure(sandbox, &error).await),
            Ok(Ok(answer)) => {
                return Ok(ExecEnd::Exited(match answer.exit_status {
                    Some(rpb::task_exec_wait_response::ExitStatus::Code(code)) => i64::from(code),
                    // A shell's convention for a command ended by a signal.
                    Some(rpb::task_exec_wait_response::ExitStatus::Signal(signal)) => {
                        128 + i64::from(signal)
                    }
                    None => -1,
                }));
            }
        }
    }
}

/// The fallback: `ContainerExec*` on the control plane.
#[allow(clippy::too_many_arguments)]
async fn run_container_exec(
    backend: &ModalInner,
    sandbox: &SandboxRef,
    task_id: String,
    argv: Vec<String>,
    working_dir: Option<&str>,
    stdin: Option<&[u8]>,
    sink: &mut dyn OutputSink,
    cancel: &CancellationToken,
) -> Result<ExecEnd, BackendError> {
    let api = backend.api().await?;
    let started = api
        .container_exec(pb::ContainerExecRequest {
            task_id,
            command: argv,
            timeout_secs: EXEC_SERVER_TIMEOUT_SECS,
            workdir: working_dir.map(str::to_owned),
        })
        .await;
    let exec_id = match started {
        Ok(answer) => answer.exec_id,
        Err(error) => return Err(backend.exec_failure(sandbox, &error).await),
    };
    let (tx, mut rx) = mpsc::channel(CHANNEL_CHUNKS);
    let _readers = Readers(
        [Stream::Stdout, Stream::Stderr]
            .into_iter()
            .map(|s| tokio::spawn(read_fd(api.clone(), exec_id.clone(), s, tx.clone())))
            .collect(),
    );
    drop(tx);
    let stdin_done = send_stdin(&api, &exec_id, stdin);
    tokio::pin!(stdin_done);
    let mut stdin_pending = true;
    let mut open = 2;
    let mut stream_code = None;
    while open > 0 {
        tokio::select! {
            () = cancel.cancelled() => return Ok(ExecEnd::StoppedBySink),
            result = &mut stdin_done, if stdin_pending => {
                stdin_pending = false;
                if let Err(error) = result {
                    // A process that exits before reading its stdin makes Modal refuse more
                    // input; that is not a failure of the command.
                    if error.code != tonic::Code::FailedPrecondition {
                        return Err(backend.exec_failure(sandbox, &error).await);
                    }
                }
            }
            event = rx.recv() => match event {
                Some(Event::Output(stream, bytes)) => {
                    if sink.push(stream, &bytes) == SinkControl::Stop {
                        return Ok(ExecEnd::StoppedBySink);
                    }
                }
                Some(Event::Done(code)) => {
                    open -= 1;
                    stream_code = stream_code.or(code);
                }
                Some(Event::Failed(error)) => return Err(backend.exec_failure(sandbox, &error).await),
                None => break,
            },
        }
    }
    loop {
        if cancel.is_cancelled() {
            return Ok(ExecEnd::StoppedBySink);
        }
        let waited = api
            .container_exec_wait(pb::ContainerExecWaitRequest {
                exec_id: exec_id.clone(),
                timeout: WAIT_POLL_SECS,
            })
            .await;
        match waited {
            Ok(answer) if answer.completed => {
                let code = answer.exit_code.or(stream_code).unwrap_or(-1);
                return Ok(ExecEnd::Exited(i64::from(code)));
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(error) => return Err(backend.exec_failure(sandbox, &error).await),
        }
    }
}

/// What an internal exec (readiness, kill sweep) produced: its stdout (the readiness marker).
pub(super) struct Collected {
    pub stdout: Vec<u8>,
}

struct Collect {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// Internal execs keep at most this much output (the readiness marker and sweep are tiny).
const COLLECT_CAP: usize = 64 * 1024;

impl OutputSink for Collect {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        let buffer = match stream {
            Stream::Stdout => &mut self.stdout,
            Stream::Stderr => &mut self.stderr,
        };
        let room = COLLECT_CAP.saturating_sub(buffer.len());
        buffer.extend_from_slice(&bytes[..bytes.len().min(room)]);
        SinkControl::Continue
    }
}

/// Runs `argv` untagged under `limit` and collects its output.
pub(super) async fn run_simple(
    backend: &ModalInner,
    sandbox: &SandboxRef,
    argv: Vec<String>,
    limit: Duration,
) -> Result<Collected, BackendError> {
    let mut sink = Collect {
        stdout: Vec::new(),
        stderr: Vec::new(),
    };
    let cancel = CancellationToken::new();
    let ended = tokio::time::timeout(
        limit,
        run(backend, sandbox, argv, None, None, &mut sink, &cancel),
    )
    .await
    .map_err(|_| {
        BackendError::Provider(format!(
            "Modal exec in sandbox {} (computer '{}') did not finish within {}s",
            sandbox.sandbox_id,
            sandbox.computer_id,
            limit.as_secs()
        ))
    })??;
    if let ExecEnd::Exited(code) = ended {
        tracing::debug!(sandbox = %sandbox.sandbox_id, code, "internal exec ended");
    }
    Ok(Collected {
        stdout: sink.stdout,
    })
}
