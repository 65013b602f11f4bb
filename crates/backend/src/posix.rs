//! The POSIX-shell pieces every backend that runs a real shell in the computer shares: the
//! keep-alive PID 1, the readiness probe and the kill sweep (docs/decisions.md, "Killing a
//! command"). Each is plain POSIX `sh`, so BusyBox images work too.

use std::time::Duration;

use crate::ids::ExecId;

/// How long a kill sweep may run before it is given up; it walks /proc three times, which
/// takes well under a second even with thousands of processes.
pub const KILL_SWEEP_TIMEOUT: Duration = Duration::from_secs(10);

/// The shell's own name (`/bin/bash` → `bash`), as tool descriptions print it.
pub fn shell_basename(shell: &str) -> &str {
    shell.rsplit('/').next().unwrap_or(shell)
}

/// POSIX single-quoting: safe for any string a shell may see.
pub fn quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// Which processes the kill sweep ends besides those carrying the exec tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepReach {
    /// Processes whose environment carries the tag (docs/decisions.md, "Killing a command") and their
    /// descendants. For providers whose PID 1 is not ours, where an orphan of the command
    /// cannot be told from the provider's own processes.
    Tagged,
    /// Also orphans (parent PID 1) started no earlier than the command, unless their tag is
    /// one an older process carries: what a command leaves behind after dropping or forging
    /// the tag (`setsid env -i …`). Only where PID 1 is our keep-alive (Docker/Podman).
    TaggedAndOrphans,
}

/// The kill sweep of docs/decisions.md, "Killing a command", widened as docs/reliability.md ("Kill tree") says:
/// four passes over /proc, 0.1 s apart, each killing the processes whose environment carries
/// the exec tag, their descendants, and with [`SweepReach::TaggedAndOrphans`] the orphans
/// started no earlier than the oldest tagged process whose tag no older process carries. The
/// kill list accumulates across passes, so the children of a process killed earlier but still
/// exiting (not yet reparented) are its descendants; a later pass catches what an earlier kill
/// orphaned. Orphans tagged as a running job's are never taken for a command's leftovers: jobs
/// are meant to outlive calls (docs/jobs.md, "Inside the computer"). Only a job that runs
/// counts — its directory has no `exit` and its recorded supervisor carries the job's
/// supervisor tag — so a forged `job…` tag on an orphan of the command does not spare it (the
/// helper's sweep applies the same test). Plain POSIX sh (BusyBox included).
pub fn kill_sweep_script(exec_id: &ExecId, reach: SweepReach) -> String {
    let orphans = match reach {
        SweepReach::Tagged => "0",
        SweepReach::TaggedAndOrphans => "1",
    };
    format!(
        r#"t='{tag}'; orphans={orphans}; since=''; kill=' '
job_runs() {{
  case "$1" in j-[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]) ;; *) return 1 ;; esac
  for b in /.kilntainers/jobs /tmp/.kilntainers/jobs; do
    [ -d "$b/$1" ] && [ ! -f "$b/$1/exit" ] || continue
    {{ read -r sp < "$b/$1/pid"; }} 2>/dev/null || continue
    case "$sp" in ''|*[!0-9]*) continue ;; esac
    [ "$(tr '\0' '\n' 2>/dev/null < "/proc/$sp/environ" | grep -m1 '^{name}=')" = "{name}={job}sup-$1" ] && return 0
  done
  return 1
}}
for n in 1 2 3 4; do
  [ "$n" = 1 ] || sleep 0.1 2>/dev/null
  snap=''
  for d in /proc/[0-9]*; do
    p=${{d#/proc/}}
    [ "$p" = "$$" ] && continue
    {{ read -r s < "$d/stat"; }} 2>/dev/null || continue
    s=${{s##*) }}
    set -- $s
    e=$(tr '\0' '\n' 2>/dev/null < "$d/environ" | grep -m1 '^{name}=')
    if [ "$e" = "$t" ]; then
      kill="$kill$p "
      if [ -z "$since" ] || [ "${{20}}" -lt "$since" ]; then since=${{20}}; fi
    fi
    snap="$snap$p $2 ${{20}} $e
"
  done
  if [ "$orphans" = 1 ] && [ -n "$since" ]; then
    older=' '
    while read -r p pp st e; do
      if [ -n "$e" ] && [ "$st" -lt "$since" ]; then older="$older$e "; fi
    done <<SNAP
$snap
SNAP
    while read -r p pp st e; do
      [ -n "$p" ] && [ "$pp" = 1 ] && [ "$st" -ge "$since" ] || continue
      case "$older" in *" $e "*) [ -n "$e" ] && continue ;; esac
      case "$e" in {name}={job}sup-*) job_runs "${{e#{name}={job}sup-}}" && continue ;; {name}={job}-*) job_runs "${{e#{name}={job}-}}" && continue ;; esac
      kill="$kill$p "
    done <<SNAP
$snap
SNAP
  fi
  grew=1
  while [ "$grew" = 1 ]; do
    grew=0
    while read -r p pp st e; do
      [ -n "$p" ] || continue
      case "$kill" in *" $p "*) continue ;; esac
      case "$kill" in *" $pp "*) kill="$kill$p "; grew=1 ;; esac
    done <<SNAP
$snap
SNAP
  done
  for p in $kill; do kill -9 "$p" 2>/dev/null; done
done
true
"#,
        tag = exec_id.env_entry(),
        name = ExecId::ENV_NAME,
        job = ExecId::JOB_PREFIX,
    )
}

/// The keep-alive PID 1 of docs/decisions.md, "Keep-alive process": exits at once on SIGTERM, needs only the shell
/// and `sleep`.
pub fn keep_alive_argv(shell: &str) -> Vec<String> {
    vec![
        shell.to_owned(),
        "-c".to_owned(),
        "trap 'exit 0' TERM INT HUP; while :; do sleep 3600 & wait $!; done".to_owned(),
    ]
}

/// `<shell> -c <kill sweep>`: the argv that runs [`kill_sweep_script`].
pub fn kill_sweep_argv(shell: &str, exec_id: &ExecId, reach: SweepReach) -> Vec<String> {
    vec![
        shell.to_owned(),
        "-c".to_owned(),
        kill_sweep_script(exec_id, reach),
    ]
}

/// Readiness: the shell must echo this marker (docs/decisions.md, "Execution model").
pub const READY_MARKER: &str = "kilntainers-ready";

/// `<shell> -c 'echo <marker>'`: proves the shell starts and runs a command.
pub fn readiness_argv(shell: &str) -> Vec<String> {
    vec![
        shell.to_owned(),
        "-c".to_owned(),
        format!("echo {READY_MARKER}"),
    ]
}

/// Whether a readiness probe's stdout shows the marker.
pub fn shows_ready(stdout: &[u8]) -> bool {
    String::from_utf8_lossy(stdout).contains(READY_MARKER)
}
