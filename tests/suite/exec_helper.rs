//! The resident exec helper against a real Docker engine, driven through the `Backend` trait and
//! `exec::run` (the same calls `terminal_execute` makes): many commands over one helper, the
//! kill of a whole process tree on timeout, an output flood, 2 MiB of stdin, binary output, a
//! helper killed mid-command, restart, and computers where the helper cannot run.
//!
//! Which path ran is read from inside the computer: under the helper a command's parent is the
//! helper (`/.kilntainers/helper-… serve`); under plain Docker exec its parent pid is 0.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use mcp_sandbox_computer_vm_for_ai::backends::{
    Backend, BackendError, CreateSpec, ExecEnd, ExecSpec, NoProgress, OutputSink, SandboxRef,
    SinkControl, Stream,
};
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;
use mcp_sandbox_computer_vm_for_ai::exec::{self, ExecError, ExecOutcome, ExecRequest, Program};
use mcp_sandbox_computer_vm_for_ai::ids::{ComputerId, ExecId, InstanceId};
use mcp_sandbox_computer_vm_for_ai::providers;
use tokio_util::sync::CancellationToken;

use crate::common::{ContainerGuard, enabled, unique_id};

/// Failure guard only: a hung call fails the test instead of hanging the suite.
const GUARD: Duration = Duration::from_secs(120);
const SHELL: &str = "/bin/bash";

struct Computer {
    backend: Arc<dyn Backend>,
    sandbox: SandboxRef,
    _guard: ContainerGuard,
}

async fn computer(label: &str, extra: &[&str]) -> Computer {
    let id = unique_id(label);
    let guard = ContainerGuard {
        names: vec![format!("kilntainer-{id}")],
        docker_host: None,
    };
    let mut args = vec!["mcp-sandbox-computer-vm-for-ai"];
    // Explicit, so KILNTAINERS_EXEC_HELPER in the environment cannot change what is tested.
    if !extra.iter().any(|a| a.starts_with("--exec-helper")) {
        args.push("--exec-helper=on");
    }
    args.extend_from_slice(extra);
    let config = Config::from_cli(
        &Cli::parse_from(args),
        mcp_sandbox_computer_vm_for_ai::config::process_env,
    )
    .expect("config");
    let backend = providers::build(&config).expect("backend");
    let spec = CreateSpec {
        computer_id: ComputerId::parse(&id).expect("id"),
        temporary: true,
        image: None,
        instance: InstanceId::random(),
        owner: None,
        egress: None,
    };
    let sandbox = backend.create(&spec, &NoProgress).await.expect("create");
    Computer {
        backend,
        sandbox,
        _guard: guard,
    }
}

#[derive(Default)]
struct Collected {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl OutputSink for Collected {
    fn push(&mut self, stream: Stream, bytes: &[u8]) -> SinkControl {
        match stream {
            Stream::Stdout => self.stdout.extend_from_slice(bytes),
            Stream::Stderr => self.stderr.extend_from_slice(bytes),
        }
        SinkControl::Continue
    }
}

impl Computer {
    /// One command straight through the backend (no output limit).
    async fn raw(&self, command: &str, stdin: Option<Vec<u8>>) -> (i64, Collected) {
        let spec = ExecSpec {
            argv: vec![SHELL.into(), "-c".into(), command.into()],
            stdin,
            working_dir: None,
            exec_id: ExecId::random(),
            command: Some(command.into()),
        };
        let mut sink = Collected::default();
        let end = tokio::time::timeout(
            GUARD,
            self.backend
                .exec(&self.sandbox, &spec, &mut sink, &CancellationToken::new()),
        )
        .await
        .expect("exec hung")
        .expect("exec");
        match end {
            ExecEnd::Exited(code) => (code, sink),
            other => panic!("unexpected end {other:?}"),
        }
    }

    async fn stdout(&self, command: &str) -> String {
        let (code, out) = self.raw(command, None).await;
        assert_eq!(
            code,
            0,
            "{command}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    }

    /// The parent of a command: the helper's pid, or 0 under plain Docker exec.
    async fn parent(&self) -> u32 {
        self.stdout("echo $PPID").await.trim().parse().expect("pid")
    }

    async fn parent_command_line(&self) -> String {
        self.stdout("tr '\\0' ' ' < /proc/$PPID/cmdline").await
    }

    /// Through `exec::run`, the policy layer: timeout, output limit, kill on early end.
    async fn policed(
        &self,
        command: &str,
        timeout_secs: u64,
        output_limit: u64,
        exec_id: ExecId,
    ) -> Result<ExecOutcome, ExecError> {
        let request = ExecRequest {
            program: Program::Shell(command.into()),
            stdin: None,
            working_dir: None,
            timeout_secs,
        };
        tokio::time::timeout(
            GUARD,
            exec::run(
                self.backend.as_ref(),
                &self.sandbox,
                SHELL,
                &request,
                exec_id,
                output_limit,
                &mcp_sandbox_computer_vm_for_ai::backends::NoProgress,
                &CancellationToken::new(),
            ),
        )
        .await
        .expect("exec::run hung")
    }

    /// Processes in the computer whose environment carries `exec_id`'s tag.
    async fn tagged(&self, exec_id: &ExecId) -> String {
        let probe = format!(
            "for d in /proc/[0-9]*; do tr '\\0' '\\n' < $d/environ 2>/dev/null | grep -qxF '{}' && echo ${{d#/proc/}}; done; true",
            exec_id.env_entry()
        );
        self.stdout(&probe).await
    }
}

#[tokio::test]
async fn commands_run_through_the_helper_by_default() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let computer = computer("rs-helper-on", &[]).await;
    let parent = computer.parent_command_line().await;
    assert!(
        parent.starts_with("/.kilntainers/helper-") && parent.contains(" serve"),
        "parent: {parent}"
    );
    // One connection serves every call.
    assert_eq!(computer.parent().await, computer.parent().await);
}

#[tokio::test]
async fn twenty_concurrent_commands_share_one_helper() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let computer = computer("rs-helper-twenty", &[]).await;
    computer.stdout("mkdir -p /tmp/arrived").await;
    // Each command waits until all twenty have arrived, so they can only finish if they all
    // run at the same time over the one connection.
    let calls = (0..20).map(|n| {
        let computer = &computer;
        async move {
            let command = format!(
                "touch /tmp/arrived/{n}; until [ $(ls /tmp/arrived | wc -l) -ge 20 ]; do sleep 0.05; done; echo $PPID {n}"
            );
            computer.stdout(&command).await
        }
    });
    let outputs = futures_util::future::join_all(calls).await;
    let helper = computer.parent().await;
    assert_ne!(helper, 0);
    for (n, output) in outputs.iter().enumerate() {
        assert_eq!(output, &format!("{helper} {n}\n"));
    }
}

#[tokio::test]
async fn a_timeout_kills_the_whole_process_tree() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let computer = computer("rs-helper-timeout", &[]).await;
    let exec_id = ExecId::random();
    // A child, a grandchild in its own session, and the shell waiting on them.
    let outcome = computer
        .policed(
            "sleep 1000 & setsid sleep 1000 & (sleep 1000 &); wait",
            1,
            1 << 20,
            exec_id.clone(),
        )
        .await
        .expect("outcome");
    assert!(
        matches!(
            outcome,
            ExecOutcome::TimedOut {
                timeout_secs: 1,
                ..
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(computer.tagged(&exec_id).await, "");
    assert_ne!(computer.parent().await, 0, "the helper is still in use");
}

#[tokio::test]
async fn an_output_flood_is_cut_at_the_limit_and_the_helper_survives() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let computer = computer("rs-helper-flood", &[]).await;
    let helper = computer.parent().await;
    let exec_id = ExecId::random();
    let outcome = computer
        .policed("cat /dev/zero; echo never", 60, 1 << 20, exec_id.clone())
        .await
        .expect("outcome");
    assert!(
        matches!(outcome, ExecOutcome::OutputLimitExceeded { limit, .. } if limit == 1 << 20),
        "{outcome:?}"
    );
    assert_eq!(computer.tagged(&exec_id).await, "");
    // Interleaved stdout and stderr floods in one command, under the limit, arrive whole.
    let (code, out) = computer
        .raw(
            "head -c 3000000 /dev/zero; head -c 2000000 /dev/zero >&2",
            None,
        )
        .await;
    assert_eq!(
        (code, out.stdout.len(), out.stderr.len()),
        (0, 3_000_000, 2_000_000)
    );
    assert_eq!(
        computer.parent().await,
        helper,
        "same connection after the flood"
    );
}

#[tokio::test]
async fn two_mib_of_stdin_and_binary_output_are_byte_exact() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let computer = computer("rs-helper-stdin", &[]).await;
    let stdin: Vec<u8> = (0..2 * 1024 * 1024).map(|i: u32| (i % 251) as u8).collect();
    let (code, out) = computer.raw("cat", Some(stdin.clone())).await;
    assert_eq!(code, 0);
    assert!(out.stdout == stdin, "stdout differs from stdin");
    // Every byte value, on both streams.
    let all: Vec<u8> = (0..=255u8).collect();
    let (code, out) = computer
        .raw(
            "cat > /tmp/bytes; cat /tmp/bytes; cat /tmp/bytes >&2",
            Some(all.clone()),
        )
        .await;
    assert_eq!(
        (code, out.stdout.as_slice(), out.stderr.as_slice()),
        (0, all.as_slice(), all.as_slice())
    );
}

#[tokio::test]
async fn a_helper_killed_mid_command_fails_that_call_and_the_next_call_gets_a_new_helper() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let computer = computer("rs-helper-crash", &[]).await;
    let first = computer.parent().await;
    let exec_id = ExecId::random();
    let result = computer
        .policed(
            "echo started; kill -9 $PPID; sleep 1000",
            600,
            1 << 20,
            exec_id.clone(),
        )
        .await;
    match result {
        Err(ExecError::Backend(BackendError::Provider(message))) => {
            assert!(message.contains("exec helper"), "{message}")
        }
        other => panic!("expected a provider error, got {other:?}"),
    }
    // The orphaned `sleep` was swept by the kill that follows a broken stream.
    assert_eq!(computer.tagged(&exec_id).await, "");
    let second = computer.parent().await;
    assert!(second != 0 && second != first, "{first} → {second}");
}

#[tokio::test]
async fn a_helper_that_keeps_dying_is_given_up_for_docker_exec() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let computer = computer("rs-helper-dies", &[]).await;
    // Three losses in a row with no command finishing in between (the limit in `helper`).
    for _ in 0..3 {
        let outcome = computer
            .policed("kill -9 $PPID; sleep 1000", 600, 1 << 20, ExecId::random())
            .await;
        assert!(
            matches!(outcome, Err(ExecError::Backend(BackendError::Provider(_)))),
            "{outcome:?}"
        );
    }
    assert_eq!(
        computer.parent().await,
        0,
        "the computer now uses Docker exec"
    );
    assert_eq!(computer.stdout("echo fine").await, "fine\n");
}

#[tokio::test]
async fn restart_brings_the_helper_back() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let computer = computer("rs-helper-restart", &[]).await;
    assert_ne!(computer.parent().await, 0);
    computer.stdout("echo kept > /state").await;
    let restarted = computer
        .backend
        .restart(&computer.sandbox)
        .await
        .expect("restart");
    assert!(restarted.state_preserved);
    let parent = computer.parent_command_line().await;
    assert!(
        parent.starts_with("/.kilntainers/helper-"),
        "parent: {parent}"
    );
    assert_eq!(computer.stdout("cat /state").await, "kept\n");
}

#[tokio::test]
async fn a_read_only_computer_uses_docker_exec() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let computer = computer("rs-helper-ro", &["--docker-run-flag=--read-only"]).await;
    assert_eq!(computer.parent().await, 0);
    let (code, out) = computer.raw("cat", Some(b"still works".to_vec())).await;
    assert_eq!(
        (code, out.stdout.as_slice()),
        (0, b"still works".as_slice())
    );
}

#[tokio::test]
async fn a_computer_that_cannot_execute_the_helper_uses_docker_exec() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    // The helper's directory is a noexec tmpfs: the upload lands, the exec is refused.
    let computer = computer(
        "rs-helper-noexec",
        &["--docker-run-flag=--tmpfs=/.kilntainers:rw,noexec"],
    )
    .await;
    assert_eq!(computer.parent().await, 0);
    assert_eq!(computer.stdout("echo fine").await, "fine\n");
    let exec_id = ExecId::random();
    let outcome = computer
        .policed("sleep 1000 & wait", 1, 1 << 20, exec_id.clone())
        .await
        .expect("outcome");
    assert!(
        matches!(outcome, ExecOutcome::TimedOut { .. }),
        "{outcome:?}"
    );
    assert_eq!(computer.tagged(&exec_id).await, "");
}

#[tokio::test]
async fn exec_helper_off_uses_docker_exec() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let computer = computer("rs-helper-off", &["--exec-helper", "off"]).await;
    assert_eq!(computer.parent().await, 0);
}
