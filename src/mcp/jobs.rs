//! The job tools (docs/jobs.md, "Tools"): `job_output`, `job_write`, `job_kill`, `job_list`,
//! and `terminal_execute` with `yield_after`. Definitions, argument decoding with the exact
//! messages, finding a job's computer, and the result payloads. The jobs themselves are
//! [`crate::jobs`]'s.

use std::time::{Duration, Instant};

use rmcp::model::{CallToolResult, JsonObject, Tool, ToolAnnotations};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use super::args::Args;
use super::format;
use crate::backends::{BackendError, Progress, SandboxRef};
use crate::ids::{ComputerId, JobId};
use crate::jobs::{
    JobError, Jobs, Listing, MAX_WAIT_SECS, MORE_WAITING, Signal, Snapshot, StartRequest, WaitFor,
};
use crate::registry::{Registry, RegistryError, Session, Unnamed};

pub const OUTPUT: &str = "job_output";
pub const WRITE: &str = "job_write";
pub const KILL: &str = "job_kill";
pub const LIST: &str = "job_list";

/// The sentence the server's instructions gain with the switch on.
pub const INSTRUCTIONS: &str = " For commands that may run longer than a minute (builds, servers, watchers, interactive programs), pass yield_after to terminal_execute and follow the job with job_output.";

/// The most seconds `yield_after` may ask for.
pub const MAX_YIELD_AFTER: i64 = 3600;

/// How long `job_write` waits for the job's answer unless told.
const WRITE_WAIT_SECS: i64 = 1;

/// Computers probed for a job this process has never seen (after a restart of the server).
const PROBE_LIMIT: usize = 64;

/// `terminal_execute`'s extra input properties.
pub fn execute_properties() -> Value {
    json!({
        "yield_after": {"type": "integer", "minimum": 0, "maximum": MAX_YIELD_AFTER, "title": "Yield After", "description": "Return after this many seconds even if the command is still running; it keeps running as a job that job_output, job_write and job_kill can follow. 0 returns at once."},
        "keep_stdin_open": {"type": "boolean", "default": false, "title": "Keep Stdin Open", "description": "With yield_after: keep the job's stdin open after stdin is written, so job_write can send more."}
    })
}

fn job_output_properties() -> Value {
    json!({
        "job_id": {"type": "string"},
        "computer_id": {"type": "string"},
        "running": {"type": "boolean"},
        "exit_code": {"type": ["integer", "null"]},
        "stdout": {"type": "string"},
        "stderr": {"type": "string"},
        "next_since": {"type": "integer"},
        "elapsed_ms": {"type": "integer"}
    })
}

const JOB_OUTPUT_FIELDS: [&str; 8] = [
    "job_id",
    "computer_id",
    "running",
    "exit_code",
    "stdout",
    "stderr",
    "next_since",
    "elapsed_ms",
];

fn annotations(read_only: bool, destructive: bool) -> ToolAnnotations {
    let mut annotations = ToolAnnotations::new();
    annotations.read_only_hint = Some(read_only);
    annotations.destructive_hint = Some(destructive);
    annotations.open_world_hint = Some(true);
    annotations
}

fn job_id_property() -> Value {
    json!({"type": "string", "title": "Job Id", "description": "The job_id terminal_execute returned (j- and 8 hex digits)."})
}

fn wait_property(default: i64) -> Value {
    json!({"type": "integer", "minimum": 0, "maximum": MAX_WAIT_SECS, "default": default, "title": "Wait", "description": "Seconds to wait for new output or the job's end before answering (0-60)."})
}

/// The four job tools, in the order they are listed; `in_server` backends keep jobs in the
/// server process, which `job_list` says.
pub fn tools(in_server: bool) -> Vec<Tool> {
    let output = Tool::new(
        OUTPUT,
        "Read a job's new output: what it printed since this session's last read of it (or since byte offset `since` of its combined output), whether it still runs, and its exit code once it ended. `wait` blocks up to that many seconds for new output or the end.",
        format::object(json!({
            "type": "object",
            "properties": {
                "job_id": job_id_property(),
                "wait": wait_property(0),
                "since": {"type": "integer", "minimum": 0, "title": "Since", "description": "Byte offset in the job's combined output to read from (next_since of an earlier result)."}
            },
            "required": ["job_id"]
        })),
    )
    .with_raw_output_schema(format::output_schema(job_output_properties(), &JOB_OUTPUT_FIELDS, None))
    .with_annotations(annotations(true, false));
    let write = Tool::new(
        WRITE,
        "Send text to a running job's stdin (a job started with keep_stdin_open), then return its new output like job_output, after waiting `wait` seconds (default 1) for the reaction. close_stdin ends its input.",
        format::object(json!({
            "type": "object",
            "properties": {
                "job_id": job_id_property(),
                "stdin": {"type": "string", "title": "Stdin", "description": "Text to write to the job's stdin (include the newline a prompt expects)."},
                "close_stdin": {"type": "boolean", "default": false, "title": "Close Stdin", "description": "Close the job's stdin after writing."},
                "wait": wait_property(WRITE_WAIT_SECS)
            },
            "required": ["job_id", "stdin"]
        })),
    )
    .with_raw_output_schema(format::output_schema(job_output_properties(), &JOB_OUTPUT_FIELDS, None))
    .with_annotations(annotations(false, false));
    let kill = Tool::new(
        KILL,
        "Stop a job: send `signal` (default TERM) to its whole process tree, then KILL whatever is left after 5 seconds. Returns the job's final state; killing an ended job just returns it.",
        format::object(json!({
            "type": "object",
            "properties": {
                "job_id": job_id_property(),
                "signal": {"type": "string", "enum": ["TERM", "INT", "KILL", "HUP"], "default": "TERM", "title": "Signal", "description": "The first signal sent."}
            },
            "required": ["job_id"]
        })),
    )
    .with_raw_output_schema(format::output_schema(job_output_properties(), &JOB_OUTPUT_FIELDS, None))
    .with_annotations(annotations(false, true));
    let durability = if in_server {
        " On this backend jobs run inside the server and end when it stops."
    } else {
        " Jobs are kept inside the computer: a permanent computer's jobs are listed here after the server restarts."
    };
    let list = Tool::new(
        LIST,
        format!("List a computer's jobs, newest first (default: this session's default computer).{durability}"),
        format::object(json!({
            "type": "object",
            "properties": {
                "computer_id": {"type": "string", "title": "Computer Id", "description": "The computer whose jobs to list. Omit for this session's default computer."}
            }
        })),
    )
    .with_raw_output_schema(format::output_schema(
        json!({
            "jobs": {"type": "array", "items": {"type": "object", "properties": {
                "job_id": {"type": "string"},
                "command": {"type": "string"},
                "running": {"type": "boolean"},
                "exit_code": {"type": ["integer", "null"]},
                "started_at": {"type": ["string", "null"]},
                "ended_at": {"type": ["string", "null"]},
                "output_bytes": {"type": "integer"}
            }}},
            "count": {"type": "integer"},
            "truncated": {"type": "boolean"}
        }),
        &["jobs", "count"],
        None,
    ))
    .with_annotations(annotations(true, false));
    vec![output, write, kill, list]
}

/// `yield_after` and `keep_stdin_open` of a `terminal_execute` call, validated.
pub struct YieldArgs {
    pub yield_after: Option<u64>,
    pub keep_stdin_open: bool,
}

pub fn decode_yield(args: &Args<'_>) -> Result<YieldArgs, String> {
    let yield_after = args.integer("yield_after").map_err(|e| e.to_string())?;
    let keep_stdin_open = args
        .boolean("keep_stdin_open")
        .map_err(|e| e.to_string())?
        .unwrap_or(false);
    let yield_after = match yield_after {
        Some(secs) if !(0..=MAX_YIELD_AFTER).contains(&secs) => {
            return Err(format!(
                "yield_after must be between 0 and {MAX_YIELD_AFTER} seconds."
            ));
        }
        Some(secs) => Some(secs.unsigned_abs()),
        None => None,
    };
    if keep_stdin_open && yield_after.is_none() {
        return Err(
            "keep_stdin_open needs yield_after: only a job keeps its stdin open.".to_owned(),
        );
    }
    Ok(YieldArgs {
        yield_after,
        keep_stdin_open,
    })
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// stdout, with the marker on a line of its own when more output waits than one result
/// carries. The newline before it is always added, so the output is exactly what precedes it.
fn stdout_text(snapshot: &Snapshot) -> String {
    let mut stdout = text(&snapshot.stdout);
    if snapshot.more {
        stdout.push('\n');
        stdout.push_str(MORE_WAITING);
    }
    stdout
}

fn job_payload(job: &JobId, computer: &ComputerId, snapshot: &Snapshot) -> CallToolResult {
    let mut payload = Map::new();
    payload.insert("job_id".into(), json!(job.as_str()));
    payload.insert("computer_id".into(), json!(computer.slug()));
    payload.insert("running".into(), json!(snapshot.running));
    payload.insert("exit_code".into(), json!(snapshot.exit_code));
    payload.insert("stdout".into(), json!(stdout_text(snapshot)));
    payload.insert("stderr".into(), json!(text(&snapshot.stderr)));
    payload.insert("next_since".into(), json!(snapshot.next_since));
    payload.insert("elapsed_ms".into(), json!(snapshot.elapsed_ms));
    format::success(payload)
}

fn job_error(error: &JobError) -> Option<CallToolResult> {
    match error {
        JobError::Cancelled => None,
        JobError::Backend(backend) => Some(format::error(format::user_message(
            &RegistryError::Backend(backend.clone()),
        ))),
        other => Some(format::error(other.to_string())),
    }
}

/// Why a job tool call failed: the job, or the computer it needed (found, attached, started).
#[derive(Debug)]
enum CallError {
    Job(JobError),
    Computer(RegistryError),
}

impl From<JobError> for CallError {
    fn from(error: JobError) -> Self {
        Self::Job(error)
    }
}

impl From<RegistryError> for CallError {
    fn from(error: RegistryError) -> Self {
        Self::Computer(error)
    }
}

/// The result a failed call answers with; `None` when the client cancelled it.
fn call_error(error: &CallError) -> Option<CallToolResult> {
    match error {
        CallError::Job(error) => job_error(error),
        CallError::Computer(RegistryError::Cancelled) => None,
        CallError::Computer(error) => Some(format::error(format::user_message(error))),
    }
}

/// Runs `op` (job scripts) on the computer. When it finds the computer stopped, the registry
/// starts it — the one start path, admitted against the running limit like a command's
/// restart-once — and `op` runs once more on the started computer.
async fn on_running<T, F, Fut>(
    registry: &Registry,
    session: &Session,
    sandbox: SandboxRef,
    op: F,
) -> Result<(SandboxRef, T), CallError>
where
    F: Fn(SandboxRef) -> Fut,
    Fut: std::future::Future<Output = Result<T, JobError>>,
{
    match op(sandbox.clone()).await {
        Err(JobError::Backend(BackendError::NotRunning(_))) => {
            let started = registry.start_stopped(session, &sandbox).await?;
            let value = op(started.clone()).await?;
            Ok((started, value))
        }
        answer => Ok((sandbox, answer?)),
    }
}

/// `terminal_execute` with `yield_after`: the command runs as a job; the call returns when it
/// ends or after `yield_after` seconds, whichever comes first.
#[allow(clippy::too_many_arguments)]
pub async fn execute(
    registry: &Registry,
    jobs: &Jobs,
    session: &Session,
    computer_id: Option<ComputerId>,
    temporary: bool,
    request: StartRequest,
    yield_after: u64,
    progress: &dyn Progress,
    cancel: &CancellationToken,
) -> Option<CallToolResult> {
    let started = Instant::now();
    let sandbox = match registry
        .acquire(
            session,
            computer_id,
            temporary,
            Unnamed::SessionDefault,
            progress,
        )
        .await
    {
        Ok(sandbox) => sandbox,
        Err(RegistryError::Cancelled) => return None,
        Err(error) => return Some(format::error(format::user_message(&error))),
    };
    let request = &request;
    let followed = async {
        let (sandbox, job) = on_running(registry, session, sandbox, |sandbox| async move {
            jobs.start(&sandbox, request, cancel).await
        })
        .await?;
        let snapshot = jobs
            .read(
                &sandbox,
                &job,
                0,
                Duration::from_secs(yield_after),
                WaitFor::End,
                cancel,
            )
            .await?;
        Ok::<_, CallError>((sandbox, job, snapshot))
    }
    .await;
    let (sandbox, job, snapshot) = match followed {
        Ok(followed) => followed,
        Err(error) => return call_error(&error),
    };
    jobs.set_cursor(
        session.id(),
        &sandbox.computer_id,
        &job,
        snapshot.next_since,
    );
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(sandbox.computer_id.slug()));
    payload.insert("temporary".into(), json!(sandbox.temporary));
    payload.insert("stdout".into(), json!(stdout_text(&snapshot)));
    payload.insert("stderr".into(), json!(text(&snapshot.stderr)));
    payload.insert("exit_code".into(), json!(snapshot.exit_code));
    payload.insert(
        "exec_duration_ms".into(),
        json!(u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)),
    );
    payload.insert("job_id".into(), json!(job.as_str()));
    if snapshot.running {
        payload.insert("running".into(), json!(true));
    }
    Some(format::success(payload))
}

/// The computer holding `job`: one of the caller's computers this process knows to hold it,
/// else the computers this session holds, else any running computer of the caller (a job
/// started by an earlier server process). Probing starts no computer, and a job found by
/// probing is remembered.
async fn locate(
    registry: &Registry,
    jobs: &Jobs,
    session: &Session,
    job: &JobId,
    cancel: &CancellationToken,
) -> Result<SandboxRef, JobError> {
    let not_found = || JobError::NotFound(job.clone());
    for computer in jobs.computers_of(job) {
        if computer.belongs_to(session.principal())
            && let Ok(sandbox) = registry.attach_existing(session, &computer).await
        {
            return Ok(sandbox);
        }
    }
    let mut candidates: Vec<SandboxRef> = Vec::new();
    for computer in session.default_id().into_iter().chain(session.held()) {
        if let Ok(sandbox) = registry.attach_existing(session, &computer).await
            && !candidates.contains(&sandbox)
        {
            candidates.push(sandbox);
        }
    }
    if let Ok(all) = registry.backend().list().await {
        let mine = |info: &crate::backends::ComputerInfo| {
            info.state == "running" && info.sandbox.computer_id.belongs_to(session.principal())
        };
        for info in all.into_iter().filter(mine) {
            if !candidates
                .iter()
                .any(|c| c.computer_id == info.sandbox.computer_id)
            {
                candidates.push(info.sandbox);
            }
        }
    }
    for sandbox in candidates.into_iter().take(PROBE_LIMIT) {
        if jobs.exists(&sandbox, job, cancel).await.unwrap_or(false) {
            jobs.remember(&sandbox.computer_id, job);
            return registry
                .attach_existing(session, &sandbox.computer_id)
                .await
                .map_err(|_| not_found());
        }
    }
    Err(not_found())
}

fn job_id(args: &Args<'_>) -> Result<JobId, String> {
    let raw = args.required_string("job_id").map_err(|e| e.to_string())?;
    JobId::parse(&raw).ok_or_else(|| format!("Job {} not found.", raw.trim()))
}

fn wait_secs(args: &Args<'_>, default: i64) -> Result<Duration, String> {
    match args.integer("wait").map_err(|e| e.to_string())? {
        Some(secs) if !(0..=i64::try_from(MAX_WAIT_SECS).unwrap_or(60)).contains(&secs) => Err(
            format!("wait must be between 0 and {MAX_WAIT_SECS} seconds."),
        ),
        Some(secs) => Ok(Duration::from_secs(secs.unsigned_abs())),
        None => Ok(Duration::from_secs(default.unsigned_abs())),
    }
}

/// Where a tool's answer reads the job from: an explicit offset, or (`None`) the session's place,
/// and how long it waits for output.
struct ReadFrom {
    since: Option<u64>,
    wait: Duration,
}

/// Finds the job's computer, runs `act` on it (a write, a kill, or nothing), then answers with
/// the job's output from `from`. The session's place moves to what was returned unless the
/// caller read from an explicit offset (a dashboard sharing the model's session must not move
/// the model's place). Errors become results.
async fn act_then_read<F, Fut>(
    registry: &Registry,
    jobs: &Jobs,
    session: &Session,
    job: JobId,
    from: ReadFrom,
    cancel: &CancellationToken,
    act: F,
) -> Option<CallToolResult>
where
    F: Fn(SandboxRef) -> Fut,
    Fut: std::future::Future<Output = Result<(), JobError>>,
{
    let sandbox = match locate(registry, jobs, session, &job, cancel).await {
        Ok(sandbox) => sandbox,
        Err(error) => return job_error(&error),
    };
    let since = from
        .since
        .unwrap_or_else(|| jobs.cursor(session.id(), &sandbox.computer_id, &job));
    let (job, act) = (&job, &act);
    let read = on_running(registry, session, sandbox, |sandbox| async move {
        act(sandbox.clone()).await?;
        jobs.read(&sandbox, job, since, from.wait, WaitFor::Output, cancel)
            .await
    });
    match read.await {
        Ok((sandbox, snapshot)) => {
            if from.since.is_none() {
                jobs.set_cursor(session.id(), &sandbox.computer_id, job, snapshot.next_since);
            }
            Some(job_payload(job, &sandbox.computer_id, &snapshot))
        }
        Err(error) => call_error(&error),
    }
}

pub async fn output(
    registry: &Registry,
    jobs: &Jobs,
    session: &Session,
    arguments: Option<&JsonObject>,
    cancel: &CancellationToken,
) -> Option<CallToolResult> {
    let args = Args::new(OUTPUT, arguments);
    let decoded: Result<_, String> = (|| {
        let job = job_id(&args)?;
        let wait = wait_secs(&args, 0)?;
        let since = match args.integer("since").map_err(|e| e.to_string())? {
            Some(offset) if offset < 0 => return Err("since must be at least 0.".to_owned()),
            offset => offset.map(i64::unsigned_abs),
        };
        Ok((job, wait, since))
    })();
    let (job, wait, since) = match decoded {
        Ok(decoded) => decoded,
        Err(message) => return Some(format::error(message)),
    };
    let from = ReadFrom { since, wait };
    act_then_read(registry, jobs, session, job, from, cancel, |_| async {
        Ok(())
    })
    .await
}

pub async fn write(
    registry: &Registry,
    jobs: &Jobs,
    session: &Session,
    arguments: Option<&JsonObject>,
    cancel: &CancellationToken,
) -> Option<CallToolResult> {
    let args = Args::new(WRITE, arguments);
    let decoded: Result<_, String> = (|| {
        let job = job_id(&args)?;
        let stdin = args.required_string("stdin").map_err(|e| e.to_string())?;
        let close = args
            .boolean("close_stdin")
            .map_err(|e| e.to_string())?
            .unwrap_or(false);
        let wait = wait_secs(&args, WRITE_WAIT_SECS)?;
        Ok((job, stdin, close, wait))
    })();
    let (job, stdin, close, wait) = match decoded {
        Ok(decoded) => decoded,
        Err(message) => return Some(format::error(message)),
    };
    let data = (!stdin.is_empty()).then_some(stdin);
    let from = ReadFrom { since: None, wait };
    let target = job.clone();
    act_then_read(registry, jobs, session, job, from, cancel, |sandbox| {
        let data = data.clone();
        let target = &target;
        async move { jobs.write(&sandbox, target, data, close, cancel).await }
    })
    .await
}

pub async fn kill(
    registry: &Registry,
    jobs: &Jobs,
    session: &Session,
    arguments: Option<&JsonObject>,
    cancel: &CancellationToken,
) -> Option<CallToolResult> {
    let args = Args::new(KILL, arguments);
    let decoded: Result<_, String> = (|| {
        let job = job_id(&args)?;
        let signal = match args.string("signal").map_err(|e| e.to_string())? {
            None => Signal::Term,
            Some(raw) => Signal::parse(&raw)
                .ok_or_else(|| "signal must be one of TERM, INT, KILL, HUP.".to_owned())?,
        };
        Ok((job, signal))
    })();
    let (job, signal) = match decoded {
        Ok(decoded) => decoded,
        Err(message) => return Some(format::error(message)),
    };
    let from = ReadFrom {
        since: None,
        wait: Duration::ZERO,
    };
    let target = job.clone();
    act_then_read(registry, jobs, session, job, from, cancel, |sandbox| {
        let target = &target;
        async move { jobs.kill(&sandbox, target, signal, cancel).await }
    })
    .await
}

pub async fn list(
    registry: &Registry,
    jobs: &Jobs,
    session: &Session,
    arguments: Option<&JsonObject>,
    cancel: &CancellationToken,
) -> Option<CallToolResult> {
    let args = Args::new(LIST, arguments);
    let computer = match args.string("computer_id") {
        Err(error) => return Some(format::error(error.to_string())),
        Ok(Some(raw)) => match ComputerId::parse(&raw) {
            Ok(id) => Some(id.owned_by(session.principal())),
            Err(error) => return Some(format::error(error.to_string())),
        },
        Ok(None) => session.default_id(),
    };
    let listing = match computer {
        // No default computer yet: nothing has run, so no job either (and none is created).
        None => Listing {
            jobs: Vec::new(),
            truncated: false,
        },
        Some(id) => {
            let listed = async {
                let sandbox = registry.attach_existing(session, &id).await?;
                let (_, listing) = on_running(registry, session, sandbox, |sandbox| async move {
                    jobs.list(&sandbox, cancel).await
                })
                .await?;
                Ok::<_, CallError>(listing)
            };
            match listed.await {
                Ok(listing) => listing,
                Err(error) => return call_error(&error),
            }
        }
    };
    let rows: Vec<Value> = listing
        .jobs
        .iter()
        .map(|row| {
            json!({
                "job_id": row.job_id.as_str(),
                "command": row.command,
                "running": row.running,
                "exit_code": row.exit_code,
                "started_at": row.started_at,
                "ended_at": row.ended_at,
                "output_bytes": row.output_bytes,
            })
        })
        .collect();
    let mut payload = Map::new();
    let count = rows.len();
    payload.insert("jobs".into(), Value::Array(rows));
    payload.insert("count".into(), json!(count));
    if listing.truncated {
        payload.insert("truncated".into(), json!(true));
    }
    Some(format::success(payload))
}
