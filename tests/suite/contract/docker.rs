//! The contract on a real Docker engine (`KILNTAINERS_IT_DOCKER=1`), with the BusyBox test
//! image and whatever exec path the configuration picks (the resident helper by default).

use clap::Parser;

use mcp_sandbox_computer_vm_for_ai::cli::Cli;
use mcp_sandbox_computer_vm_for_ai::config::Config;
use mcp_sandbox_computer_vm_for_ai::providers;

use super::{Harness, OUTPUT_LIMIT_FLAG};
use crate::common::enabled;

async fn harness() -> Option<Harness> {
    if !enabled("KILNTAINERS_IT_DOCKER") {
        return None;
    }
    let mut args = vec!["x", "--image", "sandbox-busybox:full", "--shell", "/bin/sh"];
    args.extend(OUTPUT_LIMIT_FLAG);
    let config = Config::from_cli(
        &Cli::try_parse_from(args).unwrap(),
        mcp_sandbox_computer_vm_for_ai::config::process_env,
    )
    .unwrap();
    let backend = providers::build(&config).unwrap();
    let collector = providers::build(&config).unwrap();
    Some(Harness::new(backend, collector, "/bin/sh", ()).with_container_cleanup(None))
}

contract_tests!(real);
