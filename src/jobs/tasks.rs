//! What a job needs to be an MCP task (docs/tasks.md, "Inside the computer"): the task's
//! record, a `task` file next to the job's own files, and the reads and removals the task
//! methods make. The record is what lets any later server process answer for the task from
//! the task id and the computer alone; this module stores and returns it, and leaves what it
//! means (who may see the task, whether it expired) to the MCP layer.
//!
//! The record comes back from inside the computer, so it is read like everything else there:
//! capped, parsed strictly, and a record that does not parse is no record.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::script::{FIND_JOB, JOB_FUNCTIONS};
use super::{JobError, Jobs, ScriptRun, Signal, Snapshot, parse};
use crate::backends::SandboxRef;
use crate::ids::JobId;

/// The most bytes of a `task` file read back: a real record is under 200 bytes.
const RECORD_LIMIT: usize = 1024;

/// What a job's task was granted, written once when the task is created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// The owner tag of the principal that created the task (`Principal::digest_tag`).
    pub owner: String,
    /// The random part of the task id, which only its holder knows.
    pub secret: String,
    /// Server time of creation, milliseconds since the epoch.
    pub created_ms: u64,
    /// The time to live granted, in milliseconds.
    pub ttl_ms: u64,
    /// The job's wall-clock limit in seconds (0 = none), for the timeout notice of its result.
    pub timeout_secs: u64,
}

impl TaskRecord {
    /// When the task expires, in milliseconds since the epoch.
    pub fn expires_ms(&self) -> u64 {
        self.created_ms.saturating_add(self.ttl_ms)
    }

    /// The `task` file's one line: the expiry in whole seconds (rounded up), which the scripts
    /// compare without parsing JSON, then the record.
    fn line(&self) -> String {
        let expires_secs = self.expires_ms().div_ceil(1000);
        let json = serde_json::to_string(self).unwrap_or_default();
        format!("{expires_secs} {json}")
    }

    /// A `task` file's line, or `None` for anything else.
    fn parse(line: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(line).ok()?;
        let (_, json) = text.split_once(' ')?;
        serde_json::from_str(json).ok()
    }
}

/// A task's job as one read sees it: its record, and either the end marks or, while it
/// runs, the last [`STATUS_TAIL`] bytes of its output (enough for its last complete line).
/// The output of an ended job is read with [`Jobs::read`], like every finished job's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRead {
    pub record: TaskRecord,
    /// `None` once the job ended.
    pub running_tail: Option<Snapshot>,
    /// `tasks/cancel` ended the job (the `cancelled` mark).
    pub cancelled: bool,
}

/// How much of a running job's output a status read returns: the partial-line bound of a
/// command's progress line (docs/jobs.md, "Progress of foreground calls").
pub const STATUS_TAIL: u64 = 4096;

/// Records a task for job `$1`: `$2` the `task` line, `$3` the server's clock in seconds.
/// Also removes the ended jobs of earlier tasks that expired by that clock, so a computer
/// whose tasks nobody polls again does not keep their files. Prints `missing` or `ok`.
fn record_script() -> String {
    format!(
        r#"j=$1; now=$3
{FIND_JOB}[ -n "$d" ] || {{ echo missing; exit 0; }}
printf '%s\n' "$2" > "$d/task.tmp" && mv "$d/task.tmp" "$d/task" || {{ echo "failed cannot write the task record"; exit 0; }}
for o in /.kilntainers/jobs/j-* /tmp/.kilntainers/jobs/j-*; do
  [ -f "$o/task" ] && [ -f "$o/exit" ] || continue
  read -r e rest < "$o/task" 2>/dev/null || continue
  case $e in ''|*[!0-9]*) continue;; esac
  [ "$e" -le "$now" ] && rm -rf "$o"
done
echo ok
"#
    )
}

/// Reads a task's job: `$1` id, `$2` the shell, `$3` the read script, `$4` how much of a
/// running job's output to return. Prints `missing` (no job, or a job that is no task), else
/// the `task` line, then `ended <cancelled 0/1>`, or `running <offset>` and the read script's
/// answer from that offset.
fn status_script() -> String {
    format!(
        r#"j=$1
{JOB_FUNCTIONS}{FIND_JOB}[ -n "$d" ] && [ -f "$d/task" ] || {{ echo missing; exit 0; }}
head -c {RECORD_LIMIT} "$d/task" | head -n 1
settle "$d"
if [ -f "$d/exit" ]; then
  c=0; [ -f "$d/cancelled" ] && c=1
  printf 'ended %s\n' "$c"
  exit 0
fi
t=$(awk '{{t += $2}} END {{printf "%.0f\n", t}}' "$d/order")
if [ "$t" -gt "$4" ]; then s=$((t - $4)); else s=0; fi
printf 'running %s\n' "$s"
exec "$2" -c "$3" kilntainers-job "$j" "$s" "$4" 0 output
"#
    )
}

/// Marks job `$1` cancelled unless it already ended. Prints `missing`, `ended` or `marked`.
fn cancel_script() -> String {
    format!(
        r#"j=$1
{JOB_FUNCTIONS}{FIND_JOB}[ -n "$d" ] && [ -f "$d/task" ] || {{ echo missing; exit 0; }}
settle "$d"
[ -f "$d/exit" ] && {{ echo ended; exit 0; }}
: > "$d/cancelled"
echo marked
"#
    )
}

/// Removes job `$1`'s directory. Prints `missing` or `ok`.
fn remove_script() -> String {
    format!(
        r#"j=$1
{FIND_JOB}[ -n "$d" ] || {{ echo missing; exit 0; }}
rm -rf "$d"
echo ok
"#
    )
}

/// The first line of `bytes` and the rest.
fn first_line(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = bytes.iter().position(|&b| b == b'\n')?;
    Some((&bytes[..end], &bytes[end + 1..]))
}

impl Jobs {
    /// Writes `record` next to `job`'s files; from then on the job is a task.
    pub async fn record_task(
        &self,
        sandbox: &SandboxRef,
        job: &JobId,
        record: &TaskRecord,
        cancel: &CancellationToken,
    ) -> Result<(), JobError> {
        let now_secs = super::now_ms() / 1000;
        let (stdout, _) = self
            .run_script(
                sandbox,
                ScriptRun {
                    script: record_script(),
                    args: vec![job.to_string(), record.line(), now_secs.to_string()],
                    stdin: None,
                    wait: Duration::from_secs(5),
                    cap: 4096,
                },
                cancel,
            )
            .await?;
        match String::from_utf8_lossy(&stdout).trim() {
            "ok" => Ok(()),
            "missing" => Err(JobError::NotFound(job.clone())),
            answer => Err(JobError::Failed {
                action: "record the task of a",
                computer: sandbox.computer_id.clone(),
                reason: answer
                    .strip_prefix("failed ")
                    .unwrap_or("unexpected answer")
                    .to_owned(),
            }),
        }
    }

    /// Reads `job` as a task; `None` when there is no such job or it is not a task.
    pub async fn read_task(
        &self,
        sandbox: &SandboxRef,
        job: &JobId,
        cancel: &CancellationToken,
    ) -> Result<Option<TaskRead>, JobError> {
        let args = vec![
            job.to_string(),
            self.shell.clone(),
            super::script::read(),
            STATUS_TAIL.to_string(),
        ];
        let (stdout, stderr) = self
            .run_script(
                sandbox,
                ScriptRun {
                    script: status_script(),
                    args,
                    stdin: None,
                    wait: Duration::ZERO,
                    cap: STATUS_TAIL + 64 * 1024 + RECORD_LIMIT as u64,
                },
                cancel,
            )
            .await?;
        if stdout.starts_with(b"missing") {
            return Ok(None);
        }
        let Some((record, rest)) = first_line(&stdout) else {
            return Ok(None);
        };
        let (Some(record), Some((marks, answer))) = (TaskRecord::parse(record), first_line(rest))
        else {
            return Ok(None);
        };
        let marks = String::from_utf8_lossy(marks);
        let (running_tail, cancelled) = match marks.split_once(' ') {
            Some(("ended", cancelled)) => (None, cancelled == "1"),
            Some(("running", since)) => {
                let since: u64 = since.parse().unwrap_or(0);
                let snapshot = parse::snapshot(answer, stderr, since, super::now_ms());
                let snapshot = snapshot.ok_or_else(|| JobError::Failed {
                    action: "read the task of a",
                    computer: sandbox.computer_id.clone(),
                    reason: "its answer was not understood".to_owned(),
                })?;
                (Some(snapshot), false)
            }
            _ => return Ok(None),
        };
        Ok(Some(TaskRead {
            record,
            running_tail,
            cancelled,
        }))
    }

    /// `tasks/cancel`: marks the job cancelled and kills it as `job_kill` does (TERM, then the
    /// sweep). A job that already ended stays as it ended. `false` when there is no such task.
    pub async fn cancel_task(
        &self,
        sandbox: &SandboxRef,
        job: &JobId,
        cancel: &CancellationToken,
    ) -> Result<bool, JobError> {
        let (stdout, _) = self
            .run_script(
                sandbox,
                ScriptRun {
                    script: cancel_script(),
                    args: vec![job.to_string()],
                    stdin: None,
                    wait: Duration::from_secs(5),
                    cap: 4096,
                },
                cancel,
            )
            .await?;
        match String::from_utf8_lossy(&stdout).trim() {
            "marked" => match self.kill(sandbox, job, Signal::Term, cancel).await {
                // It ended on its own meanwhile and was settled: nothing left to kill.
                Ok(()) | Err(JobError::NotFound(_)) => Ok(true),
                Err(error) => Err(error),
            },
            "ended" => Ok(true),
            _ => Ok(false),
        }
    }

    /// Ends `job` if it still runs (KILL, then the sweep) and removes its files: an expired
    /// task's result is gone.
    pub async fn remove(
        &self,
        sandbox: &SandboxRef,
        job: &JobId,
        running: bool,
        cancel: &CancellationToken,
    ) -> Result<(), JobError> {
        if running {
            match self.kill(sandbox, job, Signal::Kill, cancel).await {
                Ok(()) | Err(JobError::NotFound(_)) => {}
                Err(error) => return Err(error),
            }
        }
        self.run_script(
            sandbox,
            ScriptRun {
                script: remove_script(),
                args: vec![job.to_string()],
                stdin: None,
                wait: Duration::from_secs(5),
                cap: 4096,
            },
            cancel,
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_line_reads_back_and_leads_with_its_expiry_in_seconds() {
        let record = TaskRecord {
            owner: "0123456789abcdef".to_owned(),
            secret: "ab".repeat(16),
            created_ms: 1_700_000_000_500,
            ttl_ms: 1_000,
            timeout_secs: 1,
        };
        let line = record.line();
        assert!(line.starts_with("1700000002 {"), "{line}");
        assert_eq!(TaskRecord::parse(line.as_bytes()), Some(record));
        for hostile in [
            &b"1700000002"[..],
            b"1700000002 {\"owner\":1}",
            b"x {}",
            b"\xff\xfe {}",
        ] {
            assert_eq!(TaskRecord::parse(hostile), None);
        }
    }
}
