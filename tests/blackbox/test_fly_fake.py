"""The `fly` backend end to end, over stdio with the official Python MCP client, against the
local fake of the documented Machines API (`fakes/fly.py`, run in this process; Machines are
local `sandbox-busybox:full` containers).  These are contract tests: they show the server
drives our reading of Fly's API correctly, not that the real service agrees (docs/fly.md).

Covered: temporary Machines destroyed when the session ends, permanent Machines reattached by a
new server through the remembered app, the lifecycle tools, exec details (stdin together with
working_directory, timeout → 124 with the kill sweep, output limit), token discovery from
flyctl's config file with the `FlyV1` scheme, the no-token and rejected-token messages, 429
retries, and the tool description.  Every test asserts the fake saw no request that breaks the
documented shapes."""

from __future__ import annotations

import json

import pytest

from harness import apoll, limit_notice, timeout_notice
from fakes.fly import FakeFly

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

TOKEN = "test-token"
BUSYBOX = "sandbox-busybox:full"
NO_TOKEN = (
    "No Fly API token found (checked --fly-token, FLY_API_TOKEN, FLY_TOKEN, FLY_ACCESS_TOKEN and "
    "~/.fly/config.yml). Install flyctl (https://fly.io/docs/flyctl/install/) and run 'fly auth login' "
    "once, or set FLY_API_TOKEN (for example to the output of 'fly tokens create org'), then restart "
    "your MCP client."
)
T_FLY = (
    "Execute shell commands in an isolated Debian Fly Machine. Pass a computer_id to reconnect to a "
    "named Machine, or omit it to create a readable random ID. Temporary Machines are destroyed with "
    "their MCP session; permanent Machines persist on Fly and can be reattached later."
)


@pytest.fixture
def fake():
    with FakeFly(tokens=[f"Bearer {TOKEN}", "FlyV1 fm2_abc,fm2_def"]) as server:
        yield server
        assert server.violations == [], server.violations


def fly_args(fake: FakeFly, *extra: str, token: str | None = TOKEN, image: str = BUSYBOX) -> list[str]:
    args = [
        "--backend", "fly",
        "--fly-api-url", fake.url,
        "--fly-graphql-url", fake.url,
        "--fly-image", image,
        "--shell", "/bin/sh",
        *extra,
    ]
    if token is not None:
        args += ["--fly-token", token]
    return args


def machine_for(fake: FakeFly, computer_id: str):
    rows = [m for m in fake.live_machines() if (m.config.get("metadata") or {}).get("kilntainers-computer-id") == computer_id]
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


async def test_temporary_machine_is_destroyed_when_the_session_ends(kbb, fake):
    home = kbb.home()
    async with kbb.server(*fly_args(fake), home=home) as srv:
        res = await srv.run("echo hello; uname -s")
        assert res.structured["stdout"] == "hello\nLinux\n"
        assert res.structured["temporary"] is True
        cid = res.structured["computer_id"]
        machine = machine_for(fake, cid)
        assert machine is not None and machine.state == "started"
        meta = machine.config["metadata"]
        assert meta["kilntainers"] == "true" and meta["kilntainers-temporary"] == "true"
        assert meta["kilntainers-image"] == BUSYBOX and srv.instance_id == meta["kilntainers-instance"]
        # The app was created once in the personal organization and remembered.
        created = fake.requests_matching("POST", "/v1/apps")
        assert len(created) == 1 and created[0]["body"]["org_slug"] == "personal"
        remembered = json.loads((home / ".mcp-sandbox-computer-vm-for-ai" / "fly.json").read_text())
        assert remembered == {"app": created[0]["body"]["name"]}
    assert await apoll(lambda: machine_for(fake, cid) is None, 15, 0.1), "temporary Machine not destroyed"
    deletes = fake.requests_matching("DELETE", rf"/v1/apps/[^/]+/machines/{machine.id}")
    assert deletes and deletes[0]["query"] == {"force": "true"}


async def test_permanent_machine_is_reattached_after_a_server_restart(kbb, fake):
    home = kbb.home()
    cid = kbb.new_id("flyperm")
    async with kbb.server(*fly_args(fake), home=home) as srv:
        await srv.run("echo survived > /root/note", computer_id=cid, temporary=False)
    machine = machine_for(fake, cid)
    assert machine is not None and machine.state == "started", "a permanent Machine keeps running"
    async with kbb.server(*fly_args(fake), "--lifecycle-tools", home=home) as srv:
        res = await srv.run("cat /root/note", computer_id=cid, temporary=False)
        assert res.structured["stdout"] == "survived\n"
        conflict = await srv.call({"command": "true", "computer_id": cid, "temporary": True})
        assert conflict.is_error
        assert len(fake.requests_matching("POST", "/v1/apps")) == 1, "the remembered app is reused"
        assert len(fake.requests_matching("POST", r"/v1/apps/[^/]+/machines")) == 1
        deleted = await srv.call({"computer_id": cid}, name="computer_delete")
        assert deleted.structured == {"ok": True, "computer_id": cid, "deleted": True}
    assert machine_for(fake, cid) is None


async def test_lifecycle_tools_against_fake(kbb, fake):
    cid = kbb.new_id("flylc")
    async with kbb.server(*fly_args(fake), "--lifecycle-tools") as srv:
        created = await srv.call({"computer_id": cid, "temporary": False}, name="computer_create")
        assert not created.is_error, created.text
        machine = machine_for(fake, cid)
        assert created.structured == {"ok": True, "computer_id": cid, "sandbox_id": machine.id, "temporary": False}

        listed = await srv.call({}, name="computer_list")
        rows = [r for r in listed.structured["computers"] if r["computer_id"] == cid]
        assert rows == [{
            "computer_id": cid, "sandbox_id": machine.id, "backend": "fly", "state": "started",
            "temporary": False, "image": BUSYBOX, "created_at": machine.created_at,
        }]

        await srv.run("echo kept > /root/f", computer_id=cid, temporary=False)
        restarted = await srv.call({"computer_id": cid}, name="computer_restart")
        assert restarted.structured == {
            "ok": True, "computer_id": cid, "sandbox_id": machine.id, "temporary": False, "state_preserved": True,
        }
        assert (await srv.run("cat /root/f", computer_id=cid, temporary=False)).structured["stdout"] == "kept\n"

        reset = await srv.call({"computer_id": cid}, name="computer_factory_reset")
        assert not reset.is_error, reset.text
        assert reset.structured["sandbox_id"] != machine.id
        assert machine_for(fake, cid).id == reset.structured["sandbox_id"]
        gone = await srv.call({"command": "cat /root/f", "computer_id": cid, "temporary": False})
        assert gone.structured["exit_code"] != 0

        # A temporary Machine's disposable root filesystem does not survive a restart.
        tmp = (await srv.call({"temporary": True}, name="computer_create")).structured["computer_id"]
        tmp_restart = await srv.call({"computer_id": tmp}, name="computer_restart")
        assert tmp_restart.structured["state_preserved"] is False
        assert tmp_restart.structured["warning"].startswith("fly cannot restart a computer and keep its files")

        deleted = await srv.call({"computer_id": cid}, name="computer_delete")
        assert deleted.structured == {"ok": True, "computer_id": cid, "deleted": True}
        assert machine_for(fake, cid) is None
    assert await apoll(lambda: machine_for(fake, tmp) is None, 15, 0.1)


async def test_exec_stdin_with_working_directory_timeout_and_output_limit(kbb, fake):
    async with kbb.server(*fly_args(fake), "--output-limit", "1000") as srv:
        data = "first line\nit's \"quoted\" $HOME `x`\n"
        res = await srv.run("cat > in.txt && pwd", stdin=data, working_directory="/tmp")
        assert res.structured["stdout"] == "/tmp\n"
        assert (await srv.run("cat /tmp/in.txt")).structured["stdout"] == data
        failed = await srv.run("echo oops >&2; exit 7")
        assert (failed.structured["stderr"], failed.structured["exit_code"]) == ("oops\n", 7)
        args = await srv.call({"args": ["ls", "-d", "/tmp"]})
        assert args.structured["stdout"] == "/tmp\n"

        timed = await srv.call({"command": "sleep 91 & sleep 92; echo never", "timeout": 2})
        assert timed.structured["exit_code"] == 124
        assert timed.structured["stderr"] == timeout_notice(2)
        ps = (await srv.run("ps -o args || ps")).structured["stdout"]
        assert "sleep 91" not in ps and "sleep 92" not in ps, ps

        big = await srv.call({"command": "head -c 5000 /dev/zero | tr '\\0' x"})
        assert big.structured["stderr"] == limit_notice(1000)


async def test_token_from_flyctl_config_uses_the_flyv1_scheme(kbb, fake):
    home = kbb.home()
    (home / ".fly").mkdir()
    (home / ".fly" / "config.yml").write_text("access_token: fm2_abc,fm2_def\nlast_login: x\n")
    async with kbb.server(*fly_args(fake, token=None), home=home) as srv:
        await srv.run("true")
    with fake.lock:
        headers = {r["authorization"] for r in fake.requests}
    assert headers == {"FlyV1 fm2_abc,fm2_def"}


async def test_missing_and_rejected_tokens_are_explained(kbb, fake):
    async with kbb.server(*fly_args(fake, token=None)) as srv:
        names = [t["name"] for t in await srv.list_tools()]
        assert names == ["terminal_execute"], "the server starts without a token"
        res = await srv.call({"command": "true"})
        assert res.is_error and res.structured == {"error": NO_TOKEN}
    assert fake.requests == []
    async with kbb.server(*fly_args(fake, token="wrong")) as srv:
        res = await srv.call({"command": "true"})
        assert res.is_error
        assert res.structured == {"error": (
            "Fly rejected the API token (HTTP 401). Run 'fly auth login' again or set a valid FLY_API_TOKEN."
        )}


async def test_rate_limited_and_failing_calls_are_retried(kbb, fake):
    fake.inject("POST", r"/v1/apps/[^/]+/machines", 429, times=1, headers={"Retry-After": "1"})
    fake.inject("GET", r"/v1/apps/[^/]+/machines", 502, times=1)
    async with kbb.server(*fly_args(fake)) as srv:
        await srv.run("true")
    assert len(fake.requests_matching("POST", r"/v1/apps/[^/]+/machines")) == 2


async def test_tool_description_follows_the_image(kbb, fake):
    async with kbb.server(*fly_args(fake, image="debian:bookworm-slim")) as srv:
        tools = await srv.list_tools()
        assert tools[0]["description"] == T_FLY
    async with kbb.server(*fly_args(fake)) as srv:
        tools = await srv.list_tools()
        assert tools[0]["description"].startswith(
            f"Execute a shell command in an isolated Fly Machine (VM) built from image `{BUSYBOX}`. Commands run in sh."
        )
    assert fake.requests == [], "listing tools calls no provider API"


# See: issue 15
def run_to_exit(kbb, args: list[str], env: dict | None = None, timeout: float = 60):
    """Runs the server with stdin closed: it either refuses at startup (exit 1) or serves and
    ends at EOF (exit 0)."""
    import subprocess

    from harness import BIN

    return subprocess.run(
        [BIN, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
        env=kbb.env(kbb.home(), env),
    )


CONTROLLER_SECRETS = {"FLY_API_TOKEN": "fm2_controller_secret", "KILNTAINERS_AUTH_TOKEN": "controller-bearer-secret"}


def test_issue_15_an_app_with_secrets_is_refused_at_startup(kbb, fake):
    """Fly gives every Machine of an app that app's secrets (the fake does too): sandboxes in
    the controller's app would read its tokens from /proc/1/environ."""
    fake.add_app("controller-app", secrets=CONTROLLER_SECRETS)
    proc = run_to_exit(kbb, fly_args(fake, "--fly-app", "controller-app"))
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kilntainers: error: ")]
    assert errors == [
        "kilntainers: error: Fly App 'controller-app' has secrets (FLY_API_TOKEN, KILNTAINERS_AUTH_TOKEN). "
        "Fly gives every Machine of an app that app's secrets as environment variables, so each sandbox "
        "could read them. Use a separate app without secrets for sandbox Machines (--fly-app or "
        "KILNTAINERS_FLY_APP), or remove them with 'fly secrets unset -a controller-app <NAME>...'."
    ], proc.stderr
    assert fake.live_machines() == []
    assert fake.requests_matching("GET", "/v1/apps/controller-app/secrets")
    for value in CONTROLLER_SECRETS.values():
        assert value not in proc.stderr


def test_issue_15_the_controllers_own_app_is_refused_when_running_on_fly(kbb, fake):
    """On Fly, FLY_APP_NAME (set by the platform in every Machine) names the controller's own
    app; it is the reference's fallback for --fly-app, so a hosted server used to put its
    sandboxes next to itself."""
    fake.add_app("controller-app")
    on_fly = {"FLY_APP_NAME": "controller-app", "FLY_MACHINE_ID": "3d8d9e1bc47e89", "FLY_API_TOKEN": TOKEN}
    refusal = (
        "kilntainers: error: The Fly App for sandbox Machines ('controller-app') is the app this server runs "
        "in. Fly gives every Machine of an app that app's secrets as environment variables, so each sandbox "
        "could read this server's tokens. Create a separate app without secrets for the sandboxes and name it "
        "with --fly-app or KILNTAINERS_FLY_APP."
    )
    for extra in ([], ["--fly-app", "controller-app"]):
        proc = run_to_exit(kbb, fly_args(fake, *extra, token=None), env=on_fly)
        assert proc.returncode == 1, (extra, proc.returncode, proc.stderr)
        assert [line for line in proc.stderr.splitlines() if "error" in line] == [refusal], proc.stderr
    assert fake.requests == [], "refused before any API call"
    # Off Fly (no FLY_MACHINE_ID), FLY_APP_NAME stays the plain fallback the reference had.
    proc = run_to_exit(kbb, fly_args(fake, token=None), env={"FLY_APP_NAME": "controller-app", "FLY_API_TOKEN": TOKEN})
    assert proc.returncode == 0, proc.stderr


async def test_issue_15_sandbox_machines_never_see_a_token(kbb, fake):
    """Hosted shape: the controller runs on Fly with its tokens in its environment and a
    separate, secret-free sandbox app; nothing of the controller's reaches a Machine."""
    fake.add_app("controller-app", secrets=CONTROLLER_SECRETS)
    fake.add_app("sandbox-app")
    env = {
        "FLY_APP_NAME": "controller-app", "FLY_MACHINE_ID": "3d8d9e1bc47e89", "KILNTAINERS_FLY_APP": "sandbox-app",
        "FLY_API_TOKEN": TOKEN, "KILNTAINERS_AUTH_TOKEN": "controller-bearer-secret",
    }
    async with kbb.server(*fly_args(fake, token=None), env=env) as srv:
        res = await srv.run("tr '\\0' '\\n' < /proc/1/environ; echo ---; env")
        assert res.structured["exit_code"] == 0, res.structured
        seen = res.structured["stdout"]
        assert "---" in seen and "PATH=" in seen, seen
        for needle in ("FLY_API_TOKEN", "KILNTAINERS_AUTH_TOKEN", TOKEN, *CONTROLLER_SECRETS.values()):
            assert needle not in seen, (needle, seen)
        cid = res.structured["computer_id"]
        machine = machine_for(fake, cid)
        assert machine is not None and machine.app == "sandbox-app"
    for create in fake.requests_matching("POST", r"/v1/apps/[^/]+/machines"):
        assert "env" not in create["body"]["config"], create["body"]["config"]
    assert fake.live_machines("controller-app") == []
