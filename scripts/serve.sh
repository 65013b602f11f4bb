#!/usr/bin/env bash
# Runs the server (stdio by default) on this machine: makes sure a Docker engine is running
# and the default image exists, builds the release binary, then execs it with your arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
# Diagnostics go to stderr: stdout carries the MCP protocol.
{
  # shellcheck source=scripts/lib.sh
  LOG_PREFIX="[serve]"
  source scripts/lib.sh
  # The exec helper is linked statically against this (build.rs); without it every command
  # falls back to one Docker exec each.
  apt_ensure libc6-dev || warn "could not install libc6-dev; commands will use plain Docker exec"
  bash scripts/ensure-dockerd.sh
  if ! docker image inspect debian:bookworm-slim >/dev/null 2>&1; then
    # The product pulls the image itself when a registry is reachable; build it locally when not.
    docker pull debian:bookworm-slim || bash scripts/build-test-images.sh
  fi
  cargo build --release --locked --quiet
} >&2
exec ./target/release/mcp-sandbox-computer-vm-for-ai "$@"
