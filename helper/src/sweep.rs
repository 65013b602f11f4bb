//! Which processes a `Kill` ends: the rule of the server's shell kill sweep, in process.
//!
//! A command's processes are found three ways, because each alone misses some: by the exec tag
//! in their environment (what moved to another process group or session keeps it), by
//! descent from a process already chosen (what dropped the tag but still has its parent, as
//! `sudo`'s child does), and as orphans of PID 1 started no earlier than the command whose tag,
//! if any, no older process carries (what dropped or forged the tag *and* lost its parent:
//! `setsid env -i … &` once the shell is gone).
//! The last rule is sound only where PID 1 is the computer's keep-alive, whose only child is
//! its `sleep`, which is the case wherever this helper runs (Docker and Podman computers).
//! Processes of earlier commands started before this one and are left alone, as are new
//! orphans of an exec that was already running, and of a job that runs (a job is meant to
//! outlive the call that started it): only of a job that runs, so a forged `job…` tag on an
//! orphan of the command does not spare it. This module only reads /proc and the jobs'
//! records; the caller sends the signals.

use std::collections::HashSet;

/// One process as the sweep sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proc {
    pub pid: i32,
    pub ppid: i32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start: u64,
    /// The process's first `<NAME>=…` entry for the tag's `NAME`, if any.
    pub tag: Option<Vec<u8>>,
}

/// Every readable process but `own`. Unreadable ones (gone, zombies, someone else's) have
/// nothing left to kill.
pub fn snapshot(tag_name: &str, own: u32) -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let prefix = format!("{tag_name}=");
    let mut found = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == own {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((ppid, start)) = parse_stat(&stat) else {
            continue;
        };
        let tag = std::fs::read(entry.path().join("environ"))
            .ok()
            .and_then(|environ| {
                environ
                    .split(|&b| b == 0)
                    .find(|e| e.starts_with(prefix.as_bytes()))
                    .map(<[u8]>::to_vec)
            });
        if let Ok(pid) = i32::try_from(pid) {
            found.push(Proc {
                pid,
                ppid,
                start,
                tag,
            });
        }
    }
    found
}

/// When `pid` started, in clock ticks since boot, while it can still be read.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&stat).map(|(_, start)| start)
}

/// Where job directories live (the server's job scripts: the first writable of these).
const JOB_BASES: [&str; 2] = ["/.kilntainers/jobs", "/tmp/.kilntainers/jobs"];

/// The supervisor pid recorded for job `id` (`j-` and 8 lowercase hex digits) when its
/// directory says it runs: no `exit` yet, a `pid` file. [`targets`] then checks that this
/// process exists and carries the job's supervisor tag, the jobs' own test of a running job.
pub fn recorded_supervisor(id: &str) -> Option<i32> {
    if !is_job_id(id) {
        return None;
    }
    JOB_BASES.iter().find_map(|base| {
        let dir = std::path::Path::new(base).join(id);
        if dir.join("exit").exists() {
            return None;
        }
        std::fs::read_to_string(dir.join("pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    })
}

fn is_job_id(id: &str) -> bool {
    id.strip_prefix("j-").is_some_and(|hex| {
        hex.len() == 8
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// The job a tag value names: `job-<id>` (its command) or `jobsup-<id>` (its supervisor).
fn job_of(value: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(value).ok()?;
    value
        .strip_prefix("jobsup-")
        .or_else(|| value.strip_prefix("job-"))
        .filter(|id| is_job_id(id))
}

/// Whether `tag` (a whole `NAME=value` entry) belongs to a job that runs: its recorded
/// supervisor is listed with the tag `NAME=jobsup-<id>`.
fn of_running_job(procs: &[Proc], tag: &[u8], supervisor_of: &dyn Fn(&str) -> Option<i32>) -> bool {
    let name = tag_name(tag);
    let Some(job) = tag.get(name.len() + 1..).and_then(job_of) else {
        return false;
    };
    let Some(supervisor) = supervisor_of(job) else {
        return false;
    };
    let expected = [name, b"=jobsup-", job.as_bytes()].concat();
    procs
        .iter()
        .any(|proc| proc.pid == supervisor && proc.tag.as_deref() == Some(expected.as_slice()))
}

/// `NAME` of a whole `NAME=value` tag.
fn tag_name(tag: &[u8]) -> &[u8] {
    tag.split(|&b| b == b'=').next().unwrap_or(tag)
}

/// The parent pid and start time of a `/proc/<pid>/stat` line. The command name may hold
/// spaces and parentheses, so fields are counted from the last `)`.
fn parse_stat(stat: &str) -> Option<(i32, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    // After the name: state, ppid, … with the start time 20th.
    let ppid = fields.nth(1)?.parse().ok()?;
    let start = fields.nth(17)?.parse().ok()?;
    Some((ppid, start))
}

/// The pids to kill among `procs` for `tag` (a whole `NAME=value` entry), given `roots` (the
/// command's own processes, tagged or not, and what earlier passes killed). `since` carries the
/// oldest start time seen across passes, so a later pass still recognises orphans once every
/// tagged process is gone. A root need not be in `procs`: a killed process that is still exiting
/// is unreadable, and its children are not reparented yet, so they are found as its descendants.
/// `keeper` is the process orphans are reparented to: PID 1, the computer's keep-alive, in
/// every computer; the tests' own process (a child subreaper) when they run on a host, whose
/// other orphans are not ours to kill. `supervisor_of` is [`recorded_supervisor`] (a fixed
/// answer in tests).
pub fn targets(
    procs: &[Proc],
    tag: &[u8],
    roots: &[i32],
    keeper: i32,
    since: &mut Option<u64>,
    supervisor_of: &dyn Fn(&str) -> Option<i32>,
) -> Vec<i32> {
    let listed: HashSet<i32> = procs.iter().map(|proc| proc.pid).collect();
    let mut chosen: HashSet<i32> = roots.iter().copied().collect();
    for proc in procs {
        if proc.tag.as_deref() == Some(tag) || roots.contains(&proc.pid) {
            chosen.insert(proc.pid);
            *since = Some(since.map_or(proc.start, |s| s.min(proc.start)));
        }
    }
    if let Some(since) = *since {
        // A tag an older process carries belongs to an exec that was already running (another
        // server's command sharing the computer); any other tag on a new orphan is forged.
        let older_tags: HashSet<&[u8]> = procs
            .iter()
            .filter(|proc| proc.start < since)
            .filter_map(|proc| proc.tag.as_deref())
            .collect();
        // A running job's processes are meant to outlive the call that started them; the
        // job's own sweep finds them by their exact tag. A job tag of no running job is forged.
        for proc in procs {
            let foreign = proc.tag.as_deref().is_some_and(|tag| {
                older_tags.contains(tag) || of_running_job(procs, tag, supervisor_of)
            });
            if proc.ppid == keeper && proc.start >= since && !foreign {
                chosen.insert(proc.pid);
            }
        }
    }
    // Descendants, to a fixed point: a child is listed in any order relative to its parent.
    loop {
        let before = chosen.len();
        for proc in procs {
            if chosen.contains(&proc.ppid) {
                chosen.insert(proc.pid);
            }
        }
        if chosen.len() == before {
            break;
        }
    }
    // Only what is listed (a root may be gone), never PID 1 (the keep-alive) nor anything that
    // would widen a kill(2) to a group.
    let mut pids: Vec<i32> = chosen
        .into_iter()
        .filter(|&pid| pid > 1 && listed.contains(&pid))
        .collect();
    pids.sort_unstable();
    pids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc(pid: i32, ppid: i32, start: u64, tag: Option<&str>) -> Proc {
        Proc {
            pid,
            ppid,
            start,
            tag: tag.map(|t| t.as_bytes().to_vec()),
        }
    }

    const TAG: &[u8] = b"KILNTAINERS_EXEC_ID=b";

    fn no_jobs(_: &str) -> Option<i32> {
        None
    }

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        let line = "42 (a) b) (c) S 7 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 12345 1 2";
        assert_eq!(parse_stat(line), Some((7, 12345)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn tagged_descendants_and_late_untagged_orphans_are_chosen() {
        let procs = [
            proc(1, 0, 0, None),                            // keep-alive
            proc(5, 1, 10, None),                           // its sleep, older than the command
            proc(6, 1, 20, Some("KILNTAINERS_EXEC_ID=a")),  // an earlier command's daemon
            proc(7, 1, 22, None),                           // untagged, before this command
            proc(10, 0, 30, Some("KILNTAINERS_EXEC_ID=b")), // the command
            proc(11, 10, 31, None),                         // `sudo`'s child: no tag, has a parent
            proc(12, 11, 32, None),                         // and its child
            proc(13, 1, 33, None),                          // `setsid env -i …`, orphaned
            proc(14, 0, 40, None),                          // another exec: parent outside
            proc(15, 1, 41, Some("KILNTAINERS_EXEC_ID=x")), // a forged tag, orphaned
            proc(16, 0, 3, Some("KILNTAINERS_EXEC_ID=c")),  // an exec running since before
            proc(17, 1, 42, Some("KILNTAINERS_EXEC_ID=c")), // and its new orphan
        ];
        let mut since = None;
        assert_eq!(
            targets(&procs, TAG, &[], 1, &mut since, &no_jobs),
            vec![10, 11, 12, 13, 15]
        );
        assert_eq!(since, Some(30));
    }

    #[test]
    fn orphans_of_running_jobs_are_left_to_their_own_sweep() {
        let procs = vec![
            proc(10, 3, 30, Some("KILNTAINERS_EXEC_ID=c")), // the command
            proc(11, 1, 31, Some("KILNTAINERS_EXEC_ID=jobsup-j-0000000a")), // a job started later
            proc(12, 11, 32, Some("KILNTAINERS_EXEC_ID=job-j-0000000a")), // its command
            proc(13, 1, 33, Some("KILNTAINERS_EXEC_ID=job-j-0000000a")), // its daemon
            proc(14, 1, 34, None),                          // a tag-dropping orphan
        ];
        let running = |job: &str| (job == "j-0000000a").then_some(11);
        let mut since = None;
        assert_eq!(
            targets(
                &procs,
                b"KILNTAINERS_EXEC_ID=c",
                &[],
                1,
                &mut since,
                &running
            ),
            vec![10, 14]
        );
        let mut since = None;
        assert_eq!(
            targets(
                &procs,
                b"KILNTAINERS_EXEC_ID=job-j-0000000a",
                &[],
                1,
                &mut since,
                &running
            ),
            vec![12, 13, 14]
        );
    }

    // See: issue 30 (item 10)
    #[test]
    fn issue_30_a_forged_job_tag_spares_no_orphan() {
        let procs = vec![
            proc(10, 3, 30, Some("KILNTAINERS_EXEC_ID=c")), // the command
            // Orphans that forged the tag of a job that does not exist, of one that ended (no
            // supervisor recorded), of one whose recorded supervisor is not the supervisor,
            // and a malformed job tag.
            proc(11, 1, 31, Some("KILNTAINERS_EXEC_ID=job-j-0000000b")),
            proc(12, 1, 32, Some("KILNTAINERS_EXEC_ID=jobsup-j-0000000c")),
            proc(13, 1, 33, Some("KILNTAINERS_EXEC_ID=job-j-0000000d")),
            proc(14, 1, 34, Some("KILNTAINERS_EXEC_ID=job-../../x")),
            proc(15, 1, 35, Some("KILNTAINERS_EXEC_ID=job")),
            // A real running job: its supervisor and its command's orphan are spared.
            proc(16, 1, 36, Some("KILNTAINERS_EXEC_ID=jobsup-j-0000000e")),
            proc(17, 1, 37, Some("KILNTAINERS_EXEC_ID=job-j-0000000e")),
        ];
        let supervisor_of = |job: &str| match job {
            "j-0000000d" => Some(10),
            "j-0000000e" => Some(16),
            _ => None,
        };
        let mut since = None;
        assert_eq!(
            targets(
                &procs,
                b"KILNTAINERS_EXEC_ID=c",
                &[],
                1,
                &mut since,
                &supervisor_of
            ),
            vec![10, 11, 12, 13, 14, 15]
        );
    }

    #[test]
    fn job_ids_are_checked_before_they_name_a_path() {
        assert!(is_job_id("j-0123abcd"));
        for bad in ["j-0123ABCD", "j-0123abc", "j-../../..", "x-0123abcd", ""] {
            assert!(!is_job_id(bad), "{bad}");
            assert_eq!(recorded_supervisor(bad), None);
        }
        assert_eq!(job_of(b"jobsup-j-0123abcd"), Some("j-0123abcd"));
        assert_eq!(job_of(b"job-j-0123abcd"), Some("j-0123abcd"));
        assert_eq!(job_of(b"job-j-0123abcd/"), None);
    }

    #[test]
    fn a_later_pass_remembers_when_the_command_started() {
        let mut since = Some(30);
        let procs = [
            proc(1, 0, 0, None),
            proc(13, 1, 33, None),
            proc(7, 1, 22, None),
        ];
        assert_eq!(targets(&procs, TAG, &[], 1, &mut since, &no_jobs), vec![13]);
    }

    #[test]
    fn a_forged_tag_orphan_is_chosen_after_the_whole_command_was_reaped() {
        // The helper seeds `since` with the command's recorded start: the shell and its
        // tagged children may all be gone before the first pass lists /proc.
        let mut since = Some(30);
        let procs = [
            proc(1, 0, 0, None),
            proc(15, 1, 41, Some("KILNTAINERS_EXEC_ID=x")),
        ];
        assert_eq!(
            targets(&procs, TAG, &[10], 1, &mut since, &no_jobs),
            vec![15]
        );
    }

    #[test]
    fn without_a_tagged_process_or_root_no_orphan_is_chosen() {
        let mut since = None;
        let procs = [proc(1, 0, 0, None), proc(13, 1, 33, None)];
        assert!(targets(&procs, TAG, &[], 1, &mut since, &no_jobs).is_empty());
    }

    #[test]
    fn a_root_that_dropped_its_tag_still_dates_the_command() {
        let mut since = None;
        let procs = [
            proc(1, 0, 0, None),
            proc(10, 0, 30, None),
            proc(13, 1, 33, None),
        ];
        assert_eq!(
            targets(&procs, TAG, &[10], 1, &mut since, &no_jobs),
            vec![10, 13]
        );
    }
    #[test]
    fn children_of_a_killed_process_still_exiting_are_chosen() {
        const TAG: &str = "KILNTAINERS_EXEC_ID=a";
        // 20 was killed by an earlier pass and is exiting: unlisted, its child not yet
        // reparented. 30 belongs to someone else.
        let procs = [proc(21, 20, 50, None), proc(30, 7, 50, None)];
        let mut since = Some(40);
        assert_eq!(
            targets(&procs, TAG.as_bytes(), &[20], 1, &mut since, &no_jobs),
            [21]
        );
        // A root that is gone is never returned itself.
        assert_eq!(
            targets(&[], TAG.as_bytes(), &[20], 1, &mut since, &no_jobs),
            Vec::<i32>::new()
        );
    }
}
