"""port_url and the HTTP transport's /computers/<id>/ports/<port>/ route (docs/files.md, "Ports")
with the official Python MCP client against a real Docker engine: a real HTTP server (BusyBox
httpd, started as a job) fetched through the loopback forwarder and through the HTTP route with
and without the token; a server bound to the computer's 127.0.0.1 and a computer without a
network, both reached through the exec helper; an Upgrade (the WebSocket handshake) carried
both ways; the forwarder ending with its computer; every message.

scripts/test.sh runs this file again with KILNTAINERS_EXEC_HELPER=off: the helper's route is
then unavailable, and the cases that need it check the message instead."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import httpx
import pytest

from conftest import BUSYBOX_ARGS

pytestmark = pytest.mark.anyio

PORT_ARGS = [*BUSYBOX_ARGS, "--file-tools", "--job-tools"]
HELPER_ON = os.environ.get("KILNTAINERS_EXEC_HELPER", "on") != "off"
PAGE = "<h1>served from a sandbox computer</h1>\n"
# A minimal Upgrade endpoint for `busybox nc -ll -e`: reads the request head, agrees to switch
# protocols, then echoes. What matters here is the proxy, which carries any protocol after 101.
UPGRADE_SCRIPT = """#!/bin/sh
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\\r')
  [ -z "$line" ] && break
done
printf 'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n\\r\\n'
exec cat
"""


async def serve_page(srv, computer: str, listen: str, temporary: bool = True) -> None:
    """Writes the page and starts BusyBox httpd on `listen` as a job."""
    (await srv.call({"computer_id": computer, "path": "/www/index.html", "content": PAGE}, name="file_write")).ok()
    res = (await srv.call({
        "computer_id": computer, "command": f"busybox httpd -f -p {listen} -h /www", "yield_after": 1,
    })).ok().structured
    assert res["running"] is True, res


async def port_url(srv, computer: str, port: int, timeout: float = 20.0) -> dict:
    """port_url, asked again while the server in the computer is still starting."""
    deadline = time.monotonic() + timeout
    while True:
        res = await srv.call({"computer_id": computer, "port": port}, name="port_url")
        if not res.is_error:
            return res.structured
        assert "Nothing accepts connections" in res.text, res.text
        assert time.monotonic() < deadline, f"port {port} never became reachable: {res.text}"
        await asyncio.sleep(0.2)


async def test_switch_adds_port_url_after_the_file_tools(kbb):
    async with kbb.server(*BUSYBOX_ARGS, "--file-tools") as srv:
        names = [t["name"] for t in await srv.list_tools()]
        assert names == ["terminal_execute", "file_read", "file_write", "file_list", "port_url"]
        assert "port_url" in srv.init["instructions"]
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        with pytest.raises(Exception, match="tool not found"):
            await srv.call({"port": 80}, name="port_url")


async def test_a_real_http_server_through_the_loopback_forwarder(kbb):
    computer = kbb.new_id("web")
    kbb.track(computer)
    async with kbb.server(*PORT_ARGS) as srv:
        await serve_page(srv, computer, "8000")
        res = await port_url(srv, computer, 8000)
        assert list(res) == ["computer_id", "port", "url"]
        assert res["computer_id"] == computer and res["port"] == 8000
        assert res["url"].startswith("http://127.0.0.1:") and res["url"].endswith("/")
        page = httpx.get(res["url"] + "index.html", timeout=10)
        assert page.status_code == 200 and page.text == PAGE
        # Several connections at once, each carried on its own.
        async with httpx.AsyncClient(timeout=10) as client:
            pages = await asyncio.gather(*(client.get(res["url"] + "index.html") for _ in range(8)))
        assert all(p.status_code == 200 and p.text == PAGE for p in pages)
        # The same port again: the same forwarder.
        again = (await srv.call({"computer_id": computer, "port": 8000}, name="port_url")).ok().structured
        assert again["url"] == res["url"]
    # The forwarder ends with the server (and the temporary computer).
    with pytest.raises(httpx.TransportError):
        httpx.get(res["url"], timeout=5)


async def test_a_server_on_the_computers_own_loopback(kbb):
    computer = kbb.new_id("lo")
    kbb.track(computer)
    async with kbb.server(*PORT_ARGS) as srv:
        await serve_page(srv, computer, "127.0.0.1:8001")
        if not HELPER_ON:
            # Only the container's address is tried; the server does not listen there.
            res = await srv.call({"computer_id": computer, "port": 8001}, name="port_url")
            assert res.is_error
            assert f"Nothing accepts connections on port 8001 in computer '{computer}'" in res.text
            assert "exec helper" in res.text
            return
        res = await port_url(srv, computer, 8001)
        page = httpx.get(res["url"] + "index.html", timeout=10)
        assert page.status_code == 200 and page.text == PAGE


async def test_a_computer_without_a_network(kbb):
    computer = kbb.new_id("offline")
    kbb.track(computer)
    async with kbb.server(*PORT_ARGS, "--no-network") as srv:
        await serve_page(srv, computer, "8002")
        if not HELPER_ON:
            res = await srv.call({"computer_id": computer, "port": 8002}, name="port_url")
            assert res.is_error and "Nothing accepts connections on port 8002" in res.text
            return
        res = await port_url(srv, computer, 8002)
        page = httpx.get(res["url"] + "index.html", timeout=10)
        assert page.status_code == 200 and page.text == PAGE


async def test_messages_and_a_closed_port(kbb):
    async with kbb.server(*PORT_ARGS) as srv:
        for port, shown in [(0, "0"), (65536, "65536"), (-5, "-5")]:
            res = await srv.call({"port": port}, name="port_url")
            assert res.is_error and res.text == f"port must be between 1 and 65535, got: {shown}"
        res = await srv.call({}, name="port_url")
        assert res.is_error and "port" in res.text
        res = await srv.call({"port": 9}, name="port_url")
        assert res.is_error
        assert res.text.startswith("Nothing accepts connections on port 9 in computer '"), res.text
        assert res.text.endswith("Start a server listening on that port first."), res.text


async def test_the_forwarder_ends_when_the_computer_is_deleted(kbb):
    computer = kbb.new_id("gone")
    kbb.track(computer)
    async with kbb.server(*PORT_ARGS, "--lifecycle-tools") as srv:
        await serve_page(srv, computer, "8003")
        res = await port_url(srv, computer, 8003)
        assert httpx.get(res["url"], timeout=10).status_code == 200
        (await srv.call({"computer_id": computer}, name="computer_delete")).ok()
        with pytest.raises(httpx.TransportError):
            httpx.get(res["url"], timeout=5)


def upgrade_round_trip(host: str, port: int, path: str, token: str | None) -> bytes:
    """Sends an Upgrade request, then a payload after the 101; returns what came back."""
    with socket.create_connection((host, port), timeout=10) as sock:
        head = [
            f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: Upgrade", "Upgrade: websocket",
            "Sec-WebSocket-Version: 13", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        ]
        if token:
            head.append(f"Authorization: Bearer {token}")
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)
            assert chunk, f"closed before the response head: {received!r}"
            received += chunk
        head_bytes, rest = received.split(b"\r\n\r\n", 1)
        assert head_bytes.startswith(b"HTTP/1.1 101"), head_bytes
        sock.sendall(b"ping through the upgrade")
        deadline = time.monotonic() + 10
        while len(rest) < len(b"ping through the upgrade") and time.monotonic() < deadline:
            chunk = sock.recv(4096)
            if not chunk:
                break
            rest += chunk
        return rest


async def test_http_route_behind_the_token_with_upgrades(kbb):
    computer = kbb.new_id("proxied")
    kbb.track(computer)
    async with kbb.http_server(*PORT_ARGS) as server:
        async with kbb.http_session(server) as srv:
            await serve_page(srv, computer, "8004")
            res = await port_url(srv, computer, 8004)
            assert res["proxy_url"] == f"{server.base_url}/computers/{computer}/ports/8004/"
            route = res["proxy_url"]
            page = httpx.get(route + "index.html?x=1", headers=server.auth(), timeout=10)
            assert page.status_code == 200 and page.text == PAGE
            # Without the token, or with a wrong one: 401 before anything reaches the computer.
            assert httpx.get(route + "index.html", timeout=10).status_code == 401
            bad = httpx.get(route, headers={"Authorization": "Bearer wrong"}, timeout=10)
            assert bad.status_code == 401 and bad.headers["www-authenticate"] == "Bearer"
            # Without the trailing slash: redirected to the directory, query kept.
            bare = httpx.get(route.rstrip("/") + "?a=b", headers=server.auth(), timeout=10)
            assert bare.status_code == 308 and bare.headers["location"] == f"/computers/{computer}/ports/8004/?a=b"
            # An unknown computer is not created; a closed port is a 502 that says so.
            missing = httpx.get(f"{server.base_url}/computers/nope-{computer}/ports/8004/", headers=server.auth(), timeout=10)
            assert missing.status_code == 404 and missing.text == f"Computer 'nope-{computer}' was not found."
            closed = httpx.get(f"{server.base_url}/computers/{computer}/ports/9/", headers=server.auth(), timeout=10)
            assert closed.status_code == 502 and "Nothing accepts connections on port 9" in closed.text
            # An Upgrade is carried both ways once the port agrees.
            script = {"computer_id": computer, "path": "/srv/upgrade.sh", "content": UPGRADE_SCRIPT, "mode": "0755"}
            (await srv.call(script, name="file_write")).ok()
            job = (await srv.call({
                "computer_id": computer, "command": "busybox nc -ll -p 8005 -e /srv/upgrade.sh", "yield_after": 1,
            })).ok().structured
            assert job["running"] is True, job
            await port_url(srv, computer, 8005)
            path = f"/computers/{computer}/ports/8005/socket"
            echoed = upgrade_round_trip(server.host, server.port, path, server.token)
            assert echoed == b"ping through the upgrade"
            with pytest.raises(AssertionError, match="401"):
                upgrade_round_trip(server.host, server.port, path, None)
