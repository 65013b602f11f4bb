//! One running command: its credit, and the threads that move its output (within that
//! credit) and feed its stdin.

use super::*;

/// One started command, shared by the request loop and the command's threads.
pub(super) struct Cmd {
    pub(super) id: u32,
    /// The child's pid, which is also its process group's id.
    pub(super) pgid: i32,
    /// When the child started (clock ticks since boot), read right after the spawn. It dates
    /// the command for the orphan rule of [`sweep::targets`] even when every process of the
    /// command is already reaped by the time a `Kill` lists /proc.
    pub(super) started: Option<u64>,
    /// The `NAME=value` entries it was started with, for `Kill`.
    pub(super) env: Vec<String>,
    pub(super) state: Mutex<CmdState>,
    /// Signalled on credit, end and shutdown.
    pub(super) changed: Condvar,
}

pub(super) struct CmdState {
    /// Output bytes the command may still send.
    pub(super) credit: u64,
    /// The child has been reaped: its pgid may name nothing, or someone else, from now on.
    pub(super) exited: bool,
    /// Its output thread is finished.
    pub(super) done: bool,
    /// The helper is shutting down.
    pub(super) stop: bool,
}

impl Cmd {
    /// The credit left, or `None` once the helper is shutting down.
    pub(super) fn credit(&self) -> Option<u64> {
        let state = lock(&self.state);
        (!state.stop).then_some(state.credit)
    }

    /// Waits up to one tick for credit (or shutdown).
    pub(super) fn await_credit(&self) {
        let state = lock(&self.state);
        if state.credit == 0 && !state.stop {
            let _ = self
                .changed
                .wait_timeout(state, TICK)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    pub(super) fn spend(&self, bytes: usize) {
        let mut state = lock(&self.state);
        state.credit = state.credit.saturating_sub(bytes as u64);
    }

    pub(super) fn grant(&self, bytes: u32) {
        let mut state = lock(&self.state);
        state.credit = state.credit.saturating_add(u64::from(bytes));
        drop(state);
        self.changed.notify_all();
    }

    pub(super) fn finished(&self) -> bool {
        let state = lock(&self.state);
        state.done || state.stop
    }

    /// Kills the command's process group unless the command was reaped. `exited` is set just
    /// after the reap rather than atomically with it; a kill in that instant reaches only what
    /// is left of the command's own group, as a pid is not reused within microseconds.
    pub(super) fn kill_if_running(&self) {
        let state = lock(&self.state);
        if !state.exited {
            kill_group(self.pgid);
        }
    }

    /// Records the exit status once the child has ended; `block` waits for that.
    pub(super) fn reap(&self, child: &mut Child, code: &mut Option<i64>, block: bool) {
        if code.is_some() {
            return;
        }
        let status = if block {
            child.wait().map(Some)
        } else {
            child.try_wait()
        };
        let reaped = match status {
            Ok(Some(status)) => exit_code(status),
            Ok(None) => return,
            Err(e) => {
                log(format_args!("cannot wait for command {}: {e}", self.id));
                -1
            }
        };
        *code = Some(reaped);
        lock(&self.state).exited = true;
    }
}

/// Like Docker: the exit status, or 128 + the signal that killed the command.
pub(super) fn exit_code(status: ExitStatus) -> i64 {
    match (status.code(), status.signal()) {
        (Some(code), _) => i64::from(code),
        (None, Some(signal)) => 128 + i64::from(signal),
        (None, None) => -1,
    }
}

/// The output thread: forwards the command's stdout and stderr within its credit until both
/// end (or [`DRAIN_AFTER_EXIT`] after the exit), then reports the exit.
pub(super) fn relay(shared: &Shared, cmd: &Arc<Cmd>, mut child: Child) {
    let mut pipes = [
        (
            OutputStream::Stdout,
            child.stdout.take().map(|p| File::from(OwnedFd::from(p))),
        ),
        (
            OutputStream::Stderr,
            child.stderr.take().map(|p| File::from(OwnedFd::from(p))),
        ),
    ];
    let mut code = None;
    let mut drain_left = DRAIN_AFTER_EXIT;
    while pipes.iter().any(|(_, pipe)| pipe.is_some()) {
        let Some(credit) = cmd.credit() else {
            break;
        };
        if credit == 0 {
            // The pipes stay unread: the command blocks once they are full. An exit, or a
            // pipe that ended with nothing left in it, is still noticed.
            cmd.await_credit();
            cmd.reap(&mut child, &mut code, false);
            forget_ended(&mut pipes);
            continue;
        }
        let draining = code.is_some();
        if draining && drain_left.is_zero() {
            break;
        }
        let began = Instant::now();
        let timeout = if draining { drain_left.min(TICK) } else { TICK };
        if !forward(shared, cmd, &mut pipes, credit, timeout) {
            break;
        }
        cmd.reap(&mut child, &mut code, false);
        if draining {
            drain_left = drain_left.saturating_sub(began.elapsed());
        }
    }
    // Closing our ends now: whatever still writes to them (a background process) gets EPIPE.
    drop(pipes);
    cmd.reap(&mut child, &mut code, true);
    let stopped = {
        let mut state = lock(&cmd.state);
        state.done = true;
        state.stop
    };
    cmd.changed.notify_all();
    // Forgotten before `Exited` goes out, so the server may reuse the id right after it.
    shared.forget(cmd);
    // At shutdown the server is gone or broke the protocol; nobody waits for the exit.
    if !stopped {
        shared.writer.send(&Event::Exited {
            id: cmd.id,
            code: code.unwrap_or(-1),
        });
    }
}

/// Waits up to `timeout` for output and forwards what is ready, at most `credit` bytes. False
/// if the pipes cannot be polled (never expected), which ends the relay.
pub(super) fn forward(
    shared: &Shared,
    cmd: &Cmd,
    pipes: &mut [(OutputStream, Option<File>); 2],
    mut credit: u64,
    timeout: Duration,
) -> bool {
    // poll skips entries with a negative fd: the pipes already closed.
    let mut fds = [PollFd::new(-1, POLLIN); 2];
    for (slot, (_, pipe)) in fds.iter_mut().zip(pipes.iter()) {
        if let Some(pipe) = pipe {
            slot.fd = pipe.as_raw_fd();
        }
    }
    match poll_fds(&mut fds, timeout) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::Interrupted => return true,
        Err(e) => {
            log(format_args!(
                "cannot poll the output of command {}: {e}",
                cmd.id
            ));
            return false;
        }
    }
    for (slot, (stream, pipe)) in fds.iter().zip(pipes.iter_mut()) {
        let Some(file) = pipe.as_mut() else {
            continue;
        };
        if slot.revents == 0 || credit == 0 {
            continue;
        }
        let mut data = vec![0; credit.min(wire::CHUNK as u64) as usize];
        match file.read(&mut data) {
            Ok(0) => *pipe = None,
            Ok(n) => {
                data.truncate(n);
                credit -= n as u64;
                cmd.spend(n);
                shared.writer.send(&Event::Output {
                    id: cmd.id,
                    stream: *stream,
                    data,
                });
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => *pipe = None,
        }
    }
    true
}

/// Closes the pipes that reached their end with nothing left to read, without reading (there is
/// no credit to read with).
pub(super) fn forget_ended(pipes: &mut [(OutputStream, Option<File>); 2]) {
    for (_, pipe) in pipes.iter_mut() {
        let Some(file) = pipe.as_ref() else {
            continue;
        };
        let mut fds = [PollFd::new(file.as_raw_fd(), POLLIN)];
        if poll_fds(&mut fds, Duration::ZERO).is_ok()
            && fds[0].revents & (POLLIN | POLLHUP) == POLLHUP
        {
            *pipe = None;
        }
    }
}

/// The stdin thread: writes the queued chunks in order, then closes the pipe when the queue
/// is closed (`CloseStdin`, or the command's end). Once the command stops reading (EPIPE) or
/// has ended, the rest is dropped.
pub(super) fn feed(cmd: &Cmd, pipe: ChildStdin, chunks: &Receiver<Vec<u8>>) {
    let mut pipe = File::from(OwnedFd::from(pipe));
    'chunks: while let Ok(chunk) = chunks.recv() {
        let mut rest = chunk.as_slice();
        while !rest.is_empty() {
            if cmd.finished() {
                break 'chunks;
            }
            // Write only when the pipe has room, and no more than fits, so that a process that
            // holds the pipe without reading cannot keep this thread past the command's end.
            let mut fds = [PollFd::new(pipe.as_raw_fd(), POLLOUT)];
            match poll_fds(&mut fds, TICK) {
                Ok(0) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(_) | Err(_) => {}
            }
            match pipe.write(&rest[..rest.len().min(PIPE_BUF)]) {
                Ok(0) => break 'chunks,
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break 'chunks,
            }
        }
    }
}
