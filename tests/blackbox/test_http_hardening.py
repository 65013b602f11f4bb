"""Hardening of the HTTP listener (issue 15, items 5, 7 and 10), with raw sockets and httpx
against the real binary: a loopback server started without a token generates one (0600 file)
and requires it; `--allow-unauthenticated-http` is the explicit opt-out; `--allowed-host '*'`
without authentication is refused; a client trickling its request head is cut after the
header-read timeout; connections beyond the cap get 503; a body declared larger than the limit
is refused before it is read and a chunked one is cut at the limit, with the server's memory
bounded; a session whose only activity is a call that never ends is still reaped; and a
`timeout` above one week is refused.

Issue 30: a DELETE of an unknown or another principal's session is 404; accepted sockets have
TCP_NODELAY (read from the server's own descriptor with pidfd_getfd); unfinished large bodies
share one memory budget (503 beyond); and an answer that is ready before the client reconnects
with Last-Event-ID is replayed, to a raw client and to the official client's own reconnect
through a relay that cuts the connection."""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import os
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest

from harness import BIN, BUSYBOX_ARGS, apoll, containers_for, docker, free_port
from test_principals import ALICE, BOB
from testkit import mcp_http, procfs

pytestmark = pytest.mark.anyio

# Mirrors of the server's constants (src/transport/http/listener.rs, guard.rs).
HEADER_READ_TIMEOUT = 15
MAX_CONNECTIONS = 512
MAX_BODY = 8 * 1024 * 1024
WEEK = 604_800
ANY_HOST_REFUSAL = (
    "kilntainers: error: --allowed-host '*' turns off the Host check, so /mcp needs authentication. "
    "Set KILNTAINERS_AUTH_TOKEN/--auth-token, or drop --allow-unauthenticated-http to use a generated token."
)


def initialize_body(request_id: int = 1) -> dict:
    return mcp_http.initialize_body(request_id, client_name="kbb-http-hardening")


def connect(port: int, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def read_status_line(sock: socket.socket, timeout: float) -> bytes:
    """The first line the server sends within `timeout` (b"" if it closed without one)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


def request_head(port: int, auth: dict, extra: list[str]) -> bytes:
    lines = [
        "POST /mcp HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Accept: {mcp_http.ACCEPT}",
        *[f"{name}: {value}" for name, value in auth.items()],
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# ---------------------------------------------------------------------------------------------
# item 5: a token by default, the opt-out, and '*'


async def test_issue_15_loopback_without_token_generates_one_and_requires_it(kbb):
    # See: issue 15
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        refused = mcp_http.post(srv.mcp_url, initialize_body())
        assert refused.status_code == 401, (refused.status_code, refused.text)
        assert refused.headers.get("www-authenticate") == "Bearer"

        token_file = srv.token_file
        info = os.lstat(token_file)
        assert stat.S_ISREG(info.st_mode), "the token file is not a regular file"
        assert stat.S_IMODE(info.st_mode) == 0o600, oct(info.st_mode)
        assert info.st_uid == os.getuid()
        token = token_file.read_text()
        assert len(token) == 64 and all(c in "0123456789abcdef" for c in token), "not 32 random bytes in hex"
        assert str(token_file) in srv.stderr(), f"the startup log does not say where the token is:\n{srv.stderr()}"
        assert token not in srv.stderr(), "the token was logged"

        for wrong in ["Bearer " + token[:-1], "Bearer " + "0" * 64, token]:
            assert mcp_http.post(srv.mcp_url, initialize_body(), {"Authorization": wrong}).status_code == 401, wrong
        accepted = mcp_http.post(srv.mcp_url, initialize_body(), {"Authorization": f"Bearer {token}"})
        assert accepted.status_code == 200, (accepted.status_code, accepted.text)
        session = accepted.headers["mcp-session-id"]
        deleted = httpx.delete(srv.mcp_url, headers={"Mcp-Session-Id": session, **srv.auth()}, timeout=30)
        assert deleted.status_code == 200

        # The routes that never take a token still answer; a browser gets the dashboard page.
        assert httpx.get(srv.base_url + "/healthz", timeout=10).status_code == 200
        page = httpx.get(srv.base_url + "/", headers={"Accept": "text/html"}, timeout=10)
        assert page.status_code == 200 and "<title>Sandbox Computers</title>" in page.text
    assert not token_file.exists(), "the token file outlived its server"


async def test_issue_15_explicit_opt_out_serves_without_a_token_and_warns(kbb):
    # See: issue 15
    async with kbb.http_server(*BUSYBOX_ARGS, "--allow-unauthenticated-http") as srv:
        opened = mcp_http.post(srv.mcp_url, initialize_body())
        assert opened.status_code == 200, (opened.status_code, opened.text)
        deleted = httpx.delete(srv.mcp_url, headers={"Mcp-Session-Id": opened.headers["mcp-session-id"]}, timeout=30)
        assert deleted.status_code == 200
        assert srv.token is None, "a token file was written despite the opt-out"
        warnings = [line for line in srv.stderr().splitlines() if line.startswith("kilntainers: warning: serving without authentication")]
        assert warnings, f"no warning for an unauthenticated loopback listener:\n{srv.stderr()}"


@pytest.mark.parametrize("source", ["flag", "env"])
def test_issue_15_any_host_without_authentication_is_refused(kbb, source):
    # See: issue 15
    home = kbb.home()
    args = ["--allowed-host", "*"] if source == "flag" else []
    env = {"KILNTAINERS_ALLOWED_HOSTS": "mcp.example.com,*"} if source == "env" else None
    proc = subprocess.run(
        [BIN, "--transport", "http", "--port", str(free_port()), "--allow-unauthenticated-http", *args, *BUSYBOX_ARGS],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20, env=kbb.env(home, env),
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kilntainers: error: ")]
    assert errors == [ANY_HOST_REFUSAL], proc.stderr


# ---------------------------------------------------------------------------------------------
# item 5: slowloris and the connection cap


async def test_issue_15_a_trickled_request_head_is_cut_after_the_header_timeout(kbb):
    # See: issue 15
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:

        def trickle() -> tuple[float, bytes]:
            sock = connect(srv.port)
            started = time.monotonic()
            received = b""
            try:
                sock.sendall(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n".encode())
                deadline = started + HEADER_READ_TIMEOUT + 15
                while time.monotonic() < deadline:
                    # One header line per second: the pace is the attack, the recv timeout paces it.
                    sock.settimeout(1.0)
                    try:
                        chunk = sock.recv(4096)
                    except socket.timeout:
                        sock.sendall(b"X-Slow: 1\r\n")
                        continue
                    if not chunk:
                        return time.monotonic() - started, received
                    received += chunk
                return -1.0, received
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started, received
            finally:
                sock.close()

        worker: dict = {}
        thread = threading.Thread(target=lambda: worker.update(result=trickle()), daemon=True)
        thread.start()
        # Meanwhile, a normal request is served.
        assert httpx.get(srv.base_url + "/healthz", timeout=5).status_code == 200
        await apoll(lambda: not thread.is_alive(), HEADER_READ_TIMEOUT + 20, 0.2)
        assert "result" in worker, "the trickling client was never disconnected"
        elapsed, received = worker["result"]
        assert elapsed >= 0, f"the trickling client was still connected after {HEADER_READ_TIMEOUT + 15} s"
        assert HEADER_READ_TIMEOUT - 1 <= elapsed <= HEADER_READ_TIMEOUT + 10, elapsed
        assert not received.startswith(b"HTTP/1.1 2"), received[:200]


async def test_issue_15_connections_beyond_the_cap_get_503(kbb):
    # See: issue 15
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        held: list[socket.socket] = []
        try:
            started = time.monotonic()
            for _ in range(MAX_CONNECTIONS):
                held.append(connect(srv.port))
            extra = connect(srv.port)
            held.append(extra)
            line = read_status_line(extra, 5)
            assert line.startswith(b"HTTP/1.1 503"), line
            assert time.monotonic() - started < HEADER_READ_TIMEOUT, "too slow to test before the header timeout"
            # Freeing one slot lets a new client in.
            held.pop(0).close()

            def served() -> bool:
                try:
                    return httpx.get(srv.base_url + "/healthz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            assert await apoll(served, 10, 0.1), "no slot was freed by a closed connection"
        finally:
            for sock in held:
                sock.close()
        assert await apoll(srv.healthy, 10, 0.1)


# ---------------------------------------------------------------------------------------------
# item 10: body limits


async def test_issue_15_declared_oversize_bodies_are_refused_before_reading(kbb):
    # See: issue 15
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        head = request_head(srv.port, srv.auth(), [f"Content-Length: {50 * 1000 * 1000}"])
        results: list[tuple[bytes, float]] = []
        errors: list[BaseException] = []

        def oversize() -> None:
            try:
                sock = connect(srv.port, 10)
                try:
                    started = time.monotonic()
                    sock.sendall(head)
                    # Not a byte of the body is sent: the answer must come from the header alone.
                    line = read_status_line(sock, 10)
                    results.append((line, time.monotonic() - started))
                    # Pushing the body anyway must not make the server keep it.
                    try:
                        sock.settimeout(5)
                        block = b"x" * (1 << 20)
                        for _ in range(50):
                            sock.sendall(block)
                    except OSError:
                        pass
                finally:
                    sock.close()
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=oversize, daemon=True) for _ in range(8)]
        for thread in threads:
            thread.start()
        await apoll(lambda: not any(t.is_alive() for t in threads), 60, 0.1)
        assert not errors, errors
        assert len(results) == 8, results
        for line, elapsed in results:
            assert line.startswith(b"HTTP/1.1 413"), line
            assert elapsed < 5, elapsed
        peak = procfs.status_kib(srv.pid, "VmHWM")
        print(f"server peak RSS after 8 concurrent 50 MB POSTs: {peak} KiB")
        assert peak < 60 * 1024, f"server peak RSS {peak} KiB after 8 oversize POSTs"
        assert srv.healthy()


async def test_issue_15_chunked_body_is_cut_at_the_limit_and_the_largest_legal_request_passes(kbb):
    # See: issue 15
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        # 12 MiB: over the 8 MiB limit, under the 16 MiB the server used to read.
        pad = "p" * (12 * 1024 * 1024)
        body = httpx.Request("POST", "http://x", json={**initialize_body(), "params": {**initialize_body()["params"], "pad": pad}}).content
        sock = connect(srv.port, 10)
        outcome: dict = {}

        def send_chunked() -> None:
            try:
                sock.sendall(request_head(srv.port, srv.auth(), ["Transfer-Encoding: chunked"]))
                step = 256 * 1024
                for at in range(0, len(body), step):
                    piece = body[at:at + step]
                    sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                sock.sendall(b"0\r\n\r\n")
                outcome["sent"] = True
            except OSError as exc:
                outcome["send_error"] = exc

        sender = threading.Thread(target=send_chunked, daemon=True)
        sender.start()
        try:
            line = read_status_line(sock, 30)
        finally:
            sock.close()
            sender.join(10)
        assert line.startswith(b"HTTP/1.1 413"), (line, outcome)

        # The largest legal request: 2 MiB of stdin that doubles when JSON-escaped.
        async with kbb.http_session(srv) as sess:
            stdin = '"\\\n' * (2 * 1024 * 1024 // 3)
            res = (await sess.call({"command": "wc -c", "stdin": stdin})).ok()
            assert res.structured["stdout"].strip() == str(len(stdin.encode())), res


# ---------------------------------------------------------------------------------------------
# item 7: a call that never ends does not keep its session forever; timeout bound


class SilentEngine:
    """A Docker API socket that accepts connections and never answers (a hung engine)."""

    def __init__(self, path: Path):
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(64)
        self.connections: list[socket.socket] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            self.connections.append(conn)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        for conn in self.connections:
            conn.close()
        self.listener.close()
        self.path.unlink(missing_ok=True)


async def test_issue_15_a_session_whose_call_never_ends_is_still_reaped(kbb):
    # See: issue 15
    session_timeout, call_timeout = 2, 1
    # Unix socket paths are limited to 107 bytes: not under pytest's deep temporary directory.
    engine = SilentEngine(Path("/tmp") / f"kbb-silent-engine-{os.getpid()}-{time.monotonic_ns()}.sock")
    try:
        async with kbb.http_server(
            "--docker-host", f"unix://{engine.path}", "--session-timeout", str(session_timeout), *BUSYBOX_ARGS
        ) as srv:
            async with kbb.http_session(srv, terminate_on_close=False) as sess:
                outcome: dict = {}

                async def hung_call() -> None:
                    try:
                        outcome["result"] = await sess.call({"command": "true", "timeout": call_timeout}, timeout=120)
                    except Exception as exc:  # the session is closed under it
                        outcome["error"] = exc

                async with anyio.create_task_group() as tg:
                    started = time.monotonic()
                    tg.start_soon(hung_call)
                    # The engine API timeout (30 s) would end the call; the session must go first.
                    reaped = await apoll(lambda: "closing idle session" in srv.stderr(), 20, 0.2)
                    elapsed = time.monotonic() - started
                    assert reaped, f"the session was not reaped within 20 s:\n{srv.stderr()[-3000:]}"
                    assert "result" not in outcome, f"the call ended before the reaping: {outcome}"
                    assert elapsed >= session_timeout + call_timeout - 0.5, elapsed
                    tg.cancel_scope.cancel()
            gone = mcp_http.post(srv.mcp_url, {"jsonrpc": "2.0", "id": 9, "method": "tools/list"},
                        {**srv.auth(), "Mcp-Session-Id": sess.session_id, "MCP-Protocol-Version": "2025-11-25"})
            assert gone.status_code == 404, gone.status_code
            # Let the server's engine calls fail fast so that it can stop cleanly.
            engine.close()
    finally:
        engine.close()


async def test_issue_15_timeout_above_one_week_is_refused(kbb):
    # See: issue 15
    message = f"timeout must be at most {WEEK} seconds (one week)."
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.call({"command": "true", "timeout": WEEK + 1})
        assert res.is_error is True and res.structured == {"error": message}, res
        assert srv.containers() == [], "a refused call created a computer"
    proc = subprocess.run(
        [BIN, "--timeout", str(WEEK + 1), *BUSYBOX_ARGS],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20, env=kbb.env(kbb.home()),
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert f"kilntainers: error: --timeout must be at most {WEEK} seconds (one week)." in proc.stderr.splitlines()


# ---------------------------------------------------------------------------------------------
# issue 30: session ids, TCP_NODELAY, the budget of buffered bodies, answers kept for a reconnect

NAMED = {ALICE: "alice-" + "n" * 40, BOB: "bob-" + "m" * 40}
SESSION_NOT_FOUND = "Not Found: Session not found"


def raw_session(url: str, token: str) -> str:
    opened = mcp_http.post(url, initialize_body(), {"Authorization": f"Bearer {token}"})
    assert opened.status_code == 200, (opened.status_code, opened.text)
    session = opened.headers["mcp-session-id"]
    notified = mcp_http.post(
        url, {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"Authorization": f"Bearer {token}", "Mcp-Session-Id": session, "MCP-Protocol-Version": mcp_http.PROTOCOL_VERSION},
    )
    assert notified.status_code in (200, 202), notified.status_code
    return session


def delete(url: str, session: str, token: str) -> httpx.Response:
    return httpx.delete(url, headers={
        "Authorization": f"Bearer {token}", "Mcp-Session-Id": session, "MCP-Protocol-Version": mcp_http.PROTOCOL_VERSION,
    }, timeout=30)


async def test_issue_30_delete_of_an_unknown_or_foreign_session_is_404(kbb, tmp_path):
    # See: issue 30 (item 17)
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{p} {t}\n" for p, t in NAMED.items()))
    tokens.chmod(0o600)
    async with kbb.http_server("--auth-tokens-file", str(tokens), *BUSYBOX_ARGS) as srv:
        alice, bob = NAMED[ALICE], NAMED[BOB]
        session = raw_session(srv.mcp_url, alice)
        never = "0" * len(session)
        unknown = delete(srv.mcp_url, never, alice)
        assert unknown.status_code == 404, unknown.status_code
        assert unknown.text == SESSION_NOT_FOUND
        # Another principal's session is answered exactly like one that does not exist, and
        # stays open.
        foreign = delete(srv.mcp_url, session, bob)
        assert (foreign.status_code, foreign.text) == (unknown.status_code, unknown.text)
        listed = mcp_http.post(srv.mcp_url, {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, {
            "Authorization": f"Bearer {alice}", "Mcp-Session-Id": session, "MCP-Protocol-Version": mcp_http.PROTOCOL_VERSION,
        })
        assert listed.status_code == 200, listed.status_code
        assert delete(srv.mcp_url, session, alice).status_code == 200
        again = delete(srv.mcp_url, session, alice)
        assert (again.status_code, again.text) == (404, SESSION_NOT_FOUND)


def server_socket_of(server_pid: int, server_port: int, client: socket.socket) -> socket.socket:
    """The server's own end of `client`'s connection, duplicated into this process with
    pidfd_getfd(2), so that its socket options can be read."""
    client_port = client.getsockname()[1]
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.rsplit(":", 1)[1], 16) == server_port and int(remote.rsplit(":", 1)[1], 16) == client_port:
            inode = fields[9]
    assert inode, "the connection is not in /proc/net/tcp"
    for fd in Path(f"/proc/{server_pid}/fd").iterdir():
        try:
            if os.readlink(fd) == f"socket:[{inode}]":
                libc = ctypes.CDLL(None, use_errno=True)
                pidfd = os.pidfd_open(server_pid)
                try:
                    duplicate = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(fd.name), 0)
                finally:
                    os.close(pidfd)
                assert duplicate >= 0, os.strerror(ctypes.get_errno())
                return socket.socket(fileno=duplicate)
        except OSError:
            continue
    raise AssertionError("no descriptor of the server holds the connection")


# pidfd_getfd(2) on x86_64 and aarch64.
SYS_PIDFD_GETFD = 438


async def test_issue_30_accepted_connections_send_without_delay(kbb):
    # See: issue 30 (item 19): without TCP_NODELAY, the last small write of a response waits
    # for the client's delayed ACK (~40 ms per call for a client reading whole responses).
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        client = connect(srv.port)
        try:
            client.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n".encode())
            assert read_status_line(client, 5).startswith(b"HTTP/1.1 200")
            theirs = server_socket_of(srv.pid, srv.port, client)
            try:
                assert theirs.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0, "TCP_NODELAY is off"
            finally:
                theirs.close()
        finally:
            client.close()


# Mirror of the server's budget of request-body memory (src/transport/http/screen_body.rs).
BODY_BUDGET = 64 * 1024 * 1024


async def test_issue_30_buffered_request_bodies_share_one_budget(kbb):
    # See: issue 30 (item 18): many clients each holding a large, unfinished body must not
    # grow the server past one budget; over it, a request waits briefly, then gets 503.
    clients, size = 16, 7 * 1024 * 1024
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        before = procfs.status_kib(srv.pid, "VmRSS")
        head = request_head(srv.port, srv.auth(), ["Transfer-Encoding: chunked"])
        body = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"pad":"' + b"p" * size
        states: list[dict] = [{} for _ in range(clients)]
        sockets = [connect(srv.port, 30) for _ in range(clients)]

        def hold(sock: socket.socket, state: dict) -> None:
            # Sends all but the end of the body, then waits; an answer can come at any point.
            try:
                sock.sendall(head)
                step = 256 * 1024
                for at in range(0, len(body), step):
                    piece = body[at:at + step]
                    sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                state["sent"] = True
            except OSError as exc:
                state["send_error"] = repr(exc)

        def answer(sock: socket.socket, state: dict) -> None:
            try:
                state["status"] = read_status_line(sock, 60)
            except OSError as exc:
                state["read_error"] = repr(exc)

        threads = [threading.Thread(target=f, args=(s, st), daemon=True)
                   for s, st in zip(sockets, states) for f in (hold, answer)]
        try:
            for thread in threads:
                thread.start()
            # Every client has either sent its whole body (and is held) or was answered.
            settled = await apoll(lambda: all("sent" in st or "status" in st or "read_error" in st for st in states), 90, 0.2)
            assert settled, states
            peak = procfs.status_kib(srv.pid, "VmHWM")
            refused = [st for st in states if st.get("status", b"").startswith(b"HTTP/1.1 503")]
            print(f"RSS before {before} KiB, peak {peak} KiB; {len(refused)} of {clients} refused with 503")
            assert peak - before < BODY_BUDGET // 1024 + 32 * 1024, f"peak {peak} KiB from {before} KiB"
            assert refused, f"no request was refused over the budget: {states}"
        finally:
            for sock in sockets:
                sock.close()
            for thread in threads:
                thread.join(10)
        assert srv.healthy()
        # The budget is given back: a normal request goes through.
        async with kbb.http_session(srv) as sess:
            assert (await sess.run("echo ok")).structured["stdout"] == "ok\n"


# A command that finishes only once the test says so (a file appears), so that its connection
# can be cut while it still runs.
WAIT_FOR_GO = "while [ ! -e /tmp/go ]; do sleep 0.05; done; echo answer-after-reconnect"


def sse_events(lines) -> list[dict]:
    """The SSE events of `lines` (an iterator of decoded lines), as {id, data} dicts."""
    events, event = [], {}
    for line in lines:
        if not line:
            if event:
                events.append(event)
            event = {}
            continue
        field, _, value = line.partition(":")
        event[field] = value[1:] if value.startswith(" ") else value
    if event:
        events.append(event)
    return events


def tool_call(request_id: int, arguments: dict) -> dict:
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
            "params": {"name": "terminal_execute", "arguments": arguments}}


async def test_issue_30_an_answer_ready_before_the_client_reconnects_is_replayed(kbb):
    # See: issue 30 (item 16), with a raw client: the POST's stream is cut after its first
    # event, the command ends, then the client reconnects with Last-Event-ID.
    computer = kbb.new_id("resume")
    kbb.track(computer)
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        token = srv.token
        session = raw_session(srv.mcp_url, token)
        headers = {"Authorization": f"Bearer {token}", "Mcp-Session-Id": session,
                   "MCP-Protocol-Version": mcp_http.PROTOCOL_VERSION}
        made = mcp_http.post(srv.mcp_url, tool_call(2, {"computer_id": computer, "command": "true"}), headers)
        assert made.status_code == 200 and '"isError":false' in made.text, made.text
        [container] = containers_for(computer)
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", srv.mcp_url, json=tool_call(3, {"computer_id": computer, "command": WAIT_FOR_GO}),
                               headers={**headers, "Accept": mcp_http.ACCEPT, "Content-Type": "application/json"}) as cut:
                assert cut.status_code == 200
                first = None
                for line in cut.iter_lines():
                    if line.startswith("id:"):
                        first = line[3:].strip()
                        break
            # Leaving the block closed the connection after the first event.
        assert first, "the stream carried no event id to resume from"
        docker("exec", container, "touch", "/tmp/go")
        # The computer runs one command at a time: once this one is answered, the cut one has
        # ended and its answer has been sent into the cut stream.
        after = mcp_http.post(srv.mcp_url, tool_call(4, {"computer_id": computer, "command": "echo after"}), headers)
        assert "after" in after.text, after.text
        with httpx.Client(timeout=30) as client:
            with client.stream("GET", srv.mcp_url, headers={**headers, "Accept": "text/event-stream",
                                                              "Last-Event-ID": first}) as resumed:
                assert resumed.status_code == 200
                events = sse_events(resumed.iter_lines())
        answers = [json.loads(e["data"]) for e in events if e.get("data")]
        mine = [a for a in answers if a.get("id") == 3]
        assert mine, f"the reconnect replayed no answer: {events}"
        assert mine[0]["result"]["structuredContent"]["stdout"] == "answer-after-reconnect\n", mine
        # Read to its end is not received (the reconnect's own connection may have died
        # silently): a second reconnect within the grace gets the same answer, not a hang.
        with httpx.Client(timeout=30) as client:
            with client.stream("GET", srv.mcp_url, headers={**headers, "Accept": "text/event-stream",
                                                              "Last-Event-ID": first}) as again:
                replayed = [json.loads(e["data"]) for e in sse_events(again.iter_lines()) if e.get("data")]
        assert [a["result"] for a in replayed if a.get("id") == 3] == [mine[0]["result"]], replayed


class CuttingProxy:
    """A TCP relay in front of the server whose open connections the test can cut at once.

    `cut()` closes both sides, as a proxy that dies would. `vanish()` closes only the client's
    side and keeps reading the server's, as a middlebox that drops a connection silently does:
    the server's writes still succeed, so it cannot tell that nobody receives them. While
    `admit` is clear, new connections wait before they reach the server.

    A test cuts only once `resumable(marker)` holds: the relay runs on the test's event loop,
    which a blocking poll holds, so the server's first event can still be on its way to the
    client when the command is seen running; a stream cut before the client has an event id
    cannot be resumed, by any server.
    """

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.clients: list[asyncio.StreamWriter] = []
        self.upstreams: list[asyncio.StreamWriter] = []
        self.vanished: list[asyncio.StreamWriter] = []
        self.from_client = bytearray()
        self.into_void = bytearray()
        # For each connection: what its client sent, what reached its client, and how much
        # had reached it each time the client's bytes grew (a kept-alive connection carries
        # several requests; what answers one comes after it).
        self.exchanges: list[tuple[bytearray, bytearray, list[tuple[int, int]]]] = []
        self.admit = asyncio.Event()
        self.admit.set()
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.admit.wait()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.clients.append(writer)
        self.upstreams.append(up_writer)
        sent, relayed, points = bytearray(), bytearray(), []
        self.exchanges.append((sent, relayed, points))

        async def to_server() -> None:
            try:
                while data := await reader.read(65536):
                    self.from_client += data
                    sent.extend(data)
                    points.append((len(sent), len(relayed)))
                    up_writer.write(data)
                    await up_writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                if up_writer not in self.vanished:
                    up_writer.close()

        async def to_client() -> None:
            try:
                while data := await up_reader.read(65536):
                    if up_writer in self.vanished:
                        self.into_void += data
                    elif not writer.is_closing():
                        writer.write(data)
                        await writer.drain()
                        relayed.extend(data)
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        await asyncio.gather(to_server(), to_client())

    def resumable(self, marker: bytes) -> bool:
        """Whether the connection that carried `marker` has since relayed an SSE event id to its client."""
        for sent, relayed, points in self.exchanges:
            at = sent.find(marker)
            if at < 0:
                continue
            answer_from = next(relayed_then for sent_then, relayed_then in points if sent_then >= at + len(marker))
            if b"\nid:" in relayed[answer_from:]:
                return True
        return False

    def cut(self) -> None:
        for writer in self.clients + self.upstreams + self.vanished:
            writer.transport.abort()
        self.clients.clear()
        self.upstreams.clear()
        self.vanished.clear()

    def vanish(self) -> None:
        for writer in self.clients:
            writer.transport.abort()
        self.vanished += self.upstreams
        self.clients.clear()
        self.upstreams.clear()

    async def close(self) -> None:
        self.admit.set()
        self.cut()
        if self.server:
            self.server.close()
            await self.server.wait_closed()


async def test_issue_30_the_sdk_client_gets_its_answer_after_its_own_reconnect(kbb):
    # See: issue 30 (item 16), with the official client's own reconnect (Last-Event-ID after
    # the announced retry delay).
    computer = kbb.new_id("sdk-resume")
    kbb.track(computer)
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        proxy = CuttingProxy(srv.port)
        proxied = dataclasses.replace(srv, port=await proxy.start())
        try:
            async with kbb.http_session(proxied, headers=srv.auth()) as sess:
                (await sess.run("true", computer_id=computer)).ok()
                [container] = containers_for(computer)
                outcome: dict = {}

                async def call() -> None:
                    outcome["result"] = await sess.call({"computer_id": computer, "command": WAIT_FOR_GO}, timeout=40)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    sent = await apoll(lambda: WAIT_FOR_GO.encode() in proxy.from_client, 20, 0.02)
                    assert sent, "the call never reached the server"
                    # The command is running when the connections are cut.
                    running = await apoll(lambda: "sleep" in docker("exec", container, "ps", check=False).stdout, 20, 0.05)
                    assert running
                    resumable = await apoll(lambda: proxy.resumable(WAIT_FOR_GO.encode()), 20, 0.02)
                    assert resumable, "the call's stream never carried an event id to resume from"
                    proxy.cut()
                    docker("exec", container, "touch", "/tmp/go")
                result = outcome["result"].ok()
                assert result.structured["stdout"] == "answer-after-reconnect\n", result
        finally:
            await proxy.close()


async def test_issue_30_an_answer_written_into_a_silently_dropped_connection_reaches_the_reconnect(kbb):
    # See: issue 30 (item 16). The connection dies without the server noticing (no FIN, no
    # reset reaches it), the answer is written into it, and only then does the client's
    # reconnect (Last-Event-ID) arrive: the server must still hold the answer for it.
    computer = kbb.new_id("void-resume")
    kbb.track(computer)
    async with kbb.http_server(*BUSYBOX_ARGS) as srv:
        proxy = CuttingProxy(srv.port)
        proxied = dataclasses.replace(srv, port=await proxy.start())
        try:
            async with kbb.http_session(proxied, headers=srv.auth()) as sess:
                (await sess.run("true", computer_id=computer)).ok()
                [container] = containers_for(computer)
                outcome: dict = {}

                async def call() -> None:
                    outcome["result"] = await sess.call({"computer_id": computer, "command": WAIT_FOR_GO}, timeout=40)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    sent = await apoll(lambda: WAIT_FOR_GO.encode() in proxy.from_client, 20, 0.02)
                    assert sent, "the call never reached the server"
                    running = await apoll(lambda: "sleep" in docker("exec", container, "ps", check=False).stdout, 20, 0.05)
                    assert running
                    resumable = await apoll(lambda: proxy.resumable(WAIT_FOR_GO.encode()), 20, 0.02)
                    assert resumable, "the call's stream never carried an event id to resume from"
                    proxy.admit.clear()
                    proxy.vanish()
                    docker("exec", container, "touch", "/tmp/go")
                    answered = await apoll(lambda: b"answer-after-reconnect" in proxy.into_void, 20, 0.05)
                    assert answered, "the server never wrote the answer into the dropped connection"
                    proxy.admit.set()
                result = outcome["result"].ok()
                assert result.structured["stdout"] == "answer-after-reconnect\n", result
        finally:
            await proxy.close()
