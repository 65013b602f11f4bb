"""The `modal` backend end to end, over stdio with the official Python MCP client, against the
local fake of Modal's gRPC API (`fake-modal`, a test-only binary built from the same
`modal_api.proto` as the server; sandboxes are local `sandbox-busybox:full` containers).  These
are contract tests: they show the server drives our reading of Modal's API correctly, not that
Modal's service agrees (docs/modal.md).

Covered: a temporary sandbox terminated when the session ends, a permanent one rediscovered by
a new server from its tags, stdin with working_directory, timeout → 124 with the kill sweep,
the output limit, restart (`state_preserved: false` + warning), the description, and the
missing/rejected credential messages.  The fake checks every call's metadata strictly; its call
log is read back to assert request fields."""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from harness import apoll, docker, limit_notice, timeout_notice

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

BUSYBOX = "sandbox-busybox:full"
FAKE_BIN = Path(os.environ.get("KILNTAINERS_BIN", "target/debug/mcp-sandbox-computer-vm-for-ai")).with_name("fake-modal")
T_MODAL = (
    "Execute a shell command in a remote cloud sandbox (Modal). Commands run in bash. Each call is "
    "independent — no state (shell variables, working directory) persists between calls. Use the "
    "working_directory parameter or chain commands with && to control execution context.\n\n"
    "To write files or pass data without shell escaping, use the stdin parameter (e.g., "
    "command=\"cat > file.txt\" with content in stdin). Commands time out after 120 seconds by "
    "default (override with the timeout parameter for long-running operations)."
)


class FakeModal:
    """The fake as a child process; closing its stdin makes it remove its containers and exit."""

    def __init__(self, tmp: Path):
        self.label = f"pytest-{uuid.uuid4().hex[:12]}"
        self.log_path = tmp / "fake-modal.log"
        env = dict(os.environ, FAKE_MODAL_LABEL=self.label, FAKE_MODAL_LOG=str(self.log_path), FAKE_MODAL_PAGE_SIZE="1")
        self.proc = subprocess.Popen([str(FAKE_BIN)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        line = self.proc.stdout.readline().strip()
        assert line.startswith("FAKE_MODAL_URL="), line
        self.url = line.split("=", 1)[1]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        leftovers = docker("ps", "-aq", "--filter", f"label=fake-modal={self.label}").stdout.split()
        if leftovers:
            docker("rm", "-f", *leftovers, check=False)
        assert not leftovers, f"fake-modal left containers: {leftovers}"

    def calls(self) -> list[tuple[str, str, str]]:
        if not self.log_path.exists():
            return []
        return [tuple(line.split("\t", 2)) for line in self.log_path.read_text().splitlines()]

    def live(self) -> list[str]:
        return docker("ps", "-q", "--filter", f"label=fake-modal={self.label}").stdout.split()


@pytest.fixture
def fake(tmp_path):
    if not FAKE_BIN.exists():
        pytest.fail(f"{FAKE_BIN} is missing: build with cargo build --all-features")
    server = FakeModal(tmp_path)
    try:
        yield server
    finally:
        server.close()


def modal_env(fake: FakeModal, **extra: str) -> dict:
    env = {"MODAL_SERVER_URL": fake.url, "MODAL_TOKEN_ID": "ak-fake", "MODAL_TOKEN_SECRET": "as-fake"}
    env.update(extra)
    return env


ARGS = ("--backend", "modal", "--image", BUSYBOX, "--shell", "/bin/sh")


async def test_temporary_sandbox_lives_with_the_session(kbb, fake):
    async with kbb.server(*ARGS, env=modal_env(fake)) as srv:
        res = await srv.run("echo hello; uname -s")
        assert res.structured["stdout"] == "hello\nLinux\n"
        assert res.structured["temporary"] is True
        cid = res.structured["computer_id"]
        kbb.track(cid, temporary=True)
        assert len(fake.live()) == 1
        res = await srv.run("cat; pwd", stdin="a\tb \"q\" ü\n", working_directory="/tmp")
        assert res.structured["stdout"] == "a\tb \"q\" ü\n/tmp\n"
    assert await apoll(lambda: fake.live() == [], 15)
    methods = [c[0] for c in fake.calls()]
    assert methods[0] == "AuthTokenGet"
    assert "SandboxTerminate" in methods
    create = next(c for c in fake.calls() if c[0] == "SandboxCreate")
    assert f'name: Some("{cid}")' in create[2]
    assert "\"x-modal-client-type\": \"9\"" in create[1] and "x-modal-auth-token" in create[1]
    tags = next(c for c in fake.calls() if c[0] == "SandboxTagsSet")[2]
    for key, value in (("kilntainers", "true"), ("kilntainers-computer-id", cid),
                       ("kilntainers-temporary", "true"), ("kilntainers-image", BUSYBOX)):
        assert f'tag_name: "{key}", tag_value: "{value}"' in tags
    assert 'tag_name: "kilntainers-instance"' in tags


async def test_permanent_sandbox_is_rediscovered_and_restart_recreates(kbb, fake):
    cid = kbb.new_id("modal-perm")
    async with kbb.server(*ARGS, "--lifecycle-tools", env=modal_env(fake)) as srv:
        await srv.run("echo kept > /tmp/f", computer_id=cid, temporary=False)
        listed = (await srv.call({}, name="computer_list")).ok().structured
        first = next(c["sandbox_id"] for c in listed["computers"] if c["computer_id"] == cid)
        assert first.startswith("sb-")
    assert len(fake.live()) == 1, "a permanent sandbox survives its session"
    async with kbb.server(*ARGS, "--lifecycle-tools", env=modal_env(fake)) as srv:
        res = await srv.run("cat /tmp/f", computer_id=cid, temporary=False)
        assert res.structured["stdout"] == "kept\n"
        listed = (await srv.call({}, name="computer_list")).ok().structured
        row = next(c for c in listed["computers"] if c["computer_id"] == cid)
        assert row["sandbox_id"] == first
        assert row["temporary"] is False and row["backend"] == "modal" and row["image"] == BUSYBOX
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", row["created_at"])
        restarted = (await srv.call({"computer_id": cid}, name="computer_restart")).ok().structured
        assert restarted["state_preserved"] is False and restarted["sandbox_id"] != first
        assert restarted["warning"] == (
            f"modal cannot restart a computer and keep its files; '{cid}' was recreated from its "
            "base image and its previous files are gone."
        )
        res = await srv.run("test -e /tmp/f; echo $?", computer_id=cid, temporary=False)
        assert res.structured["stdout"] == "1\n"
        deleted = (await srv.call({"computer_id": cid}, name="computer_delete")).ok().structured
        assert deleted["deleted"] is True
    assert await apoll(lambda: fake.live() == [], 15)
    lists = [c for c in fake.calls() if c[0] == "SandboxList"]
    assert lists and all("include_finished: false" in c[2] for c in lists)


async def test_timeout_kills_the_tree_and_output_limit(kbb, fake):
    async with kbb.server(*ARGS, "--output-limit", "1024", env=modal_env(fake)) as srv:
        res = await srv.run("sleep 300 & sleep 301", timeout=1)
        assert res.structured["exit_code"] == 124
        assert res.structured["stderr"] == timeout_notice(1)
        assert res.elapsed < 10
        kbb.track(res.structured["computer_id"], temporary=True)
        res = await srv.run("ps -o args | grep -c '^sleep 30[01]' || true")
        assert res.structured["stdout"].strip() == "0"
        res = await srv.run("yes | head -c 100000000")
        assert res.structured["exit_code"] == 1
        assert res.structured["stderr"] == limit_notice(1024)
        res = await srv.run("head -c 1024 /dev/zero | tr '\\0' x")
        assert res.structured["stdout"] == "x" * 1024


async def test_description_and_credential_errors(kbb, fake, tmp_path):
    async with kbb.server("--backend", "modal", env=modal_env(fake)) as srv:
        tools = await srv.list_tools()
        assert tools[0]["description"] == T_MODAL
        assert fake.calls() == [], "listing tools creates nothing and calls nothing"
    async with kbb.server(*ARGS, env=modal_env(fake, MODAL_TOKEN_SECRET="wrong")) as srv:
        res = await srv.call({"command": "true"})
        assert res.is_error
        assert res.structured["error"] == (
            "Modal authentication failed. Either:\n  - Set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET "
            "environment variables\n  - Run 'modal token set' to configure credentials\n  - Pass "
            "--modal-token-id and --modal-token-secret"
        )
    env = {"MODAL_SERVER_URL": fake.url, "MODAL_CONFIG_PATH": str(tmp_path / "none.toml")}
    async with kbb.server(*ARGS, env=env) as srv:
        res = await srv.call({"command": "true"})
        assert res.is_error and "Run 'modal setup'" in res.structured["error"]
    # Credentials from the Modal config file's active profile.
    config = tmp_path / "modal.toml"
    config.write_text('[a]\ntoken_id = "ak-fake"\ntoken_secret = "as-fake"\nactive = true\n')
    env = {"MODAL_SERVER_URL": fake.url, "MODAL_CONFIG_PATH": str(config)}
    async with kbb.server(*ARGS, env=env) as srv:
        res = await srv.run("echo from-profile")
        assert res.structured["stdout"] == "from-profile\n"
