//! The backend contract: every behaviour the registry and `exec` rely on, written once over
//! `Arc<dyn Backend>` and run for every backend (after ripgrep's `rgtest!`, which runs each test
//! on both regex engines). One file per backend builds a [`Harness`] and instantiates the cases
//! with [`contract_tests!`], so a test reports its backend, e.g.
//! `contract::docker::exec_stdin_exit_code_and_workdir`.
//!
//! Docker, Podman and WASM run for real. Fly, E2B and Modal run against the local fakes of their
//! APIs (`common::{fly, e2b, modal}`), whose computers are local containers; their test names
//! end in `_against_fake`, because passing shows that our client drives our reading of the
//! provider's API correctly, never that the real service behaves that way.
//!
//! Where a backend truly differs, the case says so through [`Differences`] and checks the
//! documented behaviour instead: WASM has no process tree (a command is one guest instance
//! inside the server), and Modal cannot stop a sandbox, so restart recreates it and reports
//! `state_preserved: false`. Commands go through `exec::run`, the call `terminal_execute`
//! makes, so timeouts and the output limit take the registry's kill path.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use mcp_sandbox_computer_vm_for_ai::backends::files::{EntryKind, FileError, FileOpError};
use mcp_sandbox_computer_vm_for_ai::backends::{
    Backend, IdleStop, IdleStopped, NoProgress, SandboxRef,
};
use mcp_sandbox_computer_vm_for_ai::exec::{self, ExecOutcome, ExecRequest, Program};
use mcp_sandbox_computer_vm_for_ai::files::Access;
use mcp_sandbox_computer_vm_for_ai::ids::{ComputerId, ExecId, InstanceId};
use mcp_sandbox_computer_vm_for_ai::jobs::{JobSettings, Jobs, Signal, StartRequest, WaitFor};

use crate::common::{ContainerGuard, completed, computer, create_spec};

/// Instantiates every case for one backend. The invoking module defines
/// `async fn harness() -> Option<Harness>` (`None`: the environment does not provide the
/// backend, already reported by `common::enabled`). `real` keeps the case names; `fake` adds
/// `_against_fake`.
macro_rules! contract_tests {
    ($kind:ident) => {
        contract_tests!(@each $kind;
            create_then_lookup_finds_it, create_then_lookup_finds_it_against_fake;
            exec_stdin_exit_code_and_workdir, exec_stdin_exit_code_and_workdir_against_fake;
            timeout_kills_the_process_tree, timeout_kills_the_process_tree_against_fake;
            output_limit_stops_the_command, output_limit_stops_the_command_against_fake;
            restart_reports_whether_files_survive, restart_reports_whether_files_survive_against_fake;
            remove_then_lookup_finds_nothing, remove_then_lookup_finds_nothing_against_fake;
            collect_orphans_takes_only_temporaries_of_dead_instances,
                collect_orphans_takes_only_temporaries_of_dead_instances_against_fake;
            job_outlives_its_start_and_is_read_whole, job_outlives_its_start_and_is_read_whole_against_fake;
            job_takes_stdin_and_is_killed_whole, job_takes_stdin_and_is_killed_whole_against_fake;
            files_5_mib_binary_round_trip, files_5_mib_binary_round_trip_against_fake;
            files_text_list_and_errors, files_text_list_and_errors_against_fake;
            checkpoints_roll_back_and_fork_or_are_refused,
                checkpoints_roll_back_and_fork_or_are_refused_against_fake;
            idle_stop_keeps_the_files_for_the_next_start,
                idle_stop_keeps_the_files_for_the_next_start_against_fake;
        );
    };
    (@each real; $($case:ident, $fake:ident;)*) => {
        $(
            #[tokio::test]
            async fn $case() {
                if let Some(harness) = harness().await {
                    super::$case(harness).await;
                }
            }
        )*
    };
    (@each fake; $($case:ident, $fake:ident;)*) => {
        $(
            #[tokio::test]
            async fn $fake() {
                if let Some(harness) = harness().await {
                    super::$case(harness).await;
                }
            }
        )*
    };
}

mod docker;
#[cfg(feature = "e2b")]
mod e2b;
#[cfg(feature = "fly")]
mod fly;
#[cfg(feature = "kubernetes")]
mod kubernetes;
#[cfg(feature = "kubernetes")]
mod kubernetes_sandbox;
#[cfg(feature = "modal")]
mod modal;
mod podman;
#[cfg(feature = "wasm")]
mod wasm;

/// The output limit, configured on every backend (`OUTPUT_LIMIT_FLAG`) and passed to `exec::run`,
/// as the server does: WASM enforces the configured value itself while the guest writes.
const LIMIT: u64 = 65_536;
/// `--output-limit` for every harness's configuration; the same value as [`LIMIT`].
pub const OUTPUT_LIMIT_FLAG: [&str; 2] = ["--output-limit", "65536"];
/// A timed-out or stopped command must come back well before its own `sleep 300` would end;
/// generous, because the fakes' containers share a busy machine.
const PROMPT: Duration = Duration::from_secs(60);
/// How long the kill may take to show in /proc (the sweep is awaited, so this is slack).
const KILL_SETTLE: Duration = Duration::from_secs(15);

/// Where the backends legitimately differ; each case checks the documented behaviour.
#[derive(Debug, Clone, Copy)]
pub struct Differences {
    /// A command is a tree of processes the kill sweep must end (docs/decisions.md, "Killing a command"). False
    /// for WASM: a command is one guest instance inside the server process; stopping it is
    /// the whole kill, nothing can outlive it and there is no /proc to look in.
    pub process_tree: bool,
    /// A permanent computer's files survive restart. False for Modal, which cannot stop a
    /// sandbox: restart terminates and recreates it and says `state_preserved: false`.
    pub restart_keeps_files: bool,
    /// Output reaches the sink while the command runs. False for Fly, whose exec endpoint
    /// answers once, when the command has ended (`kilntainers_fly::exec`): the limit then applies
    /// to that answer, and a command that floods and keeps running is ended by its timeout.
    pub output_while_running: bool,
    /// A job can take stdin after it started (`keep_stdin_open` and `job_write`). False for
    /// WASM, whose guest takes its whole stdin when it starts: the job is given it up front,
    /// and a later write is refused.
    pub job_stdin_after_start: bool,
}

impl Differences {
    pub const CONTAINER: Differences = Differences {
        process_tree: true,
        restart_keeps_files: true,
        output_while_running: true,
        job_stdin_after_start: true,
    };
}

/// One backend, ready for one case, and whatever must live as long as the test (a fake, a
/// private directory). Dropping it removes what the case created, even after a failed assert.
pub struct Harness {
    pub backend: Arc<dyn Backend>,
    /// A second backend over the same provider: what a newly started server sees (crash GC
    /// runs there; a backend never collects computers it holds itself, e.g. Fly's leases).
    pub collector: Arc<dyn Backend>,
    /// The shell `exec::run` wraps command strings in.
    pub shell: &'static str,
    pub differences: Differences,
    /// Docker/Podman: containers of this test, force-removed on drop through this engine.
    containers: Option<Mutex<ContainerGuard>>,
    /// Fly/E2B: the fake's `/_fake/violations` (requests that broke its reading of the API).
    violations_url: Option<String>,
    _owner: Box<dyn std::any::Any>,
}

impl Harness {
    pub fn new(
        backend: Arc<dyn Backend>,
        collector: Arc<dyn Backend>,
        shell: &'static str,
        owner: impl std::any::Any,
    ) -> Self {
        Self {
            backend,
            collector,
            shell,
            differences: Differences::CONTAINER,
            containers: None,
            violations_url: None,
            _owner: Box::new(owner),
        }
    }

    pub fn with_differences(mut self, differences: Differences) -> Self {
        self.differences = differences;
        self
    }

    /// Containers named `kilntainer-<id>` on this engine are force-removed on drop.
    pub fn with_container_cleanup(mut self, docker_host: Option<String>) -> Self {
        self.containers = Some(Mutex::new(ContainerGuard {
            names: Vec::new(),
            docker_host,
        }));
        self
    }

    /// The fake must have seen no request that breaks its reading of the API.
    pub fn with_violations_check(mut self, url: String) -> Self {
        self.violations_url = Some(url);
        self
    }

    /// A fresh computer id, cleaned up on drop where the backend needs it.
    fn computer(&self, prefix: &str) -> ComputerId {
        let id = computer(prefix);
        if let Some(guard) = &self.containers {
            let mut guard = guard.lock().unwrap_or_else(|e| e.into_inner());
            guard.names.push(format!("kilntainer-{id}"));
        }
        id
    }

    async fn create(&self, id: &ComputerId, temporary: bool, instance: &InstanceId) -> SandboxRef {
        self.backend
            .create(&create_spec(id, temporary, instance), &NoProgress)
            .await
            .unwrap_or_else(|e| panic!("create {id}: {e}"))
    }

    /// One command through `exec::run`, as `terminal_execute` runs it.
    async fn run(
        &self,
        sandbox: &SandboxRef,
        request: &ExecRequest,
        limit: u64,
        exec_id: ExecId,
    ) -> ExecOutcome {
        exec::run(
            self.backend.as_ref(),
            sandbox,
            self.shell,
            request,
            exec_id,
            limit,
            &mcp_sandbox_computer_vm_for_ai::backends::NoProgress,
            &CancellationToken::new(),
        )
        .await
        .unwrap_or_else(|e| panic!("{request:?}: {e}"))
    }

    /// A plain command that must complete: `(exit code, stdout, stderr)`.
    async fn sh(&self, sandbox: &SandboxRef, command: &str) -> (i64, String, String) {
        let outcome = self
            .run(
                sandbox,
                &request(command, None, None, 60),
                LIMIT,
                ExecId::random(),
            )
            .await;
        completed(outcome)
    }

    /// Polls until no process in the computer carries `exec_id`'s tag; returns those left.
    async fn tagged_after_kill(&self, sandbox: &SandboxRef, exec_id: &ExecId) -> String {
        let probe = format!(
            "for d in /proc/[0-9]*; do tr '\\0' '\\n' < $d/environ 2>/dev/null | grep -qxF '{}' && echo ${{d#/proc/}}; done; true",
            exec_id.env_entry()
        );
        let deadline = Instant::now() + KILL_SETTLE;
        loop {
            let (_, left, _) = self.sh(sandbox, &probe).await;
            if left.trim().is_empty() || Instant::now() >= deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The job service over this backend, as the server builds it with `--job-tools`.
    fn jobs(&self) -> Arc<Jobs> {
        Jobs::new(
            self.backend.clone(),
            self.shell.to_owned(),
            JobSettings {
                max_jobs: 16,
                default_timeout_secs: 0,
                log_limit: 64 * 1024 * 1024,
                output_limit: LIMIT,
            },
        )
    }

    /// Ends the case: the fake saw no request outside its reading of the API.
    async fn finish(self) {
        if let Some(url) = &self.violations_url {
            let text = reqwest::Client::new()
                .get(url)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let violations: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(violations, serde_json::json!([]), "fake API violations");
        }
    }
}

fn request(
    command: &str,
    stdin: Option<String>,
    working_dir: Option<&str>,
    timeout_secs: u64,
) -> ExecRequest {
    ExecRequest {
        program: Program::Shell(command.to_owned()),
        stdin,
        working_dir: working_dir.map(str::to_owned),
        timeout_secs,
    }
}

/// Create, then lookup and list find the computer as it was created.
pub async fn create_then_lookup_finds_it(h: Harness) {
    let id = h.computer("ct-look");
    let sandbox = h.create(&id, true, &InstanceId::random()).await;
    assert_eq!(sandbox.computer_id, id);
    assert!(sandbox.temporary);
    let found = h
        .backend
        .lookup(&id)
        .await
        .unwrap()
        .expect("lookup finds it");
    assert!(found.running);
    assert_eq!(found.sandbox, sandbox);
    let listed = h.backend.list().await.unwrap();
    assert!(
        listed.iter().any(
            |row| row.sandbox.computer_id == id && row.sandbox.sandbox_id == sandbox.sandbox_id
        ),
        "{listed:?}"
    );
    h.backend.remove(&sandbox).await.unwrap();
    h.finish().await;
}

/// stdin reaches the command whole, the working directory applies, both streams and the exit
/// code come back; without stdin the command sees EOF at once.
pub async fn exec_stdin_exit_code_and_workdir(h: Harness) {
    let id = h.computer("ct-exec");
    let sandbox = h.create(&id, true, &InstanceId::random()).await;
    assert_eq!(h.sh(&sandbox, "mkdir -p /tmp/contract-wd").await.0, 0);
    let stdin = "line one\n\u{fc}\u{f1}\u{ed} \"quoted\" 'single' $HOME\n".repeat(500);
    let outcome = h
        .run(
            &sandbox,
            &request(
                "cat; pwd; echo oops >&2; exit 3",
                Some(stdin.clone()),
                Some("/tmp/contract-wd"),
                60,
            ),
            LIMIT,
            ExecId::random(),
        )
        .await;
    let (code, stdout, stderr) = completed(outcome);
    assert_eq!(code, 3);
    assert_eq!(stdout, format!("{stdin}/tmp/contract-wd\n"));
    assert_eq!(stderr, "oops\n");
    let (code, stdout, _) = h.sh(&sandbox, "cat; echo end").await;
    assert_eq!((code, stdout.as_str()), (0, "end\n"));
    h.backend.remove(&sandbox).await.unwrap();
    h.finish().await;
}

/// A timeout ends the command and everything it started (`exec::run` runs the kill sweep);
/// the computer stays usable.
pub async fn timeout_kills_the_process_tree(h: Harness) {
    let id = h.computer("ct-time");
    let sandbox = h.create(&id, true, &InstanceId::random()).await;
    let exec_id = ExecId::random();
    // A background child and a foreground one; WASM's shell has no `&` (and no processes).
    let command = if h.differences.process_tree {
        "sleep 300 & sleep 301; echo never"
    } else {
        "sleep 300; echo never"
    };
    let started = Instant::now();
    let outcome = h
        .run(
            &sandbox,
            &request(command, None, None, 2),
            LIMIT,
            exec_id.clone(),
        )
        .await;
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
    assert!(started.elapsed() < PROMPT, "{:?}", started.elapsed());
    if h.differences.process_tree {
        let left = h.tagged_after_kill(&sandbox, &exec_id).await;
        assert_eq!(left.trim(), "", "processes of the command remain");
    }
    // Without a process tree, the guest stopped at the deadline is the whole command: its
    // prompt return above is what there is to check.
    assert_eq!(h.sh(&sandbox, "echo after").await.1, "after\n");
    h.backend.remove(&sandbox).await.unwrap();
    h.finish().await;
}

/// Output past the limit makes the sink say stop, and the command is stopped: it does not run
/// on to its `sleep 300`, and nothing of it remains. Where output arrives only when the command
/// has ended (Fly), the limit applies to that answer and the timeout ends a command that keeps
/// running.
pub async fn output_limit_stops_the_command(h: Harness) {
    let id = h.computer("ct-flood");
    let sandbox = h.create(&id, true, &InstanceId::random()).await;
    // Three times the limit.
    let flood = "y\n".repeat(100_000);
    let exec_id = ExecId::random();
    let started = Instant::now();
    let command = if h.differences.output_while_running {
        "cat; sleep 300; echo never"
    } else {
        "cat; echo ended"
    };
    let outcome = h
        .run(
            &sandbox,
            &request(command, Some(flood.clone()), None, 240),
            LIMIT,
            exec_id.clone(),
        )
        .await;
    assert!(
        matches!(
            outcome,
            ExecOutcome::OutputLimitExceeded { limit: LIMIT, .. }
        ),
        "{outcome:?}"
    );
    assert!(started.elapsed() < PROMPT, "{:?}", started.elapsed());
    if h.differences.process_tree {
        let left = h.tagged_after_kill(&sandbox, &exec_id).await;
        assert_eq!(left.trim(), "", "processes of the command remain");
    }
    if !h.differences.output_while_running {
        // The documented difference, checked: the flood is not seen until the command ends.
        let exec_id = ExecId::random();
        let outcome = h
            .run(
                &sandbox,
                &request("cat; sleep 300; echo never", Some(flood), None, 3),
                LIMIT,
                exec_id.clone(),
            )
            .await;
        assert!(
            matches!(
                outcome,
                ExecOutcome::TimedOut {
                    timeout_secs: 3,
                    ..
                }
            ),
            "{outcome:?}"
        );
        let left = h.tagged_after_kill(&sandbox, &exec_id).await;
        assert_eq!(left.trim(), "", "processes of the command remain");
    }
    assert_eq!(h.sh(&sandbox, "echo after").await.1, "after\n");
    h.backend.remove(&sandbox).await.unwrap();
    h.finish().await;
}

/// Restart keeps the computer's id and mode, reports whether its files survived, and that
/// report is true.
pub async fn restart_reports_whether_files_survive(h: Harness) {
    let id = h.computer("ct-restart");
    let sandbox = h.create(&id, false, &InstanceId::random()).await;
    let (code, _, stderr) = h
        .sh(
            &sandbox,
            "mkdir -p /root && echo kept > /root/contract-state",
        )
        .await;
    assert_eq!(code, 0, "{stderr}");
    let restarted = h.backend.restart(&sandbox).await.unwrap();
    assert_eq!(
        restarted.state_preserved, h.differences.restart_keeps_files,
        "documented restart behaviour"
    );
    assert_eq!(restarted.sandbox.computer_id, id);
    assert!(!restarted.sandbox.temporary);
    assert_eq!(restarted.sandbox.image, sandbox.image);
    let (code, stdout, _) = h.sh(&restarted.sandbox, "cat /root/contract-state").await;
    if restarted.state_preserved {
        assert_eq!((code, stdout.as_str()), (0, "kept\n"));
    } else {
        assert_ne!(code, 0, "restart said the files are gone: {stdout}");
    }
    let found = h.backend.lookup(&id).await.unwrap().expect("still there");
    assert!(found.running);
    assert_eq!(found.sandbox.sandbox_id, restarted.sandbox.sandbox_id);
    h.backend.remove(&restarted.sandbox).await.unwrap();
    h.finish().await;
}

/// Remove deletes a permanent computer; lookup and list find nothing; removing again is not
/// an error (the goal is met).
pub async fn remove_then_lookup_finds_nothing(h: Harness) {
    let id = h.computer("ct-remove");
    let sandbox = h.create(&id, false, &InstanceId::random()).await;
    h.backend.remove(&sandbox).await.unwrap();
    assert!(h.backend.lookup(&id).await.unwrap().is_none());
    let listed = h.backend.list().await.unwrap();
    assert!(
        listed.iter().all(|row| row.sandbox.computer_id != id),
        "{listed:?}"
    );
    h.backend.remove(&sandbox).await.unwrap();
    h.finish().await;
}

/// Crash GC, run by another server, removes the temporary computers of dead instances and
/// nothing else: not the temporaries of a live instance, not the permanent ones of a dead
/// instance.
pub async fn collect_orphans_takes_only_temporaries_of_dead_instances(h: Harness) {
    let (dead, alive) = (InstanceId::random(), InstanceId::random());
    let orphan = h.computer("ct-orphan");
    let kept = h.computer("ct-kept");
    let permanent = h.computer("ct-perm");
    h.create(&orphan, true, &dead).await;
    let kept_sandbox = h.create(&kept, true, &alive).await;
    let permanent_sandbox = h.create(&permanent, false, &dead).await;
    let removed = h
        .collector
        .collect_orphans(&HashSet::from([dead]))
        .await
        .unwrap();
    assert_eq!(removed, std::slice::from_ref(&orphan));
    assert!(h.collector.lookup(&orphan).await.unwrap().is_none());
    assert!(h.collector.lookup(&kept).await.unwrap().is_some());
    assert!(h.collector.lookup(&permanent).await.unwrap().is_some());
    // The new server cleans up (the Modal fake honours only the newest auth token it issued).
    h.collector.remove(&kept_sandbox).await.unwrap();
    h.collector.remove(&permanent_sandbox).await.unwrap();
    h.finish().await;
}

fn job(command: &str, keep_stdin_open: bool) -> StartRequest {
    StartRequest {
        program: Program::Shell(command.to_owned()),
        stdin: None,
        working_dir: None,
        timeout_secs: None,
        keep_stdin_open,
    }
}

/// A job keeps running after its start returned; it is read whole, in order, from any offset
/// of its combined output, with its exit code once it ended, and it is listed.
pub async fn job_outlives_its_start_and_is_read_whole(h: Harness) {
    let id = h.computer("ct-job");
    let sandbox = h.create(&id, true, &InstanceId::random()).await;
    let jobs = h.jobs();
    let cancel = CancellationToken::new();
    let command = "echo out 1; echo err 1 >&2; sleep 1; echo out 2; echo err 2 >&2; exit 4";
    let started = Instant::now();
    let job_id = jobs
        .start(&sandbox, &job(command, false), &cancel)
        .await
        .unwrap();
    let first = jobs
        .read(
            &sandbox,
            &job_id,
            0,
            Duration::ZERO,
            WaitFor::Output,
            &cancel,
        )
        .await
        .unwrap();
    assert!(first.running, "{first:?}");
    assert!(started.elapsed() < Duration::from_secs(30));
    let done = jobs
        .read(
            &sandbox,
            &job_id,
            0,
            Duration::from_secs(30),
            WaitFor::End,
            &cancel,
        )
        .await
        .unwrap();
    assert!(!done.running, "{done:?}");
    assert_eq!(done.exit_code, Some(4));
    assert_eq!(String::from_utf8_lossy(&done.stdout), "out 1\nout 2\n");
    assert_eq!(String::from_utf8_lossy(&done.stderr), "err 1\nerr 2\n");
    assert_eq!((done.next_since, done.more), (24, false));
    // From an offset: what follows it, nothing before.
    let tail = jobs
        .read(
            &sandbox,
            &job_id,
            12,
            Duration::ZERO,
            WaitFor::Output,
            &cancel,
        )
        .await
        .unwrap();
    assert_eq!(tail.stdout.len() + tail.stderr.len(), 12);
    assert_eq!(tail.next_since, 24);
    let listed = jobs.list(&sandbox, &cancel).await.unwrap();
    assert!(!listed.truncated);
    let listed = listed.jobs;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].job_id, job_id);
    assert_eq!(
        (
            listed[0].running,
            listed[0].exit_code,
            listed[0].output_bytes
        ),
        (false, Some(4), 24)
    );
    assert_eq!(listed[0].command, command);
    h.backend.remove(&sandbox).await.unwrap();
    h.finish().await;
}

/// A job started with stdin kept open reads what is written to it later; a kill ends it and
/// everything it started, and a second kill just finds it ended.
pub async fn job_takes_stdin_and_is_killed_whole(h: Harness) {
    let id = h.computer("ct-jobin");
    let sandbox = h.create(&id, true, &InstanceId::random()).await;
    let jobs = h.jobs();
    let cancel = CancellationToken::new();
    let command = if h.differences.process_tree {
        "read line; echo got $line; sleep 300 & sleep 301"
    } else {
        // go-busybox's shell has no `read`, and a guest's output may come only when it ends.
        "head -n 1 | sed 's/^/got /'"
    };
    let job_id = if h.differences.job_stdin_after_start {
        let job_id = jobs
            .start(&sandbox, &job(command, true), &cancel)
            .await
            .unwrap();
        jobs.write(
            &sandbox,
            &job_id,
            Some("hello\n".to_owned()),
            false,
            &cancel,
        )
        .await
        .unwrap();
        job_id
    } else {
        let mut request = job(command, false);
        request.stdin = Some("hello\n".to_owned());
        let job_id = jobs.start(&sandbox, &request, &cancel).await.unwrap();
        let refused = jobs.write(&sandbox, &job_id, Some("more\n".to_owned()), false, &cancel);
        assert!(refused.await.is_err());
        job_id
    };
    let deadline = Instant::now() + PROMPT;
    let mut since = 0;
    let mut seen = String::new();
    while !seen.contains("got hello\n") {
        assert!(Instant::now() < deadline, "no answer to stdin: {seen:?}");
        let read = jobs
            .read(
                &sandbox,
                &job_id,
                since,
                Duration::from_secs(5),
                WaitFor::Output,
                &cancel,
            )
            .await
            .unwrap();
        seen.push_str(&String::from_utf8_lossy(&read.stdout));
        since = read.next_since;
    }
    // Where the answer came only with the job's end, a second job is the one killed.
    let job_id = if h.differences.job_stdin_after_start {
        job_id
    } else {
        since = 0;
        jobs.start(&sandbox, &job("sleep 300", false), &cancel)
            .await
            .unwrap()
    };
    let started = Instant::now();
    jobs.kill(&sandbox, &job_id, Signal::Term, &cancel)
        .await
        .unwrap();
    assert!(started.elapsed() < PROMPT);
    let ended = jobs
        .read(
            &sandbox,
            &job_id,
            since,
            Duration::ZERO,
            WaitFor::Output,
            &cancel,
        )
        .await
        .unwrap();
    assert!(!ended.running, "{ended:?}");
    if h.differences.process_tree {
        let left = h
            .tagged_after_kill(&sandbox, &ExecId::for_job(&job_id))
            .await;
        assert_eq!(left.trim(), "", "processes of the job remain");
    }
    // Ended: no more input, and killing again is not an error.
    assert!(
        jobs.write(&sandbox, &job_id, Some("x\n".to_owned()), false, &cancel)
            .await
            .is_err()
    );
    jobs.kill(&sandbox, &job_id, Signal::Kill, &cancel)
        .await
        .unwrap();
    h.backend.remove(&sandbox).await.unwrap();
    h.finish().await;
}

/// The file tools' access on this backend (its own file system, or the `sh` programs through
/// exec), as `file_read`/`file_write`/`file_list` use it.
fn files<'a>(h: &'a Harness, cancel: &'a CancellationToken) -> Access<'a> {
    Access::new(h.backend.as_ref(), h.shell, 60, cancel)
}

fn file_error<T: std::fmt::Debug>(answer: Result<T, FileOpError>) -> FileError {
    match answer {
        Err(FileOpError::File(error)) => error,
        other => panic!("expected a file error, got {other:?}"),
    }
}

/// docs/files.md: 5 MiB of random bytes written in one call (several programs of 1.5 MiB on a
/// shell backend, renamed once) and read back in 1 MiB pages come back byte for byte.
pub async fn files_5_mib_binary_round_trip(h: Harness) {
    const SIZE: usize = 5 * 1024 * 1024;
    const PAGE: u64 = 1024 * 1024;
    let id = h.computer("ct-files-big");
    let sandbox = h.create(&id, true, &InstanceId::random()).await;
    let cancel = CancellationToken::new();
    let access = files(&h, &cancel);
    let mut bytes = vec![0u8; SIZE];
    rand::fill(&mut bytes[..]);
    let path = "/tmp/contract-files/big.bin";
    let size = access
        .write(&sandbox, path, &bytes, false, None)
        .await
        .unwrap();
    assert_eq!(size, SIZE as u64);
    let mut back = Vec::with_capacity(SIZE);
    loop {
        let page = access
            .read(&sandbox, path, back.len() as u64, PAGE)
            .await
            .unwrap();
        assert_eq!(page.size, SIZE as u64);
        assert!(page.bytes.len() as u64 <= PAGE);
        if page.bytes.is_empty() {
            break;
        }
        back.extend_from_slice(&page.bytes);
    }
    assert_eq!(back.len(), SIZE);
    assert!(
        back == bytes,
        "the bytes read back differ from those written"
    );
    // The atomic write left no temporary file beside the target.
    let listing = access
        .list(&sandbox, "/tmp/contract-files", 1)
        .await
        .unwrap();
    let paths: Vec<&str> = listing.entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["/tmp/contract-files/big.bin"]);
    h.backend.remove(&sandbox).await.unwrap();
    h.finish().await;
}

/// Text with multibyte characters, append and mode, a listing of a tree, and the documented
/// errors; what the file tools wrote is what a command in the computer sees.
pub async fn files_text_list_and_errors(h: Harness) {
    let id = h.computer("ct-files");
    let sandbox = h.create(&id, true, &InstanceId::random()).await;
    let cancel = CancellationToken::new();
    let access = files(&h, &cancel);
    let text = "grüße, 日本語\n";
    let notes = "/tmp/contract-tree/dir/notes.txt";
    let size = access
        .write(&sandbox, notes, text.as_bytes(), false, None)
        .await
        .unwrap();
    assert_eq!(size, text.len() as u64);
    let size = access
        .write(&sandbox, notes, b"more\n", true, Some(0o600))
        .await
        .unwrap();
    assert_eq!(size, text.len() as u64 + 5);
    let (code, stdout, stderr) = h.sh(&sandbox, &format!("cat {notes}")).await;
    assert_eq!(
        (code, stdout.as_str()),
        (0, format!("{text}more\n").as_str()),
        "{stderr}"
    );
    let page = access.read(&sandbox, notes, 2, 4).await.unwrap();
    assert_eq!(page.bytes, &text.as_bytes()[2..6]);
    access
        .write(
            &sandbox,
            "/tmp/contract-tree/top.sh",
            b"#!/bin/sh\n",
            false,
            Some(0o755),
        )
        .await
        .unwrap();
    let listing = access
        .list(&sandbox, "/tmp/contract-tree", 2)
        .await
        .unwrap();
    let seen: Vec<(&str, EntryKind, &str)> = listing
        .entries
        .iter()
        .map(|e| (e.path.as_str(), e.kind, e.mode.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            ("/tmp/contract-tree/dir", EntryKind::Dir, "0755"),
            ("/tmp/contract-tree/dir/notes.txt", EntryKind::File, "0600"),
            ("/tmp/contract-tree/top.sh", EntryKind::File, "0755"),
        ]
    );
    assert!(!listing.truncated);
    assert!(listing.entries.iter().all(|e| e.modified > 1_600_000_000));
    let one = access
        .list(&sandbox, "/tmp/contract-tree", 1)
        .await
        .unwrap();
    assert_eq!(one.entries.len(), 2);
    let missing = "/tmp/contract-tree/nope";
    assert_eq!(
        file_error(access.read(&sandbox, missing, 0, 10).await),
        FileError::NotFound(missing.into())
    );
    assert_eq!(
        file_error(access.list(&sandbox, missing, 1).await),
        FileError::NotFound(missing.into())
    );
    assert_eq!(
        file_error(access.read(&sandbox, "/tmp/contract-tree/dir", 0, 10).await),
        FileError::IsDirectory("/tmp/contract-tree/dir".into())
    );
    assert_eq!(
        file_error(
            access
                .write(&sandbox, "/tmp/contract-tree/dir", b"x", false, None)
                .await
        ),
        FileError::WriteToDirectory("/tmp/contract-tree/dir".into())
    );
    h.backend.remove(&sandbox).await.unwrap();
    h.finish().await;
}

/// Checkpoints (docs/checkpoints.md): where the backend has them, a checkpoint survives a
/// change and comes back by rollback under the same id; a fork is a second computer with the
/// checkpoint's files and its own first checkpoint; a second server reads the same records;
/// delete and forget remove them, and crash GC those of a dead server's temporary computer.
/// Where it has none (Fly), it says so in the contract's words before anything is made.
pub async fn checkpoints_roll_back_and_fork_or_are_refused(h: Harness) {
    use mcp_sandbox_computer_vm_for_ai::backends::checkpoints::{
        CheckpointName, FromCheckpoint, NewCheckpoint,
    };
    use mcp_sandbox_computer_vm_for_ai::ids::Principal;
    let Some(provider) = h.backend.checkpoints() else {
        assert_eq!(
            h.backend.no_checkpoints().to_string(),
            format!(
                "Checkpoints are not available on the {} backend.",
                h.backend.kind()
            )
        );
        h.finish().await;
        return;
    };
    let id = h.computer("ct-cp");
    let fork_id = h.computer("ct-cp-fork");
    let instance = InstanceId::random();
    let sandbox = h.create(&id, false, &instance).await;
    let (code, _, stderr) = h
        .sh(&sandbox, "mkdir -p /root && echo one > /root/cp")
        .await;
    assert_eq!(code, 0, "{stderr}");
    let name = CheckpointName::parse("one").unwrap();
    let new = NewCheckpoint {
        name: name.clone(),
        lineage: Vec::new(),
        note: Some("first".to_owned()),
        owner: Principal::default_principal(),
    };
    let record = provider.checkpoint(&sandbox, &new).await.unwrap();
    assert_eq!(
        (record.name.as_str(), record.note.as_deref()),
        ("one", Some("first"))
    );
    let set = provider.checkpoints(&id).await.unwrap();
    assert_eq!(set.checkpoints.len(), 1);
    assert_eq!(set.lineage, vec![name.clone()]);
    // A second server over the same provider reads the same records.
    let other = h.collector.checkpoints().unwrap();
    assert_eq!(other.checkpoints(&id).await.unwrap(), set);
    h.sh(&sandbox, "echo two > /root/cp").await;
    let from = FromCheckpoint {
        source: &id,
        checkpoint: &set.checkpoints[0],
    };
    let rolled = provider
        .rollback(
            &sandbox,
            from.clone(),
            &create_spec(&id, false, &instance),
            &NoProgress,
        )
        .await
        .unwrap();
    assert_eq!(rolled.computer_id, id);
    assert!(!rolled.temporary);
    assert_eq!(h.sh(&rolled, "cat /root/cp").await.1, "one\n");
    let forked = provider
        .fork(
            &rolled,
            from,
            &create_spec(&fork_id, false, &instance),
            &NoProgress,
        )
        .await
        .unwrap();
    assert_eq!(h.sh(&forked, "cat /root/cp").await.1, "one\n");
    h.sh(&forked, "echo fork > /root/cp").await;
    assert_eq!(h.sh(&rolled, "cat /root/cp").await.1, "one\n");
    let fork_set = provider.checkpoints(&fork_id).await.unwrap();
    assert_eq!(fork_set.checkpoints.len(), 1);
    provider.delete(&id, &name).await.unwrap();
    assert!(
        provider
            .checkpoints(&id)
            .await
            .unwrap()
            .checkpoints
            .is_empty()
    );
    h.backend.remove(&rolled).await.unwrap();
    h.backend.remove(&forked).await.unwrap();
    provider.forget(&id).await.unwrap();
    provider.forget(&fork_id).await.unwrap();
    assert!(
        provider
            .checkpoints(&fork_id)
            .await
            .unwrap()
            .checkpoints
            .is_empty()
    );
    // Crash GC: a temporary computer of a dead server loses its checkpoints with it.
    let temp_id = h.computer("ct-cp-tmp");
    let dead = InstanceId::random();
    let temp = h.create(&temp_id, true, &dead).await;
    let new = NewCheckpoint {
        name: name.clone(),
        lineage: Vec::new(),
        note: None,
        owner: Principal::default_principal(),
    };
    provider.checkpoint(&temp, &new).await.unwrap();
    h.collector
        .collect_orphans(&HashSet::from([dead]))
        .await
        .unwrap();
    assert!(h.backend.lookup(&temp_id).await.unwrap().is_none());
    assert!(
        provider
            .checkpoints(&temp_id)
            .await
            .unwrap()
            .checkpoints
            .is_empty()
    );
    h.finish().await;
}

/// `--idle-stop` (docs/idle-stop.md): where the backend stops computers, a stopped permanent
/// computer is listed as not running, keeps its files, and runs commands again once started
/// (the registry starts it on the next use); elsewhere the option is refused or a no-op.
pub async fn idle_stop_keeps_the_files_for_the_next_start(h: Harness) {
    match h.backend.idle_stop() {
        IdleStop::Stops => {}
        IdleStop::Refused(message) => {
            assert!(
                message.starts_with("--idle-stop is not available on the"),
                "{message}"
            );
            h.finish().await;
            return;
        }
        IdleStop::NothingToStop => {
            h.finish().await;
            return;
        }
    }
    let id = h.computer("ct-idle");
    let sandbox = h.create(&id, false, &InstanceId::random()).await;
    let (code, _, stderr) = h
        .sh(&sandbox, "mkdir -p /root && echo kept > /root/idle-state")
        .await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        h.backend.stop_idle(&sandbox).await.unwrap(),
        IdleStopped::Stopped
    );
    let found = h.backend.lookup(&id).await.unwrap().expect("still there");
    assert!(!found.running, "stopped by idle stop");
    let started = h.backend.ensure_running(&found.sandbox).await.unwrap();
    let (code, stdout, _) = h.sh(&started, "cat /root/idle-state").await;
    assert_eq!((code, stdout.as_str()), (0, "kept\n"));
    h.backend.remove(&started).await.unwrap();
    h.finish().await;
}
