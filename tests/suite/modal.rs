//! Contract tests of the Modal backend against the in-process fake gRPC server (the
//! `fake-modal` workspace crate, `fakes/modal/`, built from the same `modal_api.proto`). They pin the requests we
//! send (fields and `x-modal-*` metadata, checked strictly) and how we handle answers, streaming
//! exec output included; they cannot show that Modal's real service behaves like our reading of
//! its API (docs/decisions.md, "Contract tests against fakes"), hence the names.
//!
//! The fake backs sandboxes with local Docker containers of `sandbox-busybox:full`, so tests that
//! create sandboxes need the test environment's engine (`KILNTAINERS_IT_DOCKER=1`); the
//! credential and header tests need nothing. Starting the fake and pointing a backend at it live
//! in `common::modal`; what every backend must do (crash GC included) is in `suite::contract`.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use tokio_util::sync::CancellationToken;

use fake_modal::{FakeModal, Req, pb};
use mcp_sandbox_computer_vm_for_ai::backends::{
    self, Backend, BackendError, NoProgress, SandboxRef,
};
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;
use mcp_sandbox_computer_vm_for_ai::exec::{self, ExecOutcome, ExecRequest, Program};
use mcp_sandbox_computer_vm_for_ai::ids::{ExecId, InstanceId};
use mcp_sandbox_computer_vm_for_ai::providers;

use crate::common::modal::{backend_with, fake, modal};
use crate::common::{completed, computer, create_spec, enabled};

fn requests(fake: &FakeModal) -> Vec<Req> {
    fake.log().into_iter().map(|c| c.request).collect()
}

async fn run(
    backend: &dyn Backend,
    sandbox: &SandboxRef,
    command: &str,
    stdin: Option<&str>,
    dir: Option<&str>,
    timeout_secs: u64,
    limit: u64,
) -> ExecOutcome {
    let request = ExecRequest {
        program: Program::Shell(command.to_owned()),
        stdin: stdin.map(str::to_owned),
        working_dir: dir.map(str::to_owned),
        timeout_secs,
    };
    exec::run(
        backend,
        sandbox,
        "/bin/sh",
        &request,
        ExecId::random(),
        limit,
        &mcp_sandbox_computer_vm_for_ai::backends::NoProgress,
        &CancellationToken::new(),
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn contract_missing_credentials_say_how_to_get_them_against_fake() {
    let fake = fake().await;
    let cli = Cli::try_parse_from(["x", "--backend", "modal"]).unwrap();
    let mut config =
        Config::from_cli(&cli, mcp_sandbox_computer_vm_for_ai::config::process_env).unwrap();
    config.modal.tokens = Default::default();
    config.modal.config_file = Some(PathBuf::from("/nonexistent/modal.toml"));
    config.modal.server_url_env = Some(fake.url());
    let error = providers::build(&config)
        .unwrap()
        .validate()
        .await
        .unwrap_err();
    assert!(matches!(error, BackendError::Unavailable(_)));
    let text = error.to_string();
    assert!(text.contains("Run 'modal setup'"), "{text}");
    assert!(
        text.contains("Set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"),
        "{text}"
    );
    assert!(fake.log().is_empty(), "no call without credentials");
}

#[tokio::test]
async fn contract_rejected_token_gives_the_spec_message_against_fake() {
    let fake = fake().await;
    let error = backend_with(&fake, Some("wrong"), &[])
        .validate()
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "Modal authentication failed. Either:\n  - Set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET environment variables\n  - Run 'modal token set' to configure credentials\n  - Pass --modal-token-id and --modal-token-secret"
    );
}

#[tokio::test]
async fn contract_unreachable_server_gives_the_spec_message_against_fake() {
    let fake = fake().await;
    let backend = modal(&fake, &[]);
    drop(fake);
    let error = backend.validate().await.unwrap_err();
    assert_eq!(
        error.to_string(),
        "Cannot connect to Modal. Check your network connection and Modal service status at https://status.modal.com"
    );
}

#[tokio::test]
async fn contract_validate_sends_libmodal_metadata_and_auth_token_against_fake() {
    let fake = fake().await;
    let backend = modal(&fake, &["--modal-app-name", "my-app"]);
    backend.validate().await.unwrap();
    backend.validate().await.unwrap();
    let log = fake.log();
    assert_eq!(
        log.iter().map(|c| c.method).collect::<Vec<_>>(),
        ["AuthTokenGet", "AppGetOrCreate"],
        "the app id and the token are cached"
    );
    let expected: BTreeMap<String, String> = [
        ("x-modal-client-type", "9"),
        ("x-modal-client-version", "1.0.0"),
        ("x-modal-token-id", "ak-fake"),
        ("x-modal-token-secret", "as-fake"),
        // See: issue 32 (item 7): the official Go client's form.
        ("x-modal-libmodal-version", "modal-go/0.7.4"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    assert_eq!(
        log[0].metadata, expected,
        "AuthTokenGet carries no auth token"
    );
    let mut with_token = log[1].metadata.clone();
    let token = with_token.remove("x-modal-auth-token").unwrap();
    assert_eq!(token.split('.').count(), 3, "{token}");
    assert_eq!(with_token, expected);
    let Req::AppGetOrCreate(app) = &log[1].request else {
        panic!("{:?}", log[1].request);
    };
    assert_eq!(
        app,
        &pb::AppGetOrCreateRequest {
            app_name: "my-app".to_owned(),
            environment_name: String::new(),
            object_creation_type: pb::ObjectCreationType::CreateIfMissing as i32,
        }
    );
}

#[tokio::test]
async fn contract_create_exec_rediscover_and_terminate_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = fake().await;
    let flags = [
        "--modal-cpu",
        "0.5",
        "--modal-memory",
        "256",
        "--gpu",
        "a10g:2",
        "--region",
        "us-east",
        "--sandbox-timeout",
        "600",
        "--no-network",
    ];
    let backend = modal(&fake, &flags);
    let id = computer("modal-perm");
    let sandbox = backend
        .create(&create_spec(&id, false, &InstanceId::random()), &NoProgress)
        .await
        .unwrap();
    assert!(!sandbox.temporary);
    assert_eq!(sandbox.image, "sandbox-busybox:full");

    let log = requests(&fake);
    let image = log
        .iter()
        .find_map(|r| match r {
            Req::ImageGetOrCreate(i) => Some(i.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        image.image.unwrap().dockerfile_commands,
        ["FROM sandbox-busybox:full"]
    );
    assert_eq!(image.builder_version, "2024.10");
    assert!(
        log.iter().any(|r| matches!(r, Req::ImageJoinStreaming(_))),
        "a pending build is joined"
    );
    let create = log
        .iter()
        .find_map(|r| match r {
            Req::SandboxCreate(c) => Some(c.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(create.app_id, "ap-kilntainers");
    let definition = create.definition.unwrap();
    assert_eq!(definition.name.as_deref(), Some(id.as_str()));
    assert_eq!(
        definition.entrypoint_args,
        backends::posix::keep_alive_argv("/bin/sh")
    );
    assert_eq!(definition.timeout_secs, 600);
    assert_eq!(
        definition.resources,
        Some(pb::Resources {
            memory_mb: 256,
            milli_cpu: 500,
            gpu_config: Some(pb::GpuConfig {
                count: 2,
                gpu_type: "A10G".to_owned()
            }),
        })
    );
    assert_eq!(definition.scheduler_placement.unwrap().regions, ["us-east"]);
    assert_eq!(
        definition.network_access.unwrap().network_access_type,
        pb::network_access::NetworkAccessType::Blocked as i32
    );
    let task = log
        .iter()
        .find_map(|r| match r {
            Req::SandboxGetTaskId(t) => Some(t.clone()),
            _ => None,
        })
        .unwrap();
    assert!(task.wait_until_ready);
    assert_eq!(task.sandbox_id, sandbox.sandbox_id.as_str());
    let tags = log
        .iter()
        .find_map(|r| match r {
            Req::SandboxTagsSet(t) => Some(t.clone()),
            _ => None,
        })
        .unwrap();
    let tags: BTreeMap<String, String> = tags
        .tags
        .into_iter()
        .map(|t| (t.tag_name, t.tag_value))
        .collect();
    let expected: BTreeMap<String, String> = [
        ("kilntainers", "true"),
        ("kilntainers-computer-id", id.as_str()),
        ("kilntainers-temporary", "false"),
        ("kilntainers-image", "sandbox-busybox:full"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    assert_eq!(tags, expected, "permanent computers carry no instance tag");

    // Exec: stdin, working directory, both streams, exit code.
    let before = fake.log().len();
    let stdin = "line one\nüñí \"quoted\"\n".repeat(5000);
    let (code, stdout, stderr) = completed(
        run(
            &*backend,
            &sandbox,
            "cat; pwd; echo oops >&2; exit 3",
            Some(&stdin),
            Some("/tmp"),
            30,
            2_097_152,
        )
        .await,
    );
    assert_eq!(code, 3);
    assert_eq!(stdout, format!("{stdin}/tmp\n"));
    assert_eq!(stderr, "oops\n");
    // See: issue 32 (item 3): exec goes through the task command router, as the official SDKs
    // do; the ContainerExec fallback has its own test below.
    let calls: Vec<Req> = requests(&fake)[before..].to_vec();
    // Access was asked for once (for the readiness check) and is cached per task.
    assert!(
        requests(&fake)
            .iter()
            .any(|r| matches!(r, Req::TaskGetCommandRouterAccess(_)))
    );
    assert!(!calls.iter().any(|r| matches!(r, Req::ContainerExec(_))));
    let exec = calls
        .iter()
        .find_map(|r| match r {
            Req::TaskExecStart(e) => Some(e.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(exec.command_args[0], "env");
    assert!(exec.command_args[1].starts_with("KILNTAINERS_EXEC_ID="));
    assert_eq!(&exec.command_args[2..4], ["/bin/sh", "-c"]);
    assert_eq!(exec.workdir.as_deref(), Some("/tmp"));
    assert_eq!(exec.timeout_secs, Some(3600));
    assert!(!exec.exec_id.is_empty());
    let inputs: Vec<fake_modal::rpb::TaskExecStdinWriteRequest> = calls
        .iter()
        .filter_map(|r| match r {
            Req::TaskExecStdinWrite(w) => Some(w.clone()),
            _ => None,
        })
        .collect();
    assert!(inputs.len() >= 3, "stdin is chunked");
    let mut offset = 0u64;
    for (n, input) in inputs.iter().enumerate() {
        assert_eq!(input.offset, offset, "consecutive byte offsets");
        assert_eq!(input.eof, n + 1 == inputs.len());
        assert!(input.data.len() <= 64 * 1024);
        assert_eq!(input.exec_id, exec.exec_id);
        offset += input.data.len() as u64;
    }
    assert_eq!(offset, stdin.len() as u64);
    let reads: Vec<fake_modal::rpb::TaskExecStdioReadRequest> = calls
        .iter()
        .filter_map(|r| match r {
            Req::TaskExecStdioRead(o) => Some(o.clone()),
            _ => None,
        })
        .collect();
    assert!(reads.iter().all(|o| o.exec_id == exec.exec_id));
    let fds: HashSet<i32> = reads.iter().map(|o| o.file_descriptor).collect();
    assert_eq!(fds, HashSet::from([0, 1]));
    assert!(calls.iter().any(|r| matches!(r, Req::TaskExecWait(_))));

    // Without stdin the command sees EOF at once.
    let (code, stdout, _) =
        completed(run(&*backend, &sandbox, "wc -c", None, None, 30, 2_097_152).await);
    assert_eq!((code, stdout.trim()), (0, "0"));
    run(
        &*backend,
        &sandbox,
        "echo kept > /tmp/f",
        None,
        None,
        30,
        2_097_152,
    )
    .await;

    // A second server finds the permanent computer by its tags (with paging: page size 1).
    let other = modal(&fake, &flags);
    let second = computer("modal-other");
    let other_sandbox = other
        .create(
            &create_spec(&second, true, &InstanceId::random()),
            &NoProgress,
        )
        .await
        .unwrap();
    let found = other.lookup(&id).await.unwrap().unwrap();
    assert_eq!(found.sandbox, sandbox);
    let (_, stdout, _) = completed(
        run(
            &*other,
            &found.sandbox,
            "cat /tmp/f",
            None,
            None,
            30,
            2_097_152,
        )
        .await,
    );
    assert_eq!(stdout, "kept\n");
    let listed = other.list().await.unwrap();
    let ids: Vec<&str> = listed
        .iter()
        .map(|c| c.sandbox.computer_id.as_str())
        .collect();
    assert!(
        ids.contains(&id.as_str()) && ids.contains(&second.as_str()),
        "{ids:?}"
    );
    assert!(
        listed
            .iter()
            .all(|c| c.state == "running" && c.created_at.is_some())
    );
    let list = requests(&fake)
        .into_iter()
        .filter_map(|r| match r {
            Req::SandboxList(l) => Some(l),
            _ => None,
        })
        .collect::<Vec<_>>();
    assert!(
        list.iter()
            .all(|l| !l.include_finished && l.app_id == "ap-kilntainers")
    );
    assert!(
        list.iter().any(|l| l.before_timestamp > 0.0),
        "pages are followed"
    );
    assert!(
        list.iter()
            .any(|l| l.tags.len() == 2 && l.tags[1].tag_value == id.as_str())
    );

    // A duplicate name is refused by the provider (two servers racing for one id).
    let error = other
        .create(&create_spec(&id, false, &InstanceId::random()), &NoProgress)
        .await
        .unwrap_err();
    assert!(error.to_string().contains("already exists"), "{error}");

    // Restart recreates: new sandbox, files gone, same mode and image.
    let restarted = other.restart(&found.sandbox).await.unwrap();
    assert!(!restarted.state_preserved);
    assert_ne!(restarted.sandbox.sandbox_id, sandbox.sandbox_id);
    assert!(!restarted.sandbox.temporary);
    let (code, _, _) = completed(
        run(
            &*other,
            &restarted.sandbox,
            "test -e /tmp/f",
            None,
            None,
            30,
            2_097_152,
        )
        .await,
    );
    assert_eq!(code, 1);

    other.remove(&restarted.sandbox).await.unwrap();
    other.remove(&other_sandbox).await.unwrap();
    assert!(other.lookup(&id).await.unwrap().is_none());
    assert!(fake.live_sandboxes().is_empty());
}

#[tokio::test]
async fn contract_output_limit_timeout_and_kill_sweep_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = fake().await;
    let backend = modal(&fake, &[]);
    let id = computer("modal-limits");
    let sandbox = backend
        .create(&create_spec(&id, true, &InstanceId::random()), &NoProgress)
        .await
        .unwrap();

    // Streaming: many batches arrive and are counted as they come.
    let (code, stdout, _) = completed(
        run(
            &*backend,
            &sandbox,
            "head -c 300000 /dev/zero | tr '\\0' a",
            None,
            None,
            30,
            2_097_152,
        )
        .await,
    );
    assert_eq!((code, stdout.len()), (0, 300_000));

    let started = Instant::now();
    let outcome = run(
        &*backend,
        &sandbox,
        "yes | head -c 100000000",
        None,
        None,
        60,
        1024,
    )
    .await;
    assert!(
        matches!(
            outcome,
            ExecOutcome::OutputLimitExceeded { limit: 1024, .. }
        ),
        "{outcome:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));

    let started = Instant::now();
    let outcome = run(
        &*backend,
        &sandbox,
        "sleep 300 & sleep 301",
        None,
        None,
        1,
        2_097_152,
    )
    .await;
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
    assert!(started.elapsed() < Duration::from_secs(10));
    let (_, stdout, _) = completed(
        run(
            &*backend,
            &sandbox,
            "ps -o args | grep -c '^sleep 30[01]' || true",
            None,
            None,
            30,
            2_097_152,
        )
        .await,
    );
    assert_eq!(stdout.trim(), "0", "the kill sweep removed the whole tree");
    backend.remove(&sandbox).await.unwrap();
}

#[tokio::test]
async fn contract_image_not_found_and_lifetime_expiry_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = fake().await;
    let missing = modal(&fake, &["--image", "no-such-image:nope"]);
    let error = missing
        .create(
            &create_spec(&computer("modal-noimg"), true, &InstanceId::random()),
            &NoProgress,
        )
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "Modal image not found: 'no-such-image:nope'. Check that the image name is correct and the registry is accessible."
    );
    assert!(fake.live_sandboxes().is_empty());

    let short = modal(&fake, &["--sandbox-timeout", "3"]);
    let sandbox = short
        .create(
            &create_spec(&computer("modal-expire"), true, &InstanceId::random()),
            &NoProgress,
        )
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let error = loop {
        let request = ExecRequest {
            program: Program::Shell("true".to_owned()),
            stdin: None,
            working_dir: None,
            timeout_secs: 10,
        };
        match exec::run(
            &*short,
            &sandbox,
            "/bin/sh",
            &request,
            ExecId::random(),
            1024,
            &mcp_sandbox_computer_vm_for_ai::backends::NoProgress,
            &CancellationToken::new(),
        )
        .await
        {
            Ok(_) => {
                assert!(Instant::now() < deadline, "the sandbox never expired");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(error) => break error,
        }
    };
    assert_eq!(
        error.to_string(),
        format!("Sandbox {} lifetime timeout expired", sandbox.sandbox_id)
    );
}

/// `port_url` on Modal: the ports of `--modal-ports` are opened as encrypted tunnels when a
/// sandbox is created, and a port's URL is its tunnel's, public; any other port is refused
/// with what to do. (The fake's tunnel hosts do not resolve: this pins our use of the API.)
#[tokio::test]
async fn contract_port_route_is_the_tunnel_opened_at_creation_against_fake() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = fake().await;
    let backend = modal(&fake, &["--modal-ports", "8080,3000"]);
    let id = computer("modal-ports");
    let sandbox = backend
        .create(&create_spec(&id, true, &InstanceId::random()), &NoProgress)
        .await
        .unwrap();
    let definition = requests(&fake)
        .into_iter()
        .find_map(|r| match r {
            Req::SandboxCreate(c) => c.definition,
            _ => None,
        })
        .unwrap();
    let Some(pb::sandbox::OpenPortsOneof::OpenPorts(specs)) = definition.open_ports_oneof else {
        panic!("no open_ports in {definition:?}");
    };
    let opened: Vec<(u32, bool)> = specs
        .ports
        .iter()
        .map(|p| (p.port, p.unencrypted))
        .collect();
    assert_eq!(opened, [(3000, false), (8080, false)]);

    let route = backend.port_route(&sandbox, 8080).await.unwrap();
    let expected = format!(
        "https://{}-8080.fake-modal.test/",
        sandbox.sandbox_id.as_str().to_ascii_lowercase()
    );
    match route {
        backends::PortRoute::Provider { url, public } => {
            assert_eq!(url, expected);
            assert!(public, "a Modal tunnel is reachable by anyone with the URL");
        }
        other => panic!("expected the provider's URL, got {other:?}"),
    }
    let refused = backend.port_route(&sandbox, 9090).await.unwrap_err();
    assert_eq!(
        refused.to_string(),
        format!(
            "Port 9090 is not open on Modal computer '{id}': Modal opens ports only when it creates a sandbox, for the ports in --modal-ports. Start the server with --modal-ports 9090 and use a new computer (or factory-reset this one)."
        )
    );
    assert!(requests(&fake).iter().any(
        |r| matches!(r, Req::SandboxGetTunnels(t) if t.sandbox_id == sandbox.sandbox_id.as_str())
    ));
    backend.remove(&sandbox).await.unwrap();

    // Without --modal-ports nothing is opened and every port is refused.
    let plain = modal(&fake, &[]);
    let id = computer("modal-noports");
    let sandbox = plain
        .create(&create_spec(&id, true, &InstanceId::random()), &NoProgress)
        .await
        .unwrap();
    let last_create = requests(&fake)
        .into_iter()
        .rev()
        .find_map(|r| match r {
            Req::SandboxCreate(c) => c.definition,
            _ => None,
        })
        .unwrap();
    assert!(last_create.open_ports_oneof.is_none());
    assert!(plain.port_route(&sandbox, 8080).await.is_err());
    plain.remove(&sandbox).await.unwrap();
}

#[tokio::test]
async fn issue_32_exec_falls_back_to_container_exec_without_the_router_against_fake() {
    // See: issue 32 (item 3): when the task command router is unavailable, exec uses the
    // ContainerExec* RPCs of the control plane, with the same results.
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = FakeModal::start(fake_modal::FakeConfig {
        router: false,
        ..fake_modal::FakeConfig::default()
    })
    .await
    .unwrap();
    let backend = modal(&fake, &[]);
    let id = computer("modal-fallback");
    let sandbox = backend
        .create(&create_spec(&id, true, &InstanceId::random()), &NoProgress)
        .await
        .unwrap();
    let before = fake.log().len();
    let stdin = "x".repeat(150_000);
    let (code, stdout, stderr) = completed(
        run(
            &*backend,
            &sandbox,
            "wc -c; pwd; echo err >&2; exit 4",
            Some(&stdin),
            Some("/tmp"),
            30,
            2_097_152,
        )
        .await,
    );
    assert_eq!(
        (code, stdout.as_str(), stderr.as_str()),
        (4, "150000\n/tmp\n", "err\n")
    );
    let calls: Vec<Req> = requests(&fake)[before..].to_vec();
    assert!(calls.iter().any(|r| matches!(r, Req::ContainerExec(_))));
    assert!(
        calls
            .iter()
            .any(|r| matches!(r, Req::ContainerExecPutInput(_)))
    );
    assert!(calls.iter().any(|r| matches!(r, Req::ContainerExecWait(_))));
    assert!(!calls.iter().any(|r| matches!(r, Req::TaskExecStart(_))));
    backend.remove(&sandbox).await.unwrap();
}

/// Checkpoints (docs/checkpoints.md, "E2B and Modal"): `SandboxSnapshotFs` with the wait our
/// clients use, a rollback that terminates the sandbox before creating one of the same name from
/// the snapshot image (names are unique), its tags keeping the base image, and `ImageDelete`.
#[tokio::test]
async fn contract_checkpoint_requests_against_fake() {
    use mcp_sandbox_computer_vm_for_ai::backends::checkpoints::{
        CheckpointName, FromCheckpoint, NewCheckpoint,
    };
    use mcp_sandbox_computer_vm_for_ai::ids::Principal;
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = fake().await;
    let _state = crate::common::modal::StateDir(crate::common::modal::state_dir(&fake));
    let backend = modal(&fake, &[]);
    let provider = backend.checkpoints().unwrap();
    let id = computer("modal-cp");
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
    let image = requests(&fake)
        .into_iter()
        .find_map(|r| match r {
            Req::SandboxSnapshotFs(r) => Some(r),
            _ => None,
        })
        .unwrap();
    assert_eq!(image.sandbox_id, sandbox.sandbox_id.as_str());
    assert!((image.timeout - 55.0).abs() < f32::EPSILON);
    let before = requests(&fake).len();
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
    let after: Vec<Req> = requests(&fake).into_iter().skip(before).collect();
    let terminate = after
        .iter()
        .position(|r| matches!(r, Req::SandboxTerminate(_)))
        .unwrap();
    let create = after
        .iter()
        .position(|r| matches!(r, Req::SandboxCreate(_)))
        .unwrap();
    assert!(
        terminate < create,
        "the name is free before the new sandbox takes it"
    );
    let Req::SandboxCreate(created) = &after[create] else {
        unreachable!()
    };
    let definition = created.definition.as_ref().unwrap();
    assert_eq!(definition.name.as_deref(), Some(id.as_str()));
    assert!(definition.image_id.starts_with("im-"));
    let live = fake.live_sandboxes();
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].0, rolled.sandbox_id.as_str());
    assert_eq!(
        live[0].2.get("kilntainers-image").map(String::as_str),
        Some("sandbox-busybox:full")
    );
    provider.delete(&id, &record.name).await.unwrap();
    let deleted: Vec<String> = requests(&fake)
        .into_iter()
        .filter_map(|r| match r {
            Req::ImageDelete(r) => Some(r.image_id),
            _ => None,
        })
        .collect();
    assert_eq!(deleted, vec![definition.image_id.clone()]);
    backend.remove(&rolled).await.unwrap();
    provider.forget(&id).await.unwrap();
}

/// Egress (docs/egress.md, "Modal"): the server's CIDR allow-list becomes the sandbox's
/// `NetworkAccess` (ALLOWLIST with the blocks) and its recorded tag; a computer's narrowed
/// policy is sent instead, found again by `egress_policy` and kept by a restart (a new
/// sandbox); a narrowed rule Modal has no words for is refused before anything is created.
#[tokio::test]
async fn issue_33_egress_policy_becomes_the_network_access_against_fake() {
    use mcp_sandbox_computer_vm_for_ai::backends::egress::Pattern;
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let fake = fake().await;
    let backend = modal(
        &fake,
        &[
            "--egress",
            "allowlist",
            "--egress-allow",
            "203.0.113.7",
            "--egress-allow",
            "198.51.100.0/24",
        ],
    );
    let creates = |fake: &FakeModal| -> Vec<pb::Sandbox> {
        requests(fake)
            .into_iter()
            .filter_map(|r| match r {
                Req::SandboxCreate(c) => c.definition,
                _ => None,
            })
            .collect()
    };
    let allowlist = pb::network_access::NetworkAccessType::Allowlist as i32;
    let id = computer("modal-egress");
    let sandbox = backend
        .create(&create_spec(&id, false, &InstanceId::random()), &NoProgress)
        .await
        .unwrap();
    let sent = creates(&fake).pop().unwrap().network_access.unwrap();
    assert_eq!(sent.network_access_type, allowlist);
    assert_eq!(sent.allowed_cidrs, ["203.0.113.7/32", "198.51.100.0/24"]);
    let server = backend.egress_policy(&sandbox).await.unwrap().unwrap();
    assert_eq!(
        server.to_label(),
        r#"{"mode":"allowlist","allow":["203.0.113.7","198.51.100.0/24"],"deny":[],"ask":false,"allow_private":false}"#
    );

    let narrow_id = computer("modal-egress-narrow");
    let mut spec = create_spec(&narrow_id, false, &InstanceId::random());
    spec.egress = Some(
        server
            .narrowed(&[Pattern::parse("198.51.100.128/25").unwrap()])
            .unwrap(),
    );
    let narrow = backend.create(&spec, &NoProgress).await.unwrap();
    let sent = creates(&fake).pop().unwrap().network_access.unwrap();
    assert_eq!(
        (sent.network_access_type, sent.allowed_cidrs),
        (allowlist, vec!["198.51.100.128/25".to_owned()])
    );
    let restarted = backend.restart(&narrow).await.unwrap().sandbox;
    assert_ne!(restarted.sandbox_id, narrow.sandbox_id);
    let sent = creates(&fake).pop().unwrap().network_access.unwrap();
    assert_eq!(sent.allowed_cidrs, ["198.51.100.128/25"]);
    let kept = backend.egress_policy(&restarted).await.unwrap().unwrap();
    assert_eq!(kept.allow, spec.egress.as_ref().unwrap().allow);

    let before = creates(&fake).len();
    let mut ported = create_spec(&computer("modal-egress-port"), true, &InstanceId::random());
    ported.egress = Some(
        server
            .narrowed(&[Pattern::parse("203.0.113.7:443").unwrap()])
            .unwrap(),
    );
    let refused = backend.create(&ported, &NoProgress).await.unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("'203.0.113.7:443' names a port, and Modal's network allow-list has none"),
        "{refused}"
    );
    assert_eq!(creates(&fake).len(), before, "nothing was created");
    backend.remove(&restarted).await.unwrap();
    backend.remove(&sandbox).await.unwrap();
}
