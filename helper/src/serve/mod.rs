//! The helper's side of the [`wire`] protocol: it reads the server's requests, starts each
//! command the way Docker exec would (its own process group, piped stdio, Docker's own words
//! when it cannot start), streams the command's output back within the server's credit and
//! reports how it ended.
//!
//! Per command, one thread moves the output: it polls both pipes and, while the command has no
//! credit, leaves them unread, so a command whose output nobody consumes blocks on its own pipe
//! instead of filling the helper's memory. A second thread feeds stdin when the command has one.
//! The request loop itself never waits on a command, and every event goes through one writer,
//! a whole frame at a time, so frames from different commands never interleave.

use std::collections::HashMap;
use std::fmt::Display;
use std::fs::File;
use std::io::{self, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crate::sweep;
use crate::sys::{POLLHUP, POLLIN, POLLOUT, PollFd, kill_group, kill_process, poll_fds};
use crate::wire::{self, Event, OutputStream, Request, Start, WireError};

mod command;
mod kill;
mod start;
#[cfg(test)]
mod tests;

use command::{Cmd, CmdState, exit_code, feed, relay};
#[cfg(test)]
use kill::tagged_processes;
use kill::{kill_tagged, shutdown};
use start::start_command;

/// How long a command's output may keep flowing after the command itself has exited. Its
/// pipes stay open as long as any process it started in the background still holds them
/// (`server & echo started`), and waiting for those would make the command look hung. Docker
/// exec behaves alike: it reports the exit a second or two later and leaves the background
/// process running. Time spent waiting for the server's credit does not count.
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(1);
/// How often a thread blocked on a pipe or on credit looks up to notice an exit, a deadline or
/// shutdown. Output and credit wake it at once; only those checks wait for the tick.
const TICK: Duration = Duration::from_millis(50);
/// How often the wait for the server's next request looks up to notice that the server can no
/// longer be written to.
const INPUT_TICK: Duration = Duration::from_millis(100);
/// How long shutdown waits for the killed commands' threads to reap them before giving up.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// Largest stdin write once the pipe reports room: Linux then accepts it whole without
/// blocking, so a stdin thread never sticks in a write to a process that stopped reading.
const PIPE_BUF: usize = 4096;
/// Docker's prefix for an exec the runtime could not start.
const START_FAILED: &str =
    "OCI runtime exec failed: exec failed: unable to start container process";
/// What Docker appends to any start failure that mentions ENOTDIR.
const NOT_A_DIRECTORY_HINT: &str = ": Are you trying to mount a directory onto a file (or vice-versa)? Check if the specified host path exists and is the expected type";
const ENOEXEC: i32 = 8;
/// Upper bound of kill-sweep passes; a pass that finds nothing ends the sweep earlier.
const SWEEP_MAX_PASSES: usize = 8;
/// How long a pass waits for what it killed to exit before the next one looks again.
const SWEEP_PASS_WAIT: Duration = Duration::from_millis(200);

fn log(message: impl Display) {
    // Never panics: with stderr gone there is nobody left to tell.
    let _ = writeln!(io::stderr(), "kilntainers-helper: {message}");
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serves on the process's own stdin and stdout; the result is the process's exit code.
pub fn serve() -> i32 {
    // Private, unbuffered handles: frames must leave whole and at once, and the input must be
    // pollable (std's stdin may hold bytes in its own buffer where poll cannot see them). The
    // duplicates are close-on-exec, so no command inherits the server's stream.
    let input = io::stdin().as_fd().try_clone_to_owned();
    let output = io::stdout().as_fd().try_clone_to_owned();
    let (input, output) = match (input, output) {
        (Ok(input), Ok(output)) => (File::from(input), File::from(output)),
        (Err(e), _) | (_, Err(e)) => {
            log(format_args!("cannot use stdin/stdout: {e}"));
            return 1;
        }
    };
    let broken = Arc::new(AtomicBool::new(false));
    let input = ServerInput {
        file: input,
        broken: Arc::clone(&broken),
    };
    serve_with(input, Box::new(output), broken, COMPUTER_KEEPER)
}

/// [`serve`] over any pair of streams: requests come from `input`, events go to `output`.
/// Returns once `input` ends (0) or breaks the protocol (1), after killing what still runs.
/// `keeper` is the process the commands' orphans are reparented to ([`sweep::targets`]): a
/// `Kill` also ends the keeper's children started since the command. In a computer that is
/// PID 1; anywhere else it must be a child subreaper of our own, or the sweep would take the
/// host's freshly started daemons for the command's leftovers.
pub fn serve_on<R: Read, W: Write + Send + 'static>(input: R, output: W, keeper: i32) -> i32 {
    serve_with(
        input,
        Box::new(output),
        Arc::new(AtomicBool::new(false)),
        keeper,
    )
}

/// PID 1 of a Docker/Podman computer: our keep-alive, whose only child is its `sleep`, so any
/// other child it has is an orphan.
const COMPUTER_KEEPER: i32 = 1;

/// The server's stream as seen by the request loop: it reads as end of input once the server
/// can no longer be written to, so a server that vanished is handled like one that hung up.
struct ServerInput {
    file: File,
    broken: Arc<AtomicBool>,
}

impl Read for ServerInput {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.broken.load(Ordering::Relaxed) {
                return Ok(0);
            }
            let mut fds = [PollFd::new(self.file.as_raw_fd(), POLLIN)];
            match poll_fds(&mut fds, INPUT_TICK) {
                Ok(0) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Ready, or not pollable at all: a plain read decides.
                Ok(_) | Err(_) => return self.file.read(buf),
            }
        }
    }
}

/// All events go out through here, one whole frame per write under the lock.
struct Writer {
    out: Mutex<Box<dyn Write + Send>>,
    /// Set by the first failed write; nothing is written after it (the stream may hold half a
    /// frame) and the request loop stops.
    broken: Arc<AtomicBool>,
}

impl Writer {
    fn send(&self, event: &Event) {
        let mut frame = Vec::new();
        event.encode(&mut frame);
        let mut out = lock(&self.out);
        if self.is_broken() {
            return;
        }
        if let Err(e) = out.write_all(&frame).and_then(|()| out.flush()) {
            self.broken.store(true, Ordering::Relaxed);
            log(format_args!("cannot write to the server: {e}"));
        }
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }
}

struct Shared {
    writer: Writer,
    /// Commands whose `Exited` has not been sent yet, by id.
    commands: Mutex<HashMap<u32, Entry>>,
    /// Signalled whenever a command leaves `commands`; shutdown waits on it.
    left: Condvar,
    /// Where orphans go ([`serve_on`]).
    keeper: i32,
}

impl Shared {
    fn forget(&self, cmd: &Arc<Cmd>) {
        let mut commands = lock(&self.commands);
        if commands
            .get(&cmd.id)
            .is_some_and(|entry| Arc::ptr_eq(&entry.cmd, cmd))
        {
            commands.remove(&cmd.id);
        }
        drop(commands);
        self.left.notify_all();
    }
}

struct Entry {
    cmd: Arc<Cmd>,
    /// To the stdin thread; dropping it closes the command's stdin once the queue is written.
    stdin: Option<Sender<Vec<u8>>>,
}

fn serve_with(
    input: impl Read,
    output: Box<dyn Write + Send>,
    broken: Arc<AtomicBool>,
    keeper: i32,
) -> i32 {
    let shared = Arc::new(Shared {
        writer: Writer {
            out: Mutex::new(output),
            broken,
        },
        commands: Mutex::default(),
        left: Condvar::new(),
        keeper,
    });
    let mut input = BufReader::with_capacity(wire::CHUNK + 1024, input);
    let code = loop {
        if shared.writer.is_broken() {
            break 0;
        }
        let request = wire::read_payload(&mut input)
            .and_then(|payload| payload.map(|p| Request::decode(&p)).transpose());
        let request = match request {
            Ok(Some(request)) => request,
            Ok(None) => break 0,
            // The input was cut short because the server is gone: an ordinary end.
            Err(_) if shared.writer.is_broken() => break 0,
            Err(e) => {
                log(e);
                break 1;
            }
        };
        if let Err(e) = handle(&shared, request) {
            log(e);
            break 1;
        }
    };
    shutdown(&shared);
    code
}

fn handle(shared: &Arc<Shared>, request: Request) -> Result<(), WireError> {
    match request {
        // Answered whatever the version: the server decides what a mismatch means.
        Request::Hello { .. } => shared.writer.send(&Event::Hello {
            version: wire::PROTOCOL_VERSION,
            pid: std::process::id(),
        }),
        Request::Ping { id } => shared.writer.send(&Event::Pong { id }),
        Request::Start(start) => start_command(shared, start)?,
        // Unknown ids are expected below: the command may have just ended.
        Request::Stdin { id, data } => {
            if let Some(stdin) = lock(&shared.commands)
                .get(&id)
                .and_then(|e| e.stdin.as_ref())
            {
                // Fails only after the stdin thread gave up on a closed pipe: discarded.
                let _ = stdin.send(data);
            }
        }
        Request::CloseStdin { id } => {
            if let Some(entry) = lock(&shared.commands).get_mut(&id) {
                entry.stdin = None;
            }
        }
        Request::Credit { id, bytes } => {
            if let Some(entry) = lock(&shared.commands).get(&id) {
                entry.cmd.grant(bytes);
            }
        }
        Request::Kill { id, tag } => {
            // Off the request loop: reading a process's environ can stall on a process that is
            // stuck in the kernel.
            let worker = Arc::clone(shared);
            let worker_tag = tag.clone();
            let spawned = thread::Builder::new().name("kill".into()).spawn(move || {
                kill_tagged(&worker, &worker_tag);
                worker.writer.send(&Event::Killed { id });
            });
            if let Err(e) = spawned {
                log(format_args!("no thread for a kill ({e}); killing inline"));
                kill_tagged(shared, &tag);
                shared.writer.send(&Event::Killed { id });
            }
        }
    }
    Ok(())
}
