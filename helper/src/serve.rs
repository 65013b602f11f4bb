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
    serve_with(input, Box::new(output), broken)
}

/// [`serve`] over any pair of streams: requests come from `input`, events go to `output`.
/// Returns once `input` ends (0) or breaks the protocol (1), after killing what still runs.
pub fn serve_on<R: Read, W: Write + Send + 'static>(input: R, output: W) -> i32 {
    serve_with(input, Box::new(output), Arc::new(AtomicBool::new(false)))
}

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

/// One started command, shared by the request loop and the command's threads.
struct Cmd {
    id: u32,
    /// The child's pid, which is also its process group's id.
    pgid: i32,
    /// When the child started (clock ticks since boot), read right after the spawn. It dates
    /// the command for the orphan rule of [`sweep::targets`] even when every process of the
    /// command is already reaped by the time a `Kill` lists /proc.
    started: Option<u64>,
    /// The `NAME=value` entries it was started with, for `Kill`.
    env: Vec<String>,
    state: Mutex<CmdState>,
    /// Signalled on credit, end and shutdown.
    changed: Condvar,
}

struct CmdState {
    /// Output bytes the command may still send.
    credit: u64,
    /// The child has been reaped: its pgid may name nothing, or someone else, from now on.
    exited: bool,
    /// Its output thread is finished.
    done: bool,
    /// The helper is shutting down.
    stop: bool,
}

impl Cmd {
    /// The credit left, or `None` once the helper is shutting down.
    fn credit(&self) -> Option<u64> {
        let state = lock(&self.state);
        (!state.stop).then_some(state.credit)
    }

    /// Waits up to one tick for credit (or shutdown).
    fn await_credit(&self) {
        let state = lock(&self.state);
        if state.credit == 0 && !state.stop {
            let _ = self
                .changed
                .wait_timeout(state, TICK)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn spend(&self, bytes: usize) {
        let mut state = lock(&self.state);
        state.credit = state.credit.saturating_sub(bytes as u64);
    }

    fn grant(&self, bytes: u32) {
        let mut state = lock(&self.state);
        state.credit = state.credit.saturating_add(u64::from(bytes));
        drop(state);
        self.changed.notify_all();
    }

    fn finished(&self) -> bool {
        let state = lock(&self.state);
        state.done || state.stop
    }

    /// Kills the command's process group unless the command was reaped. `exited` is set just
    /// after the reap rather than atomically with it; a kill in that instant reaches only what
    /// is left of the command's own group, as a pid is not reused within microseconds.
    fn kill_if_running(&self) {
        let state = lock(&self.state);
        if !state.exited {
            kill_group(self.pgid);
        }
    }

    /// Records the exit status once the child has ended; `block` waits for that.
    fn reap(&self, child: &mut Child, code: &mut Option<i64>, block: bool) {
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
fn exit_code(status: ExitStatus) -> i64 {
    match (status.code(), status.signal()) {
        (Some(code), _) => i64::from(code),
        (None, Some(signal)) => 128 + i64::from(signal),
        (None, None) => -1,
    }
}

fn serve_with(input: impl Read, output: Box<dyn Write + Send>, broken: Arc<AtomicBool>) -> i32 {
    let shared = Arc::new(Shared {
        writer: Writer {
            out: Mutex::new(output),
            broken,
        },
        commands: Mutex::default(),
        left: Condvar::new(),
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

/// Kills every running command started with `tag` in its environment, then what the command
/// left behind: the processes [`sweep::targets`] picks (tagged, their descendants, untagged
/// orphans started since).
fn kill_tagged(shared: &Shared, tag: &str) {
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
fn wait_until_exited(pids: &[i32], limit: Duration) {
    let deadline = Instant::now() + limit;
    while pids.iter().any(|&pid| is_running(pid)) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(2));
    }
}

/// Whether `pid` exists and is not a zombie.
fn is_running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|end| stat[end + 1..].split_ascii_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// Processes (other than this one) whose environment has `tag` as an entry.
#[cfg(test)]
fn tagged_processes(tag: &str) -> Vec<i32> {
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
fn shutdown(shared: &Shared) {
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
fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|at| stat[at + 1..].trim_start().chars().next())
            == Some('Z')
    })
}

/// Reports a command that could not start. These texts mimic Docker exec's (runc's messages as
/// the Engine API relays them, then exit code 126), so a command ends the same whether it ran
/// through the helper or through a plain Docker exec.
fn refuse(shared: &Shared, id: u32, reason: &str) {
    let mut text = format!("{START_FAILED}: {reason}: unknown");
    if text.to_lowercase().contains("not a directory") {
        text.push_str(NOT_A_DIRECTORY_HINT);
    }
    text.push_str("\r\n");
    end_with(shared, id, OutputStream::Stdout, &text, 126);
}

/// Reports a program that passed the checks but could not be executed (a script without `#!`, a
/// missing interpreter). Under Docker the runtime has already started the process by then, so
/// its exec error is the process's own output: one line on stderr, exit code 1.
fn exec_failed(shared: &Shared, id: u32, name: &str, error: &io::Error) {
    let text = format!("exec {name}: {}\n", os_text(error));
    end_with(shared, id, OutputStream::Stderr, &text, 1);
}

/// Ends a command that never ran: its only output, then its exit code.
fn end_with(shared: &Shared, id: u32, stream: OutputStream, text: &str, code: i64) {
    for chunk in text.as_bytes().chunks(wire::CHUNK) {
        shared.writer.send(&Event::Output {
            id,
            stream,
            data: chunk.to_vec(),
        });
    }
    shared.writer.send(&Event::Exited { id, code });
}

/// An OS error as Go prints it: lowercase, without Rust's "(os error N)".
fn os_text(error: &io::Error) -> String {
    let text = error.to_string();
    let text = match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => &text[..at],
        _ => text.as_str(),
    };
    text.to_lowercase()
}

/// What runc accepts as a program: anything but a directory with an execute bit.
fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| !m.is_dir() && m.permissions().mode() & 0o111 != 0)
}

/// Whether the kernel itself can run the file: an ELF binary or a `#!` script. Anything else
/// fails with ENOEXEC under Docker, but std sometimes execs through glibc's `execvp`, which
/// would run it with /bin/sh instead; so it is refused here, before the spawn. (Formats added
/// through binfmt_misc are refused too; they are unheard of in containers.) A file that cannot
/// be read, or is not a regular file, is left to the exec to judge.
fn kernel_format(path: &Path) -> bool {
    if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        return true;
    }
    let Ok(file) = File::open(path) else {
        return true;
    };
    let mut head = Vec::with_capacity(4);
    if file.take(4).read_to_end(&mut head).is_err() {
        return true;
    }
    head.starts_with(b"#!") || head.starts_with(b"\x7fELF")
}

/// A program found as runc finds it.
struct Located {
    /// What to execute (relative paths made relative to the working directory).
    path: PathBuf,
    /// What runc calls it: the name given when it has a slash, else the PATH entry joined
    /// with it.
    name: String,
}

/// Checks what runc checks before its exec, in its order (working directory, then program),
/// and finds the program as runc does, so each failure gets runc's words.
fn locate(start: &Start) -> Result<Located, String> {
    let cwd = start
        .working_dir
        .as_deref()
        .filter(|d| !d.is_empty())
        .map(Path::new);
    if let Some(dir) = cwd {
        // Stat of `dir/.` fails exactly when chdir would: missing, not a directory, or not
        // searchable.
        if let Err(e) = std::fs::metadata(dir.join(".")) {
            let shown = dir.display();
            return Err(format!(
                "chdir to cwd (\"{shown}\") set in config.json failed: {}",
                os_text(&e)
            ));
        }
    }
    let Some(program) = start.argv.first() else {
        return Err("exec: no command".into());
    };
    // Relative paths count from the command's working directory, where runc looks them up.
    let within = |path: &Path| match cwd {
        Some(dir) if path.is_relative() => dir.join(path),
        _ => path.to_path_buf(),
    };
    if program.contains('/') {
        let path = within(Path::new(program));
        return match std::fs::metadata(&path) {
            Err(e) => Err(format!(
                "exec: {program:?}: stat {program}: {}",
                os_text(&e)
            )),
            Ok(_) if !is_executable(&path) => Err(format!("exec: {program:?}: permission denied")),
            Ok(_) => Ok(Located {
                path,
                name: program.clone(),
            }),
        };
    }
    // The command's own PATH if it sets one, as runc searches the exec's environment.
    let search = start
        .env
        .iter()
        .rev()
        .find_map(|e| e.strip_prefix("PATH="))
        .map(Into::into)
        .or_else(|| std::env::var_os("PATH"))
        .unwrap_or_default();
    for dir in std::env::split_paths(&search) {
        let dir = if dir.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            dir
        };
        let found = dir.join(program);
        let candidate = within(&found);
        if is_executable(&candidate) {
            return Ok(Located {
                path: candidate,
                name: found.to_string_lossy().into_owned(),
            });
        }
    }
    Err(format!(
        "exec: {program:?}: executable file not found in $PATH"
    ))
}

fn start_command(shared: &Arc<Shared>, start: Start) -> Result<(), WireError> {
    let id = start.id;
    if lock(&shared.commands).contains_key(&id) {
        return Err(WireError(format!("command id {id} is already in use")));
    }
    let program = match locate(&start) {
        Ok(located) => located,
        Err(reason) => {
            refuse(shared, id, &reason);
            return Ok(());
        }
    };
    let argv0 = start.argv.first().map_or("", String::as_str);
    if !kernel_format(&program.path) {
        exec_failed(
            shared,
            id,
            &program.name,
            &io::Error::from_raw_os_error(ENOEXEC),
        );
        return Ok(());
    }

    // The output thread comes first and receives the child over a channel, so a failure to
    // create threads is reported before anything has been started.
    let (hand_over, taken) = mpsc::channel::<(Child, Arc<Cmd>)>();
    let worker = Arc::clone(shared);
    let spawned = thread::Builder::new()
        .name(format!("cmd-{id}"))
        .spawn(move || {
            if let Ok((child, cmd)) = taken.recv() {
                relay(&worker, &cmd, child);
            }
        });
    if let Err(e) = spawned {
        refuse(shared, id, &format!("exec: {argv0:?}: {}", os_text(&e)));
        return Ok(());
    }

    let mut command = Command::new(&program.path);
    command
        .arg0(argv0)
        .args(start.argv.iter().skip(1))
        .envs(
            start
                .env
                .iter()
                .filter_map(|e| e.split_once('='))
                .filter(|(name, _)| !name.is_empty()),
        )
        // Its own group, so a kill reaches everything it started (that stayed in the group).
        .process_group(0)
        .stdin(if start.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(dir) = start.working_dir.as_deref().filter(|d| !d.is_empty()) {
        command.current_dir(dir);
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        // Dropping `hand_over` ends the waiting thread.
        Err(e) if e.raw_os_error().is_some() => {
            exec_failed(shared, id, &program.name, &e);
            return Ok(());
        }
        Err(e) => {
            refuse(shared, id, &format!("exec: {argv0:?}: {}", os_text(&e)));
            return Ok(());
        }
    };

    let cmd = Arc::new(Cmd {
        id,
        pgid: i32::try_from(child.id()).unwrap_or(0),
        // Not reaped before the output thread gets it, so the pid is still the child's.
        started: i32::try_from(child.id()).ok().and_then(sweep::start_time),
        env: start.env,
        state: Mutex::new(CmdState {
            credit: u64::from(wire::WINDOW),
            exited: false,
            done: false,
            stop: false,
        }),
        changed: Condvar::new(),
    });
    let stdin = child.stdin.take().and_then(|pipe| {
        let (chunks_tx, chunks) = mpsc::channel();
        let feeder = Arc::clone(&cmd);
        let spawned = thread::Builder::new()
            .name(format!("stdin-{id}"))
            .spawn(move || feed(&feeder, pipe, &chunks));
        match spawned {
            Ok(_) => Some(chunks_tx),
            Err(e) => {
                // The pipe went with the closure: the command reads end of input.
                log(format_args!("no stdin thread for command {id}: {e}"));
                None
            }
        }
    });
    lock(&shared.commands).insert(
        id,
        Entry {
            cmd: Arc::clone(&cmd),
            stdin,
        },
    );
    if let Err(mpsc::SendError((mut child, cmd))) = hand_over.send((child, cmd)) {
        // Not expected: the thread does nothing before receiving. Leave nothing behind.
        log(format_args!("the output thread of command {id} is gone"));
        kill_group(cmd.pgid);
        let code = child.wait().map_or(-1, exit_code);
        lock(&cmd.state).exited = true;
        shared.forget(&cmd);
        shared.writer.send(&Event::Exited { id, code });
    }
    Ok(())
}

/// The output thread: forwards the command's stdout and stderr within its credit until both
/// end (or [`DRAIN_AFTER_EXIT`] after the exit), then reports the exit.
fn relay(shared: &Shared, cmd: &Arc<Cmd>, mut child: Child) {
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
fn forward(
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
fn forget_ended(pipes: &mut [(OutputStream, Option<File>); 2]) {
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
fn feed(cmd: &Cmd, pipe: ChildStdin, chunks: &Receiver<Vec<u8>>) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Guards every wait on the helper: a broken helper fails the test instead of hanging it.
    const EVENT_TIMEOUT: Duration = Duration::from_secs(30);

    /// A server stand-in: runs `serve_on` in a thread over two pipes.
    struct Client {
        requests: Option<io::PipeWriter>,
        events: Receiver<Event>,
        server: Option<thread::JoinHandle<i32>>,
    }

    #[derive(Debug, Default)]
    struct Outcome {
        stdout: Vec<u8>,
        stderr: Vec<u8>,
        code: i64,
    }

    impl Client {
        fn new() -> Self {
            let (request_reader, request_writer) = io::pipe().unwrap();
            let (mut event_reader, event_writer) = io::pipe().unwrap();
            let server = thread::spawn(move || serve_on(request_reader, event_writer));
            let (events_tx, events) = mpsc::channel();
            thread::spawn(move || {
                while let Ok(Some(payload)) = wire::read_payload(&mut event_reader) {
                    let event = Event::decode(&payload).expect("a well-formed event");
                    if events_tx.send(event).is_err() {
                        break;
                    }
                }
            });
            Client {
                requests: Some(request_writer),
                events,
                server: Some(server),
            }
        }

        fn send(&mut self, request: Request) {
            let mut frame = Vec::new();
            request.encode(&mut frame);
            self.send_raw(&frame);
        }

        fn send_raw(&mut self, bytes: &[u8]) {
            self.requests
                .as_mut()
                .expect("input still open")
                .write_all(bytes)
                .unwrap();
        }

        fn next(&self) -> Event {
            self.events
                .recv_timeout(EVENT_TIMEOUT)
                .expect("the helper sent no event in time")
        }

        /// Collects one command's output (returning credit as it goes) up to its exit.
        fn collect(&mut self, id: u32) -> Outcome {
            let mut outcome = Outcome::default();
            loop {
                match self.next() {
                    Event::Output {
                        id: got,
                        stream,
                        data,
                    } if got == id => {
                        assert!(data.len() <= wire::CHUNK);
                        self.send(Request::Credit {
                            id,
                            bytes: data.len() as u32,
                        });
                        match stream {
                            OutputStream::Stdout => outcome.stdout.extend(data),
                            OutputStream::Stderr => outcome.stderr.extend(data),
                        }
                    }
                    Event::Exited { id: got, code } if got == id => {
                        outcome.code = code;
                        return outcome;
                    }
                    other => panic!("unexpected event while running {id}: {other:?}"),
                }
            }
        }

        fn run(&mut self, start: Start) -> Outcome {
            let id = start.id;
            self.send(Request::Start(start));
            self.collect(id)
        }

        /// Closes the helper's input and returns its exit code.
        fn finish(mut self) -> i32 {
            self.requests = None;
            self.server.take().unwrap().join().unwrap()
        }
    }

    impl Drop for Client {
        /// End of input makes the helper kill whatever a failed test left running.
        fn drop(&mut self) {
            self.requests = None;
            if let Some(server) = self.server.take() {
                let _ = server.join();
            }
        }
    }

    fn command(id: u32, argv: &[&str]) -> Start {
        Start {
            id,
            argv: argv.iter().map(|a| (*a).to_owned()).collect(),
            working_dir: None,
            env: Vec::new(),
            stdin: false,
        }
    }

    fn sh(id: u32, script: &str) -> Start {
        command(id, &["/bin/sh", "-c", script])
    }

    fn unique() -> String {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        format!(
            "{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// A tag no other process carries; whatever still has it when the guard drops is killed.
    struct Tag(String);

    impl Tag {
        fn new() -> Self {
            Tag(format!("KILNTAINERS_EXEC_ID=helper-test-{}", unique()))
        }

        /// Waits for every tagged process to be gone. SIGKILL completes asynchronously, so this
        /// re-checks until a deadline; a process that was never killed fails it.
        fn assert_gone(&self) {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let left = tagged_processes(&self.0);
                if left.is_empty() {
                    return;
                }
                assert!(Instant::now() < deadline, "still running: {left:?}");
                thread::sleep(Duration::from_millis(10));
            }
        }
    }

    impl Drop for Tag {
        fn drop(&mut self) {
            for pid in tagged_processes(&self.0) {
                kill_process(pid);
            }
        }
    }

    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            let path = std::env::temp_dir().join(format!("kilntainers-helper-test-{}", unique()));
            std::fs::create_dir(&path).unwrap();
            TempDir(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn refused(reason: &str) -> Vec<u8> {
        format!("{START_FAILED}: {reason}\r\n").into_bytes()
    }

    #[test]
    fn answers_hello_and_ping_and_ignores_unknown_ids() {
        let mut client = Client::new();
        client.send(Request::Hello { version: 999 });
        assert_eq!(
            client.next(),
            Event::Hello {
                version: wire::PROTOCOL_VERSION,
                pid: std::process::id(),
            }
        );
        client.send(Request::Credit { id: 41, bytes: 10 });
        client.send(Request::Stdin {
            id: 41,
            data: b"x".to_vec(),
        });
        client.send(Request::CloseStdin { id: 41 });
        client.send(Request::Ping { id: 7 });
        assert_eq!(client.next(), Event::Pong { id: 7 });
        assert_eq!(client.finish(), 0);
    }

    #[test]
    fn runs_a_shell_command() {
        let mut client = Client::new();
        let outcome = client.run(sh(1, "echo hello; echo oops >&2"));
        assert_eq!(outcome.stdout, b"hello\n");
        assert_eq!(outcome.stderr, b"oops\n");
        assert_eq!(outcome.code, 0);
        assert_eq!(client.run(sh(2, "exit 3")).code, 3);
        assert_eq!(client.run(sh(3, "kill -9 $$")).code, 128 + 9);
        assert_eq!(client.finish(), 0);
    }

    #[test]
    fn passes_environment_and_working_directory() {
        let dir = TempDir::new();
        let mut client = Client::new();
        let outcome = client.run(Start {
            env: vec!["HELPER_TEST_VAR=a=b".into()],
            working_dir: Some(dir.0.to_string_lossy().into_owned()),
            ..sh(1, "echo \"$HELPER_TEST_VAR\"; pwd -P; echo \"$HOME\"")
        });
        let home = std::env::var("HOME").unwrap_or_default();
        let expected = format!("a=b\n{}\n{home}\n", dir.0.canonicalize().unwrap().display());
        assert_eq!(String::from_utf8_lossy(&outcome.stdout), expected);
        assert_eq!(outcome.code, 0);
    }

    #[test]
    fn stdin_round_trips_two_mebibytes() {
        let data: Vec<u8> = (0..2 * 1024 * 1024u32)
            .map(|i| (i % 251) as u8 ^ (i >> 12) as u8)
            .collect();
        let mut client = Client::new();
        client.send(Request::Start(Start {
            stdin: true,
            ..command(1, &["cat"])
        }));
        for chunk in data.chunks(wire::CHUNK) {
            client.send(Request::Stdin {
                id: 1,
                data: chunk.to_vec(),
            });
        }
        client.send(Request::CloseStdin { id: 1 });
        let outcome = client.collect(1);
        assert_eq!(outcome.code, 0);
        assert_eq!(outcome.stdout.len(), data.len());
        assert!(outcome.stdout == data, "stdin came back altered");
    }

    #[test]
    fn stdin_for_a_command_that_stopped_reading_is_dropped() {
        let mut client = Client::new();
        client.send(Request::Start(Start {
            stdin: true,
            ..command(1, &["head", "-c", "10"])
        }));
        for _ in 0..32 {
            client.send(Request::Stdin {
                id: 1,
                data: vec![b'z'; wire::CHUNK],
            });
        }
        client.send(Request::CloseStdin { id: 1 });
        let outcome = client.collect(1);
        assert_eq!(outcome.stdout, b"zzzzzzzzzz");
        assert_eq!(outcome.code, 0);
        client.send(Request::Ping { id: 2 });
        assert_eq!(client.next(), Event::Pong { id: 2 });
        assert_eq!(client.finish(), 0);
    }

    #[test]
    fn output_is_binary_safe() {
        let dir = TempDir::new();
        let file = dir.0.join("bytes");
        let bytes: Vec<u8> = (0..=255).collect();
        std::fs::write(&file, &bytes).unwrap();
        let mut client = Client::new();
        let outcome = client.run(Start {
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                "cat \"$1\"; cat \"$1\" >&2".into(),
                "sh".into(),
                file.to_string_lossy().into_owned(),
            ],
            ..command(1, &[])
        });
        assert_eq!(outcome.stdout, bytes);
        assert_eq!(outcome.stderr, bytes);
        assert_eq!(outcome.code, 0);
    }

    #[test]
    fn output_waits_for_credit() {
        const TOTAL: usize = 4 * 1024 * 1024;
        let window = wire::WINDOW as usize;
        let mut client = Client::new();
        client.send(Request::Start(command(
            1,
            &["head", "-c", &TOTAL.to_string(), "/dev/zero"],
        )));
        let mut received = 0;
        // `ping`: prove nothing beyond the credit follows. Not after the last byte, where the
        // command's exit may rightly come before the answer.
        let mut take_until = |client: &mut Client, limit: usize, ping: bool| {
            while received < limit {
                match client.next() {
                    Event::Output { id: 1, data, .. } => {
                        assert!(data.iter().all(|&b| b == 0));
                        received += data.len();
                        assert!(
                            received <= limit,
                            "{received} bytes sent on {limit} of credit"
                        );
                    }
                    other => panic!("unexpected event after {received} bytes: {other:?}"),
                }
            }
            if ping {
                // Output sent beyond the credit would arrive before this answer.
                client.send(Request::Ping { id: 99 });
                assert_eq!(client.next(), Event::Pong { id: 99 });
            }
        };
        take_until(&mut client, window, true);
        client.send(Request::Credit { id: 1, bytes: 1000 });
        take_until(&mut client, window + 1000, true);
        client.send(Request::Credit {
            id: 1,
            bytes: (TOTAL - window - 1000) as u32,
        });
        take_until(&mut client, TOTAL, false);
        // With the credit spent to the last byte, the end of the output still comes through.
        assert_eq!(client.next(), Event::Exited { id: 1, code: 0 });
        assert_eq!(client.finish(), 0);
    }

    #[test]
    fn kill_leaves_nothing_with_the_tag() {
        let tag = Tag::new();
        let mut client = Client::new();
        client.send(Request::Start(Start {
            env: vec![tag.0.clone()],
            ..sh(1, "sleep 1000 & sleep 1000 & echo started; wait")
        }));
        match client.next() {
            Event::Output { id: 1, data, .. } => assert_eq!(data, b"started\n"),
            other => panic!("unexpected event {other:?}"),
        }
        assert!(!tagged_processes(&tag.0).is_empty());
        client.send(Request::Kill {
            id: 2,
            tag: tag.0.clone(),
        });
        let (mut killed, mut exited) = (false, false);
        while !(killed && exited) {
            match client.next() {
                Event::Killed { id: 2 } => killed = true,
                Event::Exited { id: 1, code } => {
                    assert_eq!(code, 128 + 9);
                    exited = true;
                }
                other => panic!("unexpected event {other:?}"),
            }
        }
        tag.assert_gone();
        assert_eq!(client.finish(), 0);
    }

    #[test]
    fn runs_commands_concurrently() {
        let mut client = Client::new();
        for id in 0..20 {
            client.send(Request::Start(sh(id, &format!("echo {id}"))));
        }
        let mut outputs: HashMap<u32, Vec<u8>> = HashMap::new();
        let mut exited = Vec::new();
        while exited.len() < 20 {
            match client.next() {
                Event::Output { id, data, .. } => outputs.entry(id).or_default().extend(data),
                Event::Exited { id, code } => {
                    assert_eq!(code, 0, "command {id}");
                    exited.push(id);
                }
                other => panic!("unexpected event {other:?}"),
            }
        }
        exited.sort_unstable();
        assert_eq!(exited, (0..20).collect::<Vec<_>>());
        for id in 0..20 {
            assert_eq!(outputs.get(&id), Some(&format!("{id}\n").into_bytes()));
        }
        assert_eq!(client.finish(), 0);
    }

    #[test]
    fn start_failures_read_like_docker_exec() {
        let mut client = Client::new();
        let cases = [
            (
                command(1, &["nosuchcmd"]),
                "exec: \"nosuchcmd\": executable file not found in $PATH: unknown",
            ),
            (
                command(2, &["/nonexist/x"]),
                "exec: \"/nonexist/x\": stat /nonexist/x: no such file or directory: unknown",
            ),
            (
                command(3, &["/etc/passwd"]),
                "exec: \"/etc/passwd\": permission denied: unknown",
            ),
            (
                Start {
                    working_dir: Some("/nonexist".into()),
                    ..command(4, &["/bin/sh", "-c", "true"])
                },
                "chdir to cwd (\"/nonexist\") set in config.json failed: no such file or directory: unknown",
            ),
            (
                Start {
                    working_dir: Some("/etc/passwd".into()),
                    ..command(5, &["/bin/sh", "-c", "true"])
                },
                "chdir to cwd (\"/etc/passwd\") set in config.json failed: not a directory: unknown: Are you trying to mount a directory onto a file (or vice-versa)? Check if the specified host path exists and is the expected type",
            ),
            (
                Start {
                    env: vec!["PATH=/nonexist".into()],
                    ..command(6, &["sh", "-c", "true"])
                },
                "exec: \"sh\": executable file not found in $PATH: unknown",
            ),
        ];
        for (start, reason) in cases {
            let outcome = client.run(start);
            assert_eq!(
                String::from_utf8_lossy(&outcome.stdout),
                String::from_utf8_lossy(&refused(reason))
            );
            assert!(outcome.stderr.is_empty());
            assert_eq!(outcome.code, 126);
        }
        // Executable but not executable by the kernel: Docker's runtime fails after the start.
        let dir = TempDir::new();
        let script = dir.0.join("script");
        std::fs::write(&script, "echo hi\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let lost = dir.0.join("lost");
        std::fs::write(&lost, "#!/nonexist/interpreter\n").unwrap();
        std::fs::set_permissions(&lost, std::fs::Permissions::from_mode(0o755)).unwrap();
        let cases = [
            (
                Start {
                    env: vec![format!("PATH=/nonexist:{}", dir.0.display())],
                    ..command(8, &["script"])
                },
                format!("exec {}: exec format error\n", script.display()),
            ),
            (
                // In a working directory std spawns differently; the verdict must not change.
                Start {
                    working_dir: Some(dir.0.to_string_lossy().into_owned()),
                    ..command(9, &["./script"])
                },
                "exec ./script: exec format error\n".to_owned(),
            ),
            (
                command(10, &[&lost.to_string_lossy()]),
                format!("exec {}: no such file or directory\n", lost.display()),
            ),
        ];
        for (start, message) in cases {
            let outcome = client.run(start);
            assert_eq!(String::from_utf8_lossy(&outcome.stderr), message);
            assert!(outcome.stdout.is_empty());
            assert_eq!(outcome.code, 1);
        }
        // The command's own PATH is the one searched.
        let found = client.run(Start {
            env: vec!["PATH=/nonexist:/bin:/usr/bin".into()],
            ..command(7, &["sh", "-c", "exit 4"])
        });
        assert_eq!(found.code, 4);
        assert_eq!(client.finish(), 0);
    }

    #[test]
    fn background_process_holding_the_output_is_not_waited_for() {
        let tag = Tag::new();
        let mut client = Client::new();
        let outcome = client.run(Start {
            env: vec![tag.0.clone()],
            ..sh(1, "sleep 100 & echo hi")
        });
        assert_eq!(outcome.stdout, b"hi\n");
        assert_eq!(outcome.code, 0);
        assert_eq!(
            tagged_processes(&tag.0).len(),
            1,
            "the background sleep runs on"
        );
        client.send(Request::Kill {
            id: 2,
            tag: tag.0.clone(),
        });
        assert_eq!(client.next(), Event::Killed { id: 2 });
        tag.assert_gone();
        assert_eq!(client.finish(), 0);
    }

    fn pid_of(event: Event, id: u32) -> String {
        match event {
            Event::Output { id: got, data, .. } if got == id => {
                String::from_utf8(data).unwrap().trim().to_owned()
            }
            other => panic!("expected the pid of {id}, got {other:?}"),
        }
    }

    #[test]
    fn end_of_input_kills_running_commands_only() {
        let tag = Tag::new();
        let mut client = Client::new();
        client.send(Request::Start(sh(1, "echo $$; exec sleep 1000")));
        let running = PathBuf::from(format!("/proc/{}", pid_of(client.next(), 1)));
        assert!(running.exists());
        // Exited, but still within its drain (its background sleep holds the output) when the
        // input ends.
        client.send(Request::Start(Start {
            env: vec![tag.0.clone()],
            ..sh(2, "sleep 100 & echo $$")
        }));
        let exited = pid_of(client.next(), 2);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(format!("/proc/{exited}/stat"))
            .map_or(true, |stat| stat.contains(") Z"))
        {
            assert!(Instant::now() < deadline, "command 2 did not exit");
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(client.finish(), 0);
        assert!(
            !running.exists(),
            "{} survived the end of input",
            running.display()
        );
        assert_eq!(
            tagged_processes(&tag.0).len(),
            1,
            "an exited command's background process survives"
        );
    }

    #[test]
    fn a_malformed_frame_ends_the_session() {
        let mut client = Client::new();
        client.send(Request::Start(sh(1, "echo $$; exec sleep 1000")));
        let pid = match client.next() {
            Event::Output { id: 1, data, .. } => String::from_utf8(data).unwrap(),
            other => panic!("unexpected event {other:?}"),
        };
        client.send_raw(&[0, 0, 0, 1, 250]);
        assert_eq!(client.finish(), 1);
        assert!(!Path::new(&format!("/proc/{}", pid.trim())).exists());
    }
}
