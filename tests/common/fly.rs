//! The local fake of Fly's documented Machines API (`fakes/fly.py`) as a child process, and a
//! Fly backend pointed at it. Shared by `suite::fly` and the contract suite.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use serde_json::{Value, json};

use mcp_sandbox_computer_vm_for_ai::backends::Backend;
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;
use mcp_sandbox_computer_vm_for_ai::config::fly::TokenSources;
use mcp_sandbox_computer_vm_for_ai::providers;
use mcp_sandbox_computer_vm_for_ai::secret::Secret;

use super::PythonFake;

pub const TOKEN: &str = "test-token";

/// The fake as a child process (see [`PythonFake`]).
pub struct Fake {
    _process: PythonFake,
    pub url: String,
    pub dir: PathBuf,
    http: reqwest::Client,
}

impl Fake {
    pub fn start(args: &[&str]) -> Fake {
        let (process, port) = PythonFake::start("fly", args);
        Fake {
            url: format!("http://127.0.0.1:{}", port.trim()),
            dir: process.dir.clone(),
            _process: process,
            http: reqwest::Client::new(),
        }
    }

    /// A fake that accepts `Bearer test-token` and already has app `demo`.
    pub fn with_demo() -> Fake {
        Fake::start(&["--token", &format!("Bearer {TOKEN}"), "--app", "demo"])
    }

    pub async fn get(&self, path: &str) -> Value {
        let text = self
            .http
            .get(format!("{}{path}", self.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        serde_json::from_str(&text).unwrap()
    }

    pub async fn post(&self, path: &str, body: Value, auth: bool) -> Value {
        let mut request = self
            .http
            .post(format!("{}{path}", self.url))
            .header("Content-Type", "application/json")
            .body(body.to_string());
        if auth {
            request = request.header("Authorization", format!("Bearer {TOKEN}"));
        }
        let text = request.send().await.unwrap().text().await.unwrap();
        serde_json::from_str(&text).unwrap_or(Value::Null)
    }

    pub async fn requests(&self) -> Vec<Value> {
        self.get("/_fake/requests")
            .await
            .as_array()
            .cloned()
            .unwrap()
    }

    /// Requests whose method matches and whose path matches the regex-free `prefix`.
    pub async fn requests_to(&self, method: &str, path: &str) -> Vec<Value> {
        self.requests()
            .await
            .into_iter()
            .filter(|r| r["method"] == method && r["path"] == path)
            .collect()
    }

    pub async fn inject(&self, method: &str, path: &str, status: u16, times: u32, headers: Value) {
        self.post(
            "/_fake/inject",
            json!({"method": method, "path": path, "status": status, "times": times, "headers": headers}),
            false,
        )
        .await;
    }

    pub async fn assert_no_violations(&self) {
        assert_eq!(self.get("/_fake/violations").await, json!([]));
    }

    pub async fn machines(&self) -> Vec<Value> {
        self.get("/_fake/state").await["machines"]
            .as_array()
            .cloned()
            .unwrap()
    }
}

/// A Fly backend pointed at the fake, with no token source but the one given and its own
/// state file (never the developer's real `~/.fly` or `fly.json`).
pub fn backend_with(
    fake: &Fake,
    app: Option<&str>,
    token: Option<&str>,
    extra: &[&str],
) -> Arc<dyn Backend> {
    let mut args = vec![
        "x",
        "--backend",
        "fly",
        "--fly-api-url",
        &fake.url,
        "--fly-graphql-url",
        &fake.url,
        "--fly-image",
        "sandbox-busybox:full",
        "--shell",
        "/bin/sh",
    ];
    args.extend_from_slice(extra);
    let cli = Cli::try_parse_from(args).unwrap();
    let mut config =
        Config::from_cli(&cli, mcp_sandbox_computer_vm_for_ai::config::process_env).unwrap();
    config.fly.app = app.map(str::to_owned);
    config.fly.tokens = TokenSources {
        flag: token.map(Secret::new),
        env: Vec::new(),
        config_file: None,
    };
    config.fly.state_file = Some(fake.dir.join("fly.json"));
    providers::build(&config).unwrap()
}

pub fn backend(fake: &Fake) -> Arc<dyn Backend> {
    backend_with(fake, Some("demo"), Some(TOKEN), &[])
}
