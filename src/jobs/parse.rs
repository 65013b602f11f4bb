//! Reading what the job scripts print. Everything here comes from inside a computer, so it is
//! treated as hostile: lines are bounded by the exec's output cap, numbers that do not parse
//! count as zero, and nothing is trusted to be UTF-8.

use std::collections::HashSet;

use serde::Deserialize;

use crate::ids::JobId;

/// One read of a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub running: bool,
    /// `None` while running, or when the job ended without a known code (its computer
    /// restarted under it).
    pub exit_code: Option<i64>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// The offset after what this read returned.
    pub next_since: u64,
    /// More output than one result carries is waiting after `next_since`.
    pub more: bool,
    pub stdin_open: bool,
    /// Milliseconds from the job's start to its end, or to now while it runs.
    pub elapsed_ms: u64,
    /// Once it ended: its start and end in Unix milliseconds, the end rounded up to the whole
    /// second the computer records; where its network refusals are looked up.
    pub lifetime_ms: Option<(u64, u64)>,
}

/// One row of `job_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSummary {
    pub job_id: JobId,
    pub command: String,
    pub running: bool,
    pub exit_code: Option<i64>,
    pub started_at: Option<String>,
    pub ended_at: Option<String>,
    pub output_bytes: u64,
    pub started_ms: u64,
}

#[derive(Deserialize, Default)]
struct SummaryFile {
    #[serde(default)]
    command: String,
    #[serde(default)]
    started_at: Option<String>,
    #[serde(default)]
    started_ms: u64,
}

/// `running`, or `ended <code|-> <ended_at> <ended epoch seconds>`.
struct State {
    running: bool,
    exit_code: Option<i64>,
    ended_at: Option<String>,
    ended_secs: Option<u64>,
}

fn state(line: &str) -> State {
    let mut words = line.split_whitespace();
    match words.next() {
        Some("ended") => State {
            running: false,
            exit_code: words.next().and_then(|code| code.parse().ok()),
            ended_at: words.next().map(str::to_owned),
            ended_secs: words.next().and_then(|secs| secs.parse().ok()),
        },
        _ => State {
            running: true,
            exit_code: None,
            ended_at: None,
            ended_secs: None,
        },
    }
}

/// The first `n` lines of `bytes` (each without its newline) and the rest.
fn split_lines(bytes: &[u8], n: usize) -> Option<(Vec<&[u8]>, &[u8])> {
    let mut lines = Vec::with_capacity(n);
    let mut rest = bytes;
    for _ in 0..n {
        let end = rest.iter().position(|&b| b == b'\n')?;
        lines.push(&rest[..end]);
        rest = &rest[end + 1..];
    }
    Some((lines, rest))
}

/// The length of `bytes` without a UTF-8 sequence cut off at its end, so a character split
/// between two reads arrives whole in the second.
fn without_cut_character(bytes: &[u8]) -> usize {
    let tail_start = bytes.len().saturating_sub(3);
    for start in (tail_start..bytes.len()).rev() {
        let lead = bytes[start];
        let width = match lead {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            0x80..=0xBF => continue,
            _ => return bytes.len(),
        };
        return if bytes.len() - start < width {
            start
        } else {
            bytes.len()
        };
    }
    bytes.len()
}

/// A read's answer: four header lines, then the stdout bytes; the stderr bytes came on stderr.
/// `None` when the job does not exist.
pub fn snapshot(stdout: &[u8], stderr: Vec<u8>, since: u64, now_ms: u64) -> Option<Snapshot> {
    if stdout.starts_with(b"missing") {
        return None;
    }
    let (lines, body) = split_lines(stdout, 4)?;
    let text = |line: &[u8]| String::from_utf8_lossy(line).into_owned();
    let state = state(&text(lines[0]));
    let stdin_open = lines[1] == b"1";
    let numbers: Vec<u64> = text(lines[2])
        .split_whitespace()
        .map(|n| n.parse().unwrap_or(0))
        .collect();
    let &[_, _, want_out, want_err, total] = numbers.as_slice() else {
        return None;
    };
    let summary: SummaryFile = serde_json::from_slice(lines[3]).unwrap_or_default();
    let mut out = body.to_vec();
    out.truncate(usize::try_from(want_out).unwrap_or(usize::MAX));
    let mut err = stderr;
    err.truncate(usize::try_from(want_err).unwrap_or(usize::MAX));
    let start = since.min(total);
    let mut taken = out.len() as u64 + err.len() as u64;
    // A character cut at the end of the read is left for the next one, when it is the only
    // stream read (otherwise its bytes are not the last of the combined range).
    if state.running || start + taken < total {
        if err.is_empty() {
            out.truncate(without_cut_character(&out));
        } else if out.is_empty() {
            err.truncate(without_cut_character(&err));
        }
        taken = out.len() as u64 + err.len() as u64;
    }
    let next_since = start + taken;
    let end_ms = state
        .ended_secs
        .map_or(now_ms, |secs| secs.saturating_mul(1000));
    Some(Snapshot {
        running: state.running,
        exit_code: state.exit_code,
        stdout: out,
        stderr: err,
        next_since,
        more: next_since < total,
        stdin_open,
        elapsed_ms: end_ms.saturating_sub(summary.started_ms),
        lifetime_ms: (!state.running).then(|| {
            let ended_ms = state
                .ended_secs
                .map_or(now_ms, |secs| secs.saturating_mul(1000).saturating_add(999));
            (summary.started_ms, ended_ms)
        }),
    })
}

/// The list script's answer: per job `J <id>`, summary.json, the state, the output bytes; then
/// `T <jobs on the computer>`. At most `rows` jobs are taken, each id once: a computer that
/// sends more (or claims more in its `T` line) gets `truncated`, nothing else. Stops reading at
/// the first row past `rows`, so a flood costs no more than its bytes.
pub fn listing(stdout: &[u8], rows: usize) -> super::Listing {
    let mut lines = stdout
        .split(|&b| b == b'\n')
        .map(|line| String::from_utf8_lossy(line));
    let mut jobs: Vec<JobSummary> = Vec::new();
    let mut seen = HashSet::new();
    let mut truncated = false;
    while let Some(line) = lines.next() {
        if let Some(total) = line.strip_prefix("T ") {
            truncated |= total
                .trim()
                .parse::<u64>()
                .is_ok_and(|total| total > jobs.len() as u64);
            continue;
        }
        let Some(job_id) = line.strip_prefix("J ").and_then(JobId::parse) else {
            continue;
        };
        if jobs.len() == rows {
            truncated = true;
            break;
        }
        let (Some(summary), Some(state_line), Some(bytes)) =
            (lines.next(), lines.next(), lines.next())
        else {
            break;
        };
        if !seen.insert(job_id.clone()) {
            continue;
        }
        let summary: SummaryFile = serde_json::from_str(&summary).unwrap_or_default();
        // The exit file is `<code|-> <ended_at> <epoch>`.
        let state_text = match state_line.trim() {
            "running" => "running".to_owned(),
            ended => format!("ended {ended}"),
        };
        let state = state(&state_text);
        jobs.push(JobSummary {
            job_id,
            command: super::command_preview(&summary.command),
            running: state.running,
            exit_code: state.exit_code,
            started_at: summary.started_at,
            ended_at: state.ended_at,
            output_bytes: bytes.trim().parse().unwrap_or(0),
            started_ms: summary.started_ms,
        });
    }
    super::Listing { jobs, truncated }
}
