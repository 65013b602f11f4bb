//! The job tools (docs/jobs.md, "Tools"): `job_output`, `job_write`, `job_kill`, `job_list`,
//! and `terminal_execute` with `yield_after`. Definitions, argument decoding with the exact
//! messages, finding a job's computer, and the result payloads. The jobs themselves are
//! [`crate::jobs`]'s.

use std::time::{Duration, Instant};

use rmcp::model::{Tool, ToolAnnotations};
use serde_json::{Map, Value, json};

use super::args::Args;
use super::call::{Call, CallError, Payload};
use super::format;
use super::routes::Definitions;
use crate::backends::{BackendError, SandboxRef};
use crate::ids::{ComputerId, JobId};
use crate::jobs::{
    JobError, Jobs, Listing, MAX_WAIT_SECS, MORE_WAITING, Signal, Snapshot, StartRequest, WaitFor,
};
use crate::registry::{Registry, Session, Unnamed};

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

/// `job_output`.
pub(super) fn output_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
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
    .with_annotations(annotations(true, false))
}

/// `job_write`.
pub(super) fn write_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
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
    .with_annotations(annotations(false, false))
}

/// `job_kill`.
pub(super) fn kill_tool(_: &Definitions<'_>) -> Tool {
    Tool::new(
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
    .with_annotations(annotations(false, true))
}

/// `job_list`; backends that keep jobs in the server process say so.
pub(super) fn list_tool(definitions: &Definitions<'_>) -> Tool {
    let durability = if definitions.jobs_in_server {
        " On this backend jobs run inside the server and end when it stops."
    } else {
        " Jobs are kept inside the computer: a permanent computer's jobs are listed here after the server restarts."
    };
    Tool::new(
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
    .with_annotations(annotations(true, false))
}

/// `yield_after` and `keep_stdin_open` of a `terminal_execute` call, validated.
pub struct YieldArgs {
    pub yield_after: Option<u64>,
    pub keep_stdin_open: bool,
}

pub(super) fn decode_yield(args: &Args<'_>) -> Result<YieldArgs, CallError> {
    let yield_after = args.integer("yield_after")?;
    let keep_stdin_open = args.boolean("keep_stdin_open")?.unwrap_or(false);
    let yield_after = match yield_after {
        Some(secs) if !(0..=MAX_YIELD_AFTER).contains(&secs) => {
            return Err(CallError::invalid(format!(
                "yield_after must be between 0 and {MAX_YIELD_AFTER} seconds."
            )));
        }
        Some(secs) => Some(secs.unsigned_abs()),
        None => None,
    };
    if keep_stdin_open && yield_after.is_none() {
        return Err(CallError::invalid(
            "keep_stdin_open needs yield_after: only a job keeps its stdin open.",
        ));
    }
    Ok(YieldArgs {
        yield_after,
        keep_stdin_open,
    })
}

/// Job output as text: the scripts send bytes, a result carries a string.
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

fn job_payload(job: &JobId, computer: &ComputerId, snapshot: &Snapshot) -> Payload {
    let mut payload = Map::new();
    payload.insert("job_id".into(), json!(job.as_str()));
    payload.insert("computer_id".into(), json!(computer.slug()));
    payload.insert("running".into(), json!(snapshot.running));
    payload.insert("exit_code".into(), json!(snapshot.exit_code));
    payload.insert("stdout".into(), json!(stdout_text(snapshot)));
    payload.insert("stderr".into(), json!(text(&snapshot.stderr)));
    payload.insert("next_since".into(), json!(snapshot.next_since));
    payload.insert("elapsed_ms".into(), json!(snapshot.elapsed_ms));
    payload.into()
}

/// Runs `op` (job scripts) on the computer. When it finds the computer stopped, the registry
/// starts it — the one start path, admitted against the running limit like a command's
/// restart-once — and `op` runs once more on the started computer.
pub(super) async fn on_running<T, F, Fut>(
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

/// `terminal_execute` with `yield_after`: the command runs as a job on `computer` (its id and
/// `temporary`); the call returns when it ends or after `yield_after` seconds, whichever comes
/// first.
pub(super) async fn execute(
    call: &Call<'_>,
    jobs: &Jobs,
    computer: (Option<ComputerId>, bool),
    request: StartRequest,
    yield_after: u64,
) -> Result<Payload, CallError> {
    let started = Instant::now();
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
    let wait = Duration::from_secs(yield_after);
    let snapshot = jobs
        .read(&sandbox, &job, 0, wait, WaitFor::End, cancel)
        .await?;
    jobs.set_cursor(
        call.session.id(),
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
    Ok(payload.into())
}

/// The computer holding `job`: one of the caller's computers this process knows to hold it,
/// else the computers this session holds, else any running computer of the caller (a job
/// started by an earlier server process). Probing starts no computer, and a job found by
/// probing is remembered.
async fn locate(call: &Call<'_>, jobs: &Jobs, job: &JobId) -> Result<SandboxRef, JobError> {
    let (registry, session) = (call.registry(), call.session);
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
        if jobs
            .exists(&sandbox, job, call.cancel)
            .await
            .unwrap_or(false)
        {
            jobs.remember(&sandbox.computer_id, job);
            return registry
                .attach_existing(session, &sandbox.computer_id)
                .await
                .map_err(|_| not_found());
        }
    }
    Err(not_found())
}

/// The required `job_id`; one that is not a job id names no job.
fn job_id(args: &Args<'_>) -> Result<JobId, CallError> {
    let raw = args.required_string("job_id")?;
    JobId::parse(&raw).ok_or_else(|| CallError::invalid(format!("Job {} not found.", raw.trim())))
}

fn wait_secs(args: &Args<'_>, default: i64) -> Result<Duration, CallError> {
    match args.integer("wait")? {
        Some(secs) if !(0..=i64::try_from(MAX_WAIT_SECS).unwrap_or(60)).contains(&secs) => {
            Err(CallError::invalid(format!(
                "wait must be between 0 and {MAX_WAIT_SECS} seconds."
            )))
        }
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
/// the model's place).
async fn act_then_read<F, Fut>(
    call: &Call<'_>,
    jobs: &Jobs,
    job: JobId,
    from: ReadFrom,
    act: F,
) -> Result<Payload, CallError>
where
    F: Fn(SandboxRef) -> Fut,
    Fut: std::future::Future<Output = Result<(), JobError>>,
{
    let sandbox = locate(call, jobs, &job).await?;
    let session = call.session.id();
    let since = from
        .since
        .unwrap_or_else(|| jobs.cursor(session, &sandbox.computer_id, &job));
    let (job, act, cancel) = (&job, &act, call.cancel);
    let (sandbox, snapshot) = on_running(
        call.registry(),
        call.session,
        sandbox,
        |sandbox| async move {
            act(sandbox.clone()).await?;
            jobs.read(&sandbox, job, since, from.wait, WaitFor::Output, cancel)
                .await
        },
    )
    .await?;
    if from.since.is_none() {
        jobs.set_cursor(session, &sandbox.computer_id, job, snapshot.next_since);
    }
    Ok(job_payload(job, &sandbox.computer_id, &snapshot))
}

/// `job_output`.
pub(super) async fn output(call: &Call<'_>) -> Result<Payload, CallError> {
    let jobs = call.jobs()?;
    let args = call.args();
    let job = job_id(&args)?;
    let wait = wait_secs(&args, 0)?;
    let since = match args.integer("since")? {
        Some(offset) if offset < 0 => return Err(CallError::invalid("since must be at least 0.")),
        offset => offset.map(i64::unsigned_abs),
    };
    let from = ReadFrom { since, wait };
    act_then_read(call, jobs, job, from, |_| async { Ok(()) }).await
}

/// `job_write`.
pub(super) async fn write(call: &Call<'_>) -> Result<Payload, CallError> {
    let jobs = call.jobs()?;
    let args = call.args();
    let job = job_id(&args)?;
    let stdin = args.required_string("stdin")?;
    let close = args.boolean("close_stdin")?.unwrap_or(false);
    let wait = wait_secs(&args, WRITE_WAIT_SECS)?;
    let data = (!stdin.is_empty()).then_some(stdin);
    let from = ReadFrom { since: None, wait };
    let (target, cancel) = (job.clone(), call.cancel);
    act_then_read(call, jobs, job, from, |sandbox| {
        let data = data.clone();
        let target = &target;
        async move { jobs.write(&sandbox, target, data, close, cancel).await }
    })
    .await
}

/// `job_kill`.
pub(super) async fn kill(call: &Call<'_>) -> Result<Payload, CallError> {
    let jobs = call.jobs()?;
    let args = call.args();
    let job = job_id(&args)?;
    let signal = match args.string("signal")? {
        None => Signal::Term,
        Some(raw) => Signal::parse(&raw)
            .ok_or_else(|| CallError::invalid("signal must be one of TERM, INT, KILL, HUP."))?,
    };
    let from = ReadFrom {
        since: None,
        wait: Duration::ZERO,
    };
    let (target, cancel) = (job.clone(), call.cancel);
    act_then_read(call, jobs, job, from, |sandbox| {
        let target = &target;
        async move { jobs.kill(&sandbox, target, signal, cancel).await }
    })
    .await
}

/// `job_list`.
pub(super) async fn list(call: &Call<'_>) -> Result<Payload, CallError> {
    let jobs = call.jobs()?;
    let computer = match call.args().string("computer_id")? {
        Some(raw) => Some(ComputerId::parse(&raw)?.owned_by(call.principal())),
        None => call.session.default_id(),
    };
    let listing = match computer {
        Some(id) => jobs_of(call, jobs, &id).await?,
        // No default computer yet: nothing has run, so no job either (and none is created).
        None => Listing {
            jobs: Vec::new(),
            truncated: false,
        },
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
    Ok(payload.into())
}

/// The jobs of an existing computer (started if it stopped); never creates one.
async fn jobs_of(call: &Call<'_>, jobs: &Jobs, id: &ComputerId) -> Result<Listing, CallError> {
    let sandbox = call.registry().attach_existing(call.session, id).await?;
    let cancel = call.cancel;
    let (_, listing) = on_running(
        call.registry(),
        call.session,
        sandbox,
        |sandbox| async move { jobs.list(&sandbox, cancel).await },
    )
    .await?;
    Ok(listing)
}
