"""The `e2b` backend end to end, over stdio with the official Python MCP client, against the
local fake of E2B's documented control plane and envd process service (`fakes/e2b.py`, run in
this process; sandboxes are local `sandbox-busybox:full` containers).  These are contract
tests: they show the server drives our reading of E2B's published API definitions correctly,
not that the real service agrees (docs/e2b.md).

Covered: exec (command and args modes, stdin with working_directory, exit codes including the
omitted-zero `exitCode`), timeout → 124 with `SendSignal` and the sweep, the output limit while
streaming, temporary sandboxes killed when the session ends, permanent sandboxes rediscovered
by metadata after a server restart, the lifecycle tools (restart through pause/resume keeping
files, restart by recreation where pausing is not offered, factory reset, delete), the lifetime
extended while in use and the message once it expired, key errors and 429 retries.  Every test
asserts the fake saw no request that breaks the documented shapes."""

from __future__ import annotations

import json
import subprocess

import pytest

from harness import BIN, apoll, limit_notice, timeout_notice
from fakes.e2b import FakeE2B

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

KEY = "e2b_test_key"
T_E2B = (
    "Execute a shell command in a remote cloud sandbox (E2B). Commands run in sh. Each call is independent — "
    "no state (shell variables, working directory) persists between calls. Use the working_directory parameter "
    "or chain commands with && to control execution context.\n\n"
    "To write files or pass data without shell escaping, use the stdin parameter (e.g., command=\"cat > file.txt\" "
    "with content in stdin). Commands time out after 120 seconds by default (override with the timeout parameter "
    "for long-running operations)."
)


@pytest.fixture
def fake():
    with FakeE2B(api_keys=[KEY]) as server:
        yield server
        assert server.violations == [], server.violations


def e2b_args(fake: FakeE2B, *extra: str, key: str | None = KEY) -> list[str]:
    args = ["--backend", "e2b", "--e2b-api-url", fake.url, "--e2b-envd-url", fake.envd_url, "--shell", "/bin/sh", *extra]
    if key is not None:
        args += ["--e2b-api-key", key]
    return args


def starts(fake: FakeE2B) -> list[dict]:
    return fake.requests_matching("POST", "/process.Process/Start")


async def test_exec_and_temporary_sandbox_killed_when_the_session_ends(kbb, fake):
    async with kbb.server(*e2b_args(fake, "--e2b-metadata", "team=qa", "--e2b-env", "GREETING=hi")) as srv:
        res = await srv.run("echo hello; echo \"$GREETING\"; uname -s")
        assert res.structured["stdout"] == "hello\nhi\nLinux\n"
        assert res.structured["exit_code"] == 0 and res.structured["temporary"] is True
        cid = res.structured["computer_id"]
        sandbox = fake.by_computer(cid)
        assert sandbox is not None and sandbox.state == "running"
        created = fake.requests_matching("POST", "/sandboxes")
        assert len(created) == 1
        body = created[0]["body"]
        assert body["templateID"] == "base" and body["timeout"] == 3600
        assert body["secure"] is True and body["autoPause"] is False and body["allow_internet_access"] is True
        assert body["envVars"] == {"GREETING": "hi"}
        assert body["metadata"] == {
            "team": "qa", "kilntainers": "true", "kilntainers-computer-id": cid, "kilntainers-temporary": "true",
            "kilntainers-image": "base", "kilntainers-instance": srv.instance_id, "kilntainers-owner": "default",
        }
        start = starts(fake)[-1]
        assert start["body"]["process"]["cmd"] == "/bin/sh" and start["body"]["stdin"] is False
        assert set(start["body"]["process"]["envs"]) == {"KILNTAINERS_EXEC_ID"}
        assert start["headers"]["e2b-sandbox-id"] == sandbox.id and start["headers"]["e2b-sandbox-port"] == "49983"
        assert start["headers"]["keepalive-ping-interval"] == "50"
    assert await apoll(lambda: fake.by_computer(cid) is None, 15, 0.1), "temporary sandbox not killed"
    assert fake.requests_matching("DELETE", f"/sandboxes/{sandbox.id}")


async def test_exec_details_timeout_and_output_limit(kbb, fake):
    async with kbb.server(*e2b_args(fake, "--output-limit", "1000")) as srv:
        data = "first line\nit's \"quoted\" $HOME `x`\n\ttab ü\n"
        res = await srv.run("cat > in.txt && pwd", stdin=data, working_directory="/tmp")
        assert res.structured["stdout"] == "/tmp\n"
        assert (await srv.run("cat /tmp/in.txt")).structured["stdout"] == data
        sends = fake.requests_matching("POST", "/process.Process/SendInput")
        assert sends and fake.requests_matching("POST", "/process.Process/CloseStdin")
        failed = await srv.run("echo oops >&2; exit 7")
        assert (failed.structured["stderr"], failed.structured["exit_code"]) == ("oops\n", 7)
        args = await srv.call({"args": ["echo", "a b", "$HOME"]})
        assert args.structured["stdout"] == "a b $HOME\n"
        assert starts(fake)[-1]["body"]["process"] == {
            "cmd": "echo", "args": ["a b", "$HOME"], "envs": starts(fake)[-1]["body"]["process"]["envs"]}
        missing = await srv.call({"args": ["no-such-program"]})
        assert missing.structured["exit_code"] == 127 and "not found" in missing.structured["stderr"]

        timed = await srv.call({"command": "sleep 91 & sleep 92; echo never", "timeout": 2})
        assert timed.structured["exit_code"] == 124
        assert timed.structured["stderr"] == timeout_notice(2)
        signals = fake.requests_matching("POST", "/process.Process/SendSignal")
        assert signals and signals[-1]["body"]["signal"] == "SIGNAL_SIGKILL"
        ps = (await srv.run("ps -o args || ps")).structured["stdout"]
        assert "sleep 91" not in ps and "sleep 92" not in ps, ps

        big = await srv.call({"command": "yes | head -c 100000000"})
        assert big.structured["exit_code"] == 1 and big.structured["stderr"] == limit_notice(1000)
        ps = (await srv.run("ps -o args || ps")).structured["stdout"]
        assert "yes" not in ps.split(), ps


async def test_permanent_sandbox_rediscovered_after_a_server_restart(kbb, fake):
    home = kbb.home()
    cid = kbb.new_id("e2bperm")
    async with kbb.server(*e2b_args(fake), home=home) as srv:
        await srv.run("echo survived > /root/note", computer_id=cid, temporary=False)
    sandbox = fake.by_computer(cid)
    assert sandbox is not None, "a permanent sandbox outlives its session"
    assert sandbox.metadata["kilntainers-temporary"] == "false" and "kilntainers-instance" not in sandbox.metadata
    async with kbb.server(*e2b_args(fake), "--lifecycle-tools", home=home) as srv:
        res = await srv.run("cat /root/note", computer_id=cid, temporary=False)
        assert res.structured["stdout"] == "survived\n"
        assert len(fake.requests_matching("POST", "/sandboxes")) == 1, "found again, not created again"
        connects = fake.requests_matching("POST", f"/sandboxes/{sandbox.id}/connect")
        assert connects and connects[-1]["body"] == {"timeout": 3600}
        lists = fake.requests_matching("GET", "/v2/sandboxes")
        assert any("kilntainers-computer-id=" + cid in r["query"].get("metadata", "") for r in lists)
        conflict = await srv.call({"command": "true", "computer_id": cid, "temporary": True})
        assert conflict.is_error
        deleted = await srv.call({"computer_id": cid}, name="computer_delete")
        assert deleted.structured == {"ok": True, "computer_id": cid, "deleted": True}
    assert fake.by_computer(cid) is None


async def test_lifecycle_tools_against_fake(kbb, fake):
    cid = kbb.new_id("e2blc")
    async with kbb.server(*e2b_args(fake), "--lifecycle-tools") as srv:
        created = await srv.call({"computer_id": cid, "temporary": False}, name="computer_create")
        assert not created.is_error, created.text
        sandbox = fake.by_computer(cid)
        assert created.structured == {"ok": True, "computer_id": cid, "sandbox_id": sandbox.id, "temporary": False}
        listed = await srv.call({}, name="computer_list")
        rows = [r for r in listed.structured["computers"] if r["computer_id"] == cid]
        assert rows == [{
            "computer_id": cid, "sandbox_id": sandbox.id, "backend": "e2b", "state": "running",
            "temporary": False, "image": "base", "created_at": sandbox.listed_view()["startedAt"],
        }]

        # Pause/resume keeps files; the processes our commands started are stopped.
        await srv.run("echo kept > /root/f; nohup sleep 301 >/dev/null 2>&1 &", computer_id=cid, temporary=False)
        restarted = await srv.call({"computer_id": cid}, name="computer_restart")
        assert restarted.structured == {
            "ok": True, "computer_id": cid, "sandbox_id": sandbox.id, "temporary": False, "state_preserved": True,
        }
        assert fake.requests_matching("POST", f"/sandboxes/{sandbox.id}/pause")
        after = await srv.run("cat /root/f; ps -o args || ps", computer_id=cid, temporary=False)
        assert after.structured["stdout"].startswith("kept\n") and "sleep 301" not in after.structured["stdout"]

        reset = await srv.call({"computer_id": cid}, name="computer_factory_reset")
        assert not reset.is_error, reset.text
        assert reset.structured["sandbox_id"] != sandbox.id
        assert fake.by_computer(cid).id == reset.structured["sandbox_id"]
        gone = await srv.call({"command": "cat /root/f", "computer_id": cid, "temporary": False})
        assert gone.structured["exit_code"] != 0

        deleted = await srv.call({"computer_id": cid}, name="computer_delete")
        assert deleted.structured == {"ok": True, "computer_id": cid, "deleted": True}
        assert fake.by_computer(cid) is None


async def test_restart_without_pause_says_files_were_lost(kbb):
    with FakeE2B(api_keys=[KEY], pause=False) as fake:
        async with kbb.server(*e2b_args(fake), "--lifecycle-tools") as srv:
            cid = (await srv.run("echo x > /root/f")).structured["computer_id"]
            before = fake.by_computer(cid).id
            restarted = await srv.call({"computer_id": cid}, name="computer_restart")
            assert restarted.structured["state_preserved"] is False
            assert restarted.structured["warning"] == (
                f"e2b cannot restart a computer and keep its files; '{cid}' was recreated from its base image "
                "and its previous files are gone."
            )
            assert fake.by_computer(cid).id == restarted.structured["sandbox_id"] != before
            assert fake.by_computer(cid).metadata["kilntainers-instance"] == srv.instance_id
            assert (await srv.run("test -e /root/f")).structured["exit_code"] == 1
        assert fake.violations == [], fake.violations
    assert await apoll(lambda: not fake.live(), 15, 0.1)


async def test_lifetime_is_extended_while_in_use_and_expiry_is_reported(kbb, fake):
    async with kbb.server(*e2b_args(fake, "--e2b-sandbox-timeout", "5")) as srv:
        cid = (await srv.run("true")).structured["computer_id"]
        # Seven seconds of use outlast the five-second lifetime only if use extends it.
        for _ in range(7):
            res = await srv.call({"command": "sleep 1"})
            assert not res.is_error, res.text
        sandbox = fake.by_computer(cid)
        assert sandbox is not None
        extensions = fake.requests_matching("POST", f"/sandboxes/{sandbox.id}/timeout")
        assert extensions and all(r["body"] == {"timeout": 5} for r in extensions)
        # Left alone, it expires; the next call says so.
        assert await apoll(lambda: fake.by_computer(cid) is None, 15, 0.1)
        expired = await srv.call({"command": "true"})
        assert expired.is_error
        assert expired.structured == {"error": f"Sandbox {sandbox.id} lifetime timeout expired"}


async def test_key_errors_and_retries(kbb, fake):
    async with kbb.server(*e2b_args(fake, key=None)) as srv:
        assert [t["name"] for t in await srv.list_tools()] == ["terminal_execute"], "starts without a key"
        res = await srv.call({"command": "true"})
        assert res.structured == {"error": "E2B validation failed: no API key. Pass --e2b-api-key or set E2B_API_KEY."}
    assert fake.requests == []
    async with kbb.server(*e2b_args(fake, key="e2b_wrong")) as srv:
        res = await srv.call({"command": "true"})
        assert res.structured == {"error": (
            "E2B validation failed: 401 Invalid API key, it must start with 'e2b_'. "
            "Pass --e2b-api-key or set E2B_API_KEY.")}
    fake.inject("POST", "/sandboxes", 429, times=1, headers={"Retry-After": "0"})
    fake.inject("GET", "/v2/sandboxes", 503, times=2)
    async with kbb.server(*e2b_args(fake)) as srv:
        assert not (await srv.run("true")).is_error
    assert len(fake.requests_matching("POST", "/sandboxes")) == 2


async def test_tool_description_follows_the_template(kbb, fake):
    async with kbb.server(*e2b_args(fake)) as srv:
        assert (await srv.list_tools())[0]["description"] == T_E2B
    async with kbb.server(*e2b_args(fake, "--e2b-template", "py")) as srv:
        assert (await srv.list_tools())[0]["description"].startswith(
            "Execute a shell command in an isolated E2B cloud sandbox from template `py`. Commands run in sh.")
    assert fake.requests == [], "listing tools calls no provider API"


async def test_port_url_needs_a_port_placeholder_in_the_envd_url(kbb, fake):
    # The fake's envd answers on one fixed address, so its ports have no URLs of their own; the
    # URL shape for the real service is checked in the Rust unit tests (config::e2b).
    async with kbb.server(*e2b_args(fake), "--file-tools") as srv:
        res = await srv.call({"port": 8080}, name="port_url")
        assert res.is_error
        assert res.text == (
            "Ports are not available: --e2b-envd-url has no {port} placeholder, so the sandbox's ports have no URL."
        )


async def test_issue_33_egress_rules_become_the_sandbox_network_config(kbb, fake, tmp_path):
    # See: issue 33. E2B enforces the policy through its own `network` config at creation
    # (docs/egress.md, "E2B"); the fake validates the body against E2B's openapi.yml and keeps it.
    cid = kbb.new_id("e2begress")
    args = [*e2b_args(fake), "--lifecycle-tools", "--checkpoint-tools", "--egress", "allowlist",
            "--egress-allow", "allowed.test", "--egress-allow", "*.pkg.test", "--egress-allow", "203.0.113.0/24"]
    server_label = {"mode": "allowlist", "allow": ["allowed.test", "*.pkg.test", "203.0.113.0/24"], "deny": [],
                    "ask": False, "allow_private": False}
    narrow_label = dict(server_label, allow=["allowed.test"])

    def network_sent(computer: str) -> tuple[dict, dict]:
        body = [r["body"] for r in fake.requests_matching("POST", "/sandboxes")
                if r["body"]["metadata"]["kilntainers-computer-id"] == computer][-1]
        return body["network"], json.loads(body["metadata"]["kilntainers-egress"])

    home = kbb.home()
    async with kbb.server(*args, home=home) as srv:
        temp = (await srv.run("true")).structured["computer_id"]
        assert network_sent(temp) == (
            {"allowOut": ["allowed.test", "*.pkg.test", "203.0.113.0/24"], "denyOut": ["0.0.0.0/0"]}, server_label
        )
        assert fake.by_computer(temp).network["allowOut"] == ["allowed.test", "*.pkg.test", "203.0.113.0/24"]

        # A rule E2B has no words for is refused before anything is created.
        before = len(fake.requests_matching("POST", "/sandboxes"))
        ported = await srv.call({"computer_id": cid, "temporary": False, "egress": {"allow": ["allowed.test:443"]}},
                                name="computer_create")
        assert ported.is_error and "'allowed.test:443' names a port, and E2B's network rules have none" in ported.text
        assert len(fake.requests_matching("POST", "/sandboxes")) == before

        made = await srv.call({"computer_id": cid, "temporary": False, "egress": {"allow": ["allowed.test"]}},
                              name="computer_create")
        assert not made.is_error, made.text
        assert network_sent(cid) == ({"allowOut": ["allowed.test"], "denyOut": ["0.0.0.0/0"]}, narrow_label)
        shown = (await srv.call({"computer_id": cid}, name="computer_network")).structured
        assert (shown["mode"], shown["allow"], shown["denied"]) == ("allowlist", ["allowed.test"], [])

        # A rollback and a fork make new sandboxes: the narrowed policy goes with them.
        (await srv.call({"computer_id": cid, "name": "base"}, name="computer_checkpoint")).ok()
        (await srv.call({"computer_id": cid, "checkpoint": "base"}, name="computer_rollback")).ok()
        assert network_sent(cid) == ({"allowOut": ["allowed.test"], "denyOut": ["0.0.0.0/0"]}, narrow_label)
        forked = (await srv.call({"computer_id": cid, "checkpoint": "base"}, name="computer_fork")).ok().structured
        (fork,) = forked["computers"]
        kbb.track(fork)
        assert network_sent(fork) == ({"allowOut": ["allowed.test"], "denyOut": ["0.0.0.0/0"]}, narrow_label)
    # Another server process finds the policy in the sandbox's metadata.
    async with kbb.server(*args, home=home) as srv:
        shown = (await srv.call({"computer_id": cid}, name="computer_network")).structured
        assert (shown["mode"], shown["allow"]) == ("allowlist", ["allowed.test"]), shown
        for computer in (fork, cid):
            (await srv.call({"computer_id": computer}, name="computer_delete")).ok()


def test_issue_33_rules_e2b_cannot_express_are_refused_at_startup(kbb, fake):
    # See: issue 33
    for extra, message in [
        (["--egress", "allowlist", "--egress-allow", "db.test:5432"],
         "--egress allowlist: 'db.test:5432' names a port, and E2B's network rules have none; change that rule, "
         "or use the docker backend."),
        (["--egress-deny", "evil.test"],
         "--egress open: deny rule 'evil.test' names a host, and E2B's denyOut takes only IP addresses and CIDR "
         "blocks; change that rule, or use the docker backend."),
        (["--egress", "allowlist", "--egress-allow", "*.a.test", "--egress-deny", "b.a.test"],
         "--egress allowlist: deny rule 'b.a.test' overlaps allow rule '*.a.test', and on E2B an allow rule wins; "
         "change that rule, or use the docker backend."),
    ]:
        proc = subprocess.run([BIN, *e2b_args(fake), *extra], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL, env=kbb.env(kbb.home()))
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines()[-1] == f"kilntainers: error: {message}", proc.stderr
    assert fake.requests == []
