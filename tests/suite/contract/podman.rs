//! The contract on a real Podman engine through its Docker-compatible API socket, when the
//! environment provides one (`KILNTAINERS_IT_PODMAN=1`, `KILNTAINERS_PODMAN_SOCKET`).

use clap::Parser;

use mcp_sandbox_computer_vm_for_ai::backends;
use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;

use super::{Harness, OUTPUT_LIMIT_FLAG};
use crate::common::enabled;

async fn harness() -> Option<Harness> {
    if !enabled("KILNTAINERS_IT_PODMAN") {
        return None;
    }
    let socket = std::env::var("KILNTAINERS_PODMAN_SOCKET")
        .unwrap_or_else(|_| "unix:///run/podman/podman.sock".into());
    let mut args = vec![
        "x",
        "--engine",
        "podman",
        "--docker-host",
        &socket,
        "--image",
        "localhost/sandbox-busybox:full",
        "--shell",
        "/bin/sh",
    ];
    args.extend(OUTPUT_LIMIT_FLAG);
    let config = Config::from_cli(&Cli::try_parse_from(args).unwrap(), None).unwrap();
    let backend = backends::build(&config).unwrap();
    let collector = backends::build(&config).unwrap();
    Some(Harness::new(backend, collector, "/bin/sh", ()).with_container_cleanup(Some(socket)))
}

contract_tests!(real);
