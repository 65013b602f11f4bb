//! The MCP Tasks extension (`io.modelcontextprotocol/tasks`, SEP-2663; docs/tasks.md) over
//! the job ledger. A `terminal_execute` from a request that declared the extension runs as a
//! job (docs/jobs.md); when the command still runs after `--task-after`, the call is answered
//! with a task, and the task's record is written next to the job's files in the computer.
//! The task id names the computer and the job and carries 128 random bits, so `tasks/get`,
//! `tasks/cancel` and `tasks/update` are answered from the id and the computer alone, by this
//! process or a later one. Nothing about a task is kept in the server.
//!
//! An unknown, expired, foreign or malformed id gets one and the same error, so an id tells
//! nobody whether it exists.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::RngExt;
use rmcp::ErrorData;
use rmcp::model::{
    CallToolResponse, CreateTaskResult, DetailedTask, GetTaskResult, JsonObject, Task, TaskPayload,
    TaskStatus,
};
use serde_json::Value;
use subtle::ConstantTimeEq;
use tokio_util::sync::CancellationToken;

use super::call::{Call, CallError, Payload};
use super::execute::finished;
use super::format::{self, ErrorText};
use super::jobs::on_running;
use crate::backends::{BackendError, SandboxRef};
use crate::exec::ExecOutcome;
use crate::ids::{ComputerId, JobId, Principal};
use crate::jobs::{JobError, Jobs, Snapshot, StartRequest, TaskRead, TaskRecord, WaitFor};
use crate::registry::{Registry, RegistryError, Session, Unnamed};

/// The extension's identifier, as requests declare it and `server/discover` advertises it.
pub const EXTENSION: &str = rmcp::model::TASKS_EXTENSION_ID;

/// The polling interval every task suggests: a status read is one short exec in the computer.
pub const POLL_INTERVAL_MS: u64 = 1000;

/// The first part of every task id: the shape's version, so a later shape can be told apart.
const ID_VERSION: &str = "t1";

/// The one answer for an id that names no task of the caller's (docs/tasks.md, "Errors").
pub const UNKNOWN_TASK: &str = "Failed to retrieve task: no task with this id exists for this caller; it may have expired, and an expired task's result is removed.";

/// What `tasks/get` says of a task `tasks/cancel` ended.
const CANCELLED_MESSAGE: &str = "Cancelled by tasks/cancel; the command was killed.";

/// `--task-after` and `--task-ttl` (docs/tasks.md, "Settings").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskSettings {
    pub after: Duration,
    pub ttl: Duration,
}

/// The task side of the server: the job service every task runs on, and the settings.
pub struct Tasks {
    jobs: Arc<Jobs>,
    settings: TaskSettings,
}

/// How a `terminal_execute` that may become a task was answered.
pub(super) enum Started {
    /// The command ended in time (or the call asked for a job): its ordinary result.
    Finished(Payload),
    Task(CreateTaskResult),
}

/// A task id: `t1.<computer slug>.<job id>.<32 hex digits>`. The slug is scoped to the caller
/// again when the id is used, so another principal's use of it names a computer of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TaskId {
    /// The computer's slug (no owner tag).
    computer: ComputerId,
    job: JobId,
    /// 128 random bits, as 32 lowercase hex digits.
    secret: String,
}

impl TaskId {
    fn new(computer: &ComputerId, job: JobId) -> Self {
        let secret: u128 = rand::rng().random();
        Self {
            computer: ComputerId::parse(computer.slug()).unwrap_or_else(|_| computer.clone()),
            job,
            secret: format!("{secret:032x}"),
        }
    }

    /// Exactly the shape [`TaskId::new`] makes, nothing else (no trimming, no other case).
    fn parse(raw: &str) -> Option<Self> {
        let mut parts = raw.split('.');
        let (version, slug, job, secret) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || version != ID_VERSION {
            return None;
        }
        let computer = ComputerId::parse(slug)
            .ok()
            .filter(|c| c.as_str() == slug)?;
        let job = JobId::parse(job).filter(|j| j.as_str() == job)?;
        let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
        (secret.len() == 32 && secret.bytes().all(hex)).then(|| Self {
            computer,
            job,
            secret: secret.to_owned(),
        })
    }
}

impl std::fmt::Display for TaskId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{ID_VERSION}.{}.{}.{}",
            self.computer.slug(),
            self.job,
            self.secret
        )
    }
}

/// Whether a request declared the extension in its own `_meta` (a declaration made earlier,
/// at `initialize`, does not count: the extension asks for it on the request).
pub(super) fn declared(meta: &rmcp::model::RequestMetaObject) -> bool {
    meta.client_capabilities()
        .is_some_and(|capabilities| capabilities.supports_tasks())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn timestamp(ms: u64) -> String {
    crate::clock::rfc3339_utc(i64::try_from(ms / 1000).unwrap_or(i64::MAX))
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The last complete line of a running job's output tail, cut at 200 characters: what its
/// task's `statusMessage` shows. A read returns each stream's bytes apart, without their
/// order between the two, so stdout's last line wins and stderr's is shown when stdout has
/// none (docs/tasks.md, "What a host sees").
fn last_line(snapshot: &Snapshot) -> Option<String> {
    let complete = |bytes: &[u8]| -> Option<String> {
        let end = bytes.iter().rposition(|&b| b == b'\n')?;
        let line = bytes[..end]
            .rsplit(|&b| b == b'\n')
            .find(|line| !line.is_empty() && *line != b"\r")?;
        let text = String::from_utf8_lossy(line);
        Some(text.trim_end_matches('\r').chars().take(200).collect())
    };
    complete(&snapshot.stdout).or_else(|| complete(&snapshot.stderr))
}

/// What a finished job amounts to as a command: the outcome `terminal_execute` would have
/// had for it, or `None` when it ended with its computer (no exit code).
fn outcome_of_job(
    snapshot: &Snapshot,
    timeout_secs: u64,
    output_limit: u64,
) -> Option<ExecOutcome> {
    let exit_code = snapshot.exit_code?;
    let duration = Duration::from_millis(snapshot.elapsed_ms);
    if snapshot.more {
        return Some(ExecOutcome::OutputLimitExceeded {
            limit: output_limit,
            duration,
        });
    }
    // The supervisor ends a job at its limit with 124 and this notice (docs/jobs.md).
    let notice = ExecOutcome::timeout_notice(timeout_secs);
    if timeout_secs > 0 && exit_code == 124 && snapshot.stderr.ends_with(notice.as_bytes()) {
        return Some(ExecOutcome::TimedOut {
            timeout_secs,
            duration,
        });
    }
    Some(ExecOutcome::Completed {
        stdout: snapshot.stdout.clone(),
        stderr: snapshot.stderr.clone(),
        exit_code,
        duration,
    })
}

/// Why a task method found no task, or could not look.
enum Lookup {
    /// Unknown, expired, foreign or malformed: the one answer.
    Unknown,
    /// The computer or the provider failed; the words say what happened.
    Failed(String),
}

impl From<Lookup> for ErrorData {
    fn from(lookup: Lookup) -> Self {
        match lookup {
            Lookup::Unknown => ErrorData::invalid_params(UNKNOWN_TASK, None),
            Lookup::Failed(message) => ErrorData::internal_error(message, None),
        }
    }
}

impl From<JobError> for Lookup {
    fn from(error: JobError) -> Self {
        match error {
            JobError::NotFound(_) => Self::Unknown,
            other => Self::Failed(CallError::from(other).to_string()),
        }
    }
}

impl From<RegistryError> for Lookup {
    fn from(error: RegistryError) -> Self {
        match error {
            RegistryError::NotFound(_) | RegistryError::Backend(BackendError::Vanished(_)) => {
                Self::Unknown
            }
            other => Self::Failed(CallError::from(other).to_string()),
        }
    }
}

/// A task of the caller's, found: its computer, its id, and how its job stands.
struct Found {
    sandbox: SandboxRef,
    id: TaskId,
    read: TaskRead,
}

impl Tasks {
    pub fn new(jobs: Arc<Jobs>, settings: TaskSettings) -> Self {
        Self { jobs, settings }
    }

    /// Runs `request` as a job on the call's computer and waits `--task-after` for it: its
    /// ordinary result if it ended, else a task. The job's wall-clock limit is `timeout` (or
    /// `--job-timeout`), and never beyond the task's time to live.
    pub(super) async fn start(
        &self,
        call: &Call<'_>,
        computer: (Option<ComputerId>, bool),
        mut request: StartRequest,
    ) -> Result<Started, CallError> {
        let jobs = &self.jobs;
        let ttl_secs = self.settings.ttl.as_secs().max(1);
        let timeout = request
            .timeout_secs
            .unwrap_or(jobs.settings().default_timeout_secs);
        let timeout = if timeout == 0 {
            ttl_secs
        } else {
            timeout.min(ttl_secs)
        };
        request.timeout_secs = Some(timeout);
        let (computer_id, temporary) = computer;
        let sandbox = call
            .registry()
            .acquire(
                call.session,
                computer_id,
                temporary,
                Unnamed::SessionDefault,
                call.progress,
            )
            .await?;
        let (cancel, request) = (call.cancel, &request);
        let (sandbox, job) = on_running(
            call.registry(),
            call.session,
            sandbox,
            |sandbox| async move { jobs.start(&sandbox, request, cancel).await },
        )
        .await?;
        let created_ms = now_ms();
        let snapshot = match jobs
            .read(&sandbox, &job, 0, self.settings.after, WaitFor::End, cancel)
            .await
        {
            Ok(snapshot) => snapshot,
            Err(error) => {
                // The client gave up on the call (or the read failed): the command goes, as a
                // foreground command would. Its own token is spent, hence a fresh one.
                let _ = jobs
                    .remove(&sandbox, &job, true, &CancellationToken::new())
                    .await;
                return Err(error.into());
            }
        };
        if !snapshot.running {
            // Answered as usual: nobody asked for a job, so none is left behind.
            let answer = self.finished_answer(&sandbox, &snapshot, timeout);
            let _ = jobs.remove(&sandbox, &job, false, cancel).await;
            return answer.map(Started::Finished);
        }
        let id = TaskId::new(&sandbox.computer_id, job);
        let record = TaskRecord {
            owner: call.principal().digest_tag(),
            secret: id.secret.clone(),
            created_ms,
            ttl_ms: millis(self.settings.ttl),
            timeout_secs: timeout,
        };
        jobs.record_task(&sandbox, &id.job, &record, cancel).await?;
        let mut task = self.task(&id, &record, TaskStatus::Working);
        task.status_message = (!snapshot.more).then(|| last_line(&snapshot)).flatten();
        Ok(Started::Task(CreateTaskResult::new(task)))
    }

    /// The ordinary result for a job that ended: `terminal_execute`'s, field for field.
    fn finished_answer(
        &self,
        sandbox: &SandboxRef,
        snapshot: &Snapshot,
        timeout_secs: u64,
    ) -> Result<Payload, CallError> {
        let limit = self.jobs.settings().output_limit;
        match outcome_of_job(snapshot, timeout_secs, limit) {
            Some(outcome) => Ok(finished(sandbox, outcome)),
            // terminal_execute's words for a command whose computer died under it.
            None => Err(BackendError::DiedDuringExec(sandbox.sandbox_id.clone()).into()),
        }
    }

    /// The task fields every answer carries.
    fn task(&self, id: &TaskId, record: &TaskRecord, status: TaskStatus) -> Task {
        Task::new(
            id.to_string(),
            status,
            timestamp(record.created_ms),
            timestamp(now_ms()),
        )
        .with_ttl_ms(record.ttl_ms)
        .with_poll_interval_ms(POLL_INTERVAL_MS)
    }

    /// The caller's task named `raw`, or why not. An expired one is removed on the way.
    async fn find(
        &self,
        registry: &Registry,
        session: &Session,
        raw: &str,
        cancel: &CancellationToken,
    ) -> Result<Found, Lookup> {
        let id = TaskId::parse(raw).ok_or(Lookup::Unknown)?;
        let principal: &Principal = session.principal();
        let computer = id.computer.owned_by(principal);
        let sandbox = registry.attach_existing(session, &computer).await?;
        let jobs = &self.jobs;
        let job = &id.job;
        let (sandbox, read) = on_running(registry, session, sandbox, |sandbox| async move {
            jobs.read_task(&sandbox, job, cancel).await
        })
        .await
        .map_err(|error| match error {
            CallError::Registry(RegistryError::NotFound(_)) => Lookup::Unknown,
            other => Lookup::Failed(other.to_string()),
        })?;
        let read = read.ok_or(Lookup::Unknown)?;
        let owner_matches = read.record.owner == principal.digest_tag();
        let secret_matches: bool = read
            .record
            .secret
            .as_bytes()
            .ct_eq(id.secret.as_bytes())
            .into();
        if !(owner_matches && secret_matches) {
            return Err(Lookup::Unknown);
        }
        if now_ms() >= read.record.expires_ms() {
            let running = read.running_tail.as_ref().is_some_and(|tail| tail.running);
            self.jobs.remove(&sandbox, &id.job, running, cancel).await?;
            return Err(Lookup::Unknown);
        }
        Ok(Found { sandbox, id, read })
    }

    /// `tasks/get`.
    pub(super) async fn get(
        &self,
        registry: &Registry,
        session: &Session,
        raw: &str,
        cancel: &CancellationToken,
    ) -> Result<GetTaskResult, ErrorData> {
        let mut found = self.find(registry, session, raw, cancel).await?;
        if found
            .read
            .running_tail
            .as_ref()
            .is_some_and(|tail| !tail.running)
        {
            // It ended between the two looks: read it again for its end marks.
            found = self.find(registry, session, raw, cancel).await?;
        }
        let Found { sandbox, id, read } = found;
        let detailed = match &read.running_tail {
            Some(tail) if tail.running => {
                let mut task = self.task(&id, &read.record, TaskStatus::Working);
                task.status_message = last_line(tail);
                DetailedTask::new(task, TaskPayload::Working)
            }
            _ if read.cancelled => {
                let task = self
                    .task(&id, &read.record, TaskStatus::Cancelled)
                    .with_status_message(CANCELLED_MESSAGE);
                DetailedTask::new(task, TaskPayload::Cancelled)
            }
            _ => {
                let snapshot = self
                    .jobs
                    .read(
                        &sandbox,
                        &id.job,
                        0,
                        Duration::ZERO,
                        WaitFor::Output,
                        cancel,
                    )
                    .await
                    .map_err(Lookup::from)?;
                let answer = self.finished_answer(&sandbox, &snapshot, read.record.timeout_secs);
                let result = format::respond(answer, ErrorText::Message)?;
                let result = match serde_json::to_value(result) {
                    Ok(Value::Object(object)) => object,
                    _ => JsonObject::new(),
                };
                let task = self.task(&id, &read.record, TaskStatus::Completed);
                DetailedTask::new(task, TaskPayload::Completed { result })
            }
        };
        Ok(GetTaskResult::new(detailed))
    }

    /// `tasks/cancel`: the job's kill (TERM, then the sweep); a task that already ended stays
    /// as it ended.
    pub(super) async fn cancel(
        &self,
        registry: &Registry,
        session: &Session,
        raw: &str,
        cancel: &CancellationToken,
    ) -> Result<(), ErrorData> {
        let found = self.find(registry, session, raw, cancel).await?;
        let known = self
            .jobs
            .cancel_task(&found.sandbox, &found.id.job, cancel)
            .await
            .map_err(Lookup::from)?;
        if known {
            Ok(())
        } else {
            Err(Lookup::Unknown.into())
        }
    }

    /// `tasks/update`: `terminal_execute` asks for no input, so there is nothing to deliver;
    /// the responses are ignored, as the extension says of keys that are not outstanding.
    pub(super) async fn update(
        &self,
        registry: &Registry,
        session: &Session,
        raw: &str,
        cancel: &CancellationToken,
    ) -> Result<(), ErrorData> {
        self.find(registry, session, raw, cancel).await?;
        Ok(())
    }
}

/// The wire answer of a `terminal_execute` that may have become a task.
pub(super) fn respond(answer: Result<Started, CallError>) -> Result<CallToolResponse, ErrorData> {
    match answer {
        Ok(Started::Task(task)) => Ok(CallToolResponse::Task(task)),
        Ok(Started::Finished(payload)) => {
            format::respond(Ok(payload), ErrorText::Message).map(Into::into)
        }
        Err(error) => format::respond(Err(error), ErrorText::Message).map(Into::into),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(stdout: &[u8], stderr: &[u8], exit_code: Option<i64>, more: bool) -> Snapshot {
        Snapshot {
            running: exit_code.is_none(),
            exit_code,
            stdout: stdout.to_vec(),
            stderr: stderr.to_vec(),
            next_since: 0,
            more,
            stdin_open: false,
            elapsed_ms: 1500,
            lifetime_ms: None,
        }
    }

    #[test]
    fn ids_round_trip_and_only_their_exact_shape_parses() {
        // See: issue 36
        let computer = ComputerId::parse("dev-box").unwrap();
        let scoped = computer.owned_by(&Principal::named("alice").unwrap());
        let job = JobId::parse("j-0123abcd").unwrap();
        let id = TaskId::new(&scoped, job.clone());
        assert_eq!(id.computer, computer, "the owner tag is not in the id");
        let text = id.to_string();
        assert!(text.starts_with("t1.dev-box.j-0123abcd."), "{text}");
        assert_eq!(text.len(), "t1.dev-box.j-0123abcd.".len() + 32);
        assert_eq!(TaskId::parse(&text), Some(id.clone()));
        // 128 random bits: two ids of the same job differ.
        assert_ne!(TaskId::new(&scoped, job).secret, id.secret);
        let secret = &id.secret;
        for malformed in [
            String::new(),
            format!("t2.dev-box.j-0123abcd.{secret}"),
            format!(" t1.dev-box.j-0123abcd.{secret}"),
            format!("t1.Dev-box.j-0123abcd.{secret}"),
            format!("t1.dev-box.0123abcd.{secret}"),
            format!("t1.dev-box.j-0123abcd.{}", secret.to_uppercase()),
            format!("t1.dev-box.j-0123abcd.{}", &secret[1..]),
            format!("t1.dev-box.j-0123abcd.{secret}.x"),
            format!("t1.dev-box.{}.j-0123abcd.{secret}", "0123456789abcdef"),
            "t1.dev-box.j-0123abcd".to_owned(),
            format!("t1.../.j-0123abcd.{secret}"),
        ] {
            assert_eq!(TaskId::parse(&malformed), None, "{malformed}");
        }
    }

    #[test]
    fn a_finished_job_is_the_outcome_terminal_execute_would_have_had() {
        // See: issue 36
        let completed = outcome_of_job(&snapshot(b"hi\n", b"", Some(3), false), 0, 100);
        assert_eq!(
            completed,
            Some(ExecOutcome::Completed {
                stdout: b"hi\n".to_vec(),
                stderr: Vec::new(),
                exit_code: 3,
                duration: Duration::from_millis(1500),
            })
        );
        let overflowed = outcome_of_job(&snapshot(b"x", b"", Some(0), true), 0, 100);
        assert_eq!(
            overflowed,
            Some(ExecOutcome::OutputLimitExceeded {
                limit: 100,
                duration: Duration::from_millis(1500),
            })
        );
        let notice = ExecOutcome::timeout_notice(7);
        let stderr = format!("partial\n{notice}");
        let timed_out = outcome_of_job(&snapshot(b"", stderr.as_bytes(), Some(124), false), 7, 100);
        assert_eq!(
            timed_out,
            Some(ExecOutcome::TimedOut {
                timeout_secs: 7,
                duration: Duration::from_millis(1500),
            })
        );
        // 124 of the command's own is not a timeout.
        assert!(matches!(
            outcome_of_job(&snapshot(b"", b"", Some(124), false), 7, 100),
            Some(ExecOutcome::Completed { exit_code: 124, .. })
        ));
        assert_eq!(
            outcome_of_job(&snapshot(b"", b"", None, false), 0, 100),
            None
        );
    }

    #[test]
    fn the_status_message_is_the_last_complete_line_cut_at_200_characters() {
        let mut tail = snapshot(b"one\ntwo\r\nthr", b"", None, false);
        assert_eq!(last_line(&tail).as_deref(), Some("two"));
        tail.stdout = b"partial only".to_vec();
        tail.stderr = b"warning\n".to_vec();
        assert_eq!(last_line(&tail).as_deref(), Some("warning"));
        tail.stdout = format!("{}\n", "é".repeat(300)).into_bytes();
        assert_eq!(last_line(&tail).map(|l| l.chars().count()), Some(200));
        tail.stdout = Vec::new();
        tail.stderr = Vec::new();
        assert_eq!(last_line(&tail), None);
    }
}
