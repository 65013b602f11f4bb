//! Contract tests of the Fly backend against a local fake of the documented Machines API
//! (`fakes/fly.py`, run as a child process). They pin our request building,
//! parsing, retries and lifecycle logic against our reading of Fly's documentation; they
//! cannot show that the real service behaves that way (docs/decisions.md, "Contract tests against fakes"), hence the names.
//!
//! The fake backs Machines with local Docker containers, so tests that create Machines need
//! the test environment's engine and `sandbox-busybox:full` (`KILNTAINERS_IT_DOCKER=1`); the
//! auth, app and retry tests need only Python. The fake and the backend pointed at it live in
//! `common::fly`; what every backend must do (exec, timeout, output limit, restart, orphans) is
//! in `suite::contract`.

use std::collections::HashSet;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use mcp_sandbox_computer_vm_for_ai::backends::{self, BackendError, ExecEnd, ExecSpec, NoProgress};
use mcp_sandbox_computer_vm_for_ai::ids::{ComputerId, ExecId, InstanceId};

use crate::common::fly::{Fake, TOKEN, backend, backend_with};
use crate::common::{Collect, computer, create_spec, enabled, run};

const NO_TOKEN: &str = "No Fly API token found (checked --fly-token, FLY_API_TOKEN, FLY_TOKEN, FLY_ACCESS_TOKEN and ~/.fly/config.yml). Install flyctl (https://fly.io/docs/flyctl/install/) and run 'fly auth login' once, or set FLY_API_TOKEN (for example to the output of 'fly tokens create org'), then restart your MCP client.";

#[tokio::test]
async fn contract_app_created_in_personal_org_and_remembered_against_fake() {
    let fake = Fake::start(&["--token", &format!("Bearer {TOKEN}")]);
    let first = backend_with(&fake, None, Some(TOKEN), &[]);
    first.validate().await.unwrap();
    let graphql = fake.requests_to("POST", "/graphql").await;
    assert_eq!(graphql.len(), 1);
    // See: issue 32 (items 2, 4 and 9): the current GraphQL path, `name`, `?wait=true` and an
    // idempotency key, as Fly's current definition and its own client have them.
    assert_eq!(
        graphql[0]["body"]["query"],
        "{ organizations { nodes { slug type } } }"
    );
    let created = fake.requests_to("POST", "/v1/apps").await;
    assert_eq!(created.len(), 1);
    let body = &created[0]["body"];
    assert_eq!(body["org_slug"], "personal");
    assert_eq!(created[0]["query"], json!({"wait": "true"}));
    assert!(
        body["idempotency_key"]
            .as_str()
            .is_some_and(|k| k.len() > 16),
        "{body}"
    );
    assert!(body.get("app_name").is_none(), "{body}");
    let app = body["name"].as_str().unwrap().to_owned();
    assert!(
        app.starts_with("mcp-sandbox-computers-") && app.len() == 30,
        "{app}"
    );
    assert_eq!(
        std::fs::read_to_string(fake.dir.join("fly.json")).unwrap(),
        format!("{{\n  \"app\": \"{app}\"\n}}\n")
    );

    // A second server reuses the remembered app: one lookup, no second creation.
    let second = backend_with(&fake, None, Some(TOKEN), &[]);
    second.validate().await.unwrap();
    assert_eq!(fake.requests_to("POST", "/v1/apps").await.len(), 1);
    assert_eq!(
        fake.requests_to("GET", &format!("/v1/apps/{app}"))
            .await
            .len(),
        1
    );

    // An explicit organization skips the GraphQL lookup.
    std::fs::remove_file(fake.dir.join("fly.json")).unwrap();
    let third = backend_with(&fake, None, Some(TOKEN), &["--fly-org", "acme"]);
    third.validate().await.unwrap();
    let created = fake.requests_to("POST", "/v1/apps").await;
    assert_eq!(created.len(), 2);
    assert_eq!(created[1]["body"]["org_slug"], "acme");
    assert_eq!(fake.requests_to("POST", "/graphql").await.len(), 1);
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn contract_configured_app_must_be_visible_against_fake() {
    let fake = Fake::with_demo();
    let error = backend_with(&fake, Some("nope"), Some(TOKEN), &[])
        .validate()
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "Fly App 'nope' is not visible to the current account or token."
    );
    backend(&fake).validate().await.unwrap();
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn contract_auth_failures_and_token_schemes_against_fake() {
    let fake = Fake::start(&[
        "--token",
        &format!("Bearer {TOKEN}"),
        "--token",
        "FlyV1 fm2_abc,fm2_def",
        "--app",
        "demo",
    ]);
    // No token anywhere: the first call says how to get one, and no request is sent.
    let error = backend_with(&fake, Some("demo"), None, &[])
        .validate()
        .await
        .unwrap_err();
    assert!(matches!(error, BackendError::Unavailable(_)));
    assert_eq!(error.to_string(), NO_TOKEN);
    assert!(fake.requests().await.is_empty());

    let error = backend_with(&fake, Some("demo"), Some("wrong"), &[])
        .validate()
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "Fly rejected the API token (HTTP 401). Run 'fly auth login' again or set a valid FLY_API_TOKEN."
    );

    // See: issue 32 (item 10): 403 is a valid token without the right to the call. A fake of
    // its own, so no background call of the backends above takes the injected answer.
    let forbidding = Fake::with_demo();
    forbidding
        .inject("GET", "/v1/apps/demo", 403, 1, json!({}))
        .await;
    let error = backend_with(&forbidding, Some("demo"), Some(TOKEN), &[])
        .validate()
        .await
        .unwrap_err();
    assert!(matches!(error, BackendError::Unavailable(_)));
    assert_eq!(
        error.to_string(),
        "Fly accepted the API token but refused this call (HTTP 403: injected 403). Use a token with access to the app and organization (e.g. 'fly tokens create org'), or set --fly-app/--fly-org to ones this token may use."
    );

    // Macaroons go under FlyV1, scheme prefix stripped, pieces trimmed and comma-joined.
    backend_with(&fake, Some("demo"), Some("FlyV1 fm2_abc, fm2_def"), &[])
        .validate()
        .await
        .unwrap();
    let macaroon: Vec<Value> = fake
        .requests()
        .await
        .into_iter()
        .filter(|r| {
            r["authorization"]
                .as_str()
                .is_some_and(|a| a.starts_with("FlyV1"))
        })
        .collect();
    assert!(!macaroon.is_empty());
    assert!(
        macaroon
            .iter()
            .all(|r| r["authorization"] == "FlyV1 fm2_abc,fm2_def")
    );
    let bearer = fake.requests_to("GET", "/v1/apps/demo").await;
    assert_eq!(bearer[0]["authorization"], "Bearer wrong");
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn contract_rate_limits_and_server_errors_are_retried_against_fake() {
    let fake = Fake::with_demo();
    fake.inject("GET", "/v1/apps/demo", 429, 2, json!({"Retry-After": "0"}))
        .await;
    backend(&fake).validate().await.unwrap();
    assert_eq!(fake.requests_to("GET", "/v1/apps/demo").await.len(), 3);

    // Three retries at most, then the call and Fly's words are reported. (No app configured or
    // remembered here, so nothing is looked up in the background at construction.)
    fake.inject("POST", "/graphql", 503, 4, json!({})).await;
    let error = backend_with(&fake, None, Some(TOKEN), &[])
        .validate()
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "Fly organization lookup failed: POST /graphql returned HTTP 503: injected 503"
    );
    assert_eq!(fake.requests_to("POST", "/graphql").await.len(), 4);
    assert!(fake.requests_to("POST", "/v1/apps").await.is_empty());
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn contract_machine_create_exec_list_destroy_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = Fake::with_demo();
    let backend = backend(&fake);
    let id = computer("fly-c");
    let instance = InstanceId::random();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let sandbox = backend
        .create(&create_spec(&id, true, &instance), &NoProgress)
        .await
        .unwrap();

    let created = fake.requests_to("POST", "/v1/apps/demo/machines").await;
    assert_eq!(created.len(), 1);
    let body = &created[0]["body"];
    assert_eq!(body["name"], id.as_str());
    assert!(body.get("region").is_none());
    let config = &body["config"];
    assert_eq!(config["image"], "docker.io/library/sandbox-busybox:full");
    assert_eq!(
        config["init"]["exec"],
        json!(backends::posix::keep_alive_argv("/bin/sh"))
    );
    assert_eq!(
        config["guest"],
        json!({"cpu_kind": "shared", "cpus": 1, "memory_mb": 512})
    );
    assert_eq!(config["rootfs"], json!({"persist": "never"}));
    assert_eq!(config["restart"], json!({"policy": "no"}));
    assert_eq!(config["auto_destroy"], true);
    let metadata = config["metadata"].as_object().unwrap();
    assert_eq!(metadata["kilntainers"], "true");
    assert_eq!(metadata["kilntainers-computer-id"], id.as_str());
    assert_eq!(metadata["kilntainers-temporary"], "true");
    assert_eq!(metadata["kilntainers-image"], "sandbox-busybox:full");
    assert_eq!(metadata["kilntainers-instance"], instance.as_str());
    let lease: u64 = metadata["kilntainers-lease-until"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((before + 900..before + 960).contains(&lease), "{lease}");
    for wait in fake
        .requests()
        .await
        .iter()
        .filter(|r| r["path"].as_str().is_some_and(|p| p.ends_with("/wait")))
    {
        assert_eq!(wait["query"]["state"], "started");
        let secs: u64 = wait["query"]["timeout"].as_str().unwrap().parse().unwrap();
        assert!((1..=60).contains(&secs));
    }

    // Exec: HTTP 200 with a non-zero exit code; stdin and working directory together.
    let exec_spec = ExecSpec {
        argv: vec![
            "/bin/sh".into(),
            "-c".into(),
            "cat > in.txt; pwd; echo \"tag=$KILNTAINERS_EXEC_ID\" >&2; exit 3".into(),
        ],
        stdin: Some(b"line one\nline 'two'\n".to_vec()),
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
    let (code, out, _) = run(backend.as_ref(), &sandbox, "cat /tmp/in.txt; exit 0").await;
    assert_eq!((code, out.as_str()), (0, "line one\nline 'two'\n"));
    let exec_request = fake
        .requests()
        .await
        .into_iter()
        .rev()
        .find(|r| r["path"].as_str().is_some_and(|p| p.ends_with("/exec")));
    let exec_body = &exec_request.unwrap()["body"];
    assert_eq!(exec_body["command"][1], "-lc");
    assert!(exec_body.get("stdin").is_none());

    // Inventory and lookup read the metadata back.
    let rows = backend.list().await.unwrap();
    let row = rows.iter().find(|r| r.sandbox.computer_id == id).unwrap();
    assert_eq!(row.state, "started");
    assert_eq!(row.sandbox.sandbox_id, sandbox.sandbox_id);
    assert!(row.sandbox.temporary);
    assert_eq!(row.sandbox.image, "sandbox-busybox:full");
    assert!(row.created_at.is_some());
    let found = backend.lookup(&id).await.unwrap().unwrap();
    assert!(found.running);

    // A temporary Machine's root filesystem does not survive a restart, and we say so.
    let restarted = backend.restart(&sandbox).await.unwrap();
    assert!(!restarted.state_preserved);
    let (code, _, _) = run(backend.as_ref(), &sandbox, "test -e /tmp/in.txt").await;
    assert_eq!(code, 1);

    backend.remove(&sandbox).await.unwrap();
    let deletes = fake
        .requests_to(
            "DELETE",
            &format!("/v1/apps/demo/machines/{}", sandbox.sandbox_id),
        )
        .await;
    // `kill` is not in the definition; `force` kills a running Machine.
    assert_eq!(deletes[0]["query"], json!({"force": "true"}));
    assert!(backend.lookup(&id).await.unwrap().is_none());
    // Removing again is not an error: the goal is met.
    backend.remove(&sandbox).await.unwrap();
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn contract_permanent_machine_survives_restart_and_stop_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = Fake::with_demo();
    let backend = backend_with(
        &fake,
        Some("demo"),
        Some(TOKEN),
        &[
            "--fly-region",
            "ams",
            "--fly-cpus",
            "2",
            "--fly-memory",
            "1024",
            "--fly-cpu-kind",
            "performance",
            "--fly-rootfs-size",
            "4",
        ],
    );
    let id = computer("fly-p");
    let sandbox = backend
        .create(&create_spec(&id, false, &InstanceId::random()), &NoProgress)
        .await
        .unwrap();
    let body = &fake.requests_to("POST", "/v1/apps/demo/machines").await[0]["body"];
    assert_eq!(body["region"], "ams");
    assert_eq!(
        body["config"]["guest"],
        json!({"cpu_kind": "performance", "cpus": 2, "memory_mb": 1024})
    );
    assert_eq!(
        body["config"]["rootfs"],
        json!({"persist": "always", "size_gb": 4})
    );
    assert_eq!(body["config"]["restart"], json!({"policy": "always"}));
    assert_eq!(body["config"]["auto_destroy"], false);
    let metadata = body["config"]["metadata"].as_object().unwrap();
    assert!(!metadata.contains_key("kilntainers-instance"));
    assert!(!metadata.contains_key("kilntainers-lease-until"));

    run(backend.as_ref(), &sandbox, "echo kept > /root/state").await;
    let restarted = backend.restart(&sandbox).await.unwrap();
    assert!(restarted.state_preserved);
    assert_eq!(restarted.sandbox.sandbox_id, sandbox.sandbox_id);
    assert_eq!(
        run(backend.as_ref(), &sandbox, "cat /root/state").await.1,
        "kept\n"
    );
    assert_eq!(
        fake.requests_to(
            "POST",
            &format!("/v1/apps/demo/machines/{}/restart", sandbox.sandbox_id)
        )
        .await
        .len(),
        1
    );

    // The Machine stops behind our back: exec says so, attach starts it again, files stay.
    fake.post(
        &format!("/_fake/kill/{}", sandbox.sandbox_id),
        json!({}),
        false,
    )
    .await;
    let found = backend.lookup(&id).await.unwrap().unwrap();
    assert!(!found.running);
    let mut sink = Collect::default();
    let error = backend
        .exec(
            &sandbox,
            &ExecSpec {
                argv: vec!["true".into()],
                stdin: None,
                working_dir: None,
                exec_id: ExecId::random(),
                command: None,
            },
            &mut sink,
            &CancellationToken::new(),
        )
        .await
        .unwrap_err();
    assert!(matches!(error, BackendError::NotRunning(_)), "{error:?}");
    let again = backend.ensure_running(&found.sandbox).await.unwrap();
    assert_eq!(again.sandbox_id, sandbox.sandbox_id);
    assert_eq!(
        run(backend.as_ref(), &again, "cat /root/state").await.1,
        "kept\n"
    );
    assert_eq!(
        fake.requests_to(
            "POST",
            &format!("/v1/apps/demo/machines/{}/start", sandbox.sandbox_id)
        )
        .await
        .len(),
        1
    );
    backend.remove(&again).await.unwrap();
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn contract_machine_that_never_starts_is_destroyed_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = Fake::with_demo();
    let backend = backend(&fake);
    let id = computer("fly-s");
    fake.post("/_fake/stuck", json!({"name": id.as_str()}), false)
        .await;
    let error = backend
        .create(&create_spec(&id, false, &InstanceId::random()), &NoProgress)
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("Fly created computer '{id}' but it did not start within 120s.")
    );
    let waits = fake
        .requests()
        .await
        .into_iter()
        .filter(|r| r["path"].as_str().is_some_and(|p| p.ends_with("/wait")))
        .count();
    assert_eq!(waits, 2, "two bounded wait rounds");
    assert!(
        fake.machines()
            .await
            .iter()
            .all(|m| m["state"] == "destroyed")
    );
    // Creating over an existing computer is refused.
    let id2 = computer("fly-e");
    let sandbox = backend
        .create(&create_spec(&id2, true, &InstanceId::random()), &NoProgress)
        .await
        .unwrap();
    let error = backend
        .create(&create_spec(&id2, true, &InstanceId::random()), &NoProgress)
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("Computer '{id2}' already exists in Fly.")
    );
    backend.remove(&sandbox).await.unwrap();
    fake.assert_no_violations().await;
}

#[tokio::test]
async fn contract_crash_gc_by_instance_and_lease_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = Fake::with_demo();
    let dead = InstanceId::random();
    let alive = InstanceId::random();
    let creator = backend(&fake);
    let orphan = computer("fly-o");
    let kept = computer("fly-k");
    let permanent = computer("fly-m");
    creator
        .create(&create_spec(&orphan, true, &dead), &NoProgress)
        .await
        .unwrap();
    creator
        .create(&create_spec(&kept, true, &alive), &NoProgress)
        .await
        .unwrap();
    creator
        .create(&create_spec(&permanent, false, &dead), &NoProgress)
        .await
        .unwrap();
    // A Machine of an instance we know nothing about whose lease ran out long ago.
    let expired = computer("fly-x");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    fake.post(
        "/v1/apps/demo/machines",
        json!({"name": expired.as_str(), "config": {
        "image": "docker.io/library/sandbox-busybox:full",
        "init": {"exec": backends::posix::keep_alive_argv("/bin/sh")},
        "metadata": {
            "kilntainers": "true",
            "kilntainers-computer-id": expired.as_str(),
            "kilntainers-temporary": "true",
            "kilntainers-instance": InstanceId::random().as_str(),
            "kilntainers-lease-until": (now - 1000).to_string(),
        }}}),
        true,
    )
    .await;
    drop(creator);

    // Another server: collects by dead instance and by expired lease, nothing else.
    let collector = backend(&fake);
    let removed: HashSet<ComputerId> = collector
        .collect_orphans(&HashSet::from([dead.clone()]))
        .await
        .unwrap()
        .into_iter()
        .collect();
    // The lease collection also runs in the background as soon as the app is known, so the
    // expired Machine may already be gone by either path; the orphan is ours to report.
    assert!(removed.contains(&orphan), "{removed:?}");
    assert!(removed.is_subset(&HashSet::from([orphan.clone(), expired.clone()])));
    let left: HashSet<ComputerId> = collector
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.sandbox.computer_id)
        .collect();
    assert_eq!(left, HashSet::from([kept.clone(), permanent.clone()]));
    for id in [&kept, &permanent] {
        let found = collector.lookup(id).await.unwrap().unwrap();
        collector.remove(&found.sandbox).await.unwrap();
    }
    fake.assert_no_violations().await;
}

// See: issue 15
#[tokio::test]
async fn contract_apps_with_secrets_or_the_controllers_app_are_refused_against_fake() {
    let fake = Fake::start(&[
        "--token",
        &format!("Bearer {TOKEN}"),
        "--app",
        "demo",
        "--app",
        "armed",
        "--app-secret",
        "armed:FLY_API_TOKEN=fm2_controller",
        "--app-secret",
        "armed:KILNTAINERS_AUTH_TOKEN=bearer",
    ]);
    let refusal = "Fly App 'armed' has secrets (FLY_API_TOKEN, KILNTAINERS_AUTH_TOKEN). Fly gives every Machine of an app that app's secrets as environment variables, so each sandbox could read them. Use a separate app without secrets for sandbox Machines (--fly-app or KILNTAINERS_FLY_APP), or remove them with 'fly secrets unset -a armed <NAME>...'.";
    let armed = backend_with(&fake, Some("armed"), Some(TOKEN), &[]);
    assert_eq!(
        armed.check_startup().await.unwrap_err().to_string(),
        refusal
    );
    assert_eq!(armed.validate().await.unwrap_err().to_string(), refusal);
    let id = computer("armed");
    let created = armed
        .create(&create_spec(&id, true, &InstanceId::random()), &NoProgress)
        .await;
    assert_eq!(created.unwrap_err().to_string(), refusal);
    assert!(
        fake.requests_to("POST", "/v1/apps/armed/machines")
            .await
            .is_empty()
    );
    // The same app found through the remembered-app file is refused just the same.
    std::fs::write(fake.dir.join("fly.json"), "{\"app\": \"armed\"}\n").unwrap();
    let remembered = backend_with(&fake, None, Some(TOKEN), &[]);
    assert_eq!(
        remembered.validate().await.unwrap_err().to_string(),
        refusal
    );
    // A clean app passes, at startup and at use.
    let clean = backend(&fake);
    clean.check_startup().await.unwrap();
    clean.validate().await.unwrap();
    // Secrets that cannot be listed: startup goes on, use fails closed.
    fake.inject("GET", "/v1/apps/demo/secrets", 500, 20, json!({}))
        .await;
    let unknown = backend(&fake);
    unknown.check_startup().await.unwrap();
    let error = unknown.validate().await.unwrap_err().to_string();
    assert!(
        error.starts_with("Could not check that Fly App 'demo' has no secrets"),
        "{error}"
    );
    fake.assert_no_violations().await;
}
