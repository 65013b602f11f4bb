//! Unit tests of [`super::run`] against the fake backend, under paused tokio time: every early
//! end (timeout, cancellation, output limit, broken stream) kills the command's tree before
//! `run` returns, and a normal end does not.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{ExecError, ExecOutcome, ExecRequest, KILL_SWEEP_LIMIT, Program, run};
use crate::backends::fake::{Call, ExecScript, FakeBackend, Op, within};
use crate::backends::{BackendError, SandboxRef, Stream};
use crate::ids::{ComputerId, ExecId};

const LIMIT: u64 = 10;

fn computer() -> ComputerId {
    ComputerId::parse("box").unwrap()
}

fn setup() -> (Arc<FakeBackend>, SandboxRef) {
    let backend = FakeBackend::new();
    let sandbox = backend.insert(&computer(), false, true);
    (backend, sandbox)
}

fn request(timeout_secs: u64) -> ExecRequest {
    ExecRequest {
        program: Program::Shell("work".to_owned()),
        stdin: None,
        working_dir: None,
        timeout_secs,
    }
}

async fn run_once(
    backend: &FakeBackend,
    sandbox: &SandboxRef,
    timeout_secs: u64,
    cancel: &CancellationToken,
) -> (Result<ExecOutcome, ExecError>, ExecId) {
    let exec_id = ExecId::random();
    let result = within(run(
        backend,
        sandbox,
        "/bin/sh",
        &request(timeout_secs),
        exec_id.clone(),
        LIMIT,
        &crate::backends::NoProgress,
        cancel,
    ))
    .await;
    (result, exec_id)
}

fn kills(backend: &FakeBackend) -> Vec<ExecId> {
    backend
        .log()
        .into_iter()
        .filter_map(|call| match call {
            Call::KillExec { exec_id, .. } => Some(exec_id),
            _ => None,
        })
        .collect()
}

fn position(log: &[Call], wanted: impl Fn(&Call) -> bool) -> usize {
    log.iter()
        .position(wanted)
        .unwrap_or_else(|| panic!("call not in the log: {log:#?}"))
}

#[tokio::test(start_paused = true)]
async fn normal_end_returns_output_and_code_without_a_kill() {
    let (backend, sandbox) = setup();
    backend.script_exec(ExecScript::output(
        3,
        &[(Stream::Stdout, b"out"), (Stream::Stderr, b"err")],
    ));
    let (result, _) = run_once(&backend, &sandbox, 60, &CancellationToken::new()).await;
    match result {
        Ok(ExecOutcome::Completed {
            stdout,
            stderr,
            exit_code,
            ..
        }) => {
            assert_eq!(stdout, b"out");
            assert_eq!(stderr, b"err");
            assert_eq!(exit_code, 3);
        }
        other => panic!("expected a completed command, got {other:?}"),
    }
    assert!(kills(&backend).is_empty());
}

#[tokio::test(start_paused = true)]
async fn timeout_kills_the_tree_before_returning() {
    let (backend, sandbox) = setup();
    backend.script_exec(ExecScript::Hang);
    let started = Instant::now();
    let (result, exec_id) = run_once(&backend, &sandbox, 5, &CancellationToken::new()).await;
    assert!(
        matches!(
            result,
            Ok(ExecOutcome::TimedOut {
                timeout_secs: 5,
                ..
            })
        ),
        "{result:?}"
    );
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    assert_eq!(kills(&backend), vec![exec_id.clone()]);
    // The exec stopped being read before the kill went out.
    let log = backend.log();
    let ended = position(&log, |c| matches!(c, Call::ExecEnd { .. }));
    let killed = position(&log, |c| matches!(c, Call::KillExec { .. }));
    assert!(ended < killed, "{log:#?}");
}

#[tokio::test(start_paused = true)]
async fn cancellation_kills_the_tree_before_returning() {
    // A backend that ignores the cancellation (only `run`'s own race sees it), and one that
    // notices it too and stops (either side of the race may then win; both must kill).
    let never = Arc::new(tokio::sync::Notify::new());
    for script in [ExecScript::Gate(never), ExecScript::Hang] {
        let (backend, sandbox) = setup();
        backend.script_exec(script.clone());
        let cancel = CancellationToken::new();
        let started = Instant::now();
        let task = tokio::spawn({
            let (backend, sandbox, cancel) = (backend.clone(), sandbox.clone(), cancel.clone());
            async move { run_once(&backend, &sandbox, 60, &cancel).await }
        });
        backend
            .wait_until(|log| log.iter().any(|c| matches!(c, Call::ExecStart { .. })))
            .await;
        assert!(kills(&backend).is_empty());
        cancel.cancel();
        let (result, exec_id) = within(task).await.unwrap();
        assert!(
            matches!(result, Err(ExecError::Cancelled)),
            "{script:?}: {result:?}"
        );
        assert_eq!(kills(&backend), vec![exec_id], "{script:?}");
        assert!(started.elapsed() < Duration::from_secs(60));
    }
}

#[tokio::test(start_paused = true)]
async fn output_over_the_limit_stops_the_sink_and_kills() {
    let (backend, sandbox) = setup();
    let chunk: &[u8] = b"12345678";
    backend.script_exec(ExecScript::output(
        0,
        &[
            (Stream::Stdout, chunk),
            (Stream::Stderr, chunk),
            (Stream::Stdout, chunk),
        ],
    ));
    let (result, exec_id) = run_once(&backend, &sandbox, 60, &CancellationToken::new()).await;
    assert!(
        matches!(
            result,
            Ok(ExecOutcome::OutputLimitExceeded { limit: LIMIT, .. })
        ),
        "{result:?}"
    );
    // 16 bytes crossed the limit of 10: the third chunk was never asked for.
    let pushed = backend
        .log()
        .iter()
        .filter(|c| matches!(c, Call::Output(_)))
        .count();
    assert_eq!(pushed, 2);
    assert_eq!(kills(&backend), vec![exec_id]);
}

#[tokio::test(start_paused = true)]
async fn output_exactly_at_the_limit_completes() {
    let (backend, sandbox) = setup();
    backend.script_exec(ExecScript::output(
        0,
        &[(Stream::Stdout, b"12345"), (Stream::Stderr, b"67890")],
    ));
    let (result, _) = run_once(&backend, &sandbox, 60, &CancellationToken::new()).await;
    assert!(
        matches!(result, Ok(ExecOutcome::Completed { exit_code: 0, .. })),
        "{result:?}"
    );
    assert!(kills(&backend).is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_broken_stream_kills_but_a_stopped_or_gone_computer_does_not() {
    let (backend, sandbox) = setup();
    backend.script_exec(ExecScript::Fail(BackendError::Provider(
        "stream broke".into(),
    )));
    let (result, exec_id) = run_once(&backend, &sandbox, 60, &CancellationToken::new()).await;
    assert!(
        matches!(result, Err(ExecError::Backend(BackendError::Provider(_)))),
        "{result:?}"
    );
    assert_eq!(kills(&backend), vec![exec_id.clone()]);

    backend.script_exec(ExecScript::NotRunning);
    let (result, _) = run_once(&backend, &sandbox, 60, &CancellationToken::new()).await;
    assert!(
        matches!(result, Err(ExecError::Backend(BackendError::NotRunning(_)))),
        "{result:?}"
    );
    backend.script_exec(ExecScript::Vanish);
    let (result, _) = run_once(&backend, &sandbox, 60, &CancellationToken::new()).await;
    assert!(
        matches!(result, Err(ExecError::Backend(BackendError::Vanished(_)))),
        "{result:?}"
    );
    assert_eq!(kills(&backend), vec![exec_id], "no kill after the first");
}

#[tokio::test(start_paused = true)]
async fn a_kill_sweep_that_never_answers_is_given_up_after_its_limit() {
    let (backend, sandbox) = setup();
    backend.script_exec(ExecScript::Hang);
    backend.set_delay(Op::KillExec, Duration::from_secs(24 * 3600));
    let started = Instant::now();
    let (result, _) = run_once(&backend, &sandbox, 5, &CancellationToken::new()).await;
    assert!(
        matches!(result, Ok(ExecOutcome::TimedOut { .. })),
        "{result:?}"
    );
    assert_eq!(started.elapsed(), Duration::from_secs(5) + KILL_SWEEP_LIMIT);
}
