//! The local fake of Fly's documented Machines API (`tests/blackbox/fake_fly.py`) as a child
//! process, and a Fly backend pointed at it. Shared by `suite::fly` and the contract suite.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::{Value, json};

use mcp_sandbox_computer_vm_for_ai::backends::{self, Backend};
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;
use mcp_sandbox_computer_vm_for_ai::config::Secret;
use mcp_sandbox_computer_vm_for_ai::config::fly::TokenSources;

use super::unique_id;

pub const TOKEN: &str = "test-token";

/// The fake as a child process; closing its stdin makes it remove its containers and exit.
pub struct Fake {
    child: Child,
    pub url: String,
    pub dir: PathBuf,
    http: reqwest::Client,
}

impl Fake {
    pub fn start(args: &[&str]) -> Fake {
        let dir = std::env::temp_dir().join(format!("fake-fly-{}", unique_id("t")));
        std::fs::create_dir_all(&dir).unwrap();
        let port_file = dir.join("port");
        let python = std::env::var("KILNTAINERS_TEST_VENV")
            .map(|venv| format!("{venv}/bin/python"))
            .unwrap_or_else(|_| "python3".to_owned());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/blackbox/fake_fly.py");
        let child = Command::new(python)
            .arg(script)
            .arg("--port-file")
            .arg(&port_file)
            .args(args)
            .stdin(Stdio::piped())
            .spawn()
            .expect("start the fake Fly API");
        let deadline = Instant::now() + Duration::from_secs(20);
        let port = loop {
            if let Ok(port) = std::fs::read_to_string(&port_file) {
                break port;
            }
            assert!(Instant::now() < deadline, "the fake did not start");
            std::thread::sleep(Duration::from_millis(20));
        };
        Fake {
            child,
            url: format!("http://127.0.0.1:{}", port.trim()),
            dir,
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
    let mut config = Config::from_cli(&cli, None).unwrap();
    config.fly.app = app.map(str::to_owned);
    config.fly.tokens = TokenSources {
        flag: token.map(Secret::new),
        env: Vec::new(),
        config_file: None,
    };
    config.fly.state_file = Some(fake.dir.join("fly.json"));
    backends::build(&config).unwrap()
}

pub fn backend(fake: &Fake) -> Arc<dyn Backend> {
    backend_with(fake, Some("demo"), Some(TOKEN), &[])
}
