"""scripts/serve.sh as a normal user (docs/install.md, "From a checkout"): with a reachable engine
it serves MCP and installs nothing; with none it says what to do in one line and exits non-zero
at once, before any build.

The users are made here (root only) and removed at the end: one in the `docker` group, one
not. Their PATH has no Rust toolchain, so serve.sh runs the installed server binary (a copy of
KILNTAINERS_BIN), and shims that record any call to a package manager or to sudo.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import (
    BINARY_NAME, REPO, SYSTEM_PATH, force_remove, mcp_session, skip_or_fail, terminal_execute,
    wait_no_containers,
)

IN_DOCKER_GROUP = "kiln-serve-docker"
NO_ENGINE_ACCESS = "kiln-serve-plain"
FORBIDDEN = ("apt-get", "apt", "dpkg", "sudo", "su", "pip", "pip3", "rustup", "cargo")


@pytest.fixture(scope="module")
def users():
    if os.geteuid() != 0:
        skip_or_fail("making test users needs root")
    made = []
    for name, groups in ((IN_DOCKER_GROUP, ["--groups", "docker"]), (NO_ENGINE_ACCESS, [])):
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/bash", *groups, name], check=True)
            made.append(name)
    try:
        yield
    finally:
        for name in made:
            subprocess.run(["userdel", name], check=False)


@pytest.fixture
def checkout(users):
    """What the users can read (pytest's own tmp_path is private to root): serve.sh and lib.sh
    as in a checkout, the server binary, shims for every installer, and a home per user."""
    tmp_path = Path(tempfile.mkdtemp(prefix="kiln-serve-"))
    try:
        yield _fill(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _fill(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("serve.sh", "lib.sh"):
        shutil.copy2(REPO / "scripts" / name, root / "scripts" / name)
    installed = tmp_path / "installed-bin"
    installed.mkdir()
    binary = Path(os.environ.get("KILNTAINERS_BIN") or REPO / "target" / "debug" / BINARY_NAME)
    try:
        os.link(binary, installed / BINARY_NAME)
    except OSError:
        shutil.copy2(binary, installed / BINARY_NAME)
    shims = tmp_path / "shims"
    shims.mkdir()
    calls = tmp_path / "installer-calls.log"
    calls.touch()
    calls.chmod(0o666)
    for name in FORBIDDEN:
        shim = shims / name
        shim.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit 1\n')
        shim.chmod(0o755)
    for user in (IN_DOCKER_GROUP, NO_ENGINE_ACCESS):
        home = tmp_path / f"home-{user}"
        home.mkdir()
        entry = pwd.getpwnam(user)
        os.chown(home, entry.pw_uid, entry.pw_gid)
    for path in [tmp_path, *tmp_path.rglob("*")]:
        if path.is_dir() and not path.name.startswith("home-"):
            path.chmod(0o755)
    return tmp_path


def as_user(user: str, tmp_path: Path, *args: str, env: dict | None = None) -> list[str]:
    entry = pwd.getpwnam(user)
    path = f"{tmp_path / 'shims'}:{tmp_path / 'installed-bin'}:{SYSTEM_PATH}"
    assert shutil.which("cargo", path=f"{tmp_path / 'installed-bin'}:{SYSTEM_PATH}") is None
    variables = {"HOME": str(tmp_path / f"home-{user}"), "PATH": path, **(env or {})}
    return [
        "setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups", "--",
        "env", "-i", *(f"{k}={v}" for k, v in variables.items()),
        "bash", str(tmp_path / "checkout" / "scripts" / "serve.sh"), *args,
    ]


@pytest.mark.anyio
async def test_a_docker_group_user_gets_a_server_and_nothing_is_installed(checkout):
    # The cargo shim stands for "no toolchain": serve.sh must not try to build with it either.
    (checkout / "shims" / "cargo").unlink()
    command = as_user(IN_DOCKER_GROUP, checkout, "--image", "sandbox-busybox:full", "--shell", "/bin/sh")
    errlog = checkout / "serve.stderr"
    computer_id = None
    try:
        async with mcp_session(command[0], command[1:], {"PATH": SYSTEM_PATH}, errlog) as session:
            result = await terminal_execute(session, "echo served")
            computer_id = result["computer_id"]
            assert result["stdout"] == "served\n" and result["exit_code"] == 0, result
        assert wait_no_containers(computer_id) == [], errlog.read_text()
    finally:
        if computer_id:
            force_remove(computer_id)
    log = errlog.read_text()
    assert f"[serve] no cargo here; running the installed {checkout / 'installed-bin' / BINARY_NAME}" in log, log
    assert (checkout / "installer-calls.log").read_text() == ""


@pytest.mark.parametrize(
    "user, env, why",
    [
        (NO_ENGINE_ACCESS, {}, "permission denied on /var/run/docker.sock"),
        (IN_DOCKER_GROUP, {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}, "no engine socket at /nonexistent/docker.sock"),
    ],
)
def test_without_a_reachable_engine_it_says_so_in_one_line_and_exits(checkout, user, env, why):
    started = time.monotonic()
    # The timeout only keeps a broken script from hanging the suite; the figure is printed.
    done = subprocess.run(as_user(user, checkout, env=env), capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    print(f"serve.sh without an engine ({why}): exit {done.returncode} after {took:.2f} s")
    assert done.returncode != 0 and done.stdout == "", done
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"[serve] ERROR: no container engine reachable: {why}"), line
    assert "Install and start Docker" in line and "--engine podman" in line, line
    assert (checkout / "installer-calls.log").read_text() == ""
