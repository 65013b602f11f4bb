//! The helper's behaviour through its wire protocol: commands started, streamed, fed, killed
//! and refused as Docker exec would, and nothing left running at the end.

use super::*;
use std::sync::atomic::AtomicU32;
use std::sync::{Once, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Guards every wait on the helper: a broken helper fails the test instead of hanging it.
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Taken by every client for its whole life: shared by most, exclusively by those that send a
/// `Kill`. The sweep's orphan rule ends every child of the keeper (this process) started since
/// the killed command, so another test's commands and background processes must not be there
/// to be taken for the command's leftovers, as no other exec's are in a computer whose
/// commands all started before the killed one.
static TURNS: RwLock<()> = RwLock::new(());

enum Turn {
    Shared(#[allow(dead_code)] RwLockReadGuard<'static, ()>),
    Alone(#[allow(dead_code)] RwLockWriteGuard<'static, ()>),
}

/// A server stand-in: runs `serve_on` in a thread over two pipes, this process standing in for
/// the computer's PID 1.
struct Client {
    requests: Option<io::PipeWriter>,
    events: Receiver<Event>,
    server: Option<thread::JoinHandle<i32>>,
    /// Released after the server's thread ended (fields drop after `Drop::drop`).
    _turn: Turn,
}

#[derive(Debug, Default)]
struct Outcome {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    code: i64,
}

impl Client {
    fn new() -> Self {
        let turn = TURNS.read().unwrap_or_else(PoisonError::into_inner);
        Self::start(Turn::Shared(turn))
    }

    /// A client for a test that sends `Kill`: no other test's client runs meanwhile.
    fn alone() -> Self {
        let turn = TURNS.write().unwrap_or_else(PoisonError::into_inner);
        Self::start(Turn::Alone(turn))
    }

    fn start(turn: Turn) -> Self {
        static SUBREAPER: Once = Once::new();
        SUBREAPER.call_once(crate::sys::become_child_subreaper);
        let keeper = i32::try_from(std::process::id()).unwrap();
        let (request_reader, request_writer) = io::pipe().unwrap();
        let (mut event_reader, event_writer) = io::pipe().unwrap();
        let server = thread::spawn(move || serve_on(request_reader, event_writer, keeper));
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
            _turn: turn,
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
    let mut client = Client::alone();
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
    let mut client = Client::alone();
    let outcome = client.run(Start {
        env: vec![tag.0.clone()],
        ..sh(1, "sleep 100 & echo hi")
    });
    assert_eq!(outcome.stdout, b"hi\n");
    assert_eq!(outcome.code, 0);
    // The background child may be in the middle of its exec of `sleep`, when its environment
    // reads as empty: look again until it shows (bounded), it must still be there.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut running = tagged_processes(&tag.0).len();
    while running != 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        running = tagged_processes(&tag.0).len();
    }
    assert_eq!(running, 1, "the background sleep runs on");
    client.send(Request::Kill {
        id: 2,
        tag: tag.0.clone(),
    });
    assert_eq!(client.next(), Event::Killed { id: 2 });
    tag.assert_gone();
    assert_eq!(client.finish(), 0);
}

/// Clock ticks since boot, the unit of a process's start time.
fn ticks_now() -> u64 {
    let uptime = std::fs::read_to_string("/proc/uptime").unwrap();
    let seconds: f64 = uptime.split_whitespace().next().unwrap().parse().unwrap();
    // USER_HZ is 100 on every Linux architecture we run on.
    (seconds * 100.0) as u64
}

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_ascii_whitespace().nth(1)?.parse().ok()
}

#[test]
fn kill_ends_the_orphans_the_command_left_and_only_those() {
    let tag = Tag::new();
    let mut client = Client::alone();
    let keeper = i32::try_from(std::process::id()).unwrap();
    // An orphan left by an earlier command: untagged, but older than the killed one.
    let earlier = client.run(sh(1, "(env -i /bin/sh -c 'echo $$; exec sleep 1000' &)"));
    let earlier: i32 = String::from_utf8(earlier.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let earlier_start = crate::sweep::start_time(earlier).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while ticks_now() <= earlier_start + 1 {
        assert!(Instant::now() < deadline, "the clock did not move on");
        thread::sleep(Duration::from_millis(5));
    }
    // The killed command's own: dropped the tag, left its session and lost its parent.
    client.send(Request::Start(Start {
        env: vec![tag.0.clone()],
        ..sh(
            2,
            "(setsid env -i /bin/sh -c 'echo $$; exec sleep 1000' &); exec sleep 1000",
        )
    }));
    let escaped: i32 = pid_of(client.next(), 2).parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while parent_of(escaped) != Some(keeper) {
        assert!(
            Instant::now() < deadline,
            "{escaped} was not reparented to the keeper"
        );
        thread::sleep(Duration::from_millis(5));
    }
    client.send(Request::Kill {
        id: 3,
        tag: tag.0.clone(),
    });
    let (mut killed, mut exited) = (false, false);
    while !(killed && exited) {
        match client.next() {
            Event::Killed { id: 3 } => killed = true,
            Event::Exited { id: 2, code } => {
                assert_eq!(code, 128 + 9);
                exited = true;
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    // SIGKILL completes asynchronously.
    let deadline = Instant::now() + Duration::from_secs(10);
    while kill::is_running(escaped) {
        assert!(Instant::now() < deadline, "the escaped orphan survived");
        thread::sleep(Duration::from_millis(5));
    }
    assert!(
        kill::is_running(earlier),
        "an earlier command's orphan was killed"
    );
    kill_process(earlier);
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
    // Looked for again (bounded): a process's environment reads as empty while it is in the
    // middle of an exec, as the background `sleep` may be at the first look.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut survivors = tagged_processes(&tag.0).len();
    while survivors != 1 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
        survivors = tagged_processes(&tag.0).len();
    }
    assert_eq!(
        survivors, 1,
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
