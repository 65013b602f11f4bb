#!/usr/bin/env bash
# Builds the PyPI wheel of the server (README, "Releasing"):
#
#   scripts/build-wheel.sh [extra maturin build options]
#
# maturin (pyproject.toml: `bindings = "bin"`) compiles the release binary with zig as the
# linker against glibc 2.17 symbols, so the wheel is `manylinux2014` (manylinux_2_17) and runs
# on any x86_64 Linux of the last decade; the static exec helper is embedded (crates/helper-client/build.rs), and
# the build fails rather than ship a wheel without it. The wheel lands in target/wheels/ and
# its path is the last line printed on stdout.
#
# Tools: pinned maturin and ziglang from PyPI in a venv under target/wheel-tools (needs python3
# with venv and a reachable PyPI once). Needs a static C library for the helper (Debian:
# libc6-dev, installed here when running as root on Debian).
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_PREFIX="[build-wheel]"
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

MATURIN_VERSION=1.16.0
ZIG_VERSION=0.17.1
TOOLS="$REPO_ROOT/target/wheel-tools"
OUT="$REPO_ROOT/target/wheels"
# The cargo profile: `release` for the wheel that is published; the test suite passes
# `wheel-test` (Cargo.toml), which packs the same binary built without optimisation.
PROFILE="${KILNTAINERS_WHEEL_PROFILE:-release}"

{
    if root_on_debian; then
        apt_ensure libc6-dev python3-venv
    fi
    if [[ ! -x "$TOOLS/bin/maturin" ]] || ! "$TOOLS/bin/maturin" --version | grep -qF "$MATURIN_VERSION" ||
        ! "$TOOLS/bin/python" -m ziglang version 2>/dev/null | grep -qxF "$ZIG_VERSION"; then
        log "installing maturin $MATURIN_VERSION and zig $ZIG_VERSION into $TOOLS"
        rm -rf "$TOOLS"
        python3 -m venv "$TOOLS"
        "$TOOLS/bin/pip" install --quiet --disable-pip-version-check \
            "maturin==$MATURIN_VERSION" "ziglang==$ZIG_VERSION"
    fi
    version="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)"
    rm -f "$OUT"/mcp_sandbox_computer_vm_for_ai-"$version"-*.whl
    start="$(now)"
    # maturin finds zig through the venv's `ziglang` package.
    PATH="$TOOLS/bin:$PATH" KILNTAINERS_REQUIRE_HELPER=1 \
        maturin build --profile "$PROFILE" --locked --zig --compatibility manylinux2014 --out "$OUT" "$@"
    log "built in $(elapsed "$start")"
} >&2
wheels=("$OUT"/mcp_sandbox_computer_vm_for_ai-"$version"-*.whl)
[[ -f "${wheels[0]}" ]] || die "maturin finished but no wheel for version $version is in $OUT"
printf '%s\n' "${wheels[0]}"
