//! One file operation on one computer, the way its backend offers it: the backend's own
//! [`FileSystem`] when it has one (WASM: the computer's host directory), otherwise this
//! module's POSIX `sh` programs run through [`exec::run`] like any command (docs/files.md,
//! "How it works inside a computer"). Callers hold the computer's exec turn; the file tools
//! take it through `Registry::with_turn`, the contract suite calls this directly.

use tokio_util::sync::CancellationToken;

use super::{
    DISCARD, LIST, LIST_ENTRY_BYTES, READ, STATUS_ROOM, WRITE, WRITE_CHUNK, base64_answer_len,
    parse_list, parse_read, parse_read_base64, parse_write,
};
use crate::backends::files::{
    FileError, FileOpError, FileSystem, LIST_ANSWER_LIMIT, Listing, ReadAnswer, temporary_path,
};
use crate::backends::{Backend, NoProgress, SandboxRef};
use crate::exec::{self, ExecError, ExecOutcome, ExecRequest, Program};
use crate::ids::ExecId;

/// What the operations need besides the computer: the backend, the shell the programs run in,
/// the time one program may take and the caller's cancel.
pub struct Access<'a> {
    backend: &'a dyn Backend,
    shell: &'a str,
    timeout_secs: u64,
    cancel: &'a CancellationToken,
}

impl<'a> Access<'a> {
    pub fn new(
        backend: &'a dyn Backend,
        shell: &'a str,
        timeout_secs: u64,
        cancel: &'a CancellationToken,
    ) -> Self {
        Self {
            backend,
            shell,
            timeout_secs,
            cancel,
        }
    }

    /// Refuses, before any computer is touched, a backend that cannot reach files at all.
    pub fn check_available(backend: &dyn Backend) -> Result<(), FileOpError> {
        if backend.file_system().is_some() || backend.has_posix_shell() {
            Ok(())
        } else {
            Err(FileOpError::Unavailable(backend.kind()))
        }
    }

    /// The backend's own answer; `None` when it has no file system or declined this one
    /// operation (`NotDirect`), and the programs run instead.
    async fn directly<T, F>(
        &self,
        operation: impl FnOnce(&'a dyn FileSystem) -> F,
    ) -> Result<Option<T>, FileOpError>
    where
        F: Future<Output = Result<T, FileOpError>>,
    {
        Self::check_available(self.backend)?;
        let Some(direct) = self.backend.file_system() else {
            return Ok(None);
        };
        match self.cancellable(operation(direct)).await {
            Err(FileOpError::NotDirect) => Ok(None),
            answer => answer.map(Some),
        }
    }

    /// At most `length` bytes of `path` from `offset`, never more whatever the computer sends.
    pub async fn read(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        offset: u64,
        length: u64,
    ) -> Result<ReadAnswer, FileOpError> {
        let read = |fs: &'a dyn FileSystem| fs.read(sandbox, path, offset, length);
        if let Some(mut answer) = self.directly(read).await? {
            answer
                .bytes
                .truncate(usize::try_from(length).unwrap_or(usize::MAX));
            return Ok(answer);
        }
        let mut args = vec![path.to_owned(), offset.to_string(), length.to_string()];
        if self.backend.exec_output_is_binary() {
            let limit = length.saturating_add(STATUS_ROOM);
            let (stdout, stderr) = self.run(sandbox, READ, args, None, limit).await?;
            Ok(parse_read(path, stdout, &stderr, length)?)
        } else {
            args.push("base64".to_owned());
            let limit = base64_answer_len(length).saturating_add(STATUS_ROOM);
            let (stdout, stderr) = self.run(sandbox, READ, args, None, limit).await?;
            Ok(parse_read_base64(path, &stdout, &stderr, length)?)
        }
    }

    /// Writes `bytes` to `path` (atomically unless `append`); returns the file's size after.
    pub async fn write(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        bytes: &[u8],
        append: bool,
        mode: Option<u32>,
    ) -> Result<u64, FileOpError> {
        if path.ends_with('/') {
            return Err(FileError::WriteToDirectory(path.to_owned()).into());
        }
        let write = |fs: &'a dyn FileSystem| fs.write(sandbox, path, bytes, append, mode);
        if let Some(size) = self.directly(write).await? {
            return Ok(size);
        }
        self.write_in_chunks(sandbox, path, bytes, append, mode)
            .await
    }

    /// Every backend's exec takes 2 MiB of stdin, so a large write is several programs into
    /// one temporary file, renamed after the last (docs/files.md, "How it works inside a
    /// computer").
    async fn write_in_chunks(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        bytes: &[u8],
        append: bool,
        mode: Option<u32>,
    ) -> Result<u64, FileOpError> {
        use base64::Engine as _;
        let target = if append {
            path.to_owned()
        } else {
            temporary_path(path, rand::random())
        };
        let chunks: Vec<&[u8]> = if bytes.is_empty() {
            vec![&[][..]]
        } else {
            bytes.chunks(WRITE_CHUNK).collect()
        };
        let mode = mode.map(|m| format!("{m:o}")).unwrap_or_default();
        let mut size = None;
        for (index, chunk) in chunks.iter().enumerate() {
            let first = index == 0;
            let last = index + 1 == chunks.len();
            let flag = |b: bool| if b { "1" } else { "0" }.to_owned();
            let args = vec![
                path.to_owned(),
                target.clone(),
                flag(first),
                flag(last),
                mode.clone(),
            ];
            let stdin = base64::engine::general_purpose::STANDARD.encode(chunk);
            let answer = match self
                .run(sandbox, WRITE, args, Some(stdin), STATUS_ROOM)
                .await
            {
                Ok((stdout, _)) => parse_write(path, &stdout),
                Err(error) => {
                    if !first && !append {
                        self.discard(sandbox, &target).await;
                    }
                    return Err(error);
                }
            };
            // The program removes its temporary file itself when it answers a failure.
            size = answer?;
        }
        Ok(size.unwrap_or(bytes.len() as u64))
    }

    /// Removes the temporary file of a write that stopped half way; best effort, and not
    /// cancellable by the call that just was.
    async fn discard(&self, sandbox: &SandboxRef, temporary: &str) {
        let never = CancellationToken::new();
        let access = Access {
            cancel: &never,
            ..*self
        };
        let args = vec![temporary.to_owned()];
        if let Err(error) = access.run(sandbox, DISCARD, args, None, STATUS_ROOM).await {
            tracing::warn!(computer_id = %sandbox.computer_id, %error, "could not remove a partly written temporary file");
        }
    }

    /// The entries under `path`, to `depth` levels, sorted, at most [`super::LIST_LIMIT`].
    pub async fn list(
        &self,
        sandbox: &SandboxRef,
        path: &str,
        depth: u8,
    ) -> Result<Listing, FileOpError> {
        let list = |fs: &'a dyn FileSystem| fs.list(sandbox, path, depth);
        if let Some(listing) = self.directly(list).await? {
            return Ok(listing);
        }
        let args = vec![
            path.to_owned(),
            depth.to_string(),
            LIST_ENTRY_BYTES.to_string(),
        ];
        let (stdout, _) = self
            .run(sandbox, LIST, args, None, LIST_ANSWER_LIMIT)
            .await?;
        Ok(parse_list(path, &stdout)?)
    }

    async fn cancellable<T>(
        &self,
        operation: impl Future<Output = Result<T, FileOpError>>,
    ) -> Result<T, FileOpError> {
        tokio::select! {
            answer = operation => answer,
            () = self.cancel.cancelled() => Err(FileOpError::Cancelled),
        }
    }

    /// Runs one program as `<shell> -c <program> kilntainers-file <args…>`; its stdout and
    /// stderr, together at most `answer_limit` bytes.
    async fn run(
        &self,
        sandbox: &SandboxRef,
        program: &str,
        args: Vec<String>,
        stdin: Option<String>,
        answer_limit: u64,
    ) -> Result<(Vec<u8>, Vec<u8>), FileOpError> {
        let mut argv = vec![
            self.shell.to_owned(),
            "-c".to_owned(),
            program.to_owned(),
            "kilntainers-file".to_owned(),
        ];
        argv.extend(args);
        let request = ExecRequest {
            program: Program::Args(argv),
            stdin,
            working_dir: None,
            timeout_secs: self.timeout_secs,
        };
        let outcome = exec::run(
            self.backend,
            sandbox,
            self.shell,
            &request,
            ExecId::random(),
            answer_limit,
            &NoProgress,
            self.cancel,
        )
        .await;
        match outcome {
            Ok(ExecOutcome::Completed { stdout, stderr, .. }) => Ok((stdout, stderr)),
            Ok(ExecOutcome::TimedOut { timeout_secs, .. }) => {
                Err(FileOpError::TimedOut(timeout_secs))
            }
            Ok(ExecOutcome::OutputLimitExceeded { .. } | ExecOutcome::OutOfFuel { .. }) => {
                Err(FileOpError::Overflow)
            }
            Err(ExecError::Cancelled) => Err(FileOpError::Cancelled),
            Err(ExecError::Backend(error)) => Err(error.into()),
        }
    }
}
