//! Jobs of backends without a POSIX shell in the computer (WASM): each job is a task of this
//! server process running one exec, with its output in memory under the same log limit and
//! the same combined-stream offsets as a job kept in a computer. They are not durable: they
//! end with the server (docs/jobs.md, "Backends"). stdin is given once, at the start: a guest
//! takes its whole stdin when it starts, so `keep_stdin_open` leaves nothing to write to.
//!
//! What these jobs keep is the server's memory, so it is bounded the way a computer's claims
//! are (docs/jobs.md, "A hostile computer"): every byte kept is charged to its computer and to
//! the server ([`KEPT_BYTES_PER_COMPUTER`], [`KEPT_BYTES_TOTAL`]), ended jobs are evicted
//! oldest first to make room and past the cap on kept jobs, and what a running job prints
//! beyond the room left is counted, not kept. Everything is keyed by computer and dropped
//! with it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{JobError, JobSummary, Snapshot, StartRequest, WaitFor, list_rows, lock, now_ms};
use crate::backends::{Backend, ExecEnd, ExecSpec, OutputSink, SandboxRef, SinkControl, Stream};
use crate::exec::{ExecOutcome, Program};
use crate::ids::{ComputerId, ExecId, JobId};

/// Output bytes the jobs of one computer keep in the server, running and ended together: eight
/// ended jobs at the default 2 MiB output limit (a WASM guest's output is collected like a
/// command's, so a job prints at most that much), and a quarter of [`KEPT_BYTES_TOTAL`], so
/// one computer never holds the server's whole budget.
const KEPT_BYTES_PER_COMPUTER: u64 = 16 * 1024 * 1024;

/// Output bytes the in-server jobs of every computer keep together: what a server running
/// WebAssembly guests in its own process can spare for finished jobs' logs, whatever the
/// number of computers or principals.
const KEPT_BYTES_TOTAL: u64 = 64 * 1024 * 1024;

/// What one entry of a job's combined order costs against the budgets (its size in memory):
/// output arriving in tiny chunks that alternate between the streams costs what it takes.
const ORDER_ENTRY_BYTES: u64 = std::mem::size_of::<(Stream, u64)>() as u64;

/// Which stream is which in the per-stream counters.
fn stream_index(stream: Stream) -> usize {
    usize::from(stream == Stream::Stderr)
}

#[derive(Default)]
struct Output {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    /// The combined order: which stream each run of chunks went to, and its length.
    order: Vec<(Stream, u64)>,
    /// Bytes kept per stream, against the log limit.
    kept: [u64; 2],
    /// Bytes not kept per stream: past the log limit, and past the memory budgets.
    over_log_limit: [u64; 2],
    over_budget: [u64; 2],
    /// `Some(code)` once ended; `Some(None)` when stopped by a kill.
    ended: Option<(Option<i64>, u64)>,
}

impl Output {
    /// What appending `len` bytes of `stream` costs beyond the bytes themselves: a new order
    /// entry, unless the last one is the same stream's.
    fn entry_cost(&self, stream: Stream) -> u64 {
        match self.order.last() {
            Some((last, _)) if *last == stream => 0,
            _ => ORDER_ENTRY_BYTES,
        }
    }

    fn append(&mut self, stream: Stream, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        match stream {
            Stream::Stdout => self.stdout.extend_from_slice(bytes),
            Stream::Stderr => self.stderr.extend_from_slice(bytes),
        }
        match self.order.last_mut() {
            Some((last, len)) if *last == stream => *len += bytes.len() as u64,
            _ => self.order.push((stream, bytes.len() as u64)),
        }
    }

    fn total(&self) -> u64 {
        self.order.iter().map(|(_, n)| n).sum()
    }

    /// The lines that end a stream whose output was not all kept, and the end notice.
    fn closing_notes(&self, notice: Option<String>) -> Vec<(Stream, String)> {
        let mut notes = Vec::new();
        for stream in [Stream::Stdout, Stream::Stderr] {
            let index = stream_index(stream);
            if self.over_log_limit[index] > 0 {
                notes.push((
                    stream,
                    format!(
                        "\n[kilntainers: job log limit reached; {} further bytes of this stream were not kept]\n",
                        self.over_log_limit[index]
                    ),
                ));
            }
            if self.over_budget[index] > 0 {
                notes.push((
                    stream,
                    format!(
                        "\n[kilntainers: the server keeps no more job output for this computer; {} further bytes of this stream were not kept]\n",
                        self.over_budget[index]
                    ),
                ));
            }
        }
        if let Some(notice) = notice {
            let separator = if self.stderr.is_empty() || self.stderr.ends_with(b"\n") {
                ""
            } else {
                "\n"
            };
            notes.push((Stream::Stderr, format!("{separator}{notice}")));
        }
        notes
    }
}

struct Job {
    id: JobId,
    computer: ComputerId,
    /// What `job_list` shows of the command; the command itself is not kept.
    command: String,
    started_ms: u64,
    log_limit: u64,
    output: Mutex<Output>,
    changed: Notify,
    stop: CancellationToken,
}

/// A job the server keeps, with what it is charged for.
struct Entry {
    job: Arc<Job>,
    /// Bytes charged to its computer and to the server: kept output and order entries.
    charged: u64,
    ended: bool,
}

/// The jobs one computer keeps, oldest started first.
#[derive(Default)]
struct Kept {
    jobs: Vec<Entry>,
    /// The sum of `charged` over `jobs`.
    bytes: u64,
}

impl Kept {
    fn running(&self) -> usize {
        self.jobs.iter().filter(|entry| !entry.ended).count()
    }

    /// The oldest ended job that holds bytes, or with `any`, the oldest ended job.
    fn oldest_ended(&self, any: bool) -> Option<usize> {
        self.jobs
            .iter()
            .position(|entry| entry.ended && (any || entry.charged > 0))
    }
}

/// Every in-server job, keyed by computer, with the bytes charged to the server.
#[derive(Default)]
struct Store {
    computers: HashMap<ComputerId, Kept>,
    /// The sum of every computer's `bytes`.
    bytes: u64,
}

impl Store {
    fn job(&self, computer: &ComputerId, id: &JobId) -> Option<Arc<Job>> {
        self.computers
            .get(computer)?
            .jobs
            .iter()
            .find(|entry| &entry.job.id == id)
            .map(|entry| entry.job.clone())
    }

    /// Drops the job at `at` of `computer` and its charge.
    fn evict(&mut self, computer: &ComputerId, at: usize) {
        let Some(kept) = self.computers.get_mut(computer) else {
            return;
        };
        let entry = kept.jobs.remove(at);
        kept.bytes -= entry.charged;
        self.bytes -= entry.charged;
        if kept.jobs.is_empty() {
            self.computers.remove(computer);
        }
    }

    /// Keeps a new job of its computer's, evicting that computer's ended jobs past `cap`
    /// kept jobs, oldest first.
    fn add(&mut self, job: Arc<Job>, cap: usize) {
        let computer = job.computer.clone();
        self.computers
            .entry(computer.clone())
            .or_default()
            .jobs
            .push(Entry {
                job,
                charged: 0,
                ended: false,
            });
        while let Some(kept) = self.computers.get(&computer)
            && kept.jobs.len() > cap
            && let Some(at) = kept.oldest_ended(true)
        {
            self.evict(&computer, at);
        }
    }

    /// Makes room for `want` more bytes of `computer`'s and returns how many fit (at most
    /// `want`): the computer's own oldest ended jobs go first while it is over its budget,
    /// then, while the server is over its own, the oldest ended job of whichever computer
    /// keeps the most bytes, so one computer's output never pushes out another's before its
    /// own. Running jobs are never evicted.
    fn room(&mut self, computer: &ComputerId, want: u64) -> u64 {
        let own = |store: &Self| store.computers.get(computer).map_or(0, |kept| kept.bytes);
        while own(self) + want > KEPT_BYTES_PER_COMPUTER
            && let Some(at) = self
                .computers
                .get(computer)
                .and_then(|kept| kept.oldest_ended(false))
        {
            self.evict(computer, at);
        }
        while self.bytes + want > KEPT_BYTES_TOTAL
            && let Some((largest, at)) = self
                .computers
                .iter()
                .filter_map(|(id, kept)| Some((id, kept.bytes, kept.oldest_ended(false)?)))
                .max_by_key(|(_, bytes, _)| *bytes)
                .map(|(id, _, at)| (id.clone(), at))
        {
            self.evict(&largest, at);
        }
        let left = KEPT_BYTES_PER_COMPUTER
            .saturating_sub(own(self))
            .min(KEPT_BYTES_TOTAL.saturating_sub(self.bytes));
        want.min(left)
    }

    /// Charges `bytes` to `job`, its computer and the server (nothing when the job is no
    /// longer kept).
    fn charge(&mut self, job: &Job, bytes: u64) {
        let Some(kept) = self.computers.get_mut(&job.computer) else {
            return;
        };
        let Some(entry) = kept.jobs.iter_mut().find(|entry| entry.job.id == job.id) else {
            return;
        };
        entry.charged += bytes;
        kept.bytes += bytes;
        self.bytes += bytes;
    }

    fn mark_ended(&mut self, job: &Job) {
        if let Some(entry) = self
            .computers
            .get_mut(&job.computer)
            .and_then(|kept| kept.jobs.iter_mut().find(|entry| entry.job.id == job.id))
        {
            entry.ended = true;
        }
    }

    /// Keeps what fits of a running job's chunk and counts the rest. A job no longer kept
    /// (its computer is gone) keeps nothing and makes no room.
    fn keep(&mut self, job: &Job, stream: Stream, bytes: &[u8]) {
        if self.job(&job.computer, &job.id).is_none() {
            return;
        }
        let index = stream_index(stream);
        let mut output = lock(&job.output);
        let len = bytes.len() as u64;
        let under_log_limit = job.log_limit.saturating_sub(output.kept[index]).min(len);
        let cost = output.entry_cost(stream);
        let fits = if under_log_limit == 0 {
            0
        } else {
            self.room(&job.computer, under_log_limit + cost)
                .saturating_sub(cost)
        };
        if fits > 0 {
            self.charge(job, fits + cost);
            let end = usize::try_from(fits).unwrap_or(usize::MAX);
            output.append(stream, &bytes[..end]);
            output.kept[index] += fits;
        }
        output.over_log_limit[index] += len - under_log_limit;
        output.over_budget[index] += under_log_limit - fits;
    }

    /// Records a job's end: the notes on what was not kept and the end notice are appended
    /// whatever the budgets (they are what tells the reader), and charged.
    fn finish(&mut self, job: &Job, code: Option<i64>, notice: Option<String>) {
        let mut output = lock(&job.output);
        for (stream, note) in output.closing_notes(notice) {
            let cost = output.entry_cost(stream) + note.len() as u64;
            self.charge(job, cost);
            output.append(stream, note.as_bytes());
        }
        output.ended = Some((code, now_ms()));
        self.mark_ended(job);
    }

    /// Forgets a computer's jobs, stopping those still running.
    fn forget(&mut self, computer: &ComputerId) {
        if let Some(kept) = self.computers.remove(computer) {
            self.bytes -= kept.bytes;
            for entry in kept.jobs {
                entry.job.stop.cancel();
            }
        }
    }
}

/// Takes a running job's output as it streams. The backend's own output limit still holds (a
/// WASM guest's output is collected like a command's): a push beyond it is the backend's
/// signal that the guest crossed it, and is not kept.
struct JobSink {
    job: Arc<Job>,
    store: Arc<Mutex<Store>>,
    output_limit: u64,
    pushed: u64,
    over_output_limit: bool,
}

impl OutputSink for JobSink {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        self.pushed = self.pushed.saturating_add(bytes.len() as u64);
        if self.pushed > self.output_limit {
            self.over_output_limit = true;
            return SinkControl::Stop;
        }
        lock(&self.store).keep(&self.job, stream, bytes);
        self.job.changed.notify_waiters();
        SinkControl::Continue
    }
}

#[derive(Default)]
pub(super) struct InServerJobs {
    store: Arc<Mutex<Store>>,
}

impl InServerJobs {
    fn get(&self, id: &JobId, computer: &ComputerId) -> Result<Arc<Job>, JobError> {
        lock(&self.store)
            .job(computer, id)
            .ok_or_else(|| JobError::NotFound(id.clone()))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        &self,
        backend: Arc<dyn Backend>,
        sandbox: &SandboxRef,
        shell: &str,
        request: &StartRequest,
        command: &str,
        timeout_secs: u64,
        settings: super::JobSettings,
    ) -> Result<JobId, JobError> {
        let computer = &sandbox.computer_id;
        let job = {
            let mut store = lock(&self.store);
            let kept = store.computers.get(computer);
            let running = kept.map_or(0, Kept::running);
            if running >= settings.max_jobs as usize {
                return Err(JobError::TooMany {
                    computer: computer.clone(),
                    running: u32::try_from(running).unwrap_or(u32::MAX),
                });
            }
            let id = loop {
                let id = JobId::random();
                if store.job(computer, &id).is_none() {
                    break id;
                }
            };
            let job = Arc::new(Job {
                id,
                computer: computer.clone(),
                command: super::command_preview(command),
                started_ms: now_ms(),
                log_limit: settings.log_limit,
                output: Mutex::new(Output::default()),
                changed: Notify::new(),
                stop: CancellationToken::new(),
            });
            // Every job `job_list` can show, and every running one.
            let cap = list_rows(settings.max_jobs).max(settings.max_jobs as usize);
            store.add(job.clone(), cap);
            job
        };
        let id = job.id.clone();
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
        let store = self.store.clone();
        tokio::spawn(async move {
            let mut sink = JobSink {
                job: job.clone(),
                store: store.clone(),
                output_limit: settings.output_limit,
                pushed: 0,
                over_output_limit: false,
            };
            let cancel = CancellationToken::new();
            let limit = async {
                if timeout_secs == 0 {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_secs(timeout_secs)).await;
            };
            let ended = tokio::select! {
                ended = backend.exec(&sandbox, &spec, &mut sink, &cancel) => Some(ended),
                () = limit => None,
                () = job.stop.cancelled() => Some(Ok(ExecEnd::StoppedBySink)),
            };
            cancel.cancel();
            let (code, notice) = match ended {
                None => (Some(124), Some(ExecOutcome::timeout_notice(timeout_secs))),
                Some(Ok(ExecEnd::Exited(code))) => (Some(code), None),
                Some(Ok(ExecEnd::OutOfFuel(fuel))) => {
                    (Some(124), Some(ExecOutcome::out_of_fuel_notice(fuel)))
                }
                Some(Ok(ExecEnd::StoppedBySink)) if sink.over_output_limit => (
                    Some(1),
                    Some(ExecOutcome::output_limit_notice(settings.output_limit)),
                ),
                Some(Ok(ExecEnd::StoppedBySink)) => (None, None),
                Some(Err(error)) => (None, Some(format!("[kilntainers: {error}]"))),
            };
            lock(&store).finish(&job, code, notice);
            job.changed.notify_waiters();
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
        let store = lock(&self.store);
        let Some(kept) = store.computers.get(computer) else {
            return Vec::new();
        };
        kept.jobs
            .iter()
            .map(|entry| {
                let job = &entry.job;
                let output = lock(&job.output);
                let at = |ms: u64| crate::clock::rfc3339_utc(i64::try_from(ms / 1000).unwrap_or(0));
                JobSummary {
                    job_id: job.id.clone(),
                    command: job.command.clone(),
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
        lock(&self.store).forget(computer);
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
        lifetime_ms: output.ended.map(|(_, ended_ms)| (job.started_ms, ended_ms)),
    }
}

#[cfg(test)]
mod tests;
