//! Jobs: commands that outlive one tool call (docs/jobs.md). A job's record and output live in
//! its computer, under `/.kilntainers/jobs/<job_id>/`, written by a small supervisor the job's
//! start leaves running there ([`script`]); every later step — reading, writing stdin,
//! signalling, listing — is one short exec. So a job survives the session that started it and
//! the server itself, and any server process that reaches the computer can follow it.
//!
//! The same scripts serve every backend with a POSIX shell (Docker and Podman with or without
//! the exec helper, Fly, E2B, Modal); only the WASM backends, which have none, keep jobs in
//! the server ([`in_server`], chosen by [`crate::backends::Backend::runs_jobs_in_server`]).
//!
//! **Architecture invariant:** no MCP types, no registry locks: job execs never wait for the
//! computer's FIFO exec turn, so a running job never blocks foreground calls.

mod in_server;
mod parse;
pub mod script;
mod tasks;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::backends::{Backend, BackendError, SandboxRef, posix};
use crate::exec::{self, ExecOutcome, ExecRequest, Program};
use crate::ids::{ComputerId, ExecId, JobId};
pub use parse::{JobSummary, Snapshot};
pub use tasks::{STATUS_TAIL, TaskRead, TaskRecord};

/// `job_output`'s marker when more output is waiting than one result carries.
pub const MORE_WAITING: &str = "[kilntainers: more output waiting; call job_output again]";

/// Grace between TERM (or INT, HUP) and KILL in `job_kill`.
pub const KILL_GRACE_SECS: u64 = 5;

/// The longest `wait` a read may ask for; the exec's own bound adds a margin to it.
pub const MAX_WAIT_SECS: u64 = 60;

/// Job ids drawn before giving up on a free one (a collision needs 2^32 bad luck).
const ID_TRIES: usize = 4;

/// How long one job exec may take beyond the wait it was asked for.
const EXEC_MARGIN: Duration = Duration::from_secs(30);

/// Jobs remembered per computer (where a job lives, so `job_output` finds it without probing):
/// far more than `--max-jobs` running at once, and a bound on what one computer costs the
/// server however many ids its callers name. The oldest is forgotten first; a forgotten job is
/// still found by probing (docs/jobs.md, "Tools").
const KNOWN_JOBS_PER_COMPUTER: usize = 1024;

/// The most bytes the list script may answer with: [`list_rows`] rows of at most about 1.5 KiB
/// each (the summary line is cut at 2 KiB; a real one, the command cut at 200 characters and
/// JSON-escaped, stays under 1.4 KiB) fit with room to spare. What a hostile computer sends
/// beyond it ends the call instead of growing the server.
const LIST_ANSWER_LIMIT: u64 = 256 * 1024;

/// The fewest and the most rows `job_list` returns (docs/jobs.md, "Tools"): `--max-jobs`
/// clamped to this range, so every running job fits unless the limit is above the maximum,
/// and the answer stays within [`LIST_ANSWER_LIMIT`].
const LIST_ROWS_MIN: u32 = 64;
const LIST_ROWS_MAX: u32 = 128;

/// Server-wide job settings (docs/jobs.md, "Settings").
#[derive(Debug, Clone, Copy)]
pub struct JobSettings {
    /// Running jobs allowed per computer.
    pub max_jobs: u32,
    /// Wall-clock limit of a job started without `timeout`; 0 = none.
    pub default_timeout_secs: u64,
    /// Bytes kept per stream of a job before further output is dropped.
    pub log_limit: u64,
    /// The most bytes one result carries.
    pub output_limit: u64,
}

/// How a job is started.
#[derive(Debug, Clone)]
pub struct StartRequest {
    pub program: Program,
    pub stdin: Option<String>,
    pub working_dir: Option<String>,
    /// Wall-clock limit from the job's start; `None` = the server's `--job-timeout`.
    pub timeout_secs: Option<u64>,
    pub keep_stdin_open: bool,
}

/// What ends a read's wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitFor {
    /// New output, or the job's end.
    Output,
    /// Only the job's end.
    End,
}

/// Signals `job_kill` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Term,
    Int,
    Kill,
    Hup,
}

impl Signal {
    pub fn parse(raw: &str) -> Option<Self> {
        match raw.trim().to_ascii_uppercase().trim_start_matches("SIG") {
            "TERM" => Some(Self::Term),
            "INT" => Some(Self::Int),
            "KILL" => Some(Self::Kill),
            "HUP" => Some(Self::Hup),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Term => "TERM",
            Self::Int => "INT",
            Self::Kill => "KILL",
            Self::Hup => "HUP",
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum JobError {
    #[error("Job {0} not found.")]
    NotFound(JobId),
    #[error("Job {0} is not accepting input.")]
    NotAcceptingInput(JobId),
    #[error(
        "Computer {} already runs {running} jobs; wait for one to end or kill one with job_kill.",
        .computer.slug()
    )]
    TooMany { computer: ComputerId, running: u32 },
    #[error("The client cancelled the call.")]
    Cancelled,
    /// A job exec failed in a way the computer explains (no writable directory, no mkfifo).
    #[error("Could not {action} job on computer '{}': {reason}", .computer.slug())]
    Failed {
        action: &'static str,
        computer: ComputerId,
        reason: String,
    },
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// One job script to run: its text, arguments, stdin, how long it may wait inside the
/// computer, and the most output it may answer with.
struct ScriptRun {
    script: String,
    args: Vec<String>,
    stdin: Option<String>,
    wait: Duration,
    cap: u64,
}

/// The job service every session shares: who holds which job and where each session's reading
/// stopped. The jobs themselves are in the computers.
pub struct Jobs {
    backend: Arc<dyn Backend>,
    shell: String,
    settings: JobSettings,
    /// Which jobs each computer holds, as far as this process knows: those it started and
    /// those a caller named that a probe then found there, never the ids a listing merely
    /// claims. Keyed by computer, so one computer cannot shadow another's job, bounded per
    /// computer, and dropped with the computer.
    index: Mutex<HashMap<ComputerId, VecDeque<JobId>>>,
    /// Each session's offset in each job's combined output: `job_output` without `since`.
    cursors: Mutex<HashMap<Cursor, u64>>,
    /// One start at a time per computer, so counting running jobs and starting one is a step.
    starting: Mutex<HashMap<ComputerId, Arc<tokio::sync::Mutex<()>>>>,
    /// Jobs kept in this process, for backends without a shell in the computer.
    in_server: Option<in_server::InServerJobs>,
}

/// A session's place in one job of one computer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Cursor {
    session: u64,
    computer: ComputerId,
    job: JobId,
}

/// `job_list`'s rows and whether the computer had more jobs than it returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listing {
    pub jobs: Vec<JobSummary>,
    pub truncated: bool,
}

/// The most rows `job_list` returns for `--max-jobs` = `max_jobs`.
pub fn list_rows(max_jobs: u32) -> usize {
    usize::try_from(max_jobs.clamp(LIST_ROWS_MIN, LIST_ROWS_MAX)).unwrap_or(usize::MAX)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `argv` as one shell command line, each word single-quoted.
fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|word| posix::quote(word))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The first 200 characters of a command, as `job_list` shows it.
pub fn command_preview(command: &str) -> String {
    command.chars().take(200).collect()
}

impl Jobs {
    pub fn new(backend: Arc<dyn Backend>, shell: String, settings: JobSettings) -> Arc<Self> {
        let in_server = backend
            .runs_jobs_in_server()
            .then(in_server::InServerJobs::default);
        Arc::new(Self {
            backend,
            shell,
            settings,
            index: Mutex::new(HashMap::new()),
            cursors: Mutex::new(HashMap::new()),
            starting: Mutex::new(HashMap::new()),
            in_server,
        })
    }

    pub fn settings(&self) -> JobSettings {
        self.settings
    }

    /// The computers this process knows to hold `job`, most recently remembered first.
    pub fn computers_of(&self, job: &JobId) -> Vec<ComputerId> {
        lock(&self.index)
            .iter()
            .filter(|(_, jobs)| jobs.contains(job))
            .map(|(computer, _)| computer.clone())
            .collect()
    }

    /// Remembers that `computer` holds `job`: a job this process started, or one a caller
    /// named that a probe found there. At most [`KNOWN_JOBS_PER_COMPUTER`] per computer.
    pub fn remember(&self, computer: &ComputerId, job: &JobId) {
        let mut index = lock(&self.index);
        let jobs = index.entry(computer.clone()).or_default();
        if let Some(at) = jobs.iter().position(|known| known == job) {
            jobs.remove(at);
        }
        jobs.push_back(job.clone());
        while jobs.len() > KNOWN_JOBS_PER_COMPUTER {
            jobs.pop_front();
        }
    }

    /// Forgets a session's reading positions when it ends.
    pub fn close_session(&self, session: u64) {
        lock(&self.cursors).retain(|cursor, _| cursor.session != session);
    }

    /// Forgets everything about a computer that was reset or deleted (its jobs went with it):
    /// where its jobs are, every session's place in them, its start turn.
    pub fn forget_computer(&self, computer: &ComputerId) {
        lock(&self.index).remove(computer);
        lock(&self.cursors).retain(|cursor, _| cursor.computer != *computer);
        lock(&self.starting).remove(computer);
        if let Some(local) = &self.in_server {
            local.forget_computer(computer);
        }
    }

    pub fn cursor(&self, session: u64, computer: &ComputerId, job: &JobId) -> u64 {
        let key = Cursor {
            session,
            computer: computer.clone(),
            job: job.clone(),
        };
        lock(&self.cursors).get(&key).copied().unwrap_or(0)
    }

    pub fn set_cursor(&self, session: u64, computer: &ComputerId, job: &JobId, offset: u64) {
        let key = Cursor {
            session,
            computer: computer.clone(),
            job: job.clone(),
        };
        lock(&self.cursors).insert(key, offset);
    }

    /// Runs one job script: `<shell> -c <script> kilntainers-job <args…>`. A stopped computer
    /// answers `BackendError::NotRunning`; starting it is the registry's (one start path, one
    /// admission against the running limit), and the caller then runs the script again.
    async fn run_script(
        &self,
        sandbox: &SandboxRef,
        run: ScriptRun,
        cancel: &CancellationToken,
    ) -> Result<(Vec<u8>, Vec<u8>), JobError> {
        let mut argv = vec![
            self.shell.clone(),
            "-c".to_owned(),
            run.script,
            "kilntainers-job".to_owned(),
        ];
        argv.extend(run.args);
        let request = ExecRequest {
            program: Program::Args(argv),
            stdin: run.stdin,
            working_dir: None,
            timeout_secs: (run.wait + EXEC_MARGIN).as_secs(),
        };
        let outcome = exec::run(
            self.backend.as_ref(),
            sandbox,
            &self.shell,
            &request,
            ExecId::random(),
            run.cap,
            &crate::backends::NoProgress,
            cancel,
        )
        .await;
        match outcome {
            Ok(ExecOutcome::Completed { stdout, stderr, .. }) => Ok((stdout, stderr)),
            Ok(ExecOutcome::TimedOut { .. }) => Err(JobError::Failed {
                action: "reach the",
                computer: sandbox.computer_id.clone(),
                reason: "the computer did not answer in time".to_owned(),
            }),
            Ok(ExecOutcome::OutputLimitExceeded { .. } | ExecOutcome::OutOfFuel { .. }) => {
                Err(JobError::Failed {
                    action: "read the",
                    computer: sandbox.computer_id.clone(),
                    reason: "its answer was larger than expected".to_owned(),
                })
            }
            Err(exec::ExecError::Cancelled) => Err(JobError::Cancelled),
            Err(exec::ExecError::Backend(error)) => Err(error.into()),
        }
    }

    /// Starts a job in `sandbox`; returns its id once it runs (its supervisor recorded itself).
    pub async fn start(
        &self,
        sandbox: &SandboxRef,
        request: &StartRequest,
        cancel: &CancellationToken,
    ) -> Result<JobId, JobError> {
        let computer = sandbox.computer_id.clone();
        let turn = lock(&self.starting)
            .entry(computer.clone())
            .or_default()
            .clone();
        let _turn = turn.lock().await;
        let command = match &request.program {
            Program::Shell(command) => command.clone(),
            Program::Args(argv) => shell_words(argv),
        };
        let timeout = request
            .timeout_secs
            .unwrap_or(self.settings.default_timeout_secs);
        if let Some(local) = &self.in_server {
            let job = local.start(
                self.backend.clone(),
                sandbox,
                &self.shell,
                request,
                &command,
                timeout,
                self.settings,
            )?;
            self.remember(&computer, &job);
            return Ok(job);
        }
        let started_ms = now_ms();
        let started_at = crate::clock::rfc3339_utc(i64::try_from(started_ms / 1000).unwrap_or(0));
        for _ in 0..ID_TRIES {
            let job = JobId::random();
            let meta = json!({
                "job_id": job.as_str(),
                "command": command,
                "argv": match &request.program { Program::Args(argv) => Some(argv), Program::Shell(_) => None },
                "working_directory": request.working_dir,
                "started_at": started_at,
                "timeout": timeout,
                "keep_stdin_open": request.keep_stdin_open,
            });
            let summary = json!({
                "job_id": job.as_str(),
                "command": command_preview(&command),
                "started_at": started_at,
                "started_ms": started_ms,
            });
            let args = vec![
                job.to_string(),
                self.shell.clone(),
                timeout.to_string(),
                u8::from(request.keep_stdin_open).to_string(),
                u8::from(request.stdin.is_some()).to_string(),
                request.working_dir.clone().unwrap_or_default(),
                meta.to_string(),
                summary.to_string(),
                command.clone(),
                self.settings.max_jobs.to_string(),
                self.settings.log_limit.to_string(),
                script::SUPERVISOR.to_owned(),
            ];
            let (stdout, _) = self
                .run_script(
                    sandbox,
                    ScriptRun {
                        script: script::start(),
                        args,
                        stdin: request.stdin.clone(),
                        wait: Duration::from_secs(5),
                        cap: 4096,
                    },
                    cancel,
                )
                .await?;
            let answer = String::from_utf8_lossy(&stdout);
            let answer = answer.trim();
            match answer.split_once(' ').map_or((answer, ""), |(a, b)| (a, b)) {
                ("started", _) => {
                    self.remember(&computer, &job);
                    return Ok(job);
                }
                ("exists", _) => {}
                ("busy", running) => {
                    return Err(JobError::TooMany {
                        computer,
                        running: running.parse().unwrap_or(self.settings.max_jobs),
                    });
                }
                (_, reason) => {
                    return Err(JobError::Failed {
                        action: "start a",
                        computer,
                        reason: if reason.is_empty() {
                            format!("unexpected answer {answer:?}")
                        } else {
                            reason.to_owned()
                        },
                    });
                }
            }
        }
        Err(JobError::Failed {
            action: "start a",
            computer,
            reason: "no unused job id was found".to_owned(),
        })
    }

    /// Output of `job` from offset `since` of its combined stream, at most the output limit,
    /// waiting up to `wait` for [`WaitFor`]. Every result of a job and of a command that became
    /// one is read here, so this is where a finished job's stderr gets its refusal lines.
    pub async fn read(
        &self,
        sandbox: &SandboxRef,
        job: &JobId,
        since: u64,
        wait: Duration,
        until: WaitFor,
        cancel: &CancellationToken,
    ) -> Result<Snapshot, JobError> {
        let mut snapshot = self
            .read_output(sandbox, job, since, wait, until, cancel)
            .await?;
        self.append_refusals(sandbox, &mut snapshot).await;
        Ok(snapshot)
    }

    /// A result that shows a job ended, with nothing more to read, ends its stderr with the
    /// lines a command gets for its refused connections: those recorded for the job's computer
    /// within its lifetime (docs/egress.md, "Docker wiring"). The job ran past the exec that
    /// appends a command's, so they are looked up by time.
    async fn append_refusals(&self, sandbox: &SandboxRef, snapshot: &mut Snapshot) {
        let Some((from_ms, to_ms)) = snapshot.lifetime_ms.filter(|_| !snapshot.more) else {
            return;
        };
        let denials = self
            .backend
            .egress_denials_between(sandbox, from_ms, to_ms)
            .await;
        let at_line_start = snapshot.stderr.last().is_none_or(|&byte| byte == b'\n');
        let tail = crate::backends::egress::stderr_tail(&denials, at_line_start);
        snapshot.stderr.extend_from_slice(tail.as_bytes());
    }

    /// [`Self::read`] without the refusal lines: what the computer holds.
    async fn read_output(
        &self,
        sandbox: &SandboxRef,
        job: &JobId,
        since: u64,
        wait: Duration,
        until: WaitFor,
        cancel: &CancellationToken,
    ) -> Result<Snapshot, JobError> {
        let cap = self.settings.output_limit;
        if let Some(local) = &self.in_server {
            return local
                .read(&sandbox.computer_id, job, since, wait, until, cap, cancel)
                .await;
        }
        let args = vec![
            job.to_string(),
            since.to_string(),
            cap.to_string(),
            wait.as_secs().to_string(),
            match until {
                WaitFor::Output => "output",
                WaitFor::End => "end",
            }
            .to_owned(),
        ];
        let (stdout, stderr) = self
            .run_script(
                sandbox,
                ScriptRun {
                    script: script::read(),
                    args,
                    stdin: None,
                    wait,
                    cap: cap.saturating_add(64 * 1024),
                },
                cancel,
            )
            .await?;
        parse::snapshot(&stdout, stderr, since, now_ms())
            .ok_or_else(|| JobError::NotFound(job.clone()))
    }

    /// Writes `data` to the job's stdin and closes it if asked.
    pub async fn write(
        &self,
        sandbox: &SandboxRef,
        job: &JobId,
        data: Option<String>,
        close: bool,
        cancel: &CancellationToken,
    ) -> Result<(), JobError> {
        if let Some(local) = &self.in_server {
            return local.write(&sandbox.computer_id, job);
        }
        let args = vec![
            job.to_string(),
            u8::from(data.is_some()).to_string(),
            u8::from(close).to_string(),
        ];
        let (stdout, _) = self
            .run_script(
                sandbox,
                ScriptRun {
                    script: script::write(),
                    args,
                    stdin: data,
                    wait: Duration::from_secs(10),
                    cap: 4096,
                },
                cancel,
            )
            .await?;
        match String::from_utf8_lossy(&stdout).trim() {
            "ok" => Ok(()),
            "missing" => Err(JobError::NotFound(job.clone())),
            _ => Err(JobError::NotAcceptingInput(job.clone())),
        }
    }

    /// Signals the job's processes; unless that ends it within [`KILL_GRACE_SECS`] (or the
    /// signal was KILL), kills its whole tree with the backend's kill sweep. Returns once the
    /// job has ended, or the sweep has run.
    pub async fn kill(
        &self,
        sandbox: &SandboxRef,
        job: &JobId,
        signal: Signal,
        cancel: &CancellationToken,
    ) -> Result<(), JobError> {
        if let Some(local) = &self.in_server {
            local.kill(&sandbox.computer_id, job)?;
            // The task records the end as soon as the guest is dropped.
            self.read_output(
                sandbox,
                job,
                u64::MAX,
                Duration::from_secs(KILL_GRACE_SECS),
                WaitFor::End,
                cancel,
            )
            .await?;
            return Ok(());
        }
        let grace = if signal == Signal::Kill {
            0
        } else {
            KILL_GRACE_SECS
        };
        let args = vec![job.to_string(), signal.name().to_owned(), grace.to_string()];
        let (stdout, _) = self
            .run_script(
                sandbox,
                ScriptRun {
                    script: script::signal(),
                    args,
                    stdin: None,
                    wait: Duration::from_secs(grace),
                    cap: 4096,
                },
                cancel,
            )
            .await?;
        match String::from_utf8_lossy(&stdout).trim() {
            "ended" => return Ok(()),
            "missing" => return Err(JobError::NotFound(job.clone())),
            _ => {}
        }
        // What ignored the signal, or left the job's process group or session, still carries
        // the job's tag: the same sweep that ends a timed-out command ends it.
        exec::kill_tree(self.backend.as_ref(), sandbox, &ExecId::for_job(job)).await;
        let snapshot = self
            .read_output(
                sandbox,
                job,
                u64::MAX,
                Duration::from_secs(2),
                WaitFor::End,
                cancel,
            )
            .await?;
        if snapshot.running {
            // A process that dropped the tag still holds the job's output open; the job is
            // over all the same.
            self.run_script(
                sandbox,
                ScriptRun {
                    script: script::abandon(),
                    args: vec![job.to_string()],
                    stdin: None,
                    wait: Duration::from_secs(2),
                    cap: 4096,
                },
                cancel,
            )
            .await?;
        }
        Ok(())
    }

    /// The jobs of a computer, newest first: every running job and the newest ended ones, at
    /// most [`list_rows`]. What the computer answers is a claim: parsed up to that many rows
    /// and [`LIST_ANSWER_LIMIT`] bytes, and never remembered as where those jobs live.
    pub async fn list(
        &self,
        sandbox: &SandboxRef,
        cancel: &CancellationToken,
    ) -> Result<Listing, JobError> {
        let rows = list_rows(self.settings.max_jobs);
        let mut listing = if let Some(local) = &self.in_server {
            let mut jobs = local.list(&sandbox.computer_id);
            jobs.sort_by_key(|job| !job.running);
            let truncated = jobs.len() > rows;
            jobs.truncate(rows);
            Listing { jobs, truncated }
        } else {
            let (stdout, _) = self
                .run_script(
                    sandbox,
                    ScriptRun {
                        script: script::list(),
                        args: vec![rows.to_string()],
                        stdin: None,
                        wait: Duration::from_secs(10),
                        cap: LIST_ANSWER_LIMIT,
                    },
                    cancel,
                )
                .await?;
            parse::listing(&stdout, rows)
        };
        listing.jobs.sort_by(|a, b| {
            b.started_ms
                .cmp(&a.started_ms)
                .then_with(|| b.job_id.cmp(&a.job_id))
        });
        Ok(listing)
    }

    /// Whether `job` exists on the computer (a listing-free probe for finding a job's computer).
    pub async fn exists(
        &self,
        sandbox: &SandboxRef,
        job: &JobId,
        cancel: &CancellationToken,
    ) -> Result<bool, JobError> {
        match self
            .read_output(
                sandbox,
                job,
                u64::MAX,
                Duration::ZERO,
                WaitFor::Output,
                cancel,
            )
            .await
        {
            Ok(_) => Ok(true),
            Err(JobError::NotFound(_)) => Ok(false),
            Err(error) => Err(error),
        }
    }
}
