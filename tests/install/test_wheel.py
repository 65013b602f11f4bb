"""The PyPI wheel (docs/install.md): built by scripts/build-wheel.sh, its path in
KILNTAINERS_WHEEL. It must be a portable manylinux2014 wheel that auditwheel accepts, install
with pip and with `uv tool install` where no Rust toolchain is on PATH, and serve MCP through
its console command with the exec helper in use."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import (
    BINARY_NAME, SYSTEM_PATH, cargo_version, force_remove, mcp_session, skip_or_fail,
    terminal_execute, wait_no_containers,
)

VERSION = cargo_version()
# Under the helper a command's parent process is `/.kilntainers/helper-<hash> serve`.
PARENT = "tr '\\0' ' ' < /proc/$PPID/cmdline"


@pytest.fixture(scope="module")
def wheel() -> Path:
    path = os.environ.get("KILNTAINERS_WHEEL")
    if not path:
        skip_or_fail("KILNTAINERS_WHEEL is not set (scripts/build-wheel.sh prints the path)")
    return Path(path)


def test_the_wheel_is_manylinux2014_and_auditwheel_accepts_it(wheel):
    platforms = re.fullmatch(
        rf"mcp_sandbox_computer_vm_for_ai-{re.escape(VERSION)}-py3-none-(?P<platforms>[a-z0-9_.]+)\.whl", wheel.name,
    )
    assert platforms, wheel.name
    assert set(platforms["platforms"].split(".")) == {"manylinux2014_x86_64", "manylinux_2_17_x86_64"}, wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = archive.read(f"mcp_sandbox_computer_vm_for_ai-{VERSION}.dist-info/METADATA").decode()
        tags = archive.read(f"mcp_sandbox_computer_vm_for_ai-{VERSION}.dist-info/WHEEL").decode()
    assert f"mcp_sandbox_computer_vm_for_ai-{VERSION}.data/scripts/{BINARY_NAME}" in names, names
    assert "Name: mcp-sandbox-computer-vm-for-ai\n" in meta and f"Version: {VERSION}\n" in meta, meta
    assert "Tag: py3-none-manylinux_2_17_x86_64\n" in tags and "Tag: py3-none-manylinux2014_x86_64\n" in tags, tags
    shown = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)], capture_output=True, text=True, timeout=120,
    )
    text = " ".join((shown.stdout + shown.stderr).split())
    assert shown.returncode == 0, text
    assert 'is consistent with the following platform tag: "manylinux_2_17_x86_64"' in text, text


def installs(tmp_path: Path, wheel: Path) -> dict[str, Path]:
    """The console command as pip and as `uv tool install` put it on PATH, both offline."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "--quiet",
         "--disable-pip-version-check", str(wheel)],
        check=True, timeout=120,
    )
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if not uv:
        skip_or_fail("uv is not installed in the test venv (scripts/setup-test-env.sh)")
    tools = tmp_path / "uv"
    env = {
        "PATH": SYSTEM_PATH, "HOME": str(tmp_path), "UV_TOOL_DIR": str(tools / "tools"),
        "UV_TOOL_BIN_DIR": str(tools / "bin"), "UV_CACHE_DIR": str(tools / "cache"),
        "UV_PYTHON_DOWNLOADS": "never",
    }
    subprocess.run([uv, "tool", "install", "--offline", "--python", sys.executable, str(wheel)],
                   env=env, check=True, capture_output=True, timeout=120)
    # `uvx` (`uv tool run`), the Python server's usual launcher, from the same wheel.
    ran = subprocess.run([uv, "tool", "run", "--offline", "--python", sys.executable, "--from", str(wheel),
                          BINARY_NAME, "--version"], env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == f"{BINARY_NAME} {VERSION}", ran
    return {"pip": venv / "bin" / BINARY_NAME, "uv tool": tools / "bin" / BINARY_NAME}


@pytest.mark.anyio
async def test_installed_without_rust_it_serves_mcp_with_the_exec_helper(wheel, tmp_path):
    for how, command in installs(tmp_path, wheel).items():
        bin_dir = command.parent
        path = f"{bin_dir}:{SYSTEM_PATH}"
        # No Rust toolchain reachable: the wheel carries everything.
        assert shutil.which("cargo", path=path) is None and shutil.which("rustc", path=path) is None
        assert shutil.which(BINARY_NAME, path=path) == str(command), how
        home = tmp_path / f"home-{how.replace(' ', '-')}"
        home.mkdir()
        env = {"PATH": path, "HOME": str(home)}
        version = subprocess.run([BINARY_NAME, "--version"], env=env, capture_output=True, text=True, check=True)
        assert version.stdout.strip() == f"{BINARY_NAME} {VERSION}", how
        errlog = tmp_path / f"{how}.stderr"
        computer_id = None
        try:
            async with mcp_session(str(command), ["--image", "sandbox-busybox:full", "--shell", "/bin/sh"],
                                   env, errlog) as session:
                first = await terminal_execute(session, f"{PARENT}; echo; echo hello from the wheel")
                computer_id = first["computer_id"]
                parent, hello = first["stdout"].splitlines()
                assert parent.startswith("/.kilntainers/helper-") and parent.endswith(" serve "), (how, parent)
                assert hello == "hello from the wheel" and first["exit_code"] == 0, (how, first)
            # The temporary computer went with the session.
            assert wait_no_containers(computer_id) == [], (how, errlog.read_text())
        finally:
            if computer_id:
                force_remove(computer_id)
