//! The local fake of E2B's control plane and envd process service (`fakes/e2b.py`) as a child
//! process, and an E2B backend pointed at it. Shared by `suite::e2b` and the contract suite.

use std::sync::Arc;

use clap::Parser;
use serde_json::{Value, json};

use mcp_sandbox_computer_vm_for_ai::backends::Backend;
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;
use mcp_sandbox_computer_vm_for_ai::providers;

use super::PythonFake;

pub const KEY: &str = "e2b_test_key";

/// The fake as a child process (see [`PythonFake`]).
pub struct Fake {
    _process: PythonFake,
    /// The backends' state directory (checkpoint records), removed with the fake.
    pub state: std::path::PathBuf,
    pub api: String,
    pub envd: String,
    http: reqwest::Client,
}

impl Fake {
    pub fn start(args: &[&str]) -> Fake {
        let args: Vec<&str> = ["--api-key", KEY]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let (process, ports) = PythonFake::start("e2b", &args);
        let ports: Value = serde_json::from_str(&ports).unwrap();
        let state = std::env::temp_dir().join(format!(
            "kt-e2b-state-{}-{}",
            std::process::id(),
            ports["api"]
        ));
        Fake {
            _process: process,
            state,
            api: format!("http://127.0.0.1:{}", ports["api"]),
            envd: format!("http://127.0.0.1:{}", ports["envd"]),
            http: reqwest::Client::new(),
        }
    }

    pub async fn get(&self, path: &str) -> Value {
        let text = self
            .http
            .get(format!("{}{path}", self.api))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        serde_json::from_str(&text).unwrap()
    }

    pub async fn control(&self, path: &str, body: Value) {
        self.http
            .post(format!("{}{path}", self.api))
            .header("Content-Type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
    }

    pub async fn requests_to(&self, method: &str, path: &str) -> Vec<Value> {
        self.get("/_fake/requests")
            .await
            .as_array()
            .cloned()
            .unwrap()
            .into_iter()
            .filter(|r| r["method"] == method && r["path"] == path)
            .collect()
    }

    pub async fn assert_no_violations(&self) {
        assert_eq!(self.get("/_fake/violations").await, json!([]));
    }

    pub async fn sandboxes(&self) -> Vec<Value> {
        self.get("/_fake/state").await["sandboxes"]
            .as_array()
            .cloned()
            .unwrap()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

pub fn backend_with(fake: &Fake, key: Option<&str>, extra: &[&str]) -> Arc<dyn Backend> {
    let mut args = vec![
        "x",
        "--backend",
        "e2b",
        "--e2b-api-url",
        &fake.api,
        "--e2b-envd-url",
        &fake.envd,
        "--shell",
        "/bin/sh",
    ];
    args.extend_from_slice(extra);
    let cli = Cli::try_parse_from(args).unwrap();
    let mut config =
        Config::from_cli(&cli, mcp_sandbox_computer_vm_for_ai::config::process_env).unwrap();
    // Never the developer's own E2B_API_KEY.
    config.e2b.api_key = key.map(mcp_sandbox_computer_vm_for_ai::secret::Secret::new);
    config.e2b.state_dir = Some(fake.state.clone());
    providers::build(&config).unwrap()
}
