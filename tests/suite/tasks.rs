//! The MCP Tasks extension (docs/tasks.md) with the Rust SDK's own client: rmcp, the version
//! the server is built on, in 2026-07-28 mode (`server/discover`, per-request `_meta`) with the
//! extension declared, against the real binary over Streamable HTTP and a real Docker engine.
//! A long command becomes a task polled to its full result; a quick one is answered as usual;
//! `tasks/cancel` ends the command; a new server process answers for a task after a SIGKILL.
//! (The raw client that follows the extension's text is `tests/blackbox/test_tasks.py`.)

use std::time::{Duration, Instant};

use rmcp::RoleClient;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, ClientCapabilities, ClientConfig,
    GetTaskParams, GetTaskResult, Implementation, ProtocolVersion, TaskPayload, TaskStatus,
};
use rmcp::service::{ClientLifecycleMode, ClientServiceExt, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde_json::{Map, Value, json};

use crate::common::{ContainerGuard, HttpServer, enabled, unique_id};

const BUSYBOX: [&str; 4] = ["--image", "sandbox-busybox:full", "--shell", "/bin/sh"];
/// A first answer after one second, so the cases need not wait the default five.
const FAST: [&str; 2] = ["--task-after", "1"];

type Client = RunningService<RoleClient, ClientConfig>;

/// A 2026-07-28 client of `server` that declares the Tasks extension on every request.
async fn client(server: &HttpServer) -> Client {
    let transport = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(server.url("/mcp"))
            .auth_header(server.token()),
    );
    let capabilities = ClientCapabilities::builder().enable_tasks().build();
    ClientConfig::new(capabilities, Implementation::new("tasks-suite", "1"))
        .with_protocol_version(ProtocolVersion::V_2026_07_28)
        .serve_with_lifecycle(
            transport,
            ClientLifecycleMode::Discover {
                preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            },
        )
        .await
        .expect("a 2026-07-28 client")
}

fn call(arguments: Value) -> CallToolRequestParams {
    CallToolRequestParams::new("terminal_execute")
        .with_arguments(arguments.as_object().cloned().expect("an object"))
}

/// Polls `tasks/get` at the suggested interval until the task is terminal (at most a minute).
async fn until_terminal(client: &Client, task_id: &str) -> (GetTaskResult, usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut working = 0;
    loop {
        let got = client
            .get_task(GetTaskParams::new(task_id))
            .await
            .expect("tasks/get");
        assert_eq!(got.task.task.task_id, task_id);
        if got.task.status().is_terminal() {
            return (got, working);
        }
        working += 1;
        assert!(Instant::now() < deadline, "still working: {got:?}");
        let interval = got.task.task.poll_interval_ms.unwrap_or(1000);
        tokio::time::sleep(Duration::from_millis(interval)).await;
    }
}

/// The structured result of a completed task, without its duration.
fn completed_fields(got: &GetTaskResult) -> Map<String, Value> {
    let TaskPayload::Completed { result } = &got.task.payload else {
        panic!("not completed: {got:?}");
    };
    assert_eq!(result.get("isError"), Some(&json!(false)), "{result:?}");
    let mut fields = result
        .get("structuredContent")
        .and_then(Value::as_object)
        .cloned()
        .expect("structuredContent");
    assert!(
        fields
            .remove("exec_duration_ms")
            .is_some_and(|d| d.is_u64())
    );
    fields
}

#[tokio::test]
async fn issue_36_tasks_with_the_rust_sdk_client() {
    // See: issue 36
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return;
    }
    let id = unique_id("tasks-rmcp");
    let _guard = ContainerGuard {
        names: vec![format!("kilntainer-{id}")],
        docker_host: None,
    };
    let args: Vec<&str> = BUSYBOX.iter().chain(FAST.iter()).copied().collect();
    let mut first = HttpServer::start("tasks-rmcp", &args).await;
    let sdk = client(&first).await;
    assert!(
        sdk.peer_info()
            .is_some_and(|info| info.capabilities.supports_tasks()),
        "server/discover does not advertise the extension"
    );

    // A quick command: its plain result.
    let quick = sdk
        .call_tool_once(call(
            json!({"command": "echo hi", "computer_id": id, "temporary": false}),
        ))
        .await
        .expect("tools/call");
    let CallToolResponse::Complete(result) = quick else {
        panic!("a quick command became {quick:?}");
    };
    let quick = result.structured_content.expect("structuredContent");
    assert_eq!(quick["stdout"], "hi\n");

    // A long command: a task, polled to its whole result.
    let command = "for i in 1 2 3; do echo line$i; sleep 1; done; exit 4";
    let long = sdk
        .call_tool_once(call(
            json!({"command": command, "computer_id": id, "temporary": false}),
        ))
        .await
        .expect("tools/call");
    let CallToolResponse::Task(created) = long else {
        panic!("a long command was answered {long:?}");
    };
    assert_eq!(created.task.status, TaskStatus::Working);
    assert_eq!(created.task.ttl_ms, Some(3_600_000));
    assert_eq!(created.task.poll_interval_ms, Some(1000));
    let (done, working) = until_terminal(&sdk, &created.task.task_id).await;
    assert!(working > 0, "never seen working");
    let fields = completed_fields(&done);
    assert_eq!(
        Value::Object(fields),
        json!({"computer_id": id, "temporary": false, "stdout": "line1\nline2\nline3\n", "stderr": "", "exit_code": 4})
    );

    // tasks/cancel: acknowledged, and the task ends cancelled.
    let sleeper = sdk
        .call_tool_once(call(
            json!({"command": "sleep 600", "computer_id": id, "temporary": false}),
        ))
        .await
        .expect("tools/call");
    let CallToolResponse::Task(sleeper) = sleeper else {
        panic!("sleep 600 was answered {sleeper:?}");
    };
    sdk.cancel_task(CancelTaskParams::new(sleeper.task.task_id.clone()))
        .await
        .expect("tasks/cancel");
    let (cancelled, _) = until_terminal(&sdk, &sleeper.task.task_id).await;
    assert_eq!(cancelled.task.status(), TaskStatus::Cancelled);

    // Durable: a task created by a server that is then SIGKILLed is answered by the next one.
    let survivor = sdk
        .call_tool_once(call(
            json!({"command": "sleep 3; echo survived", "computer_id": id, "temporary": false}),
        ))
        .await
        .expect("tools/call");
    let CallToolResponse::Task(survivor) = survivor else {
        panic!("sleep 3 was answered {survivor:?}");
    };
    drop(sdk);
    first.child.kill().expect("SIGKILL");
    first.child.wait().expect("reaped");
    let second = HttpServer::start("tasks-rmcp-2", &args).await;
    let sdk = client(&second).await;
    let (done, _) = until_terminal(&sdk, &survivor.task.task_id).await;
    assert_eq!(
        Value::Object(completed_fields(&done)),
        json!({"computer_id": id, "temporary": false, "stdout": "survived\n", "stderr": "", "exit_code": 0})
    );
    // An id nobody made: the extension's invalid-params error.
    let unknown = sdk
        .get_task(GetTaskParams::new(format!(
            "t1.{id}.j-00000000.{}",
            "0".repeat(32)
        )))
        .await
        .expect_err("an unknown task");
    assert!(format!("{unknown:?}").contains("-32602"), "{unknown:?}");
}
