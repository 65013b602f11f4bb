//! Tool definitions (names, schemas, descriptions, annotations exactly as docs/decisions.md, "Tool list"
//! and "terminal_execute validation") and one thin function per tool that decodes arguments, calls the registry and formats
//! the result. No provider logic and no lifecycle rules live here.

use rmcp::model::{CallToolResult, JsonObject, MetaObject, Tool, ToolAnnotations};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use super::args::{ArgError, Args};
use super::format;
use crate::backends::Progress;
use crate::config::MAX_TIMEOUT_SECS;
use crate::exec::{ExecOutcome, ExecRequest, Program, STDIN_LIMIT};
use crate::ids::ComputerId;
use crate::jobs::{Jobs, StartRequest};
use crate::registry::{Registry, RegistryError, Session};

pub const TERMINAL_EXECUTE: &str = "terminal_execute";

fn ui_meta() -> MetaObject {
    let mut meta = MetaObject::new();
    meta.0
        .insert("ui".to_owned(), json!({"visibility": ["model", "app"]}));
    meta
}

/// `terminal_execute` with the description assembled at startup; with the job switch on it
/// gains `yield_after` and `keep_stdin_open`, and its result may be a running job.
pub fn terminal_execute_tool(description: &str, job_tools: bool) -> Tool {
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
    if job_tools {
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
        description.to_owned(),
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

fn decode_execute(
    arguments: Option<&JsonObject>,
    default_timeout: u64,
    job_tools: bool,
) -> Result<ExecuteCall, String> {
    let args = Args::new(TERMINAL_EXECUTE, arguments);
    let decode = || -> Result<_, ArgError> {
        Ok((
            args.string("command")?,
            args.string_list("args")?,
            args.string("stdin")?,
            args.string("working_directory")?,
            args.integer("timeout")?,
            args.string("computer_id")?,
            args.boolean("temporary")?,
        ))
    };
    let (command, argv, stdin, working_dir, timeout, computer_id, temporary) =
        decode().map_err(|e| e.to_string())?;
    // Empty values mean "absent" (docs/decisions.md, "terminal_execute validation").
    let command = command.filter(|c| !c.is_empty());
    let argv = argv.filter(|a| !a.is_empty());
    let stdin = stdin.filter(|s| !s.is_empty());
    let working_dir = working_dir.filter(|w| !w.is_empty());
    let program = match (command, argv) {
        (Some(_), Some(_)) => {
            return Err("Cannot provide both 'command' and 'args'. Use 'command' for shell commands or 'args' for direct execution.".to_owned());
        }
        (None, None) => return Err("Must provide either 'command' or 'args'.".to_owned()),
        (Some(command), None) => Program::Shell(command),
        (None, Some(argv)) => Program::Args(argv),
    };
    if let Some(dir) = &working_dir
        && !dir.starts_with('/')
    {
        return Err(format!(
            "working_directory must be an absolute path, got: {dir}"
        ));
    }
    if let Some(dir) = &working_dir
        && is_under_proc(dir)
    {
        return Err(format!(
            "working_directory must not be under /proc, got: {dir}"
        ));
    }
    let job = if job_tools {
        Some(super::jobs::decode_yield(&args)?)
    } else {
        None
    };
    let timeout_secs = match timeout {
        Some(t) if t < 1 => return Err("timeout must be at least 1 second.".to_owned()),
        Some(t) if t.unsigned_abs() > MAX_TIMEOUT_SECS => {
            return Err(format!(
                "timeout must be at most {MAX_TIMEOUT_SECS} seconds (one week)."
            ));
        }
        Some(t) => t.unsigned_abs(),
        None => default_timeout,
    };
    if let Some(stdin) = &stdin
        && stdin.len() > STDIN_LIMIT
    {
        return Err(format!(
            "stdin content exceeds the 2 MiB limit ({} bytes). Split into smaller chunks or use a different approach.",
            stdin.len()
        ));
    }
    let computer_id = computer_id
        .map(|raw| ComputerId::parse(&raw))
        .transpose()
        .map_err(|e| e.to_string())?;
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

/// `terminal_execute`: `Ok(None)` when the client cancelled (no result is sent).
pub async fn terminal_execute(
    registry: &Registry,
    jobs: Option<&Jobs>,
    session: &Session,
    arguments: Option<&JsonObject>,
    progress: &dyn Progress,
    cancel: &CancellationToken,
) -> Option<CallToolResult> {
    let mut call = match decode_execute(
        arguments,
        registry.limits().default_timeout_secs,
        jobs.is_some(),
    ) {
        Ok(call) => call,
        Err(message) => return Some(format::error(message)),
    };
    call.computer_id = call.computer_id.map(|id| id.owned_by(session.principal()));
    if let (Some(jobs), Some(job)) = (jobs, &call.job)
        && let Some(yield_after) = job.yield_after
    {
        let request = StartRequest {
            // A job's limit is its own: `timeout` only when given (docs/jobs.md).
            timeout_secs: call.timeout_given.then_some(call.request.timeout_secs),
            program: call.request.program,
            stdin: call.request.stdin,
            working_dir: call.request.working_dir,
            keep_stdin_open: job.keep_stdin_open,
        };
        return super::jobs::execute(
            registry,
            jobs,
            session,
            call.computer_id,
            call.temporary,
            request,
            yield_after,
            progress,
            cancel,
        )
        .await;
    }
    let executed = registry
        .execute(
            session,
            call.computer_id,
            call.temporary,
            &call.request,
            progress,
            cancel,
        )
        .await;
    let executed = match executed {
        Ok(executed) => executed,
        Err(RegistryError::Cancelled) => return None,
        Err(error) => return Some(format::error(format::user_message(&error))),
    };
    let (stdout, stderr, exit_code, duration) = match executed.outcome {
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
    payload.insert(
        "computer_id".into(),
        json!(executed.sandbox.computer_id.slug()),
    );
    payload.insert("temporary".into(), json!(executed.sandbox.temporary));
    payload.insert("stdout".into(), json!(stdout));
    payload.insert("stderr".into(), json!(stderr));
    payload.insert("exit_code".into(), json!(exit_code));
    payload.insert(
        "exec_duration_ms".into(),
        json!(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)),
    );
    Some(format::success(payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(value: Value) -> Result<ExecuteCall, String> {
        decode_execute(value.as_object(), 120, false)
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
