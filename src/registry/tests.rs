//! Unit tests of the registry's rules against the fake backend, under paused tokio time: the
//! lock order of lifecycle ops and execs, FIFO execs, one default per session, no record
//! without an owner, the shutdown sweep racing session closes, and restart-once (docs/decisions.md, "Dead computers").
//!
//! [`settle`] is the one wait that is not on an event: under paused time the clock moves only
//! when every task is blocked, so it returns once all spawned work has gone as far as it can
//! (used where "queued on a lock" cannot be observed otherwise).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{Executed, Interruption, Registry, RegistryError, Removal, Session, lock};
use crate::backends::BackendError;
use crate::backends::fake::{Call, Counts, ExecScript, FakeBackend, Op, within};
use crate::config::ExecLimits;
use crate::exec::{ExecOutcome, ExecRequest, Program};
use crate::ids::{ComputerId, InstanceId, Principal};

const LIMITS: ExecLimits = ExecLimits {
    default_timeout_secs: 60,
    output_limit: 1000,
};

fn setup() -> (Arc<FakeBackend>, Arc<Registry>) {
    setup_with(crate::config::Quotas::default())
}

fn setup_with(quotas: crate::config::Quotas) -> (Arc<FakeBackend>, Arc<Registry>) {
    let backend = FakeBackend::new();
    let registry = Registry::new(
        backend.clone(),
        InstanceId::random(),
        "/bin/sh".to_owned(),
        LIMITS,
        quotas,
    );
    (backend, registry)
}

fn id(raw: &str) -> ComputerId {
    ComputerId::parse(raw).unwrap()
}

/// Takes a checkpoint of `id` (while a command runs: it keeps running) and rolls back to it.
async fn rollback_to_a_new_checkpoint(
    registry: &Registry,
    id: &ComputerId,
) -> Result<(), RegistryError> {
    let owner = Principal::default_principal();
    let sandbox = registry.find(id).await?;
    let name = crate::backends::checkpoints::CheckpointName::random("c");
    within(registry.checkpoint(&sandbox, &owner, Some(name.clone()), None)).await?;
    within(registry.rollback(id, &owner, &name, Registry::no_progress()))
        .await
        .map(drop)
}

fn request(command: &str) -> ExecRequest {
    ExecRequest {
        program: Program::Shell(command.to_owned()),
        stdin: None,
        working_dir: None,
        timeout_secs: 60,
    }
}

async fn execute(
    registry: &Registry,
    session: &Session,
    computer: Option<&ComputerId>,
    temporary: bool,
    command: &str,
) -> Result<Executed, RegistryError> {
    within(registry.execute(
        session,
        computer.cloned(),
        temporary,
        &request(command),
        Registry::no_progress(),
        &CancellationToken::new(),
    ))
    .await
}

fn spawn_execute(
    registry: &Arc<Registry>,
    session: &Arc<Session>,
    computer: Option<&ComputerId>,
    temporary: bool,
    command: &str,
) -> JoinHandle<Result<Executed, RegistryError>> {
    let (registry, session) = (registry.clone(), session.clone());
    let (computer, command) = (computer.cloned(), command.to_owned());
    tokio::spawn(async move {
        execute(&registry, &session, computer.as_ref(), temporary, &command).await
    })
}

async fn join<T>(task: JoinHandle<T>) -> T {
    within(task).await.unwrap()
}

/// Returns once every other task is blocked (see the module doc).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

fn exit_code(result: &Result<Executed, RegistryError>) -> i64 {
    match result {
        Ok(Executed {
            outcome: ExecOutcome::Completed { exit_code, .. },
            ..
        }) => *exit_code,
        other => panic!(
            "expected a completed command, got {:?}",
            other.as_ref().map(|e| &e.outcome)
        ),
    }
}

/// Commands in the order their execs started.
fn exec_starts(backend: &FakeBackend) -> Vec<String> {
    backend
        .log()
        .into_iter()
        .filter_map(|call| match call {
            Call::ExecStart { command, .. } => Some(command),
            _ => None,
        })
        .collect()
}

fn started(command: &str) -> impl Fn(&Call) -> bool + '_ {
    move |call| matches!(call, Call::ExecStart { command: c, .. } if c == command)
}

fn position(log: &[Call], wanted: impl Fn(&Call) -> bool) -> usize {
    log.iter()
        .position(wanted)
        .unwrap_or_else(|| panic!("call not in the log: {log:#?}"))
}

/// The computers the registry holds a record of.
fn recorded(registry: &Registry) -> HashSet<ComputerId> {
    lock(&registry.slots)
        .iter()
        .filter(|(_, slot)| lock(&slot.state).record.is_some())
        .map(|(id, _)| id.clone())
        .collect()
}

/// docs/decisions.md, "Sessions, holders and leases": a record exists only while some session (or an unexpired lease) holds the computer.
fn assert_every_record_has_an_owner(registry: &Registry) {
    for (id, slot) in lock(&registry.slots).iter() {
        let state = lock(&slot.state);
        if state.record.is_some() {
            assert!(
                !state.owners.is_empty() || state.lease_until.is_some(),
                "computer '{id}' is recorded without an owner"
            );
        }
    }
}

// Lock order: lifecycle ops and execs on one computer.

#[tokio::test(start_paused = true)]
async fn a_lifecycle_op_interrupts_the_exec_in_flight_and_waits_for_its_kill() {
    for op in [
        Interruption::Restart,
        Interruption::Reset,
        Interruption::Delete,
        Interruption::Rollback,
    ] {
        let (backend, registry) = setup();
        let session = registry.open_session(Principal::default_principal());
        let box_id = id("box");
        execute(&registry, &session, Some(&box_id), false, "warm")
            .await
            .unwrap();
        backend.script_exec_on(&box_id, ExecScript::Hang);
        let long = spawn_execute(&registry, &session, Some(&box_id), false, "long");
        backend
            .wait_until(|log| log.iter().any(started("long")))
            .await;

        let lifecycle_call = match op {
            Interruption::Restart => {
                within(registry.restart(&box_id, &Principal::default_principal()))
                    .await
                    .map(drop)
            }
            Interruption::Reset => within(registry.factory_reset(
                &box_id,
                &Principal::default_principal(),
                Registry::no_progress(),
            ))
            .await
            .map(drop),
            Interruption::Delete => within(registry.delete(&box_id)).await,
            Interruption::Rollback => rollback_to_a_new_checkpoint(&registry, &box_id).await,
        };
        lifecycle_call.unwrap();
        match join(long).await {
            Err(RegistryError::Interrupted { id, op: got }) => {
                assert_eq!(id, box_id);
                assert_eq!(got, op);
            }
            other => panic!(
                "{op:?}: expected an interruption, got {:?}",
                other.map(|e| e.outcome)
            ),
        }
        // The provider-side op began only after the exec was dropped and its tree killed.
        let log = backend.log();
        let ended = position(
            &log,
            |c| matches!(c, Call::ExecEnd { command, .. } if command == "long"),
        );
        let killed = position(&log, |c| matches!(c, Call::KillExec { .. }));
        let lifecycle = position(&log, |c| matches!(c, Call::Restart(_) | Call::Remove(_)));
        assert!(ended < killed && killed < lifecycle, "{op:?}: {log:#?}");
        assert_eq!(backend.counts(&box_id).kill_exec, 1, "{op:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn an_exec_arriving_during_a_restart_waits_and_runs_on_the_new_incarnation() {
    let (backend, registry) = setup();
    let session = registry.open_session(Principal::default_principal());
    let box_id = id("box");
    let before = execute(&registry, &session, Some(&box_id), false, "warm")
        .await
        .unwrap()
        .sandbox;
    backend.set_delay(Op::Restart, Duration::from_secs(30));
    let restart = tokio::spawn({
        let (registry, box_id) = (registry.clone(), box_id.clone());
        async move {
            registry
                .restart(&box_id, &Principal::default_principal())
                .await
        }
    });
    backend
        .wait_until(|log| log.iter().any(|c| matches!(c, Call::Restart(_))))
        .await;
    let after = spawn_execute(&registry, &session, Some(&box_id), false, "after");
    settle().await;
    assert!(
        !backend.log().iter().any(started("after")),
        "an exec ran during the restart"
    );

    let restarted = join(restart).await.unwrap().sandbox;
    assert_ne!(restarted.sandbox_id, before.sandbox_id);
    let after = join(after).await.unwrap();
    assert_eq!(after.sandbox, restarted);
    let log = backend.log();
    let done = position(&log, |c| matches!(c, Call::Restarted(_)));
    let ran = position(&log, started("after"));
    assert!(done < ran, "{log:#?}");
    match &log[ran] {
        Call::ExecStart { sandbox_id, .. } => assert_eq!(sandbox_id, &restarted.sandbox_id),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn an_exec_queued_behind_a_delete_reports_the_computer_gone() {
    let (backend, registry) = setup();
    let session = registry.open_session(Principal::default_principal());
    let box_id = id("box");
    execute(&registry, &session, Some(&box_id), false, "warm")
        .await
        .unwrap();
    backend.set_delay(Op::Remove, Duration::from_secs(30));
    let delete = tokio::spawn({
        let (registry, box_id) = (registry.clone(), box_id.clone());
        async move { registry.delete(&box_id).await }
    });
    backend
        .wait_until(|log| log.iter().any(|c| matches!(c, Call::Remove(_))))
        .await;
    let queued = spawn_execute(&registry, &session, Some(&box_id), false, "queued");
    join(delete).await.unwrap();
    match join(queued).await {
        Err(RegistryError::Backend(BackendError::Vanished(gone))) => assert_eq!(gone, box_id),
        other => panic!("expected Vanished, got {:?}", other.map(|e| e.outcome)),
    }
    assert!(!backend.log().iter().any(started("queued")));
    assert!(recorded(&registry).is_empty());
    assert_eq!(session.owned_mode(&box_id), None);
}

// FIFO execs on one computer.

#[tokio::test(start_paused = true)]
async fn execs_on_one_computer_run_one_at_a_time_in_arrival_order() {
    let (backend, registry) = setup();
    let box_id = id("box");
    let gate = Arc::new(Notify::new());
    backend.script_exec_on(&box_id, ExecScript::Gate(gate.clone()));
    let first_session = registry.open_session(Principal::default_principal());
    let first = spawn_execute(&registry, &first_session, Some(&box_id), false, "first");
    backend
        .wait_until(|log| log.iter().any(started("first")))
        .await;
    // Later execs take a while each, so an unfair lock would let a later one overtake.
    backend.set_delay(Op::Exec, Duration::from_secs(1));

    let mut queued = Vec::new();
    for command in ["second", "third", "fourth", "fifth"] {
        // Each from its own session: the order holds across sessions.
        let session = registry.open_session(Principal::default_principal());
        queued.push(spawn_execute(
            &registry,
            &session,
            Some(&box_id),
            false,
            command,
        ));
        settle().await;
    }
    assert_eq!(exec_starts(&backend), ["first"], "execs ran concurrently");
    gate.notify_one();
    assert_eq!(exit_code(&join(first).await), 0);
    for task in queued {
        assert_eq!(exit_code(&join(task).await), 0);
    }
    assert_eq!(
        exec_starts(&backend),
        ["first", "second", "third", "fourth", "fifth"]
    );
    // One at a time: every exec ended before the next started.
    let mut running = None;
    for call in backend.log() {
        match call {
            Call::ExecStart { command, .. } => {
                assert_eq!(running, None, "{command} started while another ran");
                running = Some(command);
            }
            Call::ExecEnd { command, .. } => {
                assert_eq!(running.take(), Some(command));
            }
            _ => {}
        }
    }
}

// One default computer per session.

#[tokio::test(start_paused = true)]
async fn concurrent_first_calls_of_a_session_create_exactly_one_default() {
    let (backend, registry) = setup();
    backend.set_delay(Op::Create, Duration::from_secs(5));
    let session = registry.open_session(Principal::default_principal());
    let calls: Vec<_> = (0..8)
        .map(|n| spawn_execute(&registry, &session, None, true, &format!("call{n}")))
        .collect();
    let mut ids = HashSet::new();
    for call in calls {
        ids.insert(join(call).await.unwrap().sandbox.computer_id);
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    let default = ids.into_iter().next().unwrap();
    assert_eq!(session.default_id(), Some(default.clone()));
    let creates = backend
        .log()
        .iter()
        .filter(|c| matches!(c, Call::Create(_)))
        .count();
    assert_eq!(creates, 1);
    assert_eq!(backend.counts(&default).exec, 8);

    // Defaults are per session.
    let other = registry.open_session(Principal::default_principal());
    let theirs = execute(&registry, &other, None, true, "other")
        .await
        .unwrap()
        .sandbox
        .computer_id;
    assert_ne!(theirs, default);
    assert_eq!(other.default_id(), Some(theirs));
}

// No record without an owner.

#[tokio::test(start_paused = true)]
async fn closing_sessions_leaves_no_record_without_an_owner() {
    let (backend, registry) = setup();
    let (one, two) = (
        registry.open_session(Principal::default_principal()),
        registry.open_session(Principal::default_principal()),
    );
    let (shared, kept) = (id("shared"), id("kept"));
    execute(&registry, &one, Some(&shared), true, "a")
        .await
        .unwrap();
    execute(&registry, &two, Some(&shared), true, "b")
        .await
        .unwrap();
    execute(&registry, &one, Some(&kept), false, "c")
        .await
        .unwrap();
    let default = execute(&registry, &one, None, true, "d")
        .await
        .unwrap()
        .sandbox
        .computer_id;
    assert_every_record_has_an_owner(&registry);

    within(registry.close_session(&one)).await;
    assert_every_record_has_an_owner(&registry);
    // Still held by `two`: kept and not removed.
    assert_eq!(recorded(&registry), HashSet::from([shared.clone()]));
    assert_eq!(backend.counts(&shared).remove, 0);
    // Permanent: forgotten here, left alone provider-side.
    assert!(backend.exists(&kept));
    assert_eq!(backend.counts(&kept).remove, 0);
    // The default was temporary and only `one` held it.
    assert_eq!(backend.counts(&default).remove, 1);
    assert!(!backend.exists(&default));

    within(registry.close_session(&two)).await;
    assert!(recorded(&registry).is_empty());
    assert_eq!(backend.counts(&shared).remove, 1);
    assert!(!backend.exists(&shared));
    assert!(lock(&registry.slots).is_empty(), "idle slots were kept");
}

#[tokio::test(start_paused = true)]
async fn closing_a_session_interrupts_the_exec_on_its_temporary_computer() {
    let (backend, registry) = setup();
    let session = registry.open_session(Principal::default_principal());
    let scratch = id("scratch");
    backend.script_exec_on(&scratch, ExecScript::Hang);
    let long = spawn_execute(&registry, &session, Some(&scratch), true, "long");
    backend
        .wait_until(|log| log.iter().any(started("long")))
        .await;
    within(registry.close_session(&session)).await;
    assert!(matches!(
        join(long).await,
        Err(RegistryError::Interrupted {
            op: Interruption::Delete,
            ..
        })
    ));
    assert_eq!(backend.counts(&scratch).remove, 1);
    assert!(recorded(&registry).is_empty());
}

#[tokio::test(start_paused = true)]
async fn removal_hooks_hear_a_reset_as_replaced_and_a_delete_as_gone() {
    let (_backend, registry) = setup();
    let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = heard.clone();
    registry.on_removed(Box::new(move |id, how| {
        lock(&sink).push((id.to_string(), how));
    }));
    let session = registry.open_session(Principal::default_principal());
    let box_id = id("box");
    execute(&registry, &session, Some(&box_id), false, "a")
        .await
        .unwrap();
    within(registry.restart(&box_id, &Principal::default_principal()))
        .await
        .unwrap();
    assert!(lock(&heard).is_empty(), "a restart removes nothing");
    within(registry.factory_reset(
        &box_id,
        &Principal::default_principal(),
        Registry::no_progress(),
    ))
    .await
    .unwrap();
    within(registry.delete(&box_id)).await.unwrap();
    assert_eq!(
        *lock(&heard),
        [
            ("box".to_owned(), Removal::Replaced),
            ("box".to_owned(), Removal::Gone)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn delete_drops_every_sessions_hold() {
    let (backend, registry) = setup();
    let (one, two) = (
        registry.open_session(Principal::default_principal()),
        registry.open_session(Principal::default_principal()),
    );
    let shared = id("shared");
    execute(&registry, &one, Some(&shared), false, "a")
        .await
        .unwrap();
    execute(&registry, &two, Some(&shared), false, "b")
        .await
        .unwrap();
    within(registry.delete(&shared)).await.unwrap();
    assert!(recorded(&registry).is_empty());
    assert!(!backend.exists(&shared));
    // `two` no longer holds it in either mode: asking for it temporary now creates it so.
    let again = execute(&registry, &two, Some(&shared), true, "c")
        .await
        .unwrap();
    assert!(again.sandbox.temporary);
    assert_eq!(backend.counts(&shared).create, 2);
    assert_every_record_has_an_owner(&registry);
}

// Shutdown sweep racing session closes.

/// Three temporary computers, `a` and `b` held by the first session and `c` by the second.
async fn three_temporaries(registry: &Registry) -> (Arc<Session>, Arc<Session>, [ComputerId; 3]) {
    let (one, two) = (
        registry.open_session(Principal::default_principal()),
        registry.open_session(Principal::default_principal()),
    );
    let ids = [id("a"), id("b"), id("c")];
    for (session, computer) in [(&one, &ids[0]), (&one, &ids[1]), (&two, &ids[2])] {
        execute(registry, session, Some(computer), true, "x")
            .await
            .unwrap();
    }
    (one, two, ids)
}

fn assert_each_removed_once(backend: &FakeBackend, registry: &Registry, ids: &[ComputerId]) {
    for computer in ids {
        assert_eq!(backend.counts(computer).remove, 1, "{computer}");
        assert!(!backend.exists(computer), "{computer}");
    }
    assert!(registry.temporary_ids().is_empty());
    assert!(recorded(registry).is_empty());
}

#[tokio::test(start_paused = true)]
async fn shutdown_sweep_during_a_session_close_removes_each_temporary_once() {
    let (backend, registry) = setup();
    let (one, _two, ids) = three_temporaries(&registry).await;
    backend.set_delay(Op::Remove, Duration::from_secs(10));
    let close = tokio::spawn({
        let (registry, one) = (registry.clone(), one.clone());
        async move { registry.close_session(&one).await }
    });
    // The close is removing one of its computers when the sweep starts.
    backend
        .wait_until(|log| log.iter().any(|c| matches!(c, Call::Remove(_))))
        .await;
    let failed = within(registry.remove_all_temporary()).await;
    // The sweep returned only once the removal it found in progress had finished.
    for computer in &ids {
        assert!(
            !backend.exists(computer),
            "{computer} still exists after the sweep"
        );
    }
    join(close).await;
    assert!(failed.is_empty(), "{failed:?}");
    assert_each_removed_once(&backend, &registry, &ids);
}

#[tokio::test(start_paused = true)]
async fn session_close_during_the_shutdown_sweep_removes_each_temporary_once() {
    let (backend, registry) = setup();
    let (one, two, ids) = three_temporaries(&registry).await;
    backend.set_delay(Op::Remove, Duration::from_secs(10));
    let sweep = tokio::spawn({
        let registry = registry.clone();
        async move { registry.remove_all_temporary().await }
    });
    backend
        .wait_until(|log| log.iter().any(|c| matches!(c, Call::Remove(_))))
        .await;
    within(registry.close_session(&one)).await;
    within(registry.close_session(&two)).await;
    let failed = join(sweep).await;
    assert!(failed.is_empty(), "{failed:?}");
    assert_each_removed_once(&backend, &registry, &ids);
}

#[tokio::test(start_paused = true)]
async fn shutdown_sweep_waits_for_a_creation_in_progress_and_removes_it() {
    let (backend, registry) = setup();
    let session = registry.open_session(Principal::default_principal());
    let fresh = id("fresh");
    backend.set_delay(Op::Create, Duration::from_secs(10));
    let call = spawn_execute(&registry, &session, Some(&fresh), true, "x");
    backend
        .wait_until(|log| log.iter().any(|c| matches!(c, Call::Create(_))))
        .await;
    let failed = within(registry.remove_all_temporary()).await;
    assert!(failed.is_empty(), "{failed:?}");
    // Whether the exec got in before the removal or not, the computer is gone exactly once.
    let _ = join(call).await;
    assert_eq!(backend.counts(&fresh).create, 1);
    assert_eq!(backend.counts(&fresh).remove, 1);
    assert!(!backend.exists(&fresh));
    assert!(registry.temporary_ids().is_empty());
}

#[tokio::test(start_paused = true)]
async fn nothing_is_created_after_the_shutdown_sweep_starts() {
    let (backend, registry) = setup();
    within(registry.remove_all_temporary()).await;
    let session = registry.open_session(Principal::default_principal());
    let late = id("late");
    match execute(&registry, &session, Some(&late), true, "x").await {
        Err(RegistryError::ShuttingDown(refused)) => assert_eq!(refused, late),
        other => panic!("expected ShuttingDown, got {:?}", other.map(|e| e.outcome)),
    }
    assert_eq!(backend.counts(&late), Counts::default());
    assert!(lock(&registry.slots).is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_failed_removal_keeps_the_record_for_the_shutdown_sweep() {
    let (backend, registry) = setup();
    let (one, two, [a, b, c]) = three_temporaries(&registry).await;
    backend.fail_removes(&a, 1);
    backend.fail_removes(&b, 2);
    within(registry.close_session(&one)).await;
    // Both removals failed: both stay recorded, owner-less, for the sweep to try again (the
    // one exception to "no record without an owner").
    assert_eq!(
        registry.temporary_ids(),
        vec![a.clone(), b.clone(), c.clone()]
    );
    let failed = within(registry.remove_all_temporary()).await;
    assert_eq!(failed, vec![b.clone()]);
    assert_eq!(backend.counts(&a).remove, 2);
    assert!(!backend.exists(&a));
    assert_eq!(backend.counts(&b).remove, 2);
    assert!(backend.exists(&b));
    assert_eq!(backend.counts(&c).remove, 1);
    within(registry.close_session(&two)).await;
    assert_eq!(backend.counts(&c).remove, 1, "removed twice");
}

#[tokio::test(start_paused = true)]
async fn shutdown_kills_execs_in_flight_on_permanent_computers_itself() {
    let (backend, registry) = setup();
    let session = registry.open_session(Principal::default_principal());
    let (kept, scratch) = (id("kept"), id("scratch"));
    backend.script_exec_on(&kept, ExecScript::Hang);
    backend.script_exec_on(&scratch, ExecScript::Hang);
    let on_kept = spawn_execute(&registry, &session, Some(&kept), false, "p");
    let on_scratch = spawn_execute(&registry, &session, Some(&scratch), true, "t");
    backend
        .wait_until(|log| log.iter().any(started("p")) && log.iter().any(started("t")))
        .await;
    within(registry.kill_all_in_flight()).await;
    // The sweep's own kill is already done for the permanent computer, none for the temporary.
    assert_eq!(backend.counts(&kept).kill_exec, 1);
    for task in [on_kept, on_scratch] {
        assert!(matches!(
            join(task).await,
            Err(RegistryError::Interrupted {
                op: Interruption::Delete,
                ..
            })
        ));
    }
    // Then each cancelled exec::run killed its own tree too.
    assert_eq!(backend.counts(&kept).kill_exec, 2);
    assert_eq!(backend.counts(&scratch).kill_exec, 1);
}

// Restart-once on NotRunning (docs/decisions.md, "Dead computers").

#[tokio::test(start_paused = true)]
async fn a_stopped_computer_is_started_once_and_the_command_retried() {
    let (backend, registry) = setup();
    let session = registry.open_session(Principal::default_principal());
    let box_id = id("box");
    execute(&registry, &session, Some(&box_id), false, "warm")
        .await
        .unwrap();
    backend.stop(&box_id);
    let result = execute(&registry, &session, Some(&box_id), false, "again").await;
    assert_eq!(exit_code(&result), 0);
    let counts = backend.counts(&box_id);
    assert_eq!(counts.ensure_running, 1);
    assert_eq!(counts.exec, 3, "warm, the failed try, the retry");
    assert!(backend.is_running(&box_id));
}

#[tokio::test(start_paused = true)]
async fn not_running_again_after_the_restart_is_an_error_not_a_loop() {
    let (backend, registry) = setup();
    let session = registry.open_session(Principal::default_principal());
    let box_id = id("box");
    execute(&registry, &session, Some(&box_id), false, "warm")
        .await
        .unwrap();
    for _ in 0..3 {
        backend.script_exec_on(&box_id, ExecScript::NotRunning);
    }
    let result = execute(&registry, &session, Some(&box_id), false, "again").await;
    assert!(
        matches!(
            result,
            Err(RegistryError::Backend(BackendError::NotRunning(_)))
        ),
        "{:?}",
        result.map(|e| e.outcome)
    );
    let counts = backend.counts(&box_id);
    assert_eq!(counts.ensure_running, 1);
    assert_eq!(counts.exec, 3, "warm, the try, one retry");
    // The computer is still held: a stopped computer is not a vanished one.
    assert_eq!(recorded(&registry), HashSet::from([box_id]));
}

#[tokio::test(start_paused = true)]
async fn not_running_on_a_computer_that_is_gone_drops_it_everywhere() {
    let (backend, registry) = setup();
    let session = registry.open_session(Principal::default_principal());
    let default = execute(&registry, &session, None, false, "warm")
        .await
        .unwrap()
        .sandbox
        .computer_id;
    backend.vanish(&default);
    backend.script_exec_on(&default, ExecScript::NotRunning);
    match execute(&registry, &session, None, false, "again").await {
        Err(RegistryError::Backend(BackendError::Vanished(gone))) => assert_eq!(gone, default),
        other => panic!("expected Vanished, got {:?}", other.map(|e| e.outcome)),
    }
    assert_eq!(backend.counts(&default).ensure_running, 1);
    assert!(recorded(&registry).is_empty());
    assert_eq!(session.default_id(), None);
    // The next omitted-id call gets a new default.
    let next = execute(&registry, &session, None, false, "next")
        .await
        .unwrap()
        .sandbox
        .computer_id;
    assert_ne!(next, default);
    assert_eq!(session.default_id(), Some(next));
}

#[tokio::test(start_paused = true)]
async fn the_running_limit_holds_however_a_stopped_computer_would_start() {
    let (backend, registry) = setup_with(crate::config::Quotas {
        max_computers: None,
        max_running: Some(1),
    });
    let owner = Principal::default_principal();
    let session = registry.open_session(owner.clone());
    let (stopped, other) = (id("stopped"), id("other"));
    execute(&registry, &session, Some(&stopped), false, "warm")
        .await
        .unwrap();
    backend.stop(&stopped);
    backend.insert(&other, false, true);
    let refused = |result: Result<(), RegistryError>| match result {
        Err(RegistryError::QuotaReached(message)) => message.contains("--max-running-per-user"),
        _ => false,
    };
    // The exec's restart-once, restart and factory reset are each refused.
    let by_command = execute(&registry, &session, Some(&stopped), false, "again").await;
    assert!(refused(by_command.map(drop)));
    let restart = within(registry.restart(&stopped, &owner)).await;
    assert!(refused(restart.map(drop)));
    let reset = within(registry.factory_reset(&stopped, &owner, Registry::no_progress())).await;
    assert!(refused(reset.map(drop)));
    assert!(!backend.is_running(&stopped) && backend.exists(&stopped));
    // Limits that cannot be checked refuse rather than admit.
    backend.fail_lists(1);
    let unknown = within(registry.restart(&stopped, &owner)).await;
    assert!(
        matches!(&unknown, Err(RegistryError::QuotaUnknown(m)) if m == "inventory unavailable"),
        "{:?}",
        unknown.map(drop)
    );
    // A running computer is restarted without counting it twice.
    within(registry.restart(&other, &owner)).await.unwrap();
    backend.vanish(&other);
    within(registry.restart(&stopped, &owner)).await.unwrap();
    assert!(backend.is_running(&stopped));
}

// See: issue 30 (item 3)
#[tokio::test(start_paused = true)]
async fn issue_30_work_that_finds_a_computer_stopped_starts_it_through_the_running_limit() {
    let (backend, registry) = setup_with(crate::config::Quotas {
        max_computers: None,
        max_running: Some(1),
    });
    let session = registry.open_session(Principal::default_principal());
    let (stopped, other) = (id("stopped"), id("other"));
    let sandbox = execute(&registry, &session, Some(&stopped), false, "warm")
        .await
        .unwrap()
        .sandbox;
    backend.stop(&stopped);
    backend.insert(&other, false, true);
    match within(registry.start_stopped(&session, &sandbox)).await {
        Err(RegistryError::QuotaReached(message)) => {
            assert!(message.contains("--max-running-per-user"), "{message}");
        }
        other => panic!("expected the running limit, got {other:?}"),
    }
    assert!(!backend.is_running(&stopped));
    assert_eq!(backend.counts(&stopped).ensure_running, 0);
    // With the other one gone it starts, once; starting it again costs no admission.
    backend.vanish(&other);
    let started = within(registry.start_stopped(&session, &sandbox))
        .await
        .unwrap();
    assert!(backend.is_running(&stopped));
    within(registry.start_stopped(&session, &started))
        .await
        .unwrap();
    // Another principal's computer is not started for this session.
    let stranger = registry.open_session(Principal::parse("mallory").unwrap());
    assert!(matches!(
        within(registry.start_stopped(&stranger, &sandbox)).await,
        Err(RegistryError::NotFound(_))
    ));
}

// See: issue 30 (item 14)
#[tokio::test(start_paused = true)]
async fn issue_30_execs_queued_when_a_lifecycle_op_begins_are_interrupted_and_never_run() {
    for op in [
        Interruption::Restart,
        Interruption::Reset,
        Interruption::Delete,
        Interruption::Rollback,
    ] {
        let (backend, registry) = setup();
        let owner = Principal::default_principal();
        let session = registry.open_session(owner.clone());
        let box_id = id("box");
        execute(&registry, &session, Some(&box_id), false, "warm")
            .await
            .unwrap();
        backend.script_exec_on(&box_id, ExecScript::Hang);
        let long = spawn_execute(&registry, &session, Some(&box_id), false, "long");
        backend
            .wait_until(|log| log.iter().any(started("long")))
            .await;
        let queued: Vec<_> = (0..2)
            .map(|n| spawn_execute(&registry, &session, Some(&box_id), false, &format!("q{n}")))
            .collect();
        settle().await;
        match op {
            Interruption::Restart => within(registry.restart(&box_id, &owner)).await.map(drop),
            Interruption::Reset => {
                within(registry.factory_reset(&box_id, &owner, Registry::no_progress()))
                    .await
                    .map(drop)
            }
            Interruption::Delete => within(registry.delete(&box_id)).await,
            Interruption::Rollback => rollback_to_a_new_checkpoint(&registry, &box_id).await,
        }
        .unwrap();
        for task in std::iter::once(long).chain(queued) {
            match join(task).await {
                Err(RegistryError::Interrupted { id: got, op: by }) => {
                    assert_eq!((got, by), (box_id.clone(), op));
                }
                other => panic!(
                    "{op:?}: expected an interruption, got {:?}",
                    other.map(|e| e.outcome)
                ),
            }
        }
        assert_eq!(exec_starts(&backend), ["warm", "long"], "{op:?}");
        // A command that arrives afterwards runs (on the new incarnation, or creates anew).
        let after = execute(&registry, &session, Some(&box_id), false, "after").await;
        assert_eq!(exit_code(&after), 0, "{op:?}");
    }
}

// See: issue 30 (item 15)
#[tokio::test(start_paused = true)]
async fn issue_30_a_reset_whose_creation_fails_leaves_no_record_of_the_removed_computer() {
    let (backend, registry) = setup();
    let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = heard.clone();
    registry.on_removed(Box::new(move |id, how| {
        lock(&sink).push((id.to_string(), how));
    }));
    let owner = Principal::default_principal();
    let session = registry.open_session(owner.clone());
    let box_id = id("box");
    let before = execute(&registry, &session, Some(&box_id), false, "warm")
        .await
        .unwrap()
        .sandbox;
    backend.fail_creates(&box_id, 1);
    let failed = within(registry.factory_reset(&box_id, &owner, Registry::no_progress())).await;
    assert!(
        matches!(
            failed,
            Err(RegistryError::Backend(BackendError::Provider(_)))
        ),
        "{failed:?}"
    );
    assert!(!backend.exists(&box_id));
    assert!(
        recorded(&registry).is_empty(),
        "a record of the removed computer"
    );
    assert_eq!(session.owned_mode(&box_id), None);
    assert_eq!(
        *lock(&heard),
        [
            ("box".to_owned(), Removal::Replaced),
            ("box".to_owned(), Removal::Gone)
        ]
    );
    // The next command creates it instead of reporting it vanished.
    let again = execute(&registry, &session, Some(&box_id), false, "again").await;
    assert_eq!(exit_code(&again), 0);
    assert_ne!(again.unwrap().sandbox.sandbox_id, before.sandbox_id);
    assert_every_record_has_an_owner(&registry);
    // A reset that fails before removing anything keeps the computer and its record.
    backend.fail_removes(&box_id, 1);
    assert!(
        within(registry.factory_reset(&box_id, &owner, Registry::no_progress()))
            .await
            .is_err()
    );
    assert!(backend.exists(&box_id));
    assert_eq!(recorded(&registry), HashSet::from([box_id]));
}

// Idle stop (docs/idle-stop.md). Rounds are run by hand: the background ticker only repeats
// them.

const IDLE: Duration = Duration::from_secs(60);

fn never_busy() -> Box<super::BusyCheck> {
    Box::new(|_| Box::pin(async { false }))
}

async fn idle_round(registry: &Registry) {
    within(registry.stop_idle_computers(&*never_busy())).await;
}

#[tokio::test(start_paused = true)]
async fn idle_stop_stops_a_permanent_computer_only_after_a_full_period_without_use() {
    let (backend, registry) = setup();
    registry.enable_idle_stop(IDLE);
    let session = registry.open_session(Principal::default_principal());
    let box_id = id("box");
    execute(&registry, &session, Some(&box_id), false, "one")
        .await
        .unwrap();
    tokio::time::advance(IDLE * 2 / 3).await;
    execute(&registry, &session, Some(&box_id), false, "two")
        .await
        .unwrap();
    tokio::time::advance(IDLE * 2 / 3).await;
    idle_round(&registry).await;
    assert!(backend.is_running(&box_id), "used 40 s ago: not idle yet");
    assert!(registry.idle_stop_at(&box_id).is_some());
    tokio::time::advance(IDLE / 3 + Duration::from_secs(1)).await;
    idle_round(&registry).await;
    assert!(!backend.is_running(&box_id));
    assert_eq!(backend.counts(&box_id).stop_idle, 1);
    assert_eq!(
        registry.idle_stop_at(&box_id),
        None,
        "a stopped computer has no deadline"
    );
    // The next use starts it again, transparently.
    let result = execute(&registry, &session, Some(&box_id), false, "three").await;
    assert_eq!(exit_code(&result), 0);
    assert!(backend.is_running(&box_id));
    assert_eq!(backend.counts(&box_id).ensure_running, 1);
}

#[tokio::test(start_paused = true)]
async fn idle_stop_is_not_held_off_by_listing() {
    let (backend, registry) = setup();
    registry.enable_idle_stop(IDLE);
    let session = registry.open_session(Principal::default_principal());
    let box_id = id("box");
    execute(&registry, &session, Some(&box_id), false, "one")
        .await
        .unwrap();
    for _ in 0..61 {
        tokio::time::advance(Duration::from_secs(1)).await;
        let (rows, _) = within(registry.list(&Principal::default_principal())).await;
        assert_eq!(rows.len(), 1);
        within(registry.find(&box_id)).await.unwrap();
    }
    idle_round(&registry).await;
    assert!(!backend.is_running(&box_id));
}

#[tokio::test(start_paused = true)]
async fn idle_stop_leaves_temporary_computers_and_work_in_progress_alone() {
    let (backend, registry) = setup();
    registry.enable_idle_stop(IDLE);
    let session = registry.open_session(Principal::default_principal());
    let scratch = id("scratch");
    execute(&registry, &session, Some(&scratch), true, "one")
        .await
        .unwrap();
    // A command running for longer than the period holds its computer awake.
    let busy = id("busy");
    let release = Arc::new(Notify::new());
    backend.script_exec_on(&busy, ExecScript::Gate(release.clone()));
    let running = {
        let (registry, session, busy) = (registry.clone(), session.clone(), busy.clone());
        tokio::spawn(async move {
            let long = ExecRequest {
                timeout_secs: 3600,
                ..request("long")
            };
            within(registry.execute(
                &session,
                Some(busy),
                false,
                &long,
                Registry::no_progress(),
                &CancellationToken::new(),
            ))
            .await
        })
    };
    within(backend.wait_until(|log| log.iter().any(started("long")))).await;
    tokio::time::advance(IDLE * 2).await;
    idle_round(&registry).await;
    assert!(
        backend.is_running(&scratch),
        "temporary computers are never stopped"
    );
    assert!(backend.is_running(&busy), "a command in flight is use");
    release.notify_one();
    assert_eq!(exit_code(&join(running).await), 0);
    // Its end counts as use: the period starts again from there.
    tokio::time::advance(IDLE - Duration::from_secs(1)).await;
    idle_round(&registry).await;
    assert!(backend.is_running(&busy));
    tokio::time::advance(Duration::from_secs(2)).await;
    idle_round(&registry).await;
    assert!(!backend.is_running(&busy));
    assert!(backend.is_running(&scratch));
}

#[tokio::test(start_paused = true)]
async fn idle_stop_keeps_a_computer_whose_job_runs_and_finds_computers_it_never_used() {
    let (backend, registry) = setup();
    registry.enable_idle_stop(IDLE);
    // Made by another server (or before this one started), and never used here: its clock
    // starts when a round first sees it running.
    let seen = id("seen");
    backend.insert(&seen, false, true);
    let stopped_already = id("stopped-already");
    backend.insert(&stopped_already, false, false);
    idle_round(&registry).await;
    tokio::time::advance(IDLE + Duration::from_secs(1)).await;
    let jobs_run: Box<super::BusyCheck> = Box::new(|_| Box::pin(async { true }));
    within(registry.stop_idle_computers(&*jobs_run)).await;
    assert!(backend.is_running(&seen), "a running job keeps it awake");
    // The job's check counted as use: a full period again before the next try.
    tokio::time::advance(IDLE - Duration::from_secs(1)).await;
    idle_round(&registry).await;
    assert!(backend.is_running(&seen));
    tokio::time::advance(Duration::from_secs(2)).await;
    idle_round(&registry).await;
    assert!(!backend.is_running(&seen));
    assert_eq!(backend.counts(&stopped_already).stop_idle, 0);
}

#[tokio::test(start_paused = true)]
async fn without_idle_stop_nothing_is_stopped() {
    let (backend, registry) = setup();
    let session = registry.open_session(Principal::default_principal());
    let box_id = id("box");
    execute(&registry, &session, Some(&box_id), false, "one")
        .await
        .unwrap();
    tokio::time::advance(Duration::from_secs(365 * 24 * 3600)).await;
    idle_round(&registry).await;
    assert!(backend.is_running(&box_id));
    assert_eq!(registry.idle_stop_at(&box_id), None);
    assert_eq!(registry.idle_tick(), None);
}

#[tokio::test(start_paused = true)]
async fn idle_stop_leaves_a_computer_another_server_is_using() {
    let (backend, registry) = setup();
    registry.enable_idle_stop(IDLE);
    let session = registry.open_session(Principal::default_principal());
    let shared = id("shared");
    execute(&registry, &session, Some(&shared), false, "one")
        .await
        .unwrap();
    backend.set_held_elsewhere(&shared, true);
    tokio::time::advance(IDLE + Duration::from_secs(1)).await;
    idle_round(&registry).await;
    assert!(backend.is_running(&shared));
    // Looked at again only after another full period.
    backend.set_held_elsewhere(&shared, false);
    tokio::time::advance(IDLE - Duration::from_secs(1)).await;
    idle_round(&registry).await;
    assert!(backend.is_running(&shared));
    tokio::time::advance(Duration::from_secs(2)).await;
    idle_round(&registry).await;
    assert!(!backend.is_running(&shared));
}

// Where an egress question goes (docs/egress.md, "Ask-to-allow").

#[tokio::test(start_paused = true)]
async fn an_egress_question_goes_to_the_running_call_then_holders_then_the_owner() {
    let (backend, registry) = setup();
    let owner = Principal::default_principal();
    let a = registry.open_session(owner.clone());
    let b = registry.open_session(owner.clone());
    let c = registry.open_session(owner.clone());
    let stranger = registry.open_session(Principal::named("bob").unwrap());
    let box_id = id("box");
    execute(&registry, &a, Some(&box_id), false, "warm")
        .await
        .unwrap();
    execute(&registry, &b, Some(&box_id), false, "warm")
        .await
        .unwrap();
    // Nothing runs: the holders, newest first, then the owner's other sessions.
    assert_eq!(registry.egress_audience(&box_id), [b.id(), a.id(), c.id()]);
    // The session whose call runs on it comes first.
    backend.script_exec_on(&box_id, ExecScript::Hang);
    let long = spawn_execute(&registry, &a, Some(&box_id), false, "long");
    backend
        .wait_until(|log| log.iter().any(started("long")))
        .await;
    assert_eq!(registry.egress_audience(&box_id), [a.id(), b.id(), c.id()]);
    assert!(!registry.egress_audience(&box_id).contains(&stranger.id()));
    within(registry.delete(&box_id)).await.unwrap();
    let _ = join(long).await;
    // A closed session is never asked.
    drop(c);
    assert_eq!(registry.egress_audience(&id("gone")), [b.id(), a.id()]);
}
