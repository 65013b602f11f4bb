//! Ending commands: a `Kill` by tag (the command's group, its descendants and the orphans it
//! left), and the shutdown that ends whatever still runs when the server goes away.

use super::*;

/// Kills every running command started with `tag` in its environment, then what the command
/// left behind: the processes [`sweep::targets`] picks (tagged, their descendants, untagged
/// orphans started since).
pub(super) fn kill_tagged(shared: &Shared, tag: &str) {
    let mut roots = Vec::new();
    let mut since: Option<u64> = None;
    for entry in lock(&shared.commands).values() {
        if entry.cmd.env.iter().any(|e| e == tag) {
            entry.cmd.kill_if_running();
            roots.push(entry.cmd.pgid);
            if let Some(started) = entry.cmd.started {
                since = Some(since.map_or(started, |s| s.min(started)));
            }
        }
    }
    // Anything but a `NAME=value` entry would match environments at random (every environ
    // "contains" the empty entry after its last NUL).
    let Some((name, _)) = tag.split_once('=').filter(|(name, _)| !name.is_empty()) else {
        return;
    };
    // Passes until one finds nothing left: a process forked while a pass was listing is caught
    // by the next, one with SIGKILL pending cannot fork any more, and what a pass killed stays a
    // root, so the children of a process still exiting (unreadable, not yet reparented) are
    // found as its descendants. Between passes, a short wait lets the killed ones exit, which
    // turns their children into orphans the next pass recognises.
    for pass in 0..SWEEP_MAX_PASSES {
        let procs = sweep::snapshot(name, std::process::id());
        let targets = sweep::targets(
            &procs,
            tag.as_bytes(),
            &roots,
            shared.keeper,
            &mut since,
            &sweep::recorded_supervisor,
        );
        if targets.is_empty() && pass >= 2 {
            break;
        }
        for &pid in &targets {
            kill_process(pid);
        }
        wait_until_exited(&targets, SWEEP_PASS_WAIT);
        roots.extend(targets);
    }
}

/// Waits, at most `limit`, until none of `pids` is still running (gone or a zombie).
pub(super) fn wait_until_exited(pids: &[i32], limit: Duration) {
    let deadline = Instant::now() + limit;
    while pids.iter().any(|&pid| is_running(pid)) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(2));
    }
}

/// Whether `pid` exists and is not a zombie.
pub(super) fn is_running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|end| stat[end + 1..].split_ascii_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// Processes (other than this one) whose environment has `tag` as an entry.
#[cfg(test)]
pub(super) fn tagged_processes(tag: &str) -> Vec<i32> {
    let name = tag.split_once('=').map_or("", |(name, _)| name);
    sweep::snapshot(name, std::process::id())
        .into_iter()
        .filter(|proc| proc.tag.as_deref() == Some(tag.as_bytes()))
        .map(|proc| proc.pid)
        .collect()
}

/// On end of input: kills the commands that still run (their background processes included,
/// being in their group) and waits, bounded, for their threads to reap them. Commands that
/// already exited keep what they left running in the background, as under Docker.
pub(super) fn shutdown(shared: &Shared) {
    for entry in lock(&shared.commands).values() {
        let mut state = lock(&entry.cmd.state);
        state.stop = true;
        if !state.exited && !is_zombie(entry.cmd.pgid) {
            kill_group(entry.cmd.pgid);
        }
        drop(state);
        entry.cmd.changed.notify_all();
    }
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    let mut commands = lock(&shared.commands);
    while !commands.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            log(format_args!(
                "{} command(s) did not end in time",
                commands.len()
            ));
            break;
        }
        commands = shared
            .left
            .wait_timeout(commands, left)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

/// Whether `pid` has exited without being reaped yet (its output thread has not looked): its
/// group is then only what it left running in the background.
pub(super) fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|at| stat[at + 1..].trim_start().chars().next())
            == Some('Z')
    })
}
