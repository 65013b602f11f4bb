//! Unit tests of the checkpoint rules against the fake backend: names, the limit, parents
//! and the present state through rollbacks, deletes that re-parent, fork ids, quotas, and
//! refusals that change nothing.

use std::sync::Arc;

use super::{ForkTargets, Registry, RegistryError};
use crate::backends::SandboxRef;
use crate::backends::checkpoints::CheckpointName;
use crate::backends::fake::{Call, FakeBackend, within};
use crate::config::{ExecLimits, Quotas};
use crate::ids::{ComputerId, InstanceId, Principal};
use crate::registry::{Session, Unnamed};

const LIMITS: ExecLimits = ExecLimits {
    default_timeout_secs: 60,
    output_limit: 1000,
};

fn setup(quotas: Quotas) -> (Arc<FakeBackend>, Arc<Registry>, Arc<Session>) {
    let backend = FakeBackend::new();
    let registry = Registry::new(
        backend.clone(),
        InstanceId::random(),
        "/bin/sh".to_owned(),
        LIMITS,
        quotas,
    );
    registry.enable_checkpoints();
    let session = registry.open_session(Principal::default_principal());
    (backend, registry, session)
}

fn name(raw: &str) -> CheckpointName {
    CheckpointName::parse(raw).unwrap()
}

fn id(raw: &str) -> ComputerId {
    ComputerId::parse(raw).unwrap()
}

async fn computer(registry: &Registry, session: &Session, raw: &str) -> SandboxRef {
    within(registry.acquire(
        session,
        Some(id(raw)),
        false,
        Unnamed::SessionDefault,
        Registry::no_progress(),
    ))
    .await
    .unwrap()
}

async fn take(registry: &Registry, sandbox: &SandboxRef, raw: &str) -> Result<(), RegistryError> {
    within(registry.checkpoint(
        sandbox,
        &Principal::default_principal(),
        Some(name(raw)),
        None,
    ))
    .await
    .map(drop)
}

fn parents(tree: &super::CheckpointTree) -> Vec<(String, Option<String>)> {
    tree.entries
        .iter()
        .map(|e| {
            (
                e.record.name.to_string(),
                e.parent.as_ref().map(ToString::to_string),
            )
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn checkpoints_form_a_tree_through_rollbacks_and_deletes_reparent() {
    let (_backend, registry, session) = setup(Quotas::default());
    let sandbox = computer(&registry, &session, "box").await;
    take(&registry, &sandbox, "a").await.unwrap();
    take(&registry, &sandbox, "b").await.unwrap();
    let owner = Principal::default_principal();
    let (rolled, _) =
        within(registry.rollback(&id("box"), &owner, &name("a"), Registry::no_progress()))
            .await
            .unwrap();
    assert_ne!(rolled.sandbox_id, sandbox.sandbox_id);
    take(&registry, &rolled, "c").await.unwrap();
    let tree = registry.checkpoint_tree(&id("box")).await.unwrap();
    assert_eq!(tree.current, Some(name("c")));
    assert_eq!(
        parents(&tree),
        vec![
            ("a".into(), None),
            ("b".into(), Some("a".into())),
            ("c".into(), Some("a".into()))
        ]
    );
    registry
        .delete_checkpoint(&id("box"), &name("a"))
        .await
        .unwrap();
    let tree = registry.checkpoint_tree(&id("box")).await.unwrap();
    assert_eq!(parents(&tree), vec![("b".into(), None), ("c".into(), None)]);
}

#[tokio::test(start_paused = true)]
async fn bad_input_is_refused_with_the_message_and_changes_nothing() {
    let (backend, registry, session) = setup(Quotas::default());
    let sandbox = computer(&registry, &session, "box").await;
    take(&registry, &sandbox, "a").await.unwrap();
    let duplicate = take(&registry, &sandbox, "a").await.unwrap_err();
    assert_eq!(duplicate.to_string(), "Checkpoint a already exists on box.");
    let owner = Principal::default_principal();
    let removes_before = backend
        .log()
        .iter()
        .filter(|c| matches!(c, Call::Remove(_)))
        .count();
    let unknown =
        within(registry.rollback(&id("box"), &owner, &name("zz"), Registry::no_progress()))
            .await
            .unwrap_err();
    assert_eq!(
        unknown.to_string(),
        "No checkpoint zz on box; checkpoint_list shows them."
    );
    let removes_after = backend
        .log()
        .iter()
        .filter(|c| matches!(c, Call::Remove(_)))
        .count();
    assert_eq!(removes_before, removes_after);
    let unknown = registry
        .delete_checkpoint(&id("box"), &name("zz"))
        .await
        .unwrap_err();
    assert!(unknown.to_string().starts_with("No checkpoint zz on box"));
    registry.set_max_checkpoints(2);
    take(&registry, &sandbox, "b").await.unwrap();
    let full = take(&registry, &sandbox, "c").await.unwrap_err();
    assert!(full.to_string().contains("--max-checkpoints 2"), "{full}");
    assert_eq!(backend.checkpoint_names(&id("box")), vec!["a", "b"]);
    // A fork id that exists.
    computer(&registry, &session, "taken").await;
    let exists = within(registry.fork(
        &session,
        &sandbox,
        Some(name("a")),
        ForkTargets::Named(id("taken")),
        None,
        Registry::no_progress(),
    ))
    .await
    .unwrap_err();
    assert_eq!(
        exists.to_string(),
        "Computer 'taken' already exists; choose another new_computer_id."
    );
}

#[tokio::test(start_paused = true)]
async fn forks_take_the_next_free_numbers_and_count_against_quotas() {
    let quotas = Quotas {
        max_computers: Some(4),
        max_running: None,
    };
    let (backend, registry, session) = setup(quotas);
    let sandbox = computer(&registry, &session, "box").await;
    computer(&registry, &session, "box-f1").await;
    let forked = within(registry.fork(
        &session,
        &sandbox,
        None,
        ForkTargets::Numbered(3),
        None,
        Registry::no_progress(),
    ))
    .await
    .unwrap();
    assert!(forked.checkpoint.as_str().starts_with("fork-"));
    let made: Vec<&str> = forked
        .computers
        .iter()
        .map(|s| s.computer_id.as_str())
        .collect();
    assert_eq!(made, vec!["box-f2", "box-f3"]);
    let (failed, error) = forked.failed.unwrap();
    assert_eq!(failed.as_str(), "box-f4");
    assert!(matches!(error, RegistryError::QuotaReached(_)));
    assert!(!backend.exists(&id("box-f4")));
    // Each fork starts its history at the checkpoint it came from.
    let tree = registry.checkpoint_tree(&id("box-f2")).await.unwrap();
    assert_eq!(tree.current, Some(forked.checkpoint.clone()));
    assert_eq!(parents(&tree), vec![(forked.checkpoint.to_string(), None)]);
}

#[tokio::test(start_paused = true)]
async fn a_backend_without_checkpoints_refuses_before_touching_anything() {
    let (backend, registry, _session) = setup(Quotas::default());
    backend.without_checkpoints();
    let error = registry.check_checkpoints_available().unwrap_err();
    assert_eq!(
        error.to_string(),
        "Checkpoints are not available on the fake backend."
    );
    assert!(backend.log().is_empty());
}

#[tokio::test(start_paused = true)]
async fn delete_removes_the_checkpoints_and_reset_keeps_them() {
    let (backend, registry, session) = setup(Quotas::default());
    let sandbox = computer(&registry, &session, "box").await;
    take(&registry, &sandbox, "a").await.unwrap();
    let owner = Principal::default_principal();
    within(registry.factory_reset(&id("box"), &owner, Registry::no_progress()))
        .await
        .unwrap();
    assert_eq!(backend.checkpoint_names(&id("box")), vec!["a"]);
    within(registry.delete(&id("box"))).await.unwrap();
    assert!(backend.checkpoint_names(&id("box")).is_empty());
}
