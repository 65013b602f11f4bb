//! Shared helpers: start the built binary as an MCP server over stdio with the rmcp client,
//! call `terminal_execute`, run a command straight through a backend (`run`), and remove any
//! container a test made even when it fails. The submodules start the providers' local fakes
//! (and the WASM module cache) and build backends pointed at them, for the provider suites and
//! the backend contract suite alike.

#[cfg(feature = "e2b")]
pub mod e2b;
#[cfg(feature = "fly")]
pub mod fly;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
#[cfg(feature = "modal")]
pub mod modal;
#[cfg(feature = "wasm")]
pub mod wasm;

use std::process::Stdio;

use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::RunningService;
use rmcp::transport::TokioChildProcess;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{Map, Value};
use tokio::process::Command;

use tokio_util::sync::CancellationToken;

use mcp_sandbox_computer_vm_for_ai::backends::{
    Backend, CreateSpec, ExecEnd, ExecSpec, OutputSink, SandboxRef, SinkControl, Stream,
};
use mcp_sandbox_computer_vm_for_ai::exec::ExecOutcome;
use mcp_sandbox_computer_vm_for_ai::ids::{ComputerId, ExecId, InstanceId};

pub const BIN: &str = env!("CARGO_BIN_EXE_mcp-sandbox-computer-vm-for-ai");

/// Whether the test environment set up this integration target (`scripts/setup-test-env.sh`
/// writes these variables into `.test-env/env`). A plain `cargo test` reports an absent one and
/// passes; the full run (`KILNTAINERS_REQUIRE_ALL=1`, set by scripts/test.sh) fails instead, so
/// a broken environment can never look like a green suite.
pub fn enabled(variable: &str) -> bool {
    let on = std::env::var(variable).is_ok_and(|v| v == "1");
    if !on {
        assert!(
            !std::env::var("KILNTAINERS_REQUIRE_ALL").is_ok_and(|v| v == "1"),
            "{variable} is not 1 but the full run needs every integration environment: \
             scripts/setup-test-env.sh could not prepare it (see its output above)"
        );
        eprintln!("SKIP: {variable} is not 1; run the suite through scripts/test.sh");
    }
    on
}

pub type Client = RunningService<RoleClient, ()>;

/// Starts the server with `args` and a private HOME (so instance locks do not mix).
pub async fn start(args: &[&str], home: &std::path::Path) -> Client {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env("HOME", home)
        .stderr(Stdio::inherit());
    let transport = TokioChildProcess::new(command).expect("spawn server");
    ().serve(transport).await.expect("initialize")
}

pub async fn execute(client: &Client, arguments: Value) -> CallToolResult {
    let arguments: Map<String, Value> = arguments.as_object().cloned().unwrap_or_default();
    client
        .call_tool(CallToolRequestParams::new("terminal_execute").with_arguments(arguments))
        .await
        .expect("tools/call")
}

/// The structured content of a successful call.
pub fn structured(result: &CallToolResult) -> Map<String, Value> {
    assert_eq!(result.is_error, Some(false), "tool error: {result:?}");
    result
        .structured_content
        .as_ref()
        .and_then(Value::as_object)
        .cloned()
        .expect("structuredContent")
}

/// A unique computer id for this test run.
pub fn unique_id(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand_u32())
}

/// A unique, valid computer id for this test run.
pub fn computer(prefix: &str) -> ComputerId {
    ComputerId::parse(&unique_id(prefix)).expect("computer id")
}

/// What `create` needs for one computer of `instance`.
pub fn create_spec(id: &ComputerId, temporary: bool, instance: &InstanceId) -> CreateSpec {
    CreateSpec {
        computer_id: id.clone(),
        temporary,
        image: None,
        instance: instance.clone(),
        owner: None,
        egress: None,
    }
}

/// An [`OutputSink`] that keeps everything.
#[derive(Default)]
pub struct Collect {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl OutputSink for Collect {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        match stream {
            Stream::Stdout => self.stdout.extend_from_slice(bytes),
            Stream::Stderr => self.stderr.extend_from_slice(bytes),
        }
        SinkControl::Continue
    }
}

/// One `/bin/sh -c <command>` straight through the backend, without `exec::run`'s policy (no
/// timeout, no output limit): `(exit code, stdout, stderr)`; panics unless the command ran to
/// its end.
pub async fn run(
    backend: &dyn Backend,
    sandbox: &SandboxRef,
    command: &str,
) -> (i64, String, String) {
    let spec = ExecSpec {
        argv: vec!["/bin/sh".into(), "-c".into(), command.into()],
        stdin: None,
        working_dir: None,
        exec_id: ExecId::random(),
        command: None,
    };
    let mut sink = Collect::default();
    let end = backend
        .exec(sandbox, &spec, &mut sink, &CancellationToken::new())
        .await
        .unwrap();
    let ExecEnd::Exited(code) = end else {
        panic!("stopped by sink");
    };
    (
        code,
        String::from_utf8(sink.stdout).unwrap(),
        String::from_utf8(sink.stderr).unwrap(),
    )
}

fn rand_u32() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    nanos ^ std::process::id().rotate_left(16)
}

/// Force-removes the named containers on drop, through the given engine socket, so a failed
/// assertion does not leak them.
pub struct ContainerGuard {
    pub names: Vec<String>,
    pub docker_host: Option<String>,
}

impl Drop for ContainerGuard {
    fn drop(&mut self) {
        for name in &self.names {
            let mut command = std::process::Command::new("docker");
            if let Some(host) = &self.docker_host {
                command.env("DOCKER_HOST", host);
            }
            let _ = command
                .args(["rm", "-f", name])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The Podman API socket of the test setup.
pub fn podman_socket() -> String {
    std::env::var("KILNTAINERS_PODMAN_SOCKET")
        .unwrap_or_else(|_| "unix:///run/podman/podman.sock".into())
}

/// Server flags for the Podman engine at `socket` with the test BusyBox image.
pub fn podman_args(socket: &str) -> Vec<&str> {
    vec![
        "--engine",
        "podman",
        "--docker-host",
        socket,
        "--image",
        "localhost/sandbox-busybox:full",
        "--shell",
        "/bin/sh",
    ]
}

/// A temporary directory removed on drop.
pub struct TempHome(pub std::path::PathBuf);

impl TempHome {
    pub fn new(label: &str) -> Self {
        let path = std::env::temp_dir().join(format!("kilntainers-it-{label}-{:08x}", rand_u32()));
        std::fs::create_dir_all(&path).expect("temp home");
        Self(path)
    }
}

impl Drop for TempHome {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port that was free a moment ago (the kernel picks it; the race is harmless in tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("free port")
}

/// Whether the Docker container `name` exists (running or not).
pub fn container_exists(name: &str) -> bool {
    std::process::Command::new("docker")
        .args(["inspect", "--format", "{{.Id}}", name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Polls `check` every 200 ms until it holds or `limit` passes; returns whether it held.
pub async fn eventually(limit: std::time::Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if check() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// The real binary serving `--transport http` on a free loopback port with a private HOME;
/// stderr goes to `<home>/server.log`. Dropping it sends SIGTERM (so the server removes its
/// temporary computers) and kills it if it has not exited within the shutdown bound.
pub struct HttpServer {
    pub child: std::process::Child,
    pub port: u16,
    pub home: TempHome,
}

/// How long a server gets to drain before a test gives up on it (the spec bound is 20 s).
const DRAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(25);

impl HttpServer {
    /// Starts the server with `args` (after `--transport http --port <free>`); does not wait.
    pub fn spawn(label: &str, args: &[&str]) -> Self {
        Self::spawn_on(label, free_port(), args)
    }

    pub fn spawn_on(label: &str, port: u16, args: &[&str]) -> Self {
        let home = TempHome::new(label);
        let log = std::fs::File::create(home.0.join("server.log")).expect("log file");
        let port_text = port.to_string();
        let child = std::process::Command::new(BIN)
            .args(["--transport", "http", "--port", &port_text])
            .args(args)
            .env("HOME", &home.0)
            .env_remove("KILNTAINERS_AUTH_TOKEN")
            .env_remove("KILNTAINERS_ALLOWED_HOSTS")
            .env_remove("ENABLE_LIFECYCLE_TOOLS")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn server");
        Self { child, port, home }
    }

    /// Starts the server and waits until `/healthz` answers on `host` (at most 15 s).
    pub async fn start(label: &str, args: &[&str]) -> Self {
        let mut server = Self::spawn(label, args);
        server.wait_ready("127.0.0.1").await;
        server
    }

    pub async fn wait_ready(&mut self, host: &str) {
        let url = format!("http://{host}:{}/healthz", self.port);
        let client = reqwest::Client::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        loop {
            if let Ok(response) = client.get(&url).send().await
                && response.status() == 200
            {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("server exited with {status}; log:\n{}", self.log());
            }
            assert!(
                std::time::Instant::now() < deadline,
                "server not ready; log:\n{}",
                self.log()
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// The access token the server generated because none was configured (`None` if it did
    /// not: a token was given, or `--allow-unauthenticated-http`).
    pub fn generated_token(&self) -> Option<String> {
        let path = self
            .home
            .0
            .join(".mcp-sandbox-computer-vm-for-ai")
            .join(format!("http-token-{}", self.port));
        std::fs::read_to_string(path).ok()
    }

    /// The generated token; panics when there is none.
    pub fn token(&self) -> String {
        self.generated_token()
            .unwrap_or_else(|| panic!("no generated token; log:\n{}", self.log()))
    }

    /// `http://127.0.0.1:<port><path>`
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.home.0.join("server.log")).unwrap_or_default()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
    }

    /// Waits for the process to exit (polling, at most `limit`).
    pub async fn wait_exit(
        &mut self,
        limit: std::time::Duration,
    ) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        self.terminate();
        let deadline = std::time::Instant::now() + DRAIN_WAIT;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A finished command's exit code, stdout and stderr; panics on any other outcome.
pub fn completed(outcome: ExecOutcome) -> (i64, String, String) {
    let ExecOutcome::Completed {
        stdout,
        stderr,
        exit_code,
        ..
    } = outcome
    else {
        panic!("not completed: {outcome:?}");
    };
    (
        exit_code,
        String::from_utf8(stdout).unwrap(),
        String::from_utf8(stderr).unwrap(),
    )
}

/// A stdlib-Python fake of a provider API (`fakes/<name>.py`) as a child process that writes
/// where it listens into a file. Dropping it closes its stdin, which makes it remove its
/// containers and exit; a fake that does not exit within 30 s is killed.
pub struct PythonFake {
    child: std::process::Child,
    /// A private directory for the port file and whatever state the test gives the fake.
    pub dir: std::path::PathBuf,
}

impl PythonFake {
    /// Starts `python -m fakes.<name> --port-file <file> <args>` from the repository root;
    /// returns it and the file's text.
    pub fn start(name: &str, args: &[&str]) -> (Self, String) {
        let dir = std::env::temp_dir().join(format!("fake-{name}-{}", unique_id("t")));
        std::fs::create_dir_all(&dir).unwrap();
        let port_file = dir.join("ports");
        let python = std::env::var("KILNTAINERS_TEST_VENV")
            .map(|venv| format!("{venv}/bin/python"))
            .unwrap_or_else(|_| "python3".to_owned());
        let child = std::process::Command::new(python)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .arg("-m")
            .arg(format!("fakes.{name}"))
            .arg("--port-file")
            .arg(&port_file)
            .args(args)
            .stdin(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start fakes/{name}.py: {e}"));
        let fake = PythonFake { child, dir };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let ports = loop {
            if let Ok(text) = std::fs::read_to_string(&port_file) {
                break text;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "fakes/{name}.py did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        (fake, ports)
    }
}

impl Drop for PythonFake {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                let _ = std::fs::remove_dir_all(&self.dir);
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
