//! Contract tests of the E2B backend against a local fake of E2B's published control-plane
//! API and envd process service (`tests/blackbox/fake_e2b.py`, run as a child process). They
//! pin our request building, Connect framing, proto3-JSON decoding, retries and lifecycle
//! logic against our reading of E2B's definitions; they cannot show that the real service
//! behaves that way (`testing.md` §7), hence the names.
//!
//! The fake backs sandboxes with local Docker containers, so tests that create sandboxes need
//! the test environment's engine and `sandbox-busybox:full` (`KILNTAINERS_IT_DOCKER=1`); the
//! key and retry tests need only Python.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use mcp_sandbox_computer_vm_for_ai::backends::{
    self, Backend, CreateSpec, ExecEnd, ExecSpec, NoProgress, OutputSink, SandboxRef, SinkControl,
    Stream,
};
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;
use mcp_sandbox_computer_vm_for_ai::exec::{self, ExecOutcome, ExecRequest, Program};
use mcp_sandbox_computer_vm_for_ai::ids::{ComputerId, ExecId, InstanceId};

use crate::common::{enabled, unique_id};

const KEY: &str = "e2b_test_key";

/// The fake as a child process; closing its stdin makes it remove its containers and exit.
struct Fake {
    child: Child,
    api: String,
    envd: String,
    dir: PathBuf,
    http: reqwest::Client,
}

impl Fake {
    fn start(args: &[&str]) -> Fake {
        let dir = std::env::temp_dir().join(format!("fake-e2b-{}", unique_id("t")));
        std::fs::create_dir_all(&dir).unwrap();
        let port_file = dir.join("ports");
        let python = std::env::var("KILNTAINERS_TEST_VENV")
            .map(|venv| format!("{venv}/bin/python"))
            .unwrap_or_else(|_| "python3".to_owned());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/blackbox/fake_e2b.py");
        let child = Command::new(python)
            .arg(script)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--api-key")
            .arg(KEY)
            .args(args)
            .stdin(Stdio::piped())
            .spawn()
            .expect("start the fake E2B API");
        let deadline = Instant::now() + Duration::from_secs(20);
        let ports: Value = loop {
            if let Ok(text) = std::fs::read_to_string(&port_file) {
                break serde_json::from_str(&text).unwrap();
            }
            assert!(Instant::now() < deadline, "the fake did not start");
            std::thread::sleep(Duration::from_millis(20));
        };
        Fake {
            child,
            api: format!("http://127.0.0.1:{}", ports["api"]),
            envd: format!("http://127.0.0.1:{}", ports["envd"]),
            dir,
            http: reqwest::Client::new(),
        }
    }

    async fn get(&self, path: &str) -> Value {
        let text = self
            .http
            .get(format!("{}{path}", self.api))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        serde_json::from_str(&text).unwrap()
    }

    async fn control(&self, path: &str, body: Value) {
        self.http
            .post(format!("{}{path}", self.api))
            .header("Content-Type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
    }

    async fn requests_to(&self, method: &str, path: &str) -> Vec<Value> {
        self.get("/_fake/requests")
            .await
            .as_array()
            .cloned()
            .unwrap()
            .into_iter()
            .filter(|r| r["method"] == method && r["path"] == path)
            .collect()
    }

    async fn assert_no_violations(&self) {
        assert_eq!(self.get("/_fake/violations").await, json!([]));
    }

    async fn sandboxes(&self) -> Vec<Value> {
        self.get("/_fake/state").await["sandboxes"]
            .as_array()
            .cloned()
            .unwrap()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                let _ = std::fs::remove_dir_all(&self.dir);
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn backend_with(fake: &Fake, key: Option<&str>, extra: &[&str]) -> Arc<dyn Backend> {
    let mut args = vec![
        "x",
        "--backend",
        "e2b",
        "--e2b-api-url",
        &fake.api,
        "--e2b-envd-url",
        &fake.envd,
        "--shell",
        "/bin/sh",
    ];
    args.extend_from_slice(extra);
    let cli = Cli::try_parse_from(args).unwrap();
    let mut config = Config::from_cli(&cli, None).unwrap();
    // Never the developer's own E2B_API_KEY.
    config.e2b.api_key = key.map(mcp_sandbox_computer_vm_for_ai::config::Secret::new);
    backends::build(&config).unwrap()
}

fn spec(id: &ComputerId, temporary: bool, instance: &InstanceId) -> CreateSpec {
    CreateSpec {
        computer_id: id.clone(),
        temporary,
        image: None,
        instance: instance.clone(),
    }
}

#[derive(Default)]
struct Collect {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
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

async fn run(backend: &dyn Backend, sandbox: &SandboxRef, command: &str) -> (i64, String, String) {
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

fn computer(prefix: &str) -> ComputerId {
    ComputerId::parse(&unique_id(prefix)).unwrap()
}

#[tokio::test]
async fn contract_key_errors_and_retries_against_fake() {
    let fake = Fake::start(&[]);
    let error = backend_with(&fake, None, &[]).validate().await.unwrap_err();
    assert_eq!(
        error.to_string(),
        "E2B validation failed: no API key. Pass --e2b-api-key or set E2B_API_KEY."
    );
    assert!(fake.requests_to("GET", "/v2/sandboxes").await.is_empty());

    let error = backend_with(&fake, Some("e2b_wrong"), &[])
        .validate()
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "E2B validation failed: 401 Invalid API key, it must start with 'e2b_'. Pass --e2b-api-key or set E2B_API_KEY."
    );
    let probe = &fake.requests_to("GET", "/v2/sandboxes").await[0];
    assert_eq!(probe["api_key"], "e2b_wrong");
    assert_eq!(probe["query"], json!({"limit": "1"}));

    // 5xx on a read is retried (three times at most), then reported with E2B's words.
    fake.control(
        "/_fake/inject",
        json!({"method": "GET", "path": "/v2/sandboxes", "status": 503, "times": 2, "headers": {"Retry-After": "0"}}),
    )
    .await;
    backend_with(&fake, Some(KEY), &[])
        .validate()
        .await
        .unwrap();
    fake.control(
        "/_fake/inject",
        json!({"method": "GET", "path": "/v2/sandboxes", "status": 500, "times": 4, "body": {"code": 500, "message": "boom"}}),
    )
    .await;
    let before = fake.requests_to("GET", "/v2/sandboxes").await.len();
    let error = backend_with(&fake, Some(KEY), &[])
        .validate()
        .await
        .unwrap_err();
    assert_eq!(error.to_string(), "E2B validation failed: 500 boom");
    assert_eq!(
        fake.requests_to("GET", "/v2/sandboxes").await.len(),
        before + 4
    );
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn contract_create_exec_list_remove_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    // Page size 1: listing has to follow X-Next-Token to see more than one sandbox.
    let fake = Fake::start(&["--page-size", "1"]);
    let backend = backend_with(
        &fake,
        Some(KEY),
        &["--no-network", "--e2b-sandbox-timeout", "600"],
    );
    let id = computer("e2b-c");
    let other = computer("e2b-d");
    let instance = InstanceId::random();
    let sandbox = backend
        .create(&spec(&id, true, &instance), &NoProgress)
        .await
        .unwrap();
    let second = backend
        .create(&spec(&other, false, &instance), &NoProgress)
        .await
        .unwrap();
    let created = fake.requests_to("POST", "/sandboxes").await;
    let body = &created[0]["body"];
    assert_eq!(body["templateID"], "base");
    assert_eq!(body["timeout"], 600);
    assert_eq!(body["secure"], true);
    assert_eq!(body["autoPause"], false);
    assert_eq!(body["allow_internet_access"], false);
    assert_eq!(body["metadata"]["kilntainers-instance"], instance.as_str());
    assert!(
        created[1]["body"]["metadata"]
            .get("kilntainers-instance")
            .is_none()
    );

    // stdin and working directory together; the exit code and the tag come back.
    let exec_spec = ExecSpec {
        argv: vec![
            "/bin/sh".into(),
            "-c".into(),
            "cat > in.txt; pwd; echo \"tag=$KILNTAINERS_EXEC_ID\" >&2; exit 3".into(),
        ],
        stdin: Some(vec![b'x'; 150_000]),
        working_dir: Some("/tmp".into()),
        exec_id: ExecId::random(),
        command: None,
    };
    let mut sink = Collect::default();
    let end = backend
        .exec(&sandbox, &exec_spec, &mut sink, &CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(end, ExecEnd::Exited(3));
    assert_eq!(String::from_utf8_lossy(&sink.stdout), "/tmp\n");
    assert_eq!(
        String::from_utf8_lossy(&sink.stderr),
        format!("tag={}\n", exec_spec.exec_id.as_str())
    );
    let inputs = fake.requests_to("POST", "/process.Process/SendInput").await;
    assert_eq!(inputs.len(), 3, "150,000 bytes in 64 KiB pieces");
    assert_eq!(
        fake.requests_to("POST", "/process.Process/CloseStdin")
            .await
            .len(),
        1
    );
    // Exit code 0 arrives as an end event without `exitCode` (proto3 omits defaults).
    let (code, out, _) = run(backend.as_ref(), &sandbox, "wc -c < /tmp/in.txt").await;
    assert_eq!((code, out.trim()), (0, "150000"));
    let start = fake.requests_to("POST", "/process.Process/Start").await;
    let last = start.last().unwrap();
    assert_eq!(last["body"]["stdin"], false);
    assert_eq!(last["headers"]["connect-timeout-ms"], "3630000");

    // Inventory follows the pages; lookup reads the metadata back.
    let rows = backend.list().await.unwrap();
    let ids: HashSet<&ComputerId> = rows.iter().map(|r| &r.sandbox.computer_id).collect();
    assert!(ids.contains(&id) && ids.contains(&other), "{rows:?}");
    let row = rows.iter().find(|r| r.sandbox.computer_id == id).unwrap();
    assert_eq!(row.state, "running");
    assert_eq!(row.sandbox.image, "base");
    assert!(row.sandbox.temporary && row.created_at.is_some());
    let lists = fake.requests_to("GET", "/v2/sandboxes").await;
    assert!(lists.iter().any(|r| r["query"].get("nextToken").is_some()));
    let found = backend.lookup(&other).await.unwrap().unwrap();
    assert!(found.running && !found.sandbox.temporary);

    backend.remove(&sandbox).await.unwrap();
    backend.remove(&sandbox).await.unwrap();
    assert!(backend.lookup(&id).await.unwrap().is_none());
    backend.remove(&second).await.unwrap();
    assert!(fake.sandboxes().await.is_empty());
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn contract_timeout_kills_through_send_signal_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = Fake::start(&[]);
    let backend = backend_with(&fake, Some(KEY), &[]);
    let id = computer("e2b-t");
    let sandbox = backend
        .create(&spec(&id, true, &InstanceId::random()), &NoProgress)
        .await
        .unwrap();
    let request = |command: &str, timeout_secs| ExecRequest {
        program: Program::Shell(command.to_owned()),
        stdin: None,
        working_dir: None,
        timeout_secs,
    };
    let cancel = CancellationToken::new();
    let outcome = exec::run(
        backend.as_ref(),
        &sandbox,
        "/bin/sh",
        &request("sleep 97 & sleep 98; echo never", 2),
        ExecId::random(),
        1_000_000,
        &cancel,
    )
    .await
    .unwrap();
    assert!(
        matches!(
            outcome,
            ExecOutcome::TimedOut {
                timeout_secs: 2,
                ..
            }
        ),
        "{outcome:?}"
    );
    let signals = fake
        .requests_to("POST", "/process.Process/SendSignal")
        .await;
    assert_eq!(signals.len(), 1);
    assert_eq!(signals[0]["body"]["signal"], "SIGNAL_SIGKILL");
    let (_, ps, _) = run(backend.as_ref(), &sandbox, "ps -o args || ps").await;
    assert!(!ps.contains("sleep 97") && !ps.contains("sleep 98"), "{ps}");

    let outcome = exec::run(
        backend.as_ref(),
        &sandbox,
        "/bin/sh",
        &request("yes | head -c 300000000", 60),
        ExecId::random(),
        1000,
        &cancel,
    )
    .await
    .unwrap();
    assert!(
        matches!(
            outcome,
            ExecOutcome::OutputLimitExceeded { limit: 1000, .. }
        ),
        "{outcome:?}"
    );
    let (_, ps, _) = run(backend.as_ref(), &sandbox, "ps -o args || ps").await;
    assert!(!ps.split_whitespace().any(|w| w == "yes"), "{ps}");

    // The sandbox dies under a running command: the error names it and the detail.
    let long = request("sleep 30", 60);
    let dying = exec::run(
        backend.as_ref(),
        &sandbox,
        "/bin/sh",
        &long,
        ExecId::random(),
        1000,
        &cancel,
    );
    let killer = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        fake.control(&format!("/_fake/kill/{}", sandbox.sandbox_id), json!({}))
            .await;
    };
    let (died, ()) = tokio::join!(dying, killer);
    let message = died.unwrap_err().to_string();
    assert!(
        message.starts_with(&format!(
            "Sandbox {} died during command execution: ",
            sandbox.sandbox_id
        )),
        "{message}"
    );
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn contract_restart_and_crash_gc_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = Fake::start(&[]);
    let backend = backend_with(&fake, Some(KEY), &[]);
    let dead = InstanceId::random();
    let alive = InstanceId::random();
    let orphan = computer("e2b-o");
    let kept = computer("e2b-k");
    let permanent = computer("e2b-m");
    backend
        .create(&spec(&orphan, true, &dead), &NoProgress)
        .await
        .unwrap();
    backend
        .create(&spec(&kept, true, &alive), &NoProgress)
        .await
        .unwrap();
    let perm = backend
        .create(&spec(&permanent, false, &dead), &NoProgress)
        .await
        .unwrap();

    // Restart through pause/resume keeps files and the sandbox.
    run(backend.as_ref(), &perm, "echo kept > /root/state").await;
    let restarted = backend.restart(&perm).await.unwrap();
    assert!(restarted.state_preserved);
    assert_eq!(restarted.sandbox.sandbox_id, perm.sandbox_id);
    assert_eq!(
        run(backend.as_ref(), &perm, "cat /root/state").await.1,
        "kept\n"
    );
    let connects = fake
        .requests_to("POST", &format!("/sandboxes/{}/connect", perm.sandbox_id))
        .await;
    assert_eq!(connects.len(), 1);

    let removed: HashSet<ComputerId> = backend
        .collect_orphans(&HashSet::from([dead.clone()]))
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(removed, HashSet::from([orphan.clone()]));
    let left: HashSet<ComputerId> = backend
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.sandbox.computer_id)
        .collect();
    assert_eq!(left, HashSet::from([kept.clone(), permanent.clone()]));
    for id in [&kept, &permanent] {
        let found = backend.lookup(id).await.unwrap().unwrap();
        backend.remove(&found.sandbox).await.unwrap();
    }
    fake.assert_no_violations().await;
}
