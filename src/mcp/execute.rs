//! `terminal_execute` (docs/decisions.md, "Tool list" and "terminal_execute validation"): its
//! definition, the arguments checked before anything is created, and the six result fields of
//! a finished command. With `yield_after` the command runs as a job (`jobs.rs`); for a client
//! that declared the Tasks extension it may become a task (`tasks.rs`). No provider logic and
//! no lifecycle rules live here.

use rmcp::model::{MetaObject, Tool, ToolAnnotations};
use serde_json::{Map, Value, json};

use super::args::Args;
use super::call::{Call, CallError, Payload};
use super::format;
use super::routes::Definitions;
use super::tasks::{Started, Tasks};
use crate::backends::SandboxRef;
use crate::config::MAX_TIMEOUT_SECS;
use crate::exec::{ExecOutcome, ExecRequest, Program, STDIN_LIMIT};
use crate::ids::ComputerId;
use crate::jobs::StartRequest;

pub const TERMINAL_EXECUTE: &str = "terminal_execute";

fn ui_meta() -> MetaObject {
    let mut meta = MetaObject::new();
    meta.0
        .insert("ui".to_owned(), json!({"visibility": ["model", "app"]}));
    meta
}

/// `terminal_execute` with the description assembled at startup; with the job switch on it
/// gains `yield_after` and `keep_stdin_open`, and its result may be a running job.
pub(super) fn tool(definitions: &Definitions<'_>) -> Tool {
    let mut input = json!({
        "type": "object",
        "properties": {
            "command": {"type": "string", "title": "Command", "description": "Shell command string (mutually exclusive with args)."},
            "args": {"type": "array", "items": {"type": "string"}, "title": "Args", "description": "List of arguments for direct execution (mutually exclusive with command)."},
            "stdin": {"type": "string", "title": "Stdin", "description": "Content to pipe to stdin."},
            "working_directory": {"type": "string", "title": "Working Directory", "description": "Working directory for the command (must be absolute)."},
            "timeout": {"type": "integer", "title": "Timeout", "description": "Timeout in seconds (defaults to server config)."},
            "computer_id": {"type": "string", "title": "Computer Id", "description": "Stable computer slug. Omit to create and select a readable random ID for this MCP session."},
            "temporary": {"type": "boolean", "default": true, "title": "Temporary", "description": "Remove the computer when its MCP session shuts down. Set false to keep it provider-side and reconnect by computer_id."}
        }
    });
    let mut output = json!({
        "type": "object",
        "properties": {
            "computer_id": {"type": "string"},
            "temporary": {"type": "boolean"},
            "stdout": {"type": "string"},
            "stderr": {"type": "string"},
            "exit_code": {"type": "integer"},
            "exec_duration_ms": {"type": "integer"},
            "error": {"type": "string"}
        },
        "anyOf": [
            {"required": ["computer_id", "temporary", "stdout", "stderr", "exit_code", "exec_duration_ms"]},
            {"required": ["error"]}
        ]
    });
    if definitions.job_tools {
        if let (Some(properties), Value::Object(extra)) = (
            input["properties"].as_object_mut(),
            super::jobs::execute_properties(),
        ) {
            properties.extend(extra);
        }
        if let Some(properties) = output["properties"].as_object_mut() {
            properties.insert("exit_code".into(), json!({"type": ["integer", "null"]}));
            properties.insert("job_id".into(), json!({"type": "string"}));
            properties.insert("running".into(), json!({"type": "boolean"}));
        }
    }
    let mut annotations = ToolAnnotations::new();
    annotations.open_world_hint = Some(true);
    Tool::new(
        TERMINAL_EXECUTE,
        definitions.description.to_owned(),
        format::object(input),
    )
    .with_raw_output_schema(format::object(output))
    .with_annotations(annotations)
    .with_meta(ui_meta())
}

/// Validates a `terminal_execute` call (docs/decisions.md, "terminal_execute validation") before anything is created.
struct ExecuteCall {
    request: ExecRequest,
    computer_id: Option<ComputerId>,
    temporary: bool,
    /// Set only with the job switch on.
    job: Option<super::jobs::YieldArgs>,
    /// Whether `timeout` was given (a job has no limit by default).
    timeout_given: bool,
}

/// Whether `dir`, normalised lexically (`.`, `..`, repeated slashes), names `/proc` or
/// something below it. A working directory there reaches the runtime's own file descriptors
/// (`/proc/self/fd/N`: the escape of runc CVE-2024-21626 on runc before 1.1.12), and no
/// command has a reason to start there; see docs/reliability.md ("Working directory").
fn is_under_proc(dir: &str) -> bool {
    let mut parts: Vec<&str> = Vec::new();
    for part in dir.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    parts.first() == Some(&"proc")
}

/// The checks in the documented order: the first offending property in schema order, then
/// the rules between them.
fn decode_execute(
    args: &Args<'_>,
    default_timeout: u64,
    job_tools: bool,
) -> Result<ExecuteCall, CallError> {
    let command = args.string("command")?;
    let argv = args.string_list("args")?;
    let stdin = args.string("stdin")?;
    let working_dir = args.string("working_directory")?;
    let timeout = args.integer("timeout")?;
    let computer_id = args.string("computer_id")?;
    let temporary = args.boolean("temporary")?;
    // Empty values mean "absent" (docs/decisions.md, "terminal_execute validation").
    let command = command.filter(|c| !c.is_empty());
    let argv = argv.filter(|a| !a.is_empty());
    let stdin = stdin.filter(|s| !s.is_empty());
    let working_dir = working_dir.filter(|w| !w.is_empty());
    let program = match (command, argv) {
        (Some(_), Some(_)) => {
            return Err(CallError::invalid(
                "Cannot provide both 'command' and 'args'. Use 'command' for shell commands or 'args' for direct execution.",
            ));
        }
        (None, None) => {
            return Err(CallError::invalid(
                "Must provide either 'command' or 'args'.",
            ));
        }
        (Some(command), None) => Program::Shell(command),
        (None, Some(argv)) => Program::Args(argv),
    };
    if let Some(dir) = &working_dir
        && !dir.starts_with('/')
    {
        return Err(CallError::invalid(format!(
            "working_directory must be an absolute path, got: {dir}"
        )));
    }
    if let Some(dir) = &working_dir
        && is_under_proc(dir)
    {
        return Err(CallError::invalid(format!(
            "working_directory must not be under /proc, got: {dir}"
        )));
    }
    let job = if job_tools {
        Some(super::jobs::decode_yield(args)?)
    } else {
        None
    };
    let timeout_secs = match timeout {
        Some(t) if t < 1 => return Err(CallError::invalid("timeout must be at least 1 second.")),
        Some(t) if t.unsigned_abs() > MAX_TIMEOUT_SECS => {
            return Err(CallError::invalid(format!(
                "timeout must be at most {MAX_TIMEOUT_SECS} seconds (one week)."
            )));
        }
        Some(t) => t.unsigned_abs(),
        None => default_timeout,
    };
    if let Some(stdin) = &stdin
        && stdin.len() > STDIN_LIMIT
    {
        return Err(CallError::invalid(format!(
            "stdin content exceeds the 2 MiB limit ({} bytes). Split into smaller chunks or use a different approach.",
            stdin.len()
        )));
    }
    let computer_id = computer_id.map(|raw| ComputerId::parse(&raw)).transpose()?;
    Ok(ExecuteCall {
        request: ExecRequest {
            program,
            stdin,
            working_dir,
            timeout_secs,
        },
        computer_id,
        temporary: temporary.unwrap_or(true),
        job,
        timeout_given: timeout.is_some(),
    })
}

/// The call's arguments, checked, with `computer_id` scoped to the caller.
fn decode_call(call: &Call<'_>) -> Result<ExecuteCall, CallError> {
    let mut execute = decode_execute(
        &call.args(),
        call.registry().limits().default_timeout_secs,
        call.surface.jobs.is_some(),
    )?;
    execute.computer_id = execute.computer_id.map(|id| id.owned_by(call.principal()));
    Ok(execute)
}

/// `terminal_execute`: the command's six fields once it ended, or with `yield_after` the job's.
pub(super) async fn terminal_execute(call: &Call<'_>) -> Result<Payload, CallError> {
    run(call, decode_call(call)?).await
}

/// `terminal_execute` for a request that declared the Tasks extension (docs/tasks.md): the
/// command runs as a job, and the answer is its ordinary result when it ends within
/// `--task-after`, else a task. A call with `yield_after` asked for a job and gets one.
pub(super) async fn terminal_execute_or_task(
    call: &Call<'_>,
    tasks: &Tasks,
) -> Result<Started, CallError> {
    let execute = decode_call(call)?;
    if execute
        .job
        .as_ref()
        .is_some_and(|job| job.yield_after.is_some())
    {
        return run(call, execute).await.map(Started::Finished);
    }
    let request = StartRequest {
        timeout_secs: execute
            .timeout_given
            .then_some(execute.request.timeout_secs),
        program: execute.request.program,
        stdin: execute.request.stdin,
        working_dir: execute.request.working_dir,
        keep_stdin_open: false,
    };
    tasks
        .start(call, (execute.computer_id, execute.temporary), request)
        .await
}

async fn run(call: &Call<'_>, execute: ExecuteCall) -> Result<Payload, CallError> {
    let registry = call.registry();
    if let (Some(jobs), Some(job)) = (call.surface.jobs.as_deref(), &execute.job)
        && let Some(yield_after) = job.yield_after
    {
        let request = StartRequest {
            // A job's limit is its own: `timeout` only when given (docs/jobs.md).
            timeout_secs: execute
                .timeout_given
                .then_some(execute.request.timeout_secs),
            program: execute.request.program,
            stdin: execute.request.stdin,
            working_dir: execute.request.working_dir,
            keep_stdin_open: job.keep_stdin_open,
        };
        let computer = (execute.computer_id, execute.temporary);
        return super::jobs::execute(call, jobs, computer, request, yield_after).await;
    }
    let executed = registry
        .execute(
            call.session,
            execute.computer_id,
            execute.temporary,
            &execute.request,
            call.progress,
            call.cancel,
        )
        .await?;
    Ok(finished(&executed.sandbox, executed.outcome))
}

/// The six fields of a finished command, in order: the one shape of a command's result,
/// whether it ran in the foreground or as a task's job (docs/decisions.md, "Command results").
pub(super) fn finished(sandbox: &SandboxRef, outcome: ExecOutcome) -> Payload {
    let (stdout, stderr, exit_code, duration) = match outcome {
        ExecOutcome::Completed {
            stdout,
            stderr,
            exit_code,
            duration,
        } => (
            String::from_utf8_lossy(&stdout).into_owned(),
            String::from_utf8_lossy(&stderr).into_owned(),
            exit_code,
            duration,
        ),
        ExecOutcome::TimedOut {
            timeout_secs,
            duration,
        } => (
            String::new(),
            ExecOutcome::timeout_notice(timeout_secs),
            124,
            duration,
        ),
        ExecOutcome::OutputLimitExceeded { limit, duration } => (
            String::new(),
            ExecOutcome::output_limit_notice(limit),
            1,
            duration,
        ),
        ExecOutcome::OutOfFuel { fuel, duration } => (
            String::new(),
            ExecOutcome::out_of_fuel_notice(fuel),
            124,
            duration,
        ),
    };
    let mut payload = Map::new();
    payload.insert("computer_id".into(), json!(sandbox.computer_id.slug()));
    payload.insert("temporary".into(), json!(sandbox.temporary));
    payload.insert("stdout".into(), json!(stdout));
    payload.insert("stderr".into(), json!(stderr));
    payload.insert("exit_code".into(), json!(exit_code));
    payload.insert(
        "exec_duration_ms".into(),
        json!(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)),
    );
    payload.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(value: Value) -> Result<ExecuteCall, String> {
        let arguments = value.as_object();
        decode_execute(&Args::new(TERMINAL_EXECUTE, arguments), 120, false)
            .map_err(|error| error.to_string())
    }

    #[test]
    fn working_directories_under_proc_are_refused_however_spelled() {
        for dir in [
            "/proc",
            "/proc/self/fd/8",
            "//proc/1/cwd",
            "/./proc/",
            "/tmp/../proc/self",
            "/../../proc/self/fd/7",
        ] {
            assert_eq!(
                decode(json!({"command": "pwd", "working_directory": dir}))
                    .err()
                    .as_deref(),
                Some(format!("working_directory must not be under /proc, got: {dir}").as_str()),
                "{dir}"
            );
        }
        for dir in ["/procfs", "/tmp/proc", "/proc-x", "/", "/proc/../tmp"] {
            assert!(
                decode(json!({"command": "pwd", "working_directory": dir})).is_ok(),
                "{dir}"
            );
        }
    }

    #[test]
    fn validation_messages_in_order() {
        assert_eq!(
            decode(json!({"command": "a", "args": ["b"]}))
                .err()
                .as_deref(),
            Some(
                "Cannot provide both 'command' and 'args'. Use 'command' for shell commands or 'args' for direct execution."
            )
        );
        assert_eq!(
            decode(json!({})).err().as_deref(),
            Some("Must provide either 'command' or 'args'.")
        );
        assert_eq!(
            decode(json!({"command": "", "args": []})).err().as_deref(),
            Some("Must provide either 'command' or 'args'.")
        );
        assert_eq!(
            decode(json!({"command": "pwd", "working_directory": "tmp"}))
                .err()
                .as_deref(),
            Some("working_directory must be an absolute path, got: tmp")
        );
        assert_eq!(
            decode(json!({"command": "x", "timeout": 0}))
                .err()
                .as_deref(),
            Some("timeout must be at least 1 second.")
        );
        // See: issue 15
        assert_eq!(
            decode(json!({"command": "x", "timeout": 604_801}))
                .err()
                .as_deref(),
            Some("timeout must be at most 604800 seconds (one week).")
        );
        assert_eq!(
            decode(json!({"command": "x", "timeout": 604_800}))
                .unwrap()
                .request
                .timeout_secs,
            604_800
        );
        let big = "a".repeat(STDIN_LIMIT + 1);
        assert_eq!(
            decode(json!({"command": "x", "stdin": big}))
                .err()
                .as_deref(),
            Some(
                "stdin content exceeds the 2 MiB limit (2097153 bytes). Split into smaller chunks or use a different approach."
            )
        );
        assert!(decode(json!({"command": "x", "stdin": "a".repeat(STDIN_LIMIT)})).is_ok());
        assert_eq!(
            decode(json!({"command": "x", "computer_id": "UPPER"}))
                .err()
                .as_deref(),
            Some(crate::ids::INVALID_COMPUTER_ID)
        );
    }

    #[test]
    fn nulls_are_absent_and_strings_coerce() {
        let call = decode(json!({"command": "x", "args": null, "timeout": "5", "temporary": null, "computer_id": " dev-box "})).unwrap();
        assert_eq!(call.request.timeout_secs, 5);
        assert!(call.temporary);
        assert_eq!(
            call.computer_id.map(|c| c.to_string()).as_deref(),
            Some("dev-box")
        );
        assert_eq!(
            decode(json!({"command": "x", "timeout": 1.5}))
                .err()
                .as_deref(),
            Some("Invalid arguments for tool terminal_execute: timeout: expected an integer")
        );
    }
}
