"""Streamable HTTP transport driven with the SDK's HTTP client against a real Docker engine:
per-session default computers, removal on the client's DELETE, idle expiry of an abandoned
session, bearer auth / Host / Origin refusals, the non-loopback bind refusal, and SIGTERM with
live sessions (docs/decisions.md, "HTTP routes", "Sessions, holders and leases", "Startup validation" row 10, "Acceptance checklist" items 9,
13 and 21).  The stdio-mode rejections of --host/--port/--session-timeout are in test_cli.py."""

from __future__ import annotations

import signal
import subprocess
import time

import anyio
import httpx
import pytest

from harness import (
    HttpRefused,
    BIN,
    BUSYBOX_ARGS,
    apoll,
    await_gone,
    container_for,
    docker_exec,
    free_port,
    inspect,
    is_running,
)
from testkit import mcp_http

pytestmark = pytest.mark.anyio

TOKEN = "kbb-s3cret-token"
UNAUTHORIZED_BODY = '{"error":"unauthorized"}'
NON_LOOPBACK_REFUSAL = (
    "kilntainers: error: A non-loopback HTTP listener can execute arbitrary sandbox commands. "
    "Set KILNTAINERS_AUTH_TOKEN/--auth-token, or explicitly pass --allow-unauthenticated-http "
    "behind a trusted private network."
)


def initialize_body(request_id: int = 1) -> dict:
    return mcp_http.initialize_body(request_id, client_name="kbb-http-raw")


def raw_delete(url: str, session_id: str, headers: dict | None = None) -> httpx.Response:
    return httpx.delete(url, headers={"Mcp-Session-Id": session_id, **(headers or {})}, timeout=30)


def session_status(url: str, session_id: str, headers: dict | None = None) -> int:
    """Status of a `tools/list` POST on an existing session id (404 once the session is gone)."""
    body = {"jsonrpc": "2.0", "id": 99, "method": "tools/list"}
    return mcp_http.post(url, body, {"Mcp-Session-Id": session_id, **(headers or {})}).status_code


def deletes(sess) -> list[tuple[str, int, str | None]]:
    return [r for r in sess.responses if r[0] == "DELETE"]


def temporary_labels(container: str) -> dict:
    info = inspect(container)
    assert info is not None, f"container {container} vanished"
    return info["Config"]["Labels"]


# ---------------------------------------------------------------------------------------------
# sessions and their computers


async def test_concurrent_sessions_get_their_own_default_computer(kbb):
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        async with kbb.http_session(srv) as a, kbb.http_session(srv) as b:
            assert a.session_id and b.session_id and a.session_id != b.session_id
            results: dict[str, object] = {}

            async def first_call(name, sess):
                results[name] = await sess.run(f"echo {name} > /tmp/owner; cat /tmp/owner")

            async with anyio.create_task_group() as tg:  # both sessions create their default at once
                tg.start_soon(first_call, "a", a)
                tg.start_soon(first_call, "b", b)
            ra, rb = results["a"].structured, results["b"].structured
            assert ra["stdout"] == "a\n" and rb["stdout"] == "b\n"
            assert ra["temporary"] is True and rb["temporary"] is True
            a_id, b_id = ra["computer_id"], rb["computer_id"]
            assert a_id != b_id, "two HTTP sessions shared one default computer"

            ca, cb = container_for(a_id), container_for(b_id)
            assert ca and cb and ca != cb, (ca, cb)
            assert is_running(ca) and is_running(cb)
            for container in (ca, cb):
                labels = temporary_labels(container)
                assert labels.get("kilntainers.instance") == srv.instance_id, labels
                assert labels.get("kilntainers.temporary") == "true", labels
            assert sorted(srv.containers()) == sorted([ca, cb])

            # Each session keeps its own default, and the files are isolated.
            again_a = (await a.run("cat /tmp/owner")).structured
            again_b = (await b.run("cat /tmp/owner")).structured
            assert (again_a["computer_id"], again_a["stdout"]) == (a_id, "a\n")
            assert (again_b["computer_id"], again_b["stdout"]) == (b_id, "b\n")
            assert docker_exec(ca, "cat", "/tmp/owner").stdout == "a\n"
            assert docker_exec(cb, "cat", "/tmp/owner").stdout == "b\n"
        # Both clients closed: both defaults are removed.
        assert await await_gone(a_id, 15), f"{a_id} outlived its session"
        assert await await_gone(b_id, 15), f"{b_id} outlived its session"


async def test_delete_removes_only_that_sessions_temporary_computers(kbb):
    explicit = kbb.new_id("http-del-named")
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        async with kbb.http_session(srv) as b:
            b_id = (await b.run("true")).structured["computer_id"]
            async with kbb.http_session(srv) as a:
                a_session = a.session_id
                a_id = (await a.run("true")).structured["computer_id"]
                named = (await a.run("true", computer_id=explicit)).structured
                assert named["computer_id"] == explicit and named["temporary"] is True
                assert a_id != b_id
                for cid in (a_id, explicit, b_id):
                    assert container_for(cid), f"{cid} has no container"
                assert deletes(a) == []
            # Closing the SDK client sends DELETE with the session id, and the server accepts it.
            sent = deletes(a)
            assert len(sent) == 1, a.responses
            method, status, sid = sent[0]
            assert sid == a_session, sent
            assert status == 200, f"DELETE /mcp answered {status} (the Python client treats only 200/204 as success)"

            for cid in (a_id, explicit):
                assert await await_gone(cid, 15), f"{cid} survived the DELETE of its session"
            assert session_status(srv.mcp_url, a_session, srv.auth()) == 404, "the deleted session id is still served"

            # The other session is untouched and still uses the same default.
            b_container = container_for(b_id)
            assert b_container and is_running(b_container), "the other session's computer was removed"
            still = (await b.run("echo still")).structured
            assert (still["computer_id"], still["stdout"]) == (b_id, "still\n")
            assert container_for(b_id) == b_container
        assert await await_gone(b_id, 15), f"{b_id} survived the DELETE of its session"


async def test_abandoned_session_is_reaped_after_idle_timeout(kbb):
    timeout = 3
    async with kbb.http_server(*BUSYBOX_ARGS, "--session-timeout", str(timeout)) as srv:
        async with kbb.http_session(srv, terminate_on_close=False) as sess:
            session_id = sess.session_id
            assert session_id
            cid = (await sess.run("true")).structured["computer_id"]
            assert container_for(cid)
            last_request = time.monotonic()
            # The last request of the session: the idle clock starts no earlier than this.
            assert (await sess.run("echo last")).structured["computer_id"] == cid
        # The client vanished without DELETE.
        assert deletes(sess) == [], sess.responses
        gone = await apoll(lambda: container_for(cid) is None, timeout + 30, 0.2)
        gone_at = time.monotonic()
        assert gone, f"an abandoned session's computer {cid} outlived the idle timeout by 30 s"
        assert gone_at - last_request >= timeout, (
            f"the computer went {gone_at - last_request:.1f} s after the last request, before the "
            f"{timeout} s idle timeout: the disconnect itself ended the session"
        )
        assert session_status(srv.mcp_url, session_id, srv.auth()) == 404, "the expired session id is still served"


async def test_sigterm_with_live_sessions_removes_temporaries_and_exits_0(kbb):
    perm = kbb.new_id("http-term-perm")
    explicit = kbb.new_id("http-term-tmp")
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        lock = kbb.instance_locks(srv.home)
        assert [p.stem for p in lock] == [srv.instance_id], lock
        async with kbb.http_session(srv) as a, kbb.http_session(srv) as b:
            a_id = (await a.run("true")).structured["computer_id"]
            b_id = (await b.run("true")).structured["computer_id"]
            await a.run("true", computer_id=explicit)
            await b.run("true", computer_id=perm, temporary=False)
            perm_container = container_for(perm)
            temporaries = srv.containers()
            assert len(temporaries) == 3, temporaries
            outcome: dict[str, object] = {}

            async def in_flight():
                try:
                    outcome["result"] = await a.call({"command": "sleep 60", "computer_id": explicit}, timeout=40)
                except Exception as exc:  # the connection may close with the server instead
                    outcome["error"] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(in_flight)
                container = container_for(explicit)
                started = await apoll(
                    lambda: "sleep 60" in docker_exec(container, "ps").stdout or "result" in outcome, 20, 0.2
                )
                assert started and "result" not in outcome, "the long call never started"
                srv.signal(signal.SIGTERM)
                await apoll(lambda: srv.returncode() is not None, 30, 0.05)
                rc = srv.returncode()
                assert rc is not None, "the server did not exit within 30 s of SIGTERM"
                assert rc == 0, f"exit status after SIGTERM: {rc}"
                # The in-flight call ends (answered or cut off) rather than hanging.
                assert await apoll(lambda: outcome, 30, 0.1), "the in-flight call hung after SIGTERM"
                if "result" in outcome:  # killed by the drain: never reported as a normal end
                    res = outcome["result"]
                    assert res.is_error or res.structured["exit_code"] != 0, res
            for cid in (a_id, b_id, explicit):
                assert await await_gone(cid, 15), f"{cid} survived SIGTERM"
            assert srv.containers() == []
            assert is_running(perm_container), "SIGTERM removed a permanent computer"
            assert kbb.instance_locks(srv.home) == [], "the instance lock file was left behind"


# ---------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize("source", ["flag", "env"])
async def test_bearer_token_is_required(kbb, source):
    args = ["--auth-token", TOKEN] if source == "flag" else []
    env = {"KILNTAINERS_AUTH_TOKEN": TOKEN} if source == "env" else None
    async with kbb.http_server(*BUSYBOX_ARGS, *args, env=env) as srv:
        health = httpx.get(srv.base_url + "/healthz", timeout=10)
        assert (health.status_code, health.text) == (200, '{"status":"ok"}'), "/healthz is never authenticated"

        for authorization in [None, "Bearer wrong-token", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN]:
            headers = {"Authorization": authorization} if authorization else {}
            response = mcp_http.post(srv.mcp_url, initialize_body(), headers)
            assert response.status_code == 401, (authorization, response.status_code, response.text)
            assert response.text == UNAUTHORIZED_BODY, (authorization, response.text)
            assert response.headers.get("content-type") == "application/json", authorization
            assert response.headers.get("www-authenticate") == "Bearer", authorization
            assert "mcp-session-id" not in response.headers

        # The SDK client: refused with a wrong token, served with the right one.
        with pytest.raises(HttpRefused) as refused:
            async with kbb.http_session(srv, headers={"Authorization": "Bearer wrong-token"}, init_timeout=30):
                pass
        assert refused.value.status_code == 401
        async with kbb.http_session(srv, headers={"Authorization": f"Bearer {TOKEN}"}) as sess:
            tools = [t["name"] for t in await sess.list_tools()]
            assert tools == ["terminal_execute"]
            cid = (await sess.run("echo authed")).structured["computer_id"]
            # A request on that session without the token is refused too.
            assert session_status(srv.mcp_url, sess.session_id) == 401
        assert await await_gone(cid, 15)
        assert TOKEN not in srv.stderr(), "the token was logged"


async def test_host_and_origin_are_checked(kbb):
    async with kbb.http_server(*BUSYBOX_ARGS, "--auth-token", TOKEN, "--allowed-host", "mcp.example.com") as srv:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        opened: list[str] = []

        def accepted(headers: dict) -> bool:
            response = mcp_http.post(srv.mcp_url, initialize_body(), {**auth, **headers})
            if response.status_code == 200 and response.headers.get("mcp-session-id"):
                opened.append(response.headers["mcp-session-id"])
            return response.status_code == 200

        # Host: checked before authentication, so a wrong token still gets 421.
        for headers in [
            {"Host": "evil.example", **auth},
            {"Host": f"evil.example:{srv.port}", **auth},
            {"Host": "evil.example"},
            {"Host": "localhost.evil.example", **auth},
        ]:
            response = mcp_http.post(srv.mcp_url, initialize_body(), headers)
            assert response.status_code == 421, (headers, response.status_code, response.text)
            assert response.text == "Invalid Host header", response.text
        # Origin: any foreign or `null` origin is refused, before authentication too.
        for headers in [
            {"Origin": "http://evil.example", **auth},
            {"Origin": "https://evil.example:443", **auth},
            {"Origin": "null", **auth},
            {"Origin": "http://localhost.evil.example", **auth},
            {"Origin": "http://evil.example"},
        ]:
            response = mcp_http.post(srv.mcp_url, initialize_body(), headers)
            assert response.status_code == 403, (headers, response.status_code, response.text)
            assert response.text == "Invalid Origin header", response.text
        # Allowed names pass, with any port and case, including the configured one.
        for headers in [
            {},
            {"Host": f"localhost:{srv.port}", "Origin": "http://localhost:9999"},
            {"Host": "MCP.example.com", "Origin": "https://mcp.example.com"},
            {"Origin": f"http://127.0.0.1:{srv.port}"},
        ]:
            assert accepted(headers), headers

        # The SDK client sending a foreign Origin is refused.
        with pytest.raises(HttpRefused) as refused:
            async with kbb.http_session(srv, headers={**auth, "Origin": "http://evil.example"}, init_timeout=30):
                pass
        assert refused.value.status_code == 403
        for session_id in opened:
            assert 200 <= raw_delete(srv.mcp_url, session_id, auth).status_code < 300


@pytest.mark.parametrize(
    "host,env",
    [("0.0.0.0", None), ("127.0.0.2", None), ("0.0.0.0", {"KILNTAINERS_AUTH_TOKEN": ""})],
    ids=["wildcard", "127.0.0.2", "empty-env-token"],
)
def test_non_loopback_bind_without_token_is_refused(kbb, host, env):
    home = kbb.home()
    port = free_port()
    proc = subprocess.run(
        [BIN, "--transport", "http", "--host", host, "--port", str(port), *BUSYBOX_ARGS],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, env=kbb.env(home, env),
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kilntainers: error: ")]
    assert errors == [NON_LOOPBACK_REFUSAL], proc.stderr
    assert proc.stdout == ""
    assert kbb.instance_locks(home) == [], "a refused start left an instance lock"


@pytest.mark.parametrize("opt", ["allow-unauthenticated", "token"])
async def test_non_loopback_bind_starts_with_token_or_explicit_opt_out(kbb, opt):
    # 127.0.0.2 counts as non-loopback for the rule (docs/decisions.md, "Startup validation" row 10) but stays on this machine.
    args = ["--allow-unauthenticated-http"] if opt == "allow-unauthenticated" else ["--auth-token", TOKEN]
    async with kbb.http_server(*BUSYBOX_ARGS, *args, host="127.0.0.2") as srv:
        # A 127.x bind allows the loopback names only (docs/decisions.md, "Host and Origin checks"), so send one of them.
        response = mcp_http.post(srv.mcp_url, initialize_body(), {"Host": f"localhost:{srv.port}"})
        if opt == "token":
            assert response.status_code == 401, response.status_code
        else:
            assert response.status_code == 200, (response.status_code, response.text)
            session_id = response.headers["mcp-session-id"]
            deleted = raw_delete(srv.mcp_url, session_id, {"Host": f"localhost:{srv.port}"})
            assert 200 <= deleted.status_code < 300, deleted.status_code
            warnings = [line for line in srv.stderr().splitlines() if "warning" in line.lower() and "127.0.0.2" in line]
            assert warnings, f"no startup warning for an unauthenticated non-loopback listener:\n{srv.stderr()}"
