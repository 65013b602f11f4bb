#!/usr/bin/env bash
# Runs the server (stdio by default) on this machine: makes sure a Docker engine is running
# and the default image exists, builds the release binary, then execs it with your arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
# Diagnostics go to stderr: stdout carries the MCP protocol.
{
  bash scripts/ensure-dockerd.sh
  if ! docker image inspect debian:bookworm-slim >/dev/null 2>&1; then
    # The product pulls the image itself when a registry is reachable; build it locally when not.
    docker pull debian:bookworm-slim || bash scripts/build-test-images.sh
  fi
  cargo build --release --locked --quiet
} >&2
exec ./target/release/mcp-sandbox-computer-vm-for-ai "$@"
