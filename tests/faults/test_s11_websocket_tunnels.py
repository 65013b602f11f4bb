"""Scenario 11: 600 WebSocket tunnels through the port proxy.  One principal opens 600 Upgrade
requests through `/computers/<id>/ports/<port>/` to a port that agrees to every one (BusyBox
`nc -ll -e` answering 101, then echoing).  The server must cap them per principal (the rest get
429), count every tunnel as one of its connections, keep serving `/mcp` meanwhile, and give
everything back once the tunnels close: its descriptors and memory stay bounded, whatever the
client holds open."""

from __future__ import annotations

import os
import socket
import time

import anyio
import pytest

from faultkit import TOKEN, bb, mib
from testkit.procfs import status_kib

pytestmark = [pytest.mark.anyio, pytest.mark.scenario("11")]

TUNNELS = 600
# Mirror of src/transport/http/port_proxy.rs.
TUNNELS_PER_PRINCIPAL = 64
PORT = 8090
UPGRADE_SCRIPT = """#!/bin/sh
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\\r')
  [ -z "$line" ] && break
done
printf 'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n\\r\\n'
exec cat
"""


def open_tunnel(port: int, path: str) -> tuple[int, socket.socket | None]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    head = [
        f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: Upgrade", "Upgrade: websocket",
        "Sec-WebSocket-Version: 13", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", f"Authorization: Bearer {TOKEN}",
    ]
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
    except OSError:
        sock.close()
        return 0, None
    status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else 0
    if status == 101:
        return status, sock
    sock.close()
    return status, None


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_six_hundred_websocket_tunnels_are_capped(kbb, figures):
    """600 tunnels opened and held by one principal: at most 64 are carried, the rest are refused
    with 429; each carried tunnel works and holds one connection slot; /mcp keeps answering;
    closing them gives the descriptors back."""
    computer = kbb.new_id("s11-tunnels")
    kbb.track(computer)
    held: list[socket.socket] = []
    async with kbb.http_server(*bb.BUSYBOX_ARGS, "--file-tools", "--job-tools",
                               env={"KILNTAINERS_AUTH_TOKEN": TOKEN}) as srv:
        async with kbb.http_session(srv, headers={"Authorization": f"Bearer {TOKEN}"}) as sess:
            script = {"computer_id": computer, "path": "/srv/upgrade.sh", "content": UPGRADE_SCRIPT, "mode": "0755"}
            (await sess.call(script, name="file_write")).ok()
            job = (await sess.call({"computer_id": computer, "command": f"busybox nc -ll -p {PORT} -e /srv/upgrade.sh",
                                    "yield_after": 1})).ok().structured
            assert job["running"] is True, job
            deadline = time.monotonic() + 20
            while (await sess.call({"computer_id": computer, "port": PORT}, name="port_url")).is_error:
                assert time.monotonic() < deadline, "the port never became reachable"
                await anyio.sleep(0.2)
            path = f"/computers/{computer}/ports/{PORT}/socket"
            fds_before = descriptors(srv.pid)
            rss_before = status_kib(srv.pid, "VmRSS")
            statuses: dict[str, int] = {}
            started = time.monotonic()
            try:
                for _ in range(TUNNELS):
                    status, sock = open_tunnel(srv.port, path)
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
                    if sock is not None:
                        held.append(sock)
                open_seconds = time.monotonic() - started
                fds_peak = descriptors(srv.pid)
                echoed = 0
                for sock in held:
                    sock.sendall(b"ping")
                    got = b""
                    while len(got) < 4:
                        chunk = sock.recv(16)
                        if not chunk:
                            break
                        got += chunk
                    echoed += got == b"ping"
                call_started = time.monotonic()
                answered = (await sess.run("echo still-serving")).structured["stdout"] == "still-serving\n"
                call_ms = round((time.monotonic() - call_started) * 1000, 1)
            finally:
                for sock in held:
                    sock.close()
            carried = len(held)
            held.clear()
            back = await bb.apoll(lambda: descriptors(srv.pid) <= fds_before + 4, 30, 0.2)
            figures.update(
                tunnels_attempted=TUNNELS,
                tunnels_carried=carried,
                statuses=statuses,
                tunnels_echoing=echoed,
                seconds_to_open=round(open_seconds, 1),
                server_fds_before=fds_before,
                server_fds_with_tunnels=fds_peak,
                server_fds_after_close=descriptors(srv.pid),
                rss_before_mib=mib(rss_before),
                peak_rss_mib=mib(status_kib(srv.pid, "VmHWM")),
                mcp_call_while_held_ms=call_ms,
            )
            assert carried <= TUNNELS_PER_PRINCIPAL, statuses
            assert statuses.get("429", 0) == TUNNELS - carried, statuses
            assert echoed == carried, f"{echoed} of {carried} tunnels echoed"
            assert answered, "/mcp stopped answering while the tunnels were held"
            # Each tunnel is two descriptors (the client's connection and the port's).
            assert fds_peak - fds_before <= 2 * TUNNELS_PER_PRINCIPAL + 16, (fds_before, fds_peak)
            assert back, f"descriptors not given back: {descriptors(srv.pid)} (before: {fds_before})"
