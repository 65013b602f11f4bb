//! The local fake of the Kubernetes API server (`fakes/kubernetes.py`) as a child process, a
//! kubeconfig pointing at it (plain HTTP, a bearer token), and a Kubernetes backend built from
//! that kubeconfig, for the contract suite. The fake runs each Pod as a local container, so
//! commands really run.

use std::sync::Arc;

use clap::Parser;

use mcp_sandbox_computer_vm_for_ai::backends::Backend;
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;
use mcp_sandbox_computer_vm_for_ai::providers;

use super::PythonFake;

pub const TOKEN: &str = "k8s-test-token";
/// The local image the fake's Pods run (tests never pull).
pub const IMAGE: &str = "sandbox-busybox:full";

/// The fake as a child process and the kubeconfig written for it.
pub struct Fake {
    _process: PythonFake,
    pub url: String,
    pub kubeconfig: std::path::PathBuf,
}

impl Fake {
    /// The fake with namespace `default` and the agent-sandbox CRDs; `args` adds to its CLI.
    pub fn start(args: &[&str]) -> Fake {
        let args: Vec<&str> = ["--token", TOKEN, "--namespace", "default"]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let (process, port) = PythonFake::start("kubernetes", &args);
        let url = format!("http://127.0.0.1:{}", port.trim());
        let kubeconfig = process.dir.join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_text(&url, TOKEN)).unwrap();
        Fake {
            _process: process,
            url,
            kubeconfig,
        }
    }

    pub fn violations_url(&self) -> String {
        format!("{}/_fake/violations", self.url)
    }
}

/// A kubeconfig with one context, `fake`, reaching `url` with `token`.
pub fn kubeconfig_text(url: &str, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\nusers:\n- name: fake\n  user:\n    token: {token}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\ncurrent-context: fake\n"
    )
}

/// A backend on the fake, in pod mode, running [`IMAGE`] with `/bin/sh`.
pub fn backend_with(fake: &Fake, extra: &[&str]) -> Arc<dyn Backend> {
    backend_in_mode(fake, "pod", extra)
}

/// A backend on the fake in `mode` (`pod` or `sandbox`), running [`IMAGE`] with `/bin/sh`.
pub fn backend_in_mode(fake: &Fake, mode: &str, extra: &[&str]) -> Arc<dyn Backend> {
    let mut args = vec![
        "x",
        "--backend",
        "kubernetes",
        "--k8s-mode",
        mode,
        "--image",
        IMAGE,
        "--shell",
        "/bin/sh",
    ];
    args.extend_from_slice(extra);
    let cli = Cli::try_parse_from(args).unwrap();
    let mut config =
        Config::from_cli(&cli, mcp_sandbox_computer_vm_for_ai::config::process_env).unwrap();
    config.kubernetes.kubeconfig = Some(fake.kubeconfig.clone());
    providers::build(&config).unwrap()
}
