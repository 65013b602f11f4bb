//! The real binary over stdio, driven by the Rust MCP client (rmcp), against the real Docker
//! engine: the tool surface, a round trip, and the kill of a timed-out process tree.

use serde_json::json;

use crate::common::{ContainerGuard, TempHome, enabled, execute, start, structured, unique_id};

const BUSYBOX: [&str; 4] = ["--image", "sandbox-busybox:full", "--shell", "/bin/sh"];

#[tokio::test]
async fn tools_list_has_exactly_terminal_execute_with_output_schema() {
    let home = TempHome::new("surface");
    let client = start(&[], &home.0).await;
    let tools = client.list_all_tools().await.expect("tools/list");
    assert_eq!(
        tools.iter().map(|t| t.name.as_ref()).collect::<Vec<_>>(),
        ["terminal_execute"]
    );
    let tool = &tools[0];
    assert!(tool.output_schema.is_some());
    let description = tool.description.as_deref().unwrap_or_default();
    assert!(description.starts_with(
        "Execute a shell command in an isolated Debian Linux sandbox. Commands run in bash."
    ));
    let info = client.peer_info().expect("server info");
    assert_eq!(
        info.server_info.as_ref().map(|s| s.name.as_str()),
        Some("Kilntainers")
    );
    client.cancel().await.expect("close");
}

#[tokio::test]
async fn exec_round_trip_and_timeout_kills_the_tree() {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let home = TempHome::new("stdio");
    let id = unique_id("rs-stdio");
    let _guard = ContainerGuard {
        names: vec![format!("kilntainer-{id}")],
        docker_host: None,
    };
    let client = start(&BUSYBOX, &home.0).await;

    let result = execute(
        &client,
        json!({"command": "printf 'a\\tb' && echo oops >&2 && exit 7", "computer_id": id}),
    )
    .await;
    let payload = structured(&result);
    let keys: Vec<&str> = payload.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "computer_id",
            "temporary",
            "stdout",
            "stderr",
            "exit_code",
            "exec_duration_ms"
        ]
    );
    assert_eq!(payload["stdout"], "a\tb");
    assert_eq!(payload["stderr"], "oops\n");
    assert_eq!(payload["exit_code"], 7);

    let timed_out = execute(
        &client,
        json!({"command": "sleep 300 & sleep 200", "timeout": 1, "computer_id": id}),
    )
    .await;
    let payload = structured(&timed_out);
    assert_eq!(payload["exit_code"], 124);
    assert_eq!(
        payload["stderr"],
        "[kilntainers: command timed out after 1s]"
    );
    let survivors = execute(
        &client,
        json!({"command": "ps -o args | grep -c '^sleep [23]00' || true", "computer_id": id}),
    )
    .await;
    assert_eq!(
        structured(&survivors)["stdout"],
        "0\n",
        "a timed-out command's processes survived"
    );
    client.cancel().await.expect("close");
}
