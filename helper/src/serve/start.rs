//! Starting a command the way Docker exec would: the program looked up on `PATH`, its own
//! process group, and Docker's own words when it cannot start.

use super::*;

/// Reports a command that could not start. These texts mimic Docker exec's (runc's messages as
/// the Engine API relays them, then exit code 126), so a command ends the same whether it ran
/// through the helper or through a plain Docker exec.
pub(super) fn refuse(shared: &Shared, id: u32, reason: &str) {
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
pub(super) fn exec_failed(shared: &Shared, id: u32, name: &str, error: &io::Error) {
    let text = format!("exec {name}: {}\n", os_text(error));
    end_with(shared, id, OutputStream::Stderr, &text, 1);
}

/// Ends a command that never ran: its only output, then its exit code.
pub(super) fn end_with(shared: &Shared, id: u32, stream: OutputStream, text: &str, code: i64) {
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
pub(super) fn os_text(error: &io::Error) -> String {
    let text = error.to_string();
    let text = match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => &text[..at],
        _ => text.as_str(),
    };
    text.to_lowercase()
}

/// What runc accepts as a program: anything but a directory with an execute bit.
pub(super) fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| !m.is_dir() && m.permissions().mode() & 0o111 != 0)
}

/// Whether the kernel itself can run the file: an ELF binary or a `#!` script. Anything else
/// fails with ENOEXEC under Docker, but std sometimes execs through glibc's `execvp`, which
/// would run it with /bin/sh instead; so it is refused here, before the spawn. (Formats added
/// through binfmt_misc are refused too; they are unheard of in containers.) A file that cannot
/// be read, or is not a regular file, is left to the exec to judge.
pub(super) fn kernel_format(path: &Path) -> bool {
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
pub(super) struct Located {
    /// What to execute (relative paths made relative to the working directory).
    pub(super) path: PathBuf,
    /// What runc calls it: the name given when it has a slash, else the PATH entry joined
    /// with it.
    pub(super) name: String,
}

/// Checks what runc checks before its exec, in its order (working directory, then program),
/// and finds the program as runc does, so each failure gets runc's words.
pub(super) fn locate(start: &Start) -> Result<Located, String> {
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

pub(super) fn start_command(shared: &Arc<Shared>, start: Start) -> Result<(), WireError> {
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
