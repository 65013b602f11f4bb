//! Shared helpers: start the built binary as an MCP server over stdio with the rmcp client,
//! call `terminal_execute`, and remove any container a test made even when it fails.

use std::process::Stdio;

use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::RunningService;
use rmcp::transport::TokioChildProcess;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{Map, Value};
use tokio::process::Command;

pub const BIN: &str = env!("CARGO_BIN_EXE_mcp-sandbox-computer-vm-for-ai");

/// Whether the test environment set up this integration target (`scripts/setup-test-env.sh`
/// writes these variables into `.test-env/env`). Absent ones are reported, not silently passed.
pub fn enabled(variable: &str) -> bool {
    let on = std::env::var(variable).is_ok_and(|v| v == "1");
    if !on {
        eprintln!("SKIP: {variable} is not 1; run the suite through scripts/test.sh");
    }
    on
}

pub type Client = RunningService<RoleClient, ()>;

/// Starts the server with `args` and a private HOME (so instance locks do not mix).
pub async fn start(args: &[&str], home: &std::path::Path) -> Client {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env("HOME", home)
        .stderr(Stdio::inherit());
    let transport = TokioChildProcess::new(command).expect("spawn server");
    ().serve(transport).await.expect("initialize")
}

pub async fn execute(client: &Client, arguments: Value) -> CallToolResult {
    let arguments: Map<String, Value> = arguments.as_object().cloned().unwrap_or_default();
    client
        .call_tool(CallToolRequestParams::new("terminal_execute").with_arguments(arguments))
        .await
        .expect("tools/call")
}

/// The structured content of a successful call.
pub fn structured(result: &CallToolResult) -> Map<String, Value> {
    assert_eq!(result.is_error, Some(false), "tool error: {result:?}");
    result
        .structured_content
        .as_ref()
        .and_then(Value::as_object)
        .cloned()
        .expect("structuredContent")
}

/// A unique computer id for this test run.
pub fn unique_id(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand_u32())
}

fn rand_u32() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    nanos ^ std::process::id().rotate_left(16)
}

/// Force-removes the named containers on drop, through the given engine socket, so a failed
/// assertion does not leak them.
pub struct ContainerGuard {
    pub names: Vec<String>,
    pub docker_host: Option<String>,
}

impl Drop for ContainerGuard {
    fn drop(&mut self) {
        for name in &self.names {
            let mut command = std::process::Command::new("docker");
            if let Some(host) = &self.docker_host {
                command.env("DOCKER_HOST", host);
            }
            let _ = command
                .args(["rm", "-f", name])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// A temporary directory removed on drop.
pub struct TempHome(pub std::path::PathBuf);

impl TempHome {
    pub fn new(label: &str) -> Self {
        let path = std::env::temp_dir().join(format!("kilntainers-it-{label}-{:08x}", rand_u32()));
        std::fs::create_dir_all(&path).expect("temp home");
        Self(path)
    }
}

impl Drop for TempHome {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
