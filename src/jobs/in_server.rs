//! Jobs of backends without a POSIX shell in the computer (WASM): each job is a task of this
//! server process running one exec, with its output in memory under the same log limit and
//! the same combined-stream offsets as a job kept in a computer. They are not durable: they
//! end with the server (docs/jobs.md, "Backends"). stdin is given once, at the start: a guest
//! takes its whole stdin when it starts, so `keep_stdin_open` leaves nothing to write to.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{JobError, JobSummary, Snapshot, StartRequest, WaitFor, lock, now_ms};
use crate::backends::{Backend, ExecEnd, ExecSpec, OutputSink, SandboxRef, SinkControl, Stream};
use crate::exec::{ExecOutcome, Program};
use crate::ids::{ComputerId, ExecId, JobId};

#[derive(Default)]
struct Output {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    /// The combined order: which stream each chunk went to, and its length.
    order: Vec<(Stream, u64)>,
    /// Bytes kept per stream, against the log limit.
    kept: [u64; 2],
    dropped: [u64; 2],
    /// `Some(code)` once ended; `Some(None)` when stopped by a kill.
    ended: Option<(Option<i64>, u64)>,
}

impl Output {
    fn append(&mut self, stream: Stream, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        match stream {
            Stream::Stdout => self.stdout.extend_from_slice(bytes),
            Stream::Stderr => self.stderr.extend_from_slice(bytes),
        }
        self.order.push((stream, bytes.len() as u64));
    }

    fn total(&self) -> u64 {
        self.order.iter().map(|(_, n)| n).sum()
    }
}

struct Job {
    computer: ComputerId,
    command: String,
    started_ms: u64,
    log_limit: u64,
    output: Mutex<Output>,
    changed: Notify,
    stop: CancellationToken,
}

impl Job {
    fn finish(&self, code: Option<i64>, notice: Option<String>) {
        let mut output = lock(&self.output);
        for (index, stream) in [Stream::Stdout, Stream::Stderr].into_iter().enumerate() {
            if output.dropped[index] > 0 {
                let note = format!(
                    "\n[kilntainers: job log limit reached; {} further bytes of this stream were not kept]\n",
                    output.dropped[index]
                );
                output.append(stream, note.as_bytes());
            }
        }
        if let Some(notice) = notice {
            let separator = if output.stderr.is_empty() || output.stderr.ends_with(b"\n") {
                ""
            } else {
                "\n"
            };
            output.append(Stream::Stderr, format!("{separator}{notice}").as_bytes());
        }
        output.ended = Some((code, now_ms()));
        drop(output);
        self.changed.notify_waiters();
    }
}

/// Appends a running job's output as it streams.
struct JobSink(Arc<Job>);

impl OutputSink for JobSink {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        let index = usize::from(stream == Stream::Stderr);
        let mut output = lock(&self.0.output);
        if output.kept[index] + bytes.len() as u64 <= self.0.log_limit {
            output.kept[index] += bytes.len() as u64;
            output.append(stream, bytes);
        } else {
            output.dropped[index] += bytes.len() as u64;
        }
        drop(output);
        self.0.changed.notify_waiters();
        SinkControl::Continue
    }
}

#[derive(Default)]
pub(super) struct InServerJobs {
    jobs: Mutex<HashMap<JobId, Arc<Job>>>,
}

impl InServerJobs {
    fn get(&self, id: &JobId, computer: &ComputerId) -> Result<Arc<Job>, JobError> {
        lock(&self.jobs)
            .get(id)
            .filter(|job| &job.computer == computer)
            .cloned()
            .ok_or_else(|| JobError::NotFound(id.clone()))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        &self,
        backend: Arc<dyn Backend>,
        sandbox: &SandboxRef,
        shell: &str,
        request: &StartRequest,
        command: String,
        timeout_secs: u64,
        settings: super::JobSettings,
    ) -> Result<JobId, JobError> {
        let running = lock(&self.jobs)
            .values()
            .filter(|job| job.computer == sandbox.computer_id && lock(&job.output).ended.is_none())
            .count();
        if running >= settings.max_jobs as usize {
            return Err(JobError::TooMany {
                computer: sandbox.computer_id.clone(),
                running: u32::try_from(running).unwrap_or(u32::MAX),
            });
        }
        let id = loop {
            let id = JobId::random();
            if !lock(&self.jobs).contains_key(&id) {
                break id;
            }
        };
        let job = Arc::new(Job {
            computer: sandbox.computer_id.clone(),
            command: command.clone(),
            started_ms: now_ms(),
            log_limit: settings.log_limit,
            output: Mutex::new(Output::default()),
            changed: Notify::new(),
            stop: CancellationToken::new(),
        });
        lock(&self.jobs).insert(id.clone(), job.clone());
        let spec = ExecSpec {
            argv: match &request.program {
                Program::Shell(command) => vec![shell.to_owned(), "-c".to_owned(), command.clone()],
                Program::Args(argv) => argv.clone(),
            },
            stdin: request.stdin.as_ref().map(|s| s.as_bytes().to_vec()),
            working_dir: request.working_dir.clone(),
            exec_id: ExecId::for_job(&id),
            command: match &request.program {
                Program::Shell(command) => Some(command.clone()),
                Program::Args(_) => None,
            },
        };
        let sandbox = sandbox.clone();
        tokio::spawn(async move {
            let mut sink = JobSink(job.clone());
            let cancel = CancellationToken::new();
            let limit = async {
                if timeout_secs == 0 {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_secs(timeout_secs)).await;
            };
            let (code, notice) = tokio::select! {
                ended = backend.exec(&sandbox, &spec, &mut sink, &cancel) => match ended {
                    Ok(ExecEnd::Exited(code)) => (Some(code), None),
                    Ok(ExecEnd::OutOfFuel(fuel)) => (Some(124), Some(ExecOutcome::out_of_fuel_notice(fuel))),
                    Ok(ExecEnd::StoppedBySink) => (None, None),
                    Err(error) => (None, Some(format!("[kilntainers: {error}]"))),
                },
                () = limit => (Some(124), Some(ExecOutcome::timeout_notice(timeout_secs))),
                () = job.stop.cancelled() => (None, None),
            };
            cancel.cancel();
            job.finish(code, notice);
        });
        Ok(id)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn read(
        &self,
        computer: &ComputerId,
        id: &JobId,
        since: u64,
        wait: Duration,
        until: WaitFor,
        cap: u64,
        cancel: &CancellationToken,
    ) -> Result<Snapshot, JobError> {
        let job = self.get(id, computer)?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let changed = job.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let output = lock(&job.output);
                let quiet = until == WaitFor::End || output.total() <= since;
                if output.ended.is_some() || !quiet || tokio::time::Instant::now() >= deadline {
                    return Ok(snapshot(&job, &output, since, cap));
                }
            }
            tokio::select! {
                () = changed => {}
                () = tokio::time::sleep_until(deadline) => {}
                () = cancel.cancelled() => return Err(JobError::Cancelled),
            }
        }
    }

    pub(super) fn write(&self, computer: &ComputerId, id: &JobId) -> Result<(), JobError> {
        self.get(id, computer)?;
        Err(JobError::NotAcceptingInput(id.clone()))
    }

    pub(super) fn kill(&self, computer: &ComputerId, id: &JobId) -> Result<(), JobError> {
        self.get(id, computer)?.stop.cancel();
        Ok(())
    }

    pub(super) fn list(&self, computer: &ComputerId) -> Vec<JobSummary> {
        lock(&self.jobs)
            .iter()
            .filter(|(_, job)| &job.computer == computer)
            .map(|(id, job)| {
                let output = lock(&job.output);
                let at = |ms: u64| crate::clock::rfc3339_utc(i64::try_from(ms / 1000).unwrap_or(0));
                JobSummary {
                    job_id: id.clone(),
                    command: super::command_preview(&job.command),
                    running: output.ended.is_none(),
                    exit_code: output.ended.and_then(|(code, _)| code),
                    started_at: Some(at(job.started_ms)),
                    ended_at: output.ended.map(|(_, ms)| at(ms)),
                    output_bytes: output.total(),
                    started_ms: job.started_ms,
                }
            })
            .collect()
    }

    /// Forgets the jobs of a computer that is gone, stopping those still running.
    pub(super) fn forget_computer(&self, computer: &ComputerId) {
        lock(&self.jobs).retain(|_, job| {
            let keep = &job.computer != computer;
            if !keep {
                job.stop.cancel();
            }
            keep
        });
    }
}

/// The same plan as the read script's: skip `since` bytes of the combined stream, then take up
/// to `cap` bytes in order.
fn snapshot(job: &Job, output: &Output, since: u64, cap: u64) -> Snapshot {
    let (mut position, mut left) = (0u64, cap);
    let (mut out_at, mut err_at, mut out_take, mut err_take) = (0u64, 0u64, 0u64, 0u64);
    for &(stream, n) in &output.order {
        let skip = since.saturating_sub(position).min(n);
        let take = (n - skip).min(left);
        match stream {
            Stream::Stdout => {
                out_at += skip;
                out_take += take;
            }
            Stream::Stderr => {
                err_at += skip;
                err_take += take;
            }
        }
        left -= take;
        position += n;
    }
    let slice = |bytes: &[u8], at: u64, take: u64| {
        let start = usize::try_from(at).unwrap_or(usize::MAX).min(bytes.len());
        let end = start
            .saturating_add(usize::try_from(take).unwrap_or(usize::MAX))
            .min(bytes.len());
        bytes[start..end].to_vec()
    };
    let next_since = since.min(position) + out_take + err_take;
    let end_ms = output.ended.map_or_else(now_ms, |(_, ms)| ms);
    Snapshot {
        running: output.ended.is_none(),
        exit_code: output.ended.and_then(|(code, _)| code),
        stdout: slice(&output.stdout, out_at, out_take),
        stderr: slice(&output.stderr, err_at, err_take),
        next_since,
        more: next_since < position,
        stdin_open: false,
        elapsed_ms: end_ms.saturating_sub(job.started_ms),
    }
}
