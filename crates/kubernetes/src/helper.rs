//! The exec helper on Kubernetes (docs/kubernetes.md, "Exec"): the shared client
//! (`kilntainers-helper-client`, the same as on Docker) speaks the protocol, holds its limits
//! and falls back; this module is how it reaches into a Pod. Nothing is baked into the image:
//! the binary goes in through one `pods/exec` of the computer's shell that writes its stdin to
//! a temporary file and renames it over the helper's path (a copy another connection runs is
//! not disturbed), and the helper then runs as one long-lived `pods/exec` of
//! `<helper> serve` per computer, whose stdin, stdout and stderr are the WebSocket's channels.
//!
//! A Pod where the file cannot be written (a non-root user, a read-only root filesystem, no
//! shell) keeps one `pods/exec` per command, which the shared client decides and logs once.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::{Stream, StreamExt};
use kube::api::AttachedProcess;
use tokio_util::io::ReaderStream;
use tokio_util::sync::CancellationToken;

use crate::KubernetesBackend;
use crate::exec::{self, ExecError};
use kilntainers_backend::posix::quote;
use kilntainers_backend::{ExecEnd, OutputSink, SandboxRef, SinkControl, Stream as OutputStream};
use kilntainers_helper_client::{Attached, Chunk, Transport, UploadError, binary, printable};

/// The fallback's name in logs and in the notice a broken helper leaves in stderr.
pub(crate) const PLAIN: &str = "pods/exec";
/// How long the upload (about 1.5 MB through the API server) may take.
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(60);
/// Bytes of the helper's output read at a time, and kube's pipe size for each stream: frames
/// larger than this are simply read in several pieces.
const PIPE: usize = 16 * 1024;
/// What of a failed upload's stderr is kept for the log.
const UPLOAD_ERROR_KEPT: usize = 512;

/// The shell script that puts stdin at the helper's path: written beside it under a name of
/// its own, made executable, then renamed over the old copy; the temporary file is removed
/// whatever happens.
pub(crate) fn upload_script() -> String {
    let dir = format!("/{}", binary::DIR);
    format!(
        "set -e; umask 022; mkdir -p {dir}; t={dir}/.upload-$$; trap 'rm -f \"$t\"' EXIT; cat > \"$t\"; chmod 755 \"$t\"; mv -f \"$t\" {path}",
        dir = quote(&dir),
        path = quote(&binary::PATH),
    )
}

/// The backend's way into a Pod for the helper, for one call.
pub(crate) struct PodTransport<'a>(pub(crate) &'a KubernetesBackend);

#[async_trait]
impl Transport for PodTransport<'_> {
    async fn upload(&self, sandbox: &SandboxRef) -> Result<(), UploadError> {
        let backend = self.0;
        let unreached =
            |e: kilntainers_backend::BackendError| UploadError::Unreached(e.to_string());
        let cluster = backend.cluster().await.map_err(unreached)?;
        let pod = backend
            .pod_name(&sandbox.computer_id)
            .await
            .map_err(unreached)?;
        let argv = vec![backend.shell.clone(), "-c".to_owned(), upload_script()];
        let mut stderr = Stderr::default();
        let ran = tokio::time::timeout(
            UPLOAD_TIMEOUT,
            exec::run(
                &cluster.pods,
                &pod,
                argv,
                Some(binary::bytes()),
                &mut stderr,
                &CancellationToken::new(),
            ),
        )
        .await;
        match ran {
            Ok(Ok(ExecEnd::Exited(0))) => Ok(()),
            Ok(Ok(ExecEnd::Exited(code))) => Err(UploadError::Impossible(format!(
                "writing the helper into the Pod failed (exit {code}): {}",
                printable(stderr.0.trim_ascii(), UPLOAD_ERROR_KEPT)
            ))),
            Ok(Ok(_)) => Err(UploadError::Unreached("the upload was stopped".to_owned())),
            // The shell could not start at all (the API server's status names why): this
            // image cannot take the helper this way.
            Ok(Err(ExecError::Failed(message))) => Err(UploadError::Impossible(format!(
                "writing the helper into the Pod failed: {message}"
            ))),
            Ok(Err(other)) => Err(UploadError::Unreached(other.to_string())),
            Err(_) => Err(UploadError::Unreached(format!(
                "the upload did not finish within {}s",
                UPLOAD_TIMEOUT.as_secs()
            ))),
        }
    }

    async fn attach(&self, sandbox: &SandboxRef, argv: Vec<String>) -> Result<Attached, String> {
        let backend = self.0;
        let cluster = backend.cluster().await.map_err(|e| e.to_string())?;
        let pod = backend
            .pod_name(&sandbox.computer_id)
            .await
            .map_err(|e| e.to_string())?;
        let mut process = cluster
            .pods
            .exec(&pod, argv, &exec::attach_params(true, PIPE))
            .await
            .map_err(|e| exec::cap(&e.to_string()))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (process.stdin(), process.stdout(), process.stderr())
        else {
            return Err("the API server did not attach the helper's streams".to_owned());
        };
        let stdout = ReaderStream::with_capacity(stdout, PIPE).map(|read| match read {
            Ok(bytes) => Ok(Chunk::Stdout(bytes)),
            Err(e) => Err(format!("reading the helper's output failed: {e}")),
        });
        let stderr = ReaderStream::with_capacity(stderr, PIPE).map(|read| match read {
            Ok(bytes) => Ok(Chunk::Stderr(bytes)),
            Err(e) => Err(format!("reading the helper's stderr failed: {e}")),
        });
        let output = Holding {
            streams: Box::pin(futures_util::stream::select(stdout, stderr)),
            _process: process,
        };
        Ok(Attached {
            output: Box::pin(output),
            input: Box::pin(stdin),
        })
    }
}

/// The helper's merged output, holding the exec's WebSocket task: kube ends the exec when its
/// `AttachedProcess` is dropped, which is exactly when the connection drops this stream.
struct Holding {
    streams: Pin<Box<dyn Stream<Item = Result<Chunk, String>> + Send>>,
    _process: AttachedProcess,
}

impl Stream for Holding {
    type Item = Result<Chunk, String>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.streams.poll_next_unpin(cx)
    }
}

/// The upload's stderr, capped (it comes from the computer).
#[derive(Default)]
struct Stderr(Vec<u8>);

impl OutputSink for Stderr {
    fn push(&mut self, stream: OutputStream, bytes: &[u8]) -> SinkControl {
        if stream == OutputStream::Stderr {
            let room = UPLOAD_ERROR_KEPT.saturating_sub(self.0.len());
            self.0.extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
        SinkControl::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upload_writes_beside_the_helper_and_renames_over_it() {
        let script = upload_script();
        assert!(script.starts_with("set -e; umask 022; mkdir -p '/.kilntainers';"));
        assert!(
            script.ends_with(&format!("mv -f \"$t\" '{}'", *binary::PATH)),
            "{script}"
        );
        assert!(script.contains("trap 'rm -f \"$t\"' EXIT"));
    }
}
