//! Exec round trips on the other engines the Docker backend supports: Podman through its
//! Docker-compatible API socket, and gVisor (`--runtime runsc`) with networking off, both
//! through the resident exec helper.

use serde_json::json;

use crate::common::{
    ContainerGuard, TempHome, enabled, eventually, execute, podman_args, podman_socket, start,
    structured, unique_id,
};

async fn round_trip(args: &[&str], id: &str) {
    let home = TempHome::new("engine");
    let client = start(args, &home.0).await;
    let result = execute(
        &client,
        json!({"command": "cat; echo \" $(id -u)\"", "stdin": "über", "computer_id": id}),
    )
    .await;
    let payload = structured(&result);
    assert_eq!(payload["stdout"], "über 0\n");
    assert_eq!(payload["exit_code"], 0);
    // Through the resident exec helper (its pid is the parent; plain Docker exec shows 0).
    let parent = execute(&client, json!({"command": "echo $PPID", "computer_id": id})).await;
    let parent = structured(&parent)["stdout"]
        .as_str()
        .unwrap_or_default()
        .trim()
        .to_owned();
    assert!(
        parent.parse::<u32>().is_ok_and(|pid| pid > 0),
        "parent {parent:?}"
    );
    let timed_out = execute(
        &client,
        json!({"command": "sleep 100", "timeout": 1, "computer_id": id}),
    )
    .await;
    assert_eq!(structured(&timed_out)["exit_code"], 124);
    client.cancel().await.expect("close");
}

#[tokio::test]
async fn podman_exec_round_trip() {
    if !enabled("KILNTAINERS_IT_PODMAN") {
        return;
    }
    let socket = podman_socket();
    let id = unique_id("rs-podman");
    let _guard = ContainerGuard {
        names: vec![format!("kilntainer-{id}")],
        docker_host: Some(socket.clone()),
    };
    round_trip(&podman_args(&socket), &id).await;
}

#[tokio::test]
async fn gvisor_exec_round_trip_without_network() {
    if !enabled("KILNTAINERS_IT_RUNSC") {
        return;
    }
    let id = unique_id("rs-runsc");
    let _guard = ContainerGuard {
        names: vec![format!("kilntainer-{id}")],
        docker_host: None,
    };
    let args = [
        "--runtime",
        "runsc",
        "--no-network",
        "--image",
        "sandbox-busybox:full",
        "--shell",
        "/bin/sh",
    ];
    round_trip(&args, &id).await;
}

/// The `docker` CLI against `host`; its stdout.
fn docker_on(host: &str, args: &[&str]) -> String {
    let output = std::process::Command::new("docker")
        .env("DOCKER_HOST", host)
        .args(args)
        .output()
        .expect("docker CLI");
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// Podman renames through its Docker-compatible API too, so a spare becomes the computer there
/// as on Docker (docs/warm-pool.md).
#[tokio::test]
async fn podman_hands_out_a_warm_pool_spare() {
    if !enabled("KILNTAINERS_IT_PODMAN") {
        return;
    }
    let socket = podman_socket();
    let id = unique_id("rs-podman-pool");
    let _guard = ContainerGuard {
        names: vec![format!("kilntainer-{id}")],
        docker_host: Some(socket.clone()),
    };
    let home = TempHome::new("podman-pool");
    let mut args = podman_args(&socket);
    args.extend(["--warm-pool", "1", "--lifecycle-tools"]);
    let client = start(&args, &home.0).await;
    let locks = home.0.join(".mcp-sandbox-computer-vm-for-ai/instances");
    let instance = std::fs::read_dir(&locks)
        .expect("instance locks")
        .filter_map(Result::ok)
        .find_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            name.strip_suffix(".lock").map(str::to_owned)
        })
        .expect("the server's instance lock");
    let instance_filter = format!("label=kilntainers.instance={instance}");
    let spare_ids = || {
        docker_on(
            &socket,
            &[
                "ps",
                "-q",
                "--no-trunc",
                "--filter",
                &instance_filter,
                "--filter",
                "label=kilntainers.pooled=true",
            ],
        )
    };
    // Ready as the server sees it (running, and its readiness checked), not only running.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let listing = client
            .call_tool(rmcp::model::CallToolRequestParams::new("computer_list"))
            .await
            .expect("computer_list");
        if structured(&listing)["warm_pool"]["ready"] == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the spare never became ready"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let spare = spare_ids();
    let result = execute(
        &client,
        json!({"command": "echo pooled", "computer_id": id, "temporary": true}),
    )
    .await;
    assert_eq!(structured(&result)["stdout"], "pooled\n");
    let container = docker_on(
        &socket,
        &[
            "inspect",
            "--format",
            "{{.Id}}",
            &format!("kilntainer-{id}"),
        ],
    );
    assert_eq!(container, spare, "the computer is not the spare");
    client.cancel().await.expect("close");
    let all = || docker_on(&socket, &["ps", "-aq", "--filter", &instance_filter]);
    assert!(
        eventually(std::time::Duration::from_secs(20), || all().is_empty()).await,
        "containers of the server outlived it: {}",
        all()
    );
}
