//! The exec helper on Docker (`docs/exec-helper.md`): the shared client
//! (`kilntainers-helper-client`) does the protocol, its limits and the fallback; this module is
//! how Docker reaches in. The binary is uploaded with the Engine API's archive call (before
//! start for new computers, and again before every later connection, remote engines included),
//! and the helper runs as one attached Docker exec of `<helper> serve`.
//!
//! It also carries the broker binary ([`broker`]) for the egress proxy.

pub(super) mod broker;

use async_trait::async_trait;
use bollard::Docker;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::query_parameters::UploadToContainerOptionsBuilder;
use futures_util::StreamExt;

use kilntainers_backend::SandboxRef;
use kilntainers_helper_client::{Attached, Chunk, Transport, UploadError};
pub(super) use kilntainers_helper_client::{
    Helpers, INTERNAL_OUTPUT_CAP, Lost, PORT_CONNECTED, binary,
};

/// The fallback's name in logs and in the notice a broken helper leaves in stderr.
pub(super) const PLAIN: &str = "Docker exec";

/// Docker's way into a container for the helper, for one call.
pub(super) struct DockerTransport<'a>(pub(super) &'a Docker);

#[async_trait]
impl Transport for DockerTransport<'_> {
    async fn upload(&self, sandbox: &SandboxRef) -> Result<(), UploadError> {
        // Any failure counts as final, as it always has on Docker: the archive call works on
        // stopped containers too, so what fails here is the container itself.
        upload(self.0, sandbox.sandbox_id.as_str())
            .await
            .map_err(UploadError::Impossible)
    }

    async fn attach(&self, sandbox: &SandboxRef, argv: Vec<String>) -> Result<Attached, String> {
        let options = CreateExecOptions {
            cmd: Some(argv),
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            ..Default::default()
        };
        let docker = self.0;
        let created = docker
            .create_exec(sandbox.sandbox_id.as_str(), options)
            .await
            .map_err(|e| super::describe(&e))?;
        let start = StartExecOptions {
            detach: false,
            tty: false,
            // Small on purpose: one connection stays open per computer, and frames larger
            // than the buffer are simply read in several pieces.
            output_capacity: Some(16 * 1024),
        };
        let started = docker
            .start_exec(&created.id, Some(start))
            .await
            .map_err(|e| super::describe(&e))?;
        let StartExecResults::Attached { output, input } = started else {
            return Err("the engine did not attach to the helper's exec".to_owned());
        };
        let output = output.filter_map(|item| async move {
            match item {
                Ok(LogOutput::StdOut { message }) => Some(Ok(Chunk::Stdout(message))),
                Ok(LogOutput::StdErr { message }) => Some(Ok(Chunk::Stderr(message))),
                Ok(_) => None,
                Err(e) => Some(Err(e.to_string())),
            }
        });
        Ok(Attached {
            output: Box::pin(output),
            input,
        })
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
