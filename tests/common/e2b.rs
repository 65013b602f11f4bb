//! The local fake of E2B's control plane and envd process service (`tests/blackbox/fake_e2b.py`)
//! as a child process, and an E2B backend pointed at it. Shared by `suite::e2b` and the contract
//! suite.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::{Value, json};

use mcp_sandbox_computer_vm_for_ai::backends::{self, Backend};
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;

use super::unique_id;

pub const KEY: &str = "e2b_test_key";

/// The fake as a child process; closing its stdin makes it remove its containers and exit.
pub struct Fake {
    child: Child,
    pub api: String,
    pub envd: String,
    dir: PathBuf,
    http: reqwest::Client,
}

impl Fake {
    pub fn start(args: &[&str]) -> Fake {
        let dir = std::env::temp_dir().join(format!("fake-e2b-{}", unique_id("t")));
        std::fs::create_dir_all(&dir).unwrap();
        let port_file = dir.join("ports");
        let python = std::env::var("KILNTAINERS_TEST_VENV")
            .map(|venv| format!("{venv}/bin/python"))
            .unwrap_or_else(|_| "python3".to_owned());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/blackbox/fake_e2b.py");
        let child = Command::new(python)
            .arg(script)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--api-key")
            .arg(KEY)
            .args(args)
            .stdin(Stdio::piped())
            .spawn()
            .expect("start the fake E2B API");
        let deadline = Instant::now() + Duration::from_secs(20);
        let ports: Value = loop {
            if let Ok(text) = std::fs::read_to_string(&port_file) {
                break serde_json::from_str(&text).unwrap();
            }
            assert!(Instant::now() < deadline, "the fake did not start");
            std::thread::sleep(Duration::from_millis(20));
        };
        Fake {
            child,
            api: format!("http://127.0.0.1:{}", ports["api"]),
            envd: format!("http://127.0.0.1:{}", ports["envd"]),
            dir,
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
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                let _ = std::fs::remove_dir_all(&self.dir);
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
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
    let mut config = Config::from_cli(&cli, None).unwrap();
    // Never the developer's own E2B_API_KEY.
    config.e2b.api_key = key.map(mcp_sandbox_computer_vm_for_ai::config::Secret::new);
    backends::build(&config).unwrap()
}
