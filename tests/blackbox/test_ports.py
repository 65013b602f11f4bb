"""port_url and the HTTP transport's /computers/<id>/ports/<port>/ route (docs/files.md, "Ports")
with the official Python MCP client against a real Docker engine: a real HTTP server (BusyBox
httpd, started as a job) fetched through the loopback forwarder and through the HTTP route with
and without the token; a server bound to the computer's 127.0.0.1 and a computer without a
network, both reached through the exec helper; an Upgrade (the WebSocket handshake) carried
both ways; the forwarder ending with its computer; every message.

Issue 30: over HTTP the url is the port's own origin (its key in the host name) and no loopback
listener is opened; the computer never sees the client's cookies or a proxy's identity headers
and the browser never gets the computer's origin-wide headers; pages on other origins cannot
reach the route, even without authentication; WebSocket tunnels hold connection slots and are
capped per principal.

scripts/test.sh runs this file again with KILNTAINERS_EXEC_HELPER=off: the helper's route is
then unavailable, and the cases that need it check the message instead."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from harness import BUSYBOX_ARGS, apoll
from test_principals import ALICE, BOB

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

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


# ---------------------------------------------------------------------------------------------
# issue 30: a port's pages keep to an origin of their own, and carry no credential either way

# Answers each request with its own request head as the body, plus response headers that would
# let a page act on the server's origin (cookies, a service worker for the whole origin, wiping
# the origin's storage, HSTS and Alt-Svc for the server's host, a reporting endpoint).
ECHO_SCRIPT = """#!/bin/sh
head=""
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\\r')
  [ -z "$line" ] && break
  head="$head$line
"
done
len=$(printf '%s' "$head" | wc -c)
printf 'HTTP/1.1 200 OK\\r\\nContent-Type: text/plain\\r\\nContent-Length: %s\\r\\nSet-Cookie: planted=1; Path=/\\r\\nService-Worker-Allowed: /\\r\\nClear-Site-Data: "*"\\r\\nStrict-Transport-Security: max-age=31536000\\r\\nAlt-Svc: h2=":9"\\r\\nNEL: {"report_to":"x","max_age":86400}\\r\\nAccess-Control-Allow-Origin: *\\r\\nX-Kept: yes\\r\\nConnection: close\\r\\n\\r\\n%s' "$len" "$head"
"""
# What a browser, or a reverse proxy in front, adds to a request: none of it is the computer's.
CREDENTIAL_HEADERS = {
    "Cookie": "dashboard=secret-cookie",
    "X-Forwarded-For": "203.0.113.9",
    "X-Forwarded-User": "alice",
    "X-Forwarded-Email": "alice@example.com",
    "X-Auth-Request-User": "alice",
    "X-Auth-Request-Access-Token": "secret-upstream-token",
    "Forwarded": "for=203.0.113.9",
    "X-Real-IP": "203.0.113.9",
}
DANGEROUS_RESPONSE_HEADERS = [
    "set-cookie", "service-worker-allowed", "clear-site-data", "strict-transport-security", "alt-svc", "nel",
    "access-control-allow-origin",
]


async def start_echo(srv, computer: str, port: int) -> None:
    script = {"computer_id": computer, "path": "/srv/echo.sh", "content": ECHO_SCRIPT, "mode": "0755"}
    (await srv.call(script, name="file_write")).ok()
    job = (await srv.call({
        "computer_id": computer, "command": f"busybox nc -ll -p {port} -e /srv/echo.sh", "yield_after": 1,
    })).ok().structured
    assert job["running"] is True, job


def fetch(url: str, headers: dict | None = None, method: str = "GET") -> httpx.Response:
    """`url` as a browser on this machine would fetch it: a `*.localhost` name is loopback
    (browsers resolve it themselves; this machine's resolver does not), with the name kept in
    `Host`."""
    parsed = httpx.URL(url)
    if parsed.host.endswith(".localhost"):
        target = parsed.copy_with(host="127.0.0.1")
        headers = {"Host": f"{parsed.host}:{parsed.port}", **(headers or {})}
    else:
        target = parsed
    return httpx.request(method, target, headers=headers, timeout=10)


def check_response_and_request(response: httpx.Response, where: str) -> str:
    """The response of the echo server as a browser would get it; returns the request head the
    computer saw."""
    assert response.status_code == 200, (where, response.status_code, response.text)
    for name in DANGEROUS_RESPONSE_HEADERS:
        assert name not in response.headers, f"{where}: the computer's {name} reached the browser"
    assert response.headers.get("x-kept") == "yes", f"{where}: an ordinary header was dropped"
    policy = response.headers.get("content-security-policy", "")
    assert policy.startswith("sandbox"), f"{where}: no sandbox policy: {policy!r}"
    seen = response.text.lower()
    for name, value in CREDENTIAL_HEADERS.items():
        assert value.lower() not in seen, f"{where}: the client's {name} reached the computer:\n{response.text}"
    assert "authorization" not in seen, f"{where}: an Authorization header reached the computer"
    return seen


async def test_issue_30_a_ports_pages_get_an_origin_of_their_own_and_no_credentials(kbb):
    # See: issue 30 (items 4 and 11)
    computer = kbb.new_id("origin")
    kbb.track(computer)
    async with kbb.http_server(*PORT_ARGS) as server:
        async with kbb.http_session(server) as srv:
            await start_echo(srv, computer, 8006)
            res = await port_url(srv, computer, 8006)
            url, route = res["url"], res["proxy_url"]
            server_origin = (server.host, server.port)
            page_origin = (httpx.URL(url).host, httpx.URL(url).port)
            assert page_origin != server_origin, f"the port's url shares the server's origin: {url}"
            # The url needs nothing but itself (a browser follows it), yet it is a credential:
            # the same port on a guessed name, or with no name, is not served.
            on_own_origin = check_response_and_request(fetch(url + "index.html", CREDENTIAL_HEADERS), "url")
            assert "get /index.html http/1.1" in on_own_origin
            # On its own origin, /mcp is the computer's path, never the server's MCP endpoint.
            assert "get /mcp http/1.1" in fetch(url + "mcp").text.lower()
            if httpx.URL(url).host.endswith(".localhost"):
                label = httpx.URL(url).host.split(".", 1)[0]
                guessed = url.replace(label, label[:-1] + ("1" if label.endswith("0") else "0"))
                assert fetch(guessed).status_code == 404
            # The path route on the server's origin: for HTTP clients with the token, sandboxed.
            on_route = check_response_and_request(
                httpx.get(route + "index.html", headers={**server.auth(), **CREDENTIAL_HEADERS}, timeout=10), "proxy_url"
            )
            assert f"x-forwarded-prefix: /computers/{computer}/ports/8006" in on_route
            sandbox = httpx.get(route, headers=server.auth(), timeout=10).headers["content-security-policy"]
            assert "allow-same-origin" not in sandbox, f"pages on the server's own origin keep it: {sandbox}"


def listening_ports(pid: int) -> set[int]:
    """TCP ports the process listens on (its sockets' inodes matched against /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


async def test_issue_30_over_http_port_url_opens_no_loopback_listener_without_a_credential(kbb):
    # See: issue 30 (item 11)
    computer = kbb.new_id("nolisten")
    kbb.track(computer)
    async with kbb.http_server(*PORT_ARGS) as server:
        async with kbb.http_session(server) as srv:
            await serve_page(srv, computer, "8007")
            before = listening_ports(server.pid)
            res = await port_url(srv, computer, 8007)
            assert listening_ports(server.pid) == before, (
                f"port_url opened a listener that takes no credential: {sorted(listening_ports(server.pid) - before)}"
            )
            page = fetch(res["url"] + "index.html")
            assert page.status_code == 200 and page.text == PAGE
            # The listener the server has is its own, where nothing is served without a credential.
            assert before == {server.port}, before
            bare = httpx.get(f"{server.base_url}/computers/{computer}/ports/8007/index.html", timeout=10)
            assert bare.status_code == 401


async def test_issue_30_without_authentication_pages_cannot_reach_the_proxy_route(kbb):
    # See: issue 30 (item 4): with --allow-unauthenticated-http, a page a computer serves (on
    # any other origin) must not reach the route; a person typing it, or a plain HTTP client, may.
    computer = kbb.new_id("open")
    kbb.track(computer)
    async with kbb.http_server(*PORT_ARGS, "--allow-unauthenticated-http") as server:
        async with kbb.http_session(server) as srv:
            await start_echo(srv, computer, 8008)
            res = await port_url(srv, computer, 8008)
            route = res["proxy_url"]
            other_origin = "http://127.0.0.1:9"
            from_a_page = [
                ("POST", {"Origin": other_origin, "Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors"}),
                ("GET", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"}),
                ("GET", {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}),
                ("GET", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors", "Origin": "null"}),
                ("POST", {"Origin": "null"}),
            ]
            for method, headers in from_a_page:
                refused = httpx.request(method, route + "x", headers=headers, timeout=10)
                assert refused.status_code == 403, (method, headers, refused.status_code, refused.text)
                assert "get /x" not in refused.text.lower() and "post /x" not in refused.text.lower()
            typed = {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
            assert httpx.get(route + "typed", headers=typed, timeout=10).status_code == 200
            assert httpx.get(route + "plain", timeout=10).status_code == 200
            # The port's own origin takes requests from its own pages only.
            own = f"http://{httpx.URL(res['url']).netloc.decode()}"
            assert fetch(res["url"] + "a", {"Origin": own, "Sec-Fetch-Site": "same-origin"}, "POST").status_code == 200
            for headers in [{"Origin": other_origin}, {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}]:
                assert fetch(res["url"] + "b", headers, "POST").status_code == 403, headers


# ---------------------------------------------------------------------------------------------
# issue 30 (item 7): WebSocket tunnels hold a connection slot each, and a principal holds at
# most TUNNELS_PER_PRINCIPAL of them (mirrors of src/transport/http/listener.rs and
# port_proxy.rs)

MAX_CONNECTIONS = 512
TUNNELS_PER_PRINCIPAL = 64
TUNNEL_TOKENS = {ALICE: "alice-" + "t" * 40, BOB: "bob-" + "u" * 40}


def open_tunnel(port: int, path: str, token: str) -> tuple[int, socket.socket | None, bytes]:
    """An Upgrade request through the route: (status, the open socket after a 101, the head)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = [
        f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: Upgrade", "Upgrade: websocket",
        "Sec-WebSocket-Version: 13", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", f"Authorization: Bearer {token}",
    ]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(4096)
        if not chunk:
            break
        received += chunk
    status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else 0
    if status == 101:
        return status, sock, received
    sock.close()
    return status, None, received


def echoes(sock: socket.socket, payload: bytes) -> bool:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(4096)
        if not chunk:
            return False
        got += chunk
    return got == payload


async def test_issue_30_websocket_tunnels_are_counted_and_capped_per_principal(kbb, tmp_path):
    # See: issue 30 (item 7)
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{p} {t}\n" for p, t in TUNNEL_TOKENS.items()))
    tokens.chmod(0o600)
    computer = kbb.new_id("tunnels")
    for principal in TUNNEL_TOKENS:
        kbb.track(f"{computer}.{hashlib.sha256(principal.encode()).hexdigest()[:16]}", temporary=False)
    held: list[socket.socket] = []
    try:
        async with kbb.http_server(*PORT_ARGS, "--auth-tokens-file", str(tokens)) as server:
            for token in TUNNEL_TOKENS.values():
                async with kbb.http_session(server, headers={"Authorization": f"Bearer {token}"}) as srv:
                    # Permanent: the computer must outlive this session.
                    (await srv.call({"computer_id": computer, "command": "true", "temporary": False})).ok()
                    script = {"computer_id": computer, "path": "/srv/upgrade.sh", "content": UPGRADE_SCRIPT, "mode": "0755"}
                    (await srv.call(script, name="file_write")).ok()
                    job = (await srv.call({
                        "computer_id": computer, "command": "busybox nc -ll -p 8009 -e /srv/upgrade.sh",
                        "yield_after": 1, "temporary": False,
                    })).ok().structured
                    assert job["running"] is True, job
                    await port_url(srv, computer, 8009)
            path = f"/computers/{computer}/ports/8009/socket"
            alice, bob = TUNNEL_TOKENS[ALICE], TUNNEL_TOKENS[BOB]
            refusal = None
            for _ in range(TUNNELS_PER_PRINCIPAL + 36):
                status, sock, head = open_tunnel(server.port, path, alice)
                if sock is None:
                    refusal = (status, head)
                    break
                held.append(sock)
            assert len(held) <= TUNNELS_PER_PRINCIPAL, f"alice holds {len(held)} tunnels"
            assert refusal and refusal[0] == 429, refusal
            assert b"tunnels" in refusal[1].lower(), refusal
            assert echoes(held[0], b"alice's first tunnel still works")
            # Another principal is not shut out by alice's tunnels.
            status, bobs, _ = open_tunnel(server.port, path, bob)
            assert status == 101 and bobs is not None
            held.append(bobs)
            assert echoes(bobs, b"bob's tunnel")
            # Every tunnel holds a connection slot: the rest of the slots, then 503.
            for _ in range(MAX_CONNECTIONS - len(held)):
                held.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
            extra = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            held.append(extra)
            extra.settimeout(5)
            assert extra.recv(64).startswith(b"HTTP/1.1 503"), "tunnels do not count against the connection cap"
            for sock in held:
                sock.close()
            held.clear()
            # Closed tunnels give their slots back.

            def reopened() -> bool:
                status, sock, _ = open_tunnel(server.port, path, alice)
                if sock is not None:
                    held.append(sock)
                return status == 101

            assert await apoll(reopened, 10, 0.2), "closed tunnels were never released"
    finally:
        for sock in held:
            sock.close()
