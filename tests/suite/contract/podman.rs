//! The contract on a real Podman engine through its Docker-compatible API socket, when the
//! environment provides one (`KILNTAINERS_IT_PODMAN=1`, `KILNTAINERS_PODMAN_SOCKET`).

use clap::Parser;

use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;
use mcp_sandbox_computer_vm_for_ai::providers;

use super::{Harness, OUTPUT_LIMIT_FLAG};
use crate::common::{enabled, podman_args, podman_socket};

async fn harness() -> Option<Harness> {
    if !enabled("KILNTAINERS_IT_PODMAN") {
        return None;
    }
    let socket = podman_socket();
    let mut args = vec!["x"];
    args.extend(podman_args(&socket));
    args.extend(OUTPUT_LIMIT_FLAG);
    let config = Config::from_cli(
        &Cli::try_parse_from(args).unwrap(),
        mcp_sandbox_computer_vm_for_ai::config::process_env,
    )
    .unwrap();
    let backend = providers::build(&config).unwrap();
    let collector = providers::build(&config).unwrap();
    Some(Harness::new(backend, collector, "/bin/sh", ()).with_container_cleanup(Some(socket)))
}

contract_tests!(real);
