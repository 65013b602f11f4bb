//! Exec round trips on the other engines the Docker backend supports: Podman through its
//! Docker-compatible API socket, and gVisor (`--runtime runsc`) with networking off, both
//! through the resident exec helper.

use serde_json::json;

use crate::common::{ContainerGuard, TempHome, enabled, execute, start, structured, unique_id};

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
    let socket = std::env::var("KILNTAINERS_PODMAN_SOCKET")
        .unwrap_or_else(|_| "unix:///run/podman/podman.sock".into());
    let id = unique_id("rs-podman");
    let _guard = ContainerGuard {
        names: vec![format!("kilntainer-{id}")],
        docker_host: Some(socket.clone()),
    };
    let args = [
        "--engine",
        "podman",
        "--docker-host",
        &socket,
        "--image",
        "localhost/sandbox-busybox:full",
        "--shell",
        "/bin/sh",
    ];
    round_trip(&args, &id).await;
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
