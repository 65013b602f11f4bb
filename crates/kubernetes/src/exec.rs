//! Commands through `pods/exec`, one WebSocket per command (docs/kubernetes.md, "Exec"): kube's
//! `AttachedProcess` speaks the channel protocol (`v5.channel.k8s.io`, else v4), stdin is
//! written while output is read and then closed (`[255, 0]` on v5), and the exit code comes
//! from the `metav1.Status` on the status channel.
//!
//! `pods/exec` has no environment or working-directory fields, so the argv is wrapped:
//! `<shell> -c "export KILNTAINERS_EXEC_ID=<uuid>; cd -- '<wd>' && exec <argv>"`; `exec` makes
//! the tagged process replace the wrapper, so the whole tree carries the tag the kill sweep
//! looks for. Output goes into the sink as it arrives, so the exec layer's output limit holds
//! whatever the computer writes; the status message is capped before it is shown.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use kube::Api;
use kube::api::AttachParams;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::objects::CONTAINER;
use kilntainers_backend::posix::quote;
use kilntainers_backend::{ExecEnd, ExecSpec, OutputSink, SinkControl, Stream};

/// Bytes read from one output stream at a time, and kube's pipe size for each.
const CHUNK: usize = 64 * 1024;
/// The status channel's message arrives right before the stream closes; this only bounds a
/// server that closes without one.
const STATUS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// Longest part of a failure message shown to the user: the message can quote the command.
const MESSAGE_CAP: usize = 512;

/// Why a command could not be run to its end.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The exec request was refused or the connection failed before the command started.
    #[error("{0}")]
    Connect(#[source] kube::Error),
    /// The stream ended without a status: the Pod or its node went away, or the API server
    /// dropped the connection.
    #[error("the exec stream ended without an exit status")]
    NoStatus,
    /// The API server reported a failure other than an exit code (e.g. the shell is missing).
    #[error("{0}")]
    Failed(String),
}

/// The wrapper script run by `<shell> -c` (see the module text).
pub fn wrapper_script(spec: &ExecSpec) -> String {
    let mut script = format!("export {}; ", spec.exec_id.env_entry());
    if let Some(dir) = &spec.working_dir {
        script.push_str(&format!("cd -- {} && ", quote(dir)));
    }
    script.push_str("exec");
    for word in &spec.argv {
        script.push(' ');
        script.push_str(&quote(word));
    }
    script
}

/// The exit code a status reports: 0 for `Success`, the `ExitCode` cause of a
/// `NonZeroExitCode` failure; `Err` with the (capped) message for any other failure.
pub fn exit_code(status: &Status) -> Result<i64, ExecError> {
    if status.status.as_deref() == Some("Success") {
        return Ok(0);
    }
    if status.reason.as_deref() == Some("NonZeroExitCode")
        && let Some(code) = status
            .details
            .as_ref()
            .and_then(|d| d.causes.as_ref())
            .and_then(|causes| {
                causes
                    .iter()
                    .find(|c| c.reason.as_deref() == Some("ExitCode"))
            })
            .and_then(|c| c.message.as_deref())
            .and_then(|m| m.trim().parse::<i64>().ok())
    {
        return Ok(code);
    }
    Err(ExecError::Failed(cap(status.message.as_deref().unwrap_or(
        status.reason.as_deref().unwrap_or("unknown failure"),
    ))))
}

/// `text` cut to [`MESSAGE_CAP`] bytes on a character boundary.
pub fn cap(text: &str) -> String {
    if text.len() <= MESSAGE_CAP {
        return text.to_owned();
    }
    let mut end = MESSAGE_CAP;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// The parameters of an exec in the computer's container: stdout and stderr always, stdin when
/// asked, and `pipe` bytes of kube's buffer for each stream.
pub fn attach_params(stdin: bool, pipe: usize) -> AttachParams {
    let mut params = AttachParams::default()
        .container(CONTAINER)
        .stdin(stdin)
        .stdout(true)
        .stderr(true);
    params.max_stdin_buf_size = Some(pipe);
    params.max_stdout_buf_size = Some(pipe);
    params.max_stderr_buf_size = Some(pipe);
    params
}

/// Runs `argv` in the computer's container of Pod `name`, pushing output into `sink` until it
/// ends or the sink says stop.
pub async fn run(
    pods: &Api<Pod>,
    name: &str,
    argv: Vec<String>,
    stdin: Option<&[u8]>,
    sink: &mut dyn OutputSink,
    cancel: &CancellationToken,
) -> Result<ExecEnd, ExecError> {
    let params = attach_params(stdin.is_some(), CHUNK);
    let mut attached = pods
        .exec(name, argv, &params)
        .await
        .map_err(ExecError::Connect)?;
    let status = attached.take_status();
    let mut stdout = attached.stdout();
    let mut stderr = attached.stderr();
    let mut writer = attached.stdin().filter(|_| stdin.is_some());
    let data = stdin.unwrap_or_default();
    // Dropping the writer closes stdin (kube sends the CLOSE message).
    let feed = async move {
        if let Some(w) = writer.as_mut() {
            let _ = w.write_all(data).await;
            let _ = w.shutdown().await;
        }
        drop(writer);
    };
    tokio::pin!(feed);
    let mut fed = false;
    let mut out_buf = vec![0u8; CHUNK];
    let mut err_buf = vec![0u8; CHUNK];
    while stdout.is_some() || stderr.is_some() {
        let pushed = tokio::select! {
            () = cancel.cancelled() => return Ok(ExecEnd::StoppedBySink),
            () = &mut feed, if !fed => { fed = true; SinkControl::Continue }
            read = async { stdout.as_mut()?.read(&mut out_buf).await.ok() }, if stdout.is_some() => match read {
                Some(n) if n > 0 => sink.push(Stream::Stdout, &out_buf[..n]),
                _ => { stdout = None; SinkControl::Continue }
            },
            read = async { stderr.as_mut()?.read(&mut err_buf).await.ok() }, if stderr.is_some() => match read {
                Some(n) if n > 0 => sink.push(Stream::Stderr, &err_buf[..n]),
                _ => { stderr = None; SinkControl::Continue }
            },
        };
        if pushed == SinkControl::Stop {
            return Ok(ExecEnd::StoppedBySink);
        }
    }
    let status = match status {
        Some(status) => tokio::time::timeout(STATUS_WAIT, status)
            .await
            .ok()
            .flatten(),
        None => None,
    };
    drop(attached);
    match status {
        Some(status) => exit_code(&status).map(ExecEnd::Exited),
        None => Err(ExecError::NoStatus),
    }
}

/// Output of a command the backend runs for itself (readiness, kill sweeps), capped.
#[derive(Default)]
pub struct Collected {
    pub stdout: Vec<u8>,
}

/// What a probe's output may hold: the readiness marker is a few bytes.
const COLLECT_CAP: usize = 64 * 1024;

impl OutputSink for Collected {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        if stream == Stream::Stdout {
            let room = COLLECT_CAP.saturating_sub(self.stdout.len());
            self.stdout
                .extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
        SinkControl::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{StatusCause, StatusDetails};
    use kilntainers_backend::ids::ExecId;

    #[test]
    fn wrapper_tags_changes_directory_and_quotes() {
        let exec_id = ExecId::random();
        let spec = ExecSpec {
            argv: vec!["/bin/sh".into(), "-c".into(), "echo 'hi'".into()],
            stdin: None,
            working_dir: Some("/tmp/it's".into()),
            exec_id: exec_id.clone(),
            command: None,
        };
        assert_eq!(
            wrapper_script(&spec),
            format!(
                "export KILNTAINERS_EXEC_ID={}; cd -- '/tmp/it'\\''s' && exec '/bin/sh' '-c' 'echo '\\''hi'\\'''",
                exec_id.as_str()
            )
        );
    }

    fn failure(reason: &str, causes: Vec<StatusCause>, message: &str) -> Status {
        Status {
            status: Some("Failure".into()),
            reason: Some(reason.into()),
            message: Some(message.into()),
            details: Some(StatusDetails {
                causes: Some(causes),
                ..StatusDetails::default()
            }),
            ..Status::default()
        }
    }

    #[test]
    fn exit_codes_come_from_the_status_channel() {
        let success = Status {
            status: Some("Success".into()),
            ..Status::default()
        };
        assert_eq!(exit_code(&success).unwrap(), 0);
        let cause = StatusCause {
            reason: Some("ExitCode".into()),
            message: Some("42".into()),
            ..StatusCause::default()
        };
        assert_eq!(
            exit_code(&failure("NonZeroExitCode", vec![cause], "exit 42")).unwrap(),
            42
        );
        let other = failure("InternalError", vec![], &"x".repeat(2000));
        match exit_code(&other) {
            Err(ExecError::Failed(text)) => {
                assert!(text.len() <= MESSAGE_CAP + 3, "{}", text.len())
            }
            wrong => panic!("{wrong:?}"),
        }
    }
}
