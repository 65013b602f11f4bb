//! Contract tests of the E2B backend against a local fake of E2B's published control-plane
//! API and envd process service (`fakes/e2b.py`, run as a child process). They
//! pin our request building, Connect framing, proto3-JSON decoding, retries and lifecycle
//! logic against our reading of E2B's definitions; they cannot show that the real service
//! behaves that way (docs/decisions.md, "Contract tests against fakes"), hence the names.
//!
//! The fake backs sandboxes with local Docker containers, so tests that create sandboxes need
//! the test environment's engine and `sandbox-busybox:full` (`KILNTAINERS_IT_DOCKER=1`); the
//! key and retry tests need only Python. The fake and the backend pointed at it live in
//! `common::e2b`; what every backend must do is in `suite::contract`.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use mcp_sandbox_computer_vm_for_ai::backends::{ExecEnd, ExecSpec, NoProgress};
use mcp_sandbox_computer_vm_for_ai::exec::{self, ExecOutcome, ExecRequest, Program};
use mcp_sandbox_computer_vm_for_ai::ids::{ComputerId, ExecId, InstanceId};

use super::contract::{self, Harness, OUTPUT_LIMIT_FLAG};
use crate::common::e2b::{Fake, KEY, backend_with};
use crate::common::{Collect, computer, create_spec, enabled, run};

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
        .create(&create_spec(&id, true, &instance), &NoProgress)
        .await
        .unwrap();
    let second = backend
        .create(&create_spec(&other, false, &instance), &NoProgress)
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
        .create(&create_spec(&id, true, &InstanceId::random()), &NoProgress)
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
        &mcp_sandbox_computer_vm_for_ai::backends::NoProgress,
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
        &mcp_sandbox_computer_vm_for_ai::backends::NoProgress,
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
        &mcp_sandbox_computer_vm_for_ai::backends::NoProgress,
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
        .create(&create_spec(&orphan, true, &dead), &NoProgress)
        .await
        .unwrap();
    backend
        .create(&create_spec(&kept, true, &alive), &NoProgress)
        .await
        .unwrap();
    let perm = backend
        .create(&create_spec(&permanent, false, &dead), &NoProgress)
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

/// How many of the fake's `process.Process/Start` calls ran a program whose arguments include
/// `marker` (the file programs run as `sh -c <program> kilntainers-file …`).
async fn starts_with_arg(fake: &Fake, marker: &str) -> usize {
    fake.requests_to("POST", "/process.Process/Start")
        .await
        .iter()
        .filter(|r| {
            r["body"]["process"]["args"]
                .as_array()
                .is_some_and(|args| args.iter().any(|a| a == marker))
        })
        .count()
}

/// The contract suite's file cases, run again against a fake this test keeps, to show which
/// way the files went: through envd's own file API (`/files`, `filesystem.Filesystem`), with the
/// shell programs only for what envd cannot do (an append) and one `chmod` for a mode.
#[tokio::test]
async fn contract_file_tools_use_the_envd_file_api_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = Arc::new(Fake::start(&[]));
    let harness = || {
        Harness::new(
            backend_with(&fake, Some(KEY), &OUTPUT_LIMIT_FLAG),
            backend_with(&fake, Some(KEY), &OUTPUT_LIMIT_FLAG),
            "/bin/sh",
            Arc::clone(&fake),
        )
        .with_violations_check(format!("{}/_fake/violations", fake.api))
    };

    contract::files_5_mib_binary_round_trip(harness()).await;
    let uploads = fake.requests_to("POST", "/files").await;
    assert_eq!(uploads.len(), 1, "one upload of the whole file");
    assert_eq!(uploads[0]["size"], 5 * 1024 * 1024);
    let upload_path = uploads[0]["query"]["path"].as_str().unwrap();
    assert!(
        upload_path.starts_with("/tmp/contract-files/.big.bin.kilntainers-"),
        "{upload_path}"
    );
    assert!(uploads[0]["query"].get("username").is_none());
    let downloads = fake.requests_to("GET", "/files").await;
    assert_eq!(
        downloads.len(),
        5,
        "five 1 MiB pages, nothing fetched past the end"
    );
    assert_eq!(downloads[0]["headers"]["range"], "bytes=0-1048575");
    assert_eq!(downloads[4]["headers"]["range"], "bytes=4194304-5242879");
    let moves = fake
        .requests_to("POST", "/filesystem.Filesystem/Move")
        .await;
    assert_eq!(moves.len(), 1);
    assert_eq!(moves[0]["body"]["source"], upload_path);
    assert_eq!(
        moves[0]["body"]["destination"],
        "/tmp/contract-files/big.bin"
    );
    assert_eq!(
        fake.requests_to("POST", "/filesystem.Filesystem/ListDir")
            .await
            .len(),
        1
    );
    assert_eq!(starts_with_arg(&fake, "kilntainers-file").await, 0);

    contract::files_text_list_and_errors(harness()).await;
    assert_eq!(fake.requests_to("POST", "/files").await.len(), 3);
    let listed = fake
        .requests_to("POST", "/filesystem.Filesystem/ListDir")
        .await;
    assert_eq!(listed.len(), 3);
    assert_eq!(listed[1]["body"]["depth"], 2);
    // Only the append went through the programs; the new script's 0755 was one chmod.
    assert_eq!(starts_with_arg(&fake, "kilntainers-file").await, 1);
    assert_eq!(starts_with_arg(&fake, "kilntainers-chmod").await, 1);
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn issue_32_old_envd_gets_the_user_named_and_stdin_refused_against_fake() {
    // See: issue 32 (item 5): below envd 0.4.0 the user is named in `Authorization: Basic`,
    // below 0.3.0 `Start` has no `stdin` field, and below 0.5.2 there is no `CloseStdin`, so a
    // command with input is refused with a message saying to rebuild the template.
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = Fake::start(&["--envd-version", "0.2.0"]);
    let backend = backend_with(&fake, Some(KEY), &[]);
    let id = computer("e2b-old");
    let sandbox = backend
        .create(&create_spec(&id, true, &InstanceId::random()), &NoProgress)
        .await
        .unwrap();
    let (code, out, _) = run(backend.as_ref(), &sandbox, "echo old-envd").await;
    assert_eq!((code, out.as_str()), (0, "old-envd\n"));
    let started = fake.requests_to("POST", "/process.Process/Start").await;
    assert!(
        started.iter().all(|r| r["body"].get("stdin").is_none()),
        "{started:?}"
    );
    assert_eq!(started[0]["headers"]["authorization"], "Basic dXNlcjo=");

    let with_input = ExecSpec {
        argv: vec!["/bin/sh".into(), "-c".into(), "cat".into()],
        stdin: Some(b"x".to_vec()),
        working_dir: None,
        exec_id: ExecId::random(),
        command: None,
    };
    let error = backend
        .exec(
            &sandbox,
            &with_input,
            &mut Collect::default(),
            &CancellationToken::new(),
        )
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("older than 0.5.2")
            && error.to_string().contains("rebuild the E2B template"),
        "{error}"
    );
    backend.remove(&sandbox).await.unwrap();
    fake.assert_no_violations().await;
}

/// Checkpoints (docs/checkpoints.md, "E2B and Modal"): the snapshot call, a rollback's new
/// sandbox from the snapshot template with the computer's metadata (its image still the base
/// template) before the old one is killed, and the template's deletion by its id without the tag.
#[tokio::test]
async fn contract_checkpoint_requests_follow_the_definition_against_fake() {
    use mcp_sandbox_computer_vm_for_ai::backends::checkpoints::{
        CheckpointName, FromCheckpoint, NewCheckpoint,
    };
    use mcp_sandbox_computer_vm_for_ai::ids::Principal;
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = Fake::start(&[]);
    let backend = backend_with(&fake, Some(KEY), &[]);
    let provider = backend.checkpoints().unwrap();
    let id = computer("e2b-cp");
    let instance = InstanceId::random();
    let sandbox = backend
        .create(&create_spec(&id, false, &instance), &NoProgress)
        .await
        .unwrap();
    let new = NewCheckpoint {
        name: CheckpointName::parse("one").unwrap(),
        lineage: Vec::new(),
        note: None,
        owner: Principal::default_principal(),
    };
    let record = provider.checkpoint(&sandbox, &new).await.unwrap();
    assert!(!record.memory && record.size_bytes.is_none());
    let path = format!("/sandboxes/{}/snapshots", sandbox.sandbox_id);
    let snapshots = fake.requests_to("POST", &path).await;
    assert_eq!(snapshots.len(), 1);
    assert_eq!(snapshots[0]["body"], json!({}));
    let state = fake.get("/_fake/state").await;
    let template = state["snapshots"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    let rolled = provider
        .rollback(
            &sandbox,
            FromCheckpoint {
                source: &id,
                checkpoint: &record,
            },
            &create_spec(&id, false, &instance),
            &NoProgress,
        )
        .await
        .unwrap();
    let creates = fake.requests_to("POST", "/sandboxes").await;
    let body = &creates.last().unwrap()["body"];
    assert_eq!(body["templateID"], format!("{template}:default"));
    assert_eq!(body["metadata"]["kilntainers-computer-id"], id.as_str());
    assert_eq!(body["metadata"]["kilntainers-image"], "base");
    let sandboxes = fake.sandboxes().await;
    assert_eq!(sandboxes.len(), 1, "the old sandbox is killed");
    assert_eq!(sandboxes[0]["sandboxID"], rolled.sandbox_id.as_str());
    provider.delete(&id, &record.name).await.unwrap();
    assert_eq!(
        fake.requests_to("DELETE", &format!("/templates/{template}"))
            .await
            .len(),
        1
    );
    backend.remove(&rolled).await.unwrap();
    provider.forget(&id).await.unwrap();
    fake.assert_no_violations().await;
}

/// Egress (docs/egress.md, "E2B"): the server's allow-list becomes the sandbox's `network`
/// config (checked against E2B's openapi.yml by the fake) and its recorded metadata; a
/// computer's narrowed policy is sent instead and found again by `egress_policy`; a narrowed
/// rule E2B has no words for is refused before anything is created.
#[tokio::test]
async fn issue_33_egress_policy_becomes_the_network_config_against_fake() {
    use mcp_sandbox_computer_vm_for_ai::backends::egress::Pattern;
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = Fake::start(&[]);
    let backend = backend_with(
        &fake,
        Some(KEY),
        &[
            "--egress",
            "allowlist",
            "--egress-allow",
            "allowed.test",
            "--egress-allow",
            "*.pkg.test",
            "--egress-allow",
            "203.0.113.0/24",
        ],
    );
    let instance = InstanceId::random();
    let id = computer("e2b-egress");
    let sandbox = backend
        .create(&create_spec(&id, false, &instance), &NoProgress)
        .await
        .unwrap();
    let creates = fake.requests_to("POST", "/sandboxes").await;
    let body = &creates.last().unwrap()["body"];
    assert_eq!(
        body["network"],
        json!({"allowOut": ["allowed.test", "*.pkg.test", "203.0.113.0/24"], "denyOut": ["0.0.0.0/0"]})
    );
    assert_eq!(body["allow_internet_access"], true);
    assert_eq!(
        body["metadata"]["kilntainers-egress"],
        r#"{"mode":"allowlist","allow":["allowed.test","*.pkg.test","203.0.113.0/24"],"deny":[],"ask":false,"allow_private":false}"#
    );
    let server = backend.egress_policy(&sandbox).await.unwrap().unwrap();
    assert_eq!(server.allow.len(), 3);

    let narrow_id = computer("e2b-egress-narrow");
    let mut spec = create_spec(&narrow_id, false, &instance);
    spec.egress = Some(
        server
            .narrowed(&[Pattern::parse("a.pkg.test").unwrap()])
            .unwrap(),
    );
    let narrow = backend.create(&spec, &NoProgress).await.unwrap();
    let creates = fake.requests_to("POST", "/sandboxes").await;
    assert_eq!(
        creates.last().unwrap()["body"]["network"],
        json!({"allowOut": ["a.pkg.test"], "denyOut": ["0.0.0.0/0"]})
    );
    let kept = backend.egress_policy(&narrow).await.unwrap().unwrap();
    assert_eq!(kept.allow, spec.egress.as_ref().unwrap().allow);

    let before = creates.len();
    let mut ported = create_spec(&computer("e2b-egress-port"), true, &instance);
    ported.egress = Some(
        server
            .narrowed(&[Pattern::parse("allowed.test:443").unwrap()])
            .unwrap(),
    );
    let refused = backend.create(&ported, &NoProgress).await.unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("'allowed.test:443' names a port, and E2B's network rules have none"),
        "{refused}"
    );
    assert_eq!(fake.requests_to("POST", "/sandboxes").await.len(), before);
    backend.remove(&narrow).await.unwrap();
    backend.remove(&sandbox).await.unwrap();
    fake.assert_no_violations().await;
}
