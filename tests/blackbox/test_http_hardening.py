"""Hardening of the HTTP listener (issue 15, items 5, 7 and 10), with raw sockets and httpx
against the real binary: a loopback server started without a token generates one (0600 file)
and requires it; `--allow-unauthenticated-http` is the explicit opt-out; `--allowed-host '*'`
without authentication is refused; a client trickling its request head is cut after the
header-read timeout; connections beyond the cap get 503; a body declared larger than the limit
is refused before it is read and a chunked one is cut at the limit, with the server's memory
bounded; a session whose only activity is a call that never ends is still reaped; and a
`timeout` above one week is refused."""

from __future__ import annotations

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

from conftest import BIN, BUSYBOX_ARGS, apoll, free_port
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
