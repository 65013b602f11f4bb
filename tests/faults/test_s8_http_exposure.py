"""Scenario 8: what the HTTP listener shows to whoever reaches it.  With a bearer token set:
no token or a wrong one → 401, a foreign `Host` (DNS rebinding) → 421, a foreign `Origin` (a web
page) → 403, a body larger than any legal request → 413 (with `Content-Length` and chunked, the
server's peak RSS recorded).  A non-loopback bind without a token is refused at startup
(127.0.0.2 stands in for a non-loopback address: the rule treats it as one, and it stays on
this machine).  Requests are written with plain httpx or raw sockets, never the SDK."""

from __future__ import annotations

import select
import socket
import subprocess
import threading
import time

import httpx
import pytest

from faultkit import MIB, TOKEN, bb, mib
from testkit import mcp_http
from testkit.mcp_http import ACCEPT
from testkit.procfs import status_kib

pytestmark = [pytest.mark.anyio, pytest.mark.scenario("8")]

# Far beyond the largest legal request (2 MiB of stdin, JSON-escaped) and the 16 MiB cap.
BIG_BODY_BYTES = 50 * MIB
CHUNK = 64 * 1024
BIG_BODY_DEADLINE = 60.0


def post(url: str, headers: dict) -> httpx.Response:
    return mcp_http.post(url, mcp_http.initialize_body(client_name="faults-http"), headers)


def big_post(port: int, *, chunked: bool) -> tuple[int | None, int, float]:
    """POSTs BIG_BODY_BYTES to /mcp over a raw socket, reading a response as soon as one comes
    (a server may answer and close before the body is through).  Returns (status or None,
    body bytes sent, seconds)."""
    started = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nAccept: {ACCEPT}\r\n"
        + ("Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {BIG_BODY_BYTES}\r\n")
        + "\r\n"
    )
    sent = 0
    reply = b""
    try:
        sock.sendall(head.encode())
        payload = b"[" + b" " * (CHUNK - 1)
        while sent < BIG_BODY_BYTES and time.monotonic() - started < BIG_BODY_DEADLINE:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            data = payload if sent == 0 else b" " * CHUNK
            frame = (b"%x\r\n" % len(data)) + data + b"\r\n" if chunked else data
            try:
                sock.sendall(frame)
            except OSError:
                break
            sent += len(data)
        if chunked and sent >= BIG_BODY_BYTES:
            try:
                sock.sendall(b"0\r\n\r\n")
            except OSError:
                pass
        deadline = time.monotonic() + 30
        while b"\r\n" not in reply and time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 1)
            if readable:
                try:
                    data = sock.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                reply += data
    finally:
        sock.close()
    status = None
    if reply.startswith(b"HTTP/1.1 "):
        status = int(reply.split(b" ", 2)[1])
    return status, sent, time.monotonic() - started


async def test_http_refusals_with_a_token(kbb, figures):
    """A loopback server with a bearer token: unauthenticated and wrong-token /mcp → 401, wrong
    Host → 421, evil Origin → 403, a 50 MB body (Content-Length and chunked) → 413; the right
    token on the right Host is answered (control)."""
    async with kbb.http_server(*bb.BUSYBOX_ARGS, env={"KILNTAINERS_AUTH_TOKEN": TOKEN}) as srv:
        url = srv.mcp_url
        good = {"Authorization": f"Bearer {TOKEN}"}
        statuses = {
            "no token": post(url, {}).status_code,
            "wrong token": post(url, {"Authorization": "Bearer wrong-" + TOKEN}).status_code,
            "wrong Host": post(url, {**good, "Host": "evil.example"}).status_code,
            "evil Origin": post(url, {**good, "Origin": "http://evil.example"}).status_code,
        }
        control = post(url, good)
        statuses["right token (control)"] = control.status_code
        if control.status_code == 200 and control.headers.get("mcp-session-id"):
            httpx.delete(url, headers={**good, "Mcp-Session-Id": control.headers["mcp-session-id"]}, timeout=30)
        rss_before = status_kib(srv.pid, "VmRSS")
        big = {}
        for chunked in (False, True):
            status, sent, seconds = big_post(srv.port, chunked=chunked)
            label = "chunked" if chunked else "content-length"
            statuses[f"50 MB body ({label})"] = status
            big[label] = {"sent_mib": round(sent / MIB, 1), "seconds": round(seconds, 2)}
        figures.update(
            statuses=statuses,
            mib_sent_before_413={k: v["sent_mib"] for k, v in big.items()},
            rss_before_big_bodies_mib=mib(rss_before),
            peak_rss_mib=mib(status_kib(srv.pid, "VmHWM")),
            rss_after_big_bodies_mib=mib(status_kib(srv.pid, "VmRSS")),
        )
        assert statuses == {
            "no token": 401,
            "wrong token": 401,
            "wrong Host": 421,
            "evil Origin": 403,
            "right token (control)": 200,
            "50 MB body (content-length)": 413,
            "50 MB body (chunked)": 413,
        }, statuses
        assert srv.healthy()


async def test_non_loopback_bind_without_a_token_is_refused(kbb, figures):
    """`--host 127.0.0.2` (non-loopback for the rule) without a token: the server refuses to
    start, says why, and leaves nothing behind."""
    home = kbb.home()
    port = bb.free_port()
    env = kbb.env(home)
    env.pop("KILNTAINERS_AUTH_TOKEN", None)
    proc = subprocess.Popen(
        [bb.BIN, "--transport", "http", "--host", "127.0.0.2", "--port", str(port), *bb.BUSYBOX_ARGS],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the server started listening on 127.0.0.2 without a token:\n{err[-2000:]}")
    figures.update(exit_status=proc.returncode, refusal=next(
        (line for line in err.splitlines() if line.startswith("kilntainers: error: ")), "")[:200])
    assert proc.returncode != 0, err
    assert "non-loopback" in err and "token" in err.lower(), err
    assert kbb.instance_locks(home) == [], "a refused start left an instance lock"


# Many clients each sending a body just under the per-request limit, all at once: only the
# server's budget of request-body memory (64 MiB, src/transport/http/screen_body.rs) bounds
# what it holds: a body is charged six bytes per byte while it is held and parsed.
BODY_BUDGET_MIB = 64
FLOOD_CLIENTS = 32
FLOOD_BODY_BYTES = 7 * MIB + MIB // 2


def full_post(port: int, body: bytes) -> int | None:
    """One complete chunked POST of `body`, reading the answer as soon as one comes (a refusal
    can come before the body is through); the status, or None when none came."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=90) as sock:
            head = (
                f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nAccept: {ACCEPT}\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            sock.sendall(head.encode())
            frames = [b"%x\r\n" % len(body[at:at + CHUNK]) + body[at:at + CHUNK] + b"\r\n"
                      for at in range(0, len(body), CHUNK)] + [b"0\r\n\r\n"]
            for frame in frames:
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    break
                try:
                    sock.sendall(frame)
                except OSError:
                    break
            reply = b""
            while b"\r\n" not in reply:
                readable, _, _ = select.select([sock], [], [], 90)
                if not readable:
                    break
                data = sock.recv(4096)
                if not data:
                    break
                reply += data
    except OSError:
        return None
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else None


async def test_many_large_bodies_at_once_stay_within_the_budget(kbb, figures):
    """32 clients each POST a 7.5 MiB body at once (each under the 8 MiB limit): the server holds
    at most its 64 MiB budget of them (six bytes of memory per body byte: the bytes and their
    parses); the rest wait briefly, then get 503 with Retry-After. Peak RSS recorded."""
    body = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"pad":"' + b"p" * (FLOOD_BODY_BYTES - 80) + b'"}}'
    async with kbb.http_server(*bb.BUSYBOX_ARGS, env={"KILNTAINERS_AUTH_TOKEN": TOKEN}) as srv:
        rss_before = status_kib(srv.pid, "VmRSS")
        statuses: list[int | None] = []
        started = time.monotonic()
        threads = [threading.Thread(target=lambda: statuses.append(full_post(srv.port, body)), daemon=True)
                   for _ in range(FLOOD_CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        counts: dict[str, int] = {}
        for status in statuses:
            counts[str(status)] = counts.get(str(status), 0) + 1
        peak = status_kib(srv.pid, "VmHWM")
        figures.update(
            clients=FLOOD_CLIENTS,
            body_mib=round(FLOOD_BODY_BYTES / MIB, 1),
            statuses=counts,
            seconds=round(time.monotonic() - started, 1),
            rss_before_mib=mib(rss_before),
            peak_rss_mib=mib(peak),
            rss_after_mib=mib(status_kib(srv.pid, "VmRSS")),
        )
        assert len(statuses) == FLOOD_CLIENTS, statuses
        # Read whole and answered by rmcp (no session: 400), or refused over the budget (503).
        assert set(counts) <= {"400", "503"}, counts
        assert peak - rss_before < (BODY_BUDGET_MIB + 16) * 1024, f"peak {peak} KiB from {rss_before} KiB"
        assert srv.healthy()
