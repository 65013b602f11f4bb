"""The computers' network (docs/auth.md, "Network"), with the official Python client against a
real Docker engine: with named tokens every principal's computers sit on a network of their
own, so another principal's computer neither reaches them by address nor finds them in a scan
of their subnet, while the same principal's computers still reach each other; the network is
made on first use and removed with the principal's last computer. The single-user default keeps
the engine's default network. No computer has the raw-socket capability unless the run flags
add it (BusyBox's `ping` then works again), and `port_url` reaches the computer it names even
when a neighbour answers ARP for its address."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import httpx
import pytest

from egress_net import SHARED_NETWORKS
from harness import BUSYBOX_ARGS, docker, inspect, poll
from test_ports import port_url, serve_page
from test_principals import ALICE, BOB, TOKENS, bearer, tag, write_tokens

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent]

NETWORK_PREFIX = "kilntainers-net-"
CAP_NET_RAW = 13
SECRET = "principal-private-page"


def network_of(principal: str) -> str:
    """The name the server gives a principal's network (docs/auth.md, "Network")."""
    return NETWORK_PREFIX + hashlib.sha256(principal.encode()).hexdigest()[:16]


def network_exists(name: str) -> bool:
    return docker("network", "inspect", name, check=False).returncode == 0


def remove_network(name: str) -> None:
    if network_exists(name):
        docker("network", "rm", name, check=False)


def networks_of(container: str) -> dict:
    info = inspect(container)
    assert info, f"no container {container}"
    return info["NetworkSettings"]["Networks"]


def address_of(container: str) -> str:
    addresses = [n["IPAddress"] for n in networks_of(container).values() if n.get("IPAddress")]
    assert len(addresses) == 1, addresses
    return addresses[0]


def scan_command(address: str, port: int) -> str:
    """A plain TCP scan of the address's /24 from inside a computer: prints `open <host>` for
    every address that accepts a connection on `port`."""
    prefix = address.rsplit(".", 1)[0]
    return (
        f"for i in $(seq 1 254); do "
        f"(nc -w 1 {prefix}.$i {port} </dev/null >/dev/null 2>&1 && echo open {prefix}.$i) & "
        f"if [ $((i % 64)) = 0 ]; then wait; fi; done; wait; echo scanned"
    )


def net_raw_in(stdout: str) -> bool:
    effective = next(line for line in stdout.splitlines() if line.startswith("CapEff:"))
    return bool(int(effective.split()[1], 16) >> CAP_NET_RAW & 1)


async def start_page(sess, computer: str, text: str, port: int = 8000) -> None:
    res = await sess.run(
        f"mkdir -p /w && echo {text} > /w/index.html && httpd -p {port} -h /w && echo started",
        computer_id=computer, temporary=True,
    )
    assert res.structured["stdout"].strip() == "started", res


async def fetch(sess, computer: str, address: str, port: int = 8000) -> str:
    res = await sess.run(
        f"timeout 3 wget -q -O - http://{address}:{port}/ 2>&1; echo rc=$?", computer_id=computer, temporary=True,
    )
    return res.structured["stdout"]


async def test_principals_cannot_reach_each_others_computers(kbb, tmp_path):
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    web, peer, scanner = kbb.new_id("web"), kbb.new_id("peer"), kbb.new_id("scan")
    for principal in TOKENS:
        for computer in (web, peer, scanner):
            kbb.track(f"{computer}.{tag(principal)}", temporary=True)
    alice_net, bob_net = network_of(ALICE), network_of(BOB)
    try:
        async with kbb.http_server("--auth-tokens-file", str(tokens), *BUSYBOX_ARGS) as srv:
            async with kbb.http_session(srv, headers=bearer(TOKENS[ALICE])) as alice, \
                    kbb.http_session(srv, headers=bearer(TOKENS[BOB])) as bob:
                await start_page(alice, web, SECRET)
                web_container = f"kilntainer-{web}.{tag(ALICE)}"
                address = address_of(web_container)

                # The same principal's computers reach each other (this is what the scan below
                # would find if the networks were shared).
                assert SECRET in await fetch(alice, peer, address)
                found = (await alice.run(scan_command(address, 8000), computer_id=peer, temporary=True)).structured
                assert f"open {address}" in found["stdout"], found

                # Another principal reaches nothing of alice's, by address or by scanning.
                await bob.run("true", computer_id=scanner, temporary=True)
                seen = await fetch(bob, scanner, address)
                assert SECRET not in seen and "rc=0" not in seen, seen
                scan = (await bob.run(scan_command(address, 8000), computer_id=scanner, timeout=120,
                                      temporary=True)).structured
                assert scan["stdout"].strip().endswith("scanned"), scan
                assert "open" not in scan["stdout"], scan

                # Each principal's computers are on that principal's network only.
                assert set(networks_of(web_container)) == {alice_net}
                assert set(networks_of(f"kilntainer-{peer}.{tag(ALICE)}")) == {alice_net}
                assert set(networks_of(f"kilntainer-{scanner}.{tag(BOB)}")) == {bob_net}
                labels = json.loads(docker("network", "inspect", "-f", "{{json .Labels}}", alice_net).stdout)
                assert labels["kilntainers"] == "true" and labels["kilntainers.owner"] == ALICE, labels

            # The sessions ended: their temporary computers went, and with the last of each
            # principal's computers its network.
            assert poll(lambda: not network_exists(alice_net) and not network_exists(bob_net), 20), (
                docker("network", "ls").stdout
            )
    finally:
        remove_network(alice_net)
        remove_network(bob_net)


async def test_a_principals_network_lives_as_long_as_its_computers(kbb, tmp_path):
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    first, second = kbb.new_id("keep-one"), kbb.new_id("keep-two")
    for computer in (first, second):
        kbb.track(f"{computer}.{tag(ALICE)}", temporary=False)
    alice_net = network_of(ALICE)
    try:
        async with kbb.http_server("--auth-tokens-file", str(tokens), "--lifecycle-tools", *BUSYBOX_ARGS) as srv:
            async with kbb.http_session(srv, headers=bearer(TOKENS[ALICE])) as alice:
                assert not network_exists(alice_net)
                for computer in (first, second):
                    made = await alice.call({"computer_id": computer, "temporary": False}, name="computer_create")
                    assert not made.is_error, made.text
                assert network_exists(alice_net)
                # A stopped computer still needs its network: it must not go while one is left.
                docker("stop", "-t", "0", f"kilntainer-{first}.{tag(ALICE)}")
                assert not (await alice.call({"computer_id": second}, name="computer_delete")).is_error
                assert network_exists(alice_net)
                # Started again, it is on its network as before.
                res = await alice.run("echo back", computer_id=first, temporary=False)
                assert res.structured["stdout"].strip() == "back", res
                assert set(networks_of(f"kilntainer-{first}.{tag(ALICE)}")) == {alice_net}
                assert not (await alice.call({"computer_id": first}, name="computer_delete")).is_error
                assert not network_exists(alice_net)
    finally:
        remove_network(alice_net)


async def test_single_user_keeps_the_default_network_without_net_raw(kbb):
    computer = kbb.new_id("caps")
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        res = await srv.run("grep CapEff /proc/self/status; ping -c 1 -W 2 127.0.0.1 2>&1; echo rc=$?",
                            computer_id=computer)
        out = res.structured["stdout"]
        assert not net_raw_in(out), out
        # BusyBox's ping needs a raw socket (docs/auth.md, "Network").
        assert "permission denied" in out and "rc=1" in out, out
        container = f"kilntainer-{computer}"
        assert inspect(container)["HostConfig"]["NetworkMode"] in ("default", "bridge")
        assert set(networks_of(container)) == {"bridge"}
        # No network of a principal made by this server (a network names the process that made
        # it; tests on other workers make theirs meanwhile).
        made = docker("network", "ls", "--filter", f"label=kilntainers.instance={srv.instance_id}",
                      "--format", "{{.Name}}").stdout.split()
        assert made == [], made


async def test_run_flags_can_give_back_net_raw(kbb):
    computer = kbb.new_id("ping")
    async with kbb.server(*BUSYBOX_ARGS, "--docker-run-flag=--cap-add=NET_RAW") as srv:
        res = await srv.run("grep CapEff /proc/self/status; ping -c 1 -W 2 127.0.0.1 >/dev/null 2>&1; echo rc=$?",
                            computer_id=computer)
        out = res.structured["stdout"]
        assert net_raw_in(out) and "rc=0" in out, out


async def test_port_url_reaches_the_computer_it_names_not_an_address_thief(kbb):
    """A neighbour allowed to (run flags add NET_ADMIN and NET_RAW) takes over the computer's
    address and announces it by ARP; the server's port forwarder still reaches the computer."""
    genuine, thief = kbb.new_id("genuine"), kbb.new_id("thief")
    flags = ["--docker-run-flag=--cap-add=NET_ADMIN --cap-add=NET_RAW"]
    async with kbb.server(*BUSYBOX_ARGS, "--file-tools", "--job-tools", *flags) as srv:
        await serve_page(srv, genuine, "8000")
        res = await port_url(srv, genuine, 8000)
        assert httpx.get(res["url"], timeout=10).text == "<h1>served from a sandbox computer</h1>\n"
        address = address_of(f"kilntainer-{genuine}")
        genuine_mac = networks_of(f"kilntainer-{genuine}")["bridge"]["MacAddress"]
        await srv.run("mkdir -p /w && echo impostor > /w/index.html && httpd -p 8000 -h /w", computer_id=thief)
        spoof = await srv.run(
            f"ip addr add {address}/32 dev eth0 && "
            f"(arping -U -c 100000 -w 600 -I eth0 -s {address} {address} >/dev/null 2>&1 &) ; echo spoofing",
            computer_id=thief,
        )
        assert spoof.structured["stdout"].strip() == "spoofing", spoof
        thief_mac = networks_of(f"kilntainer-{thief}")["bridge"]["MacAddress"]

        def host_sees_thief() -> bool:
            # A direct request keeps the host's entry for the address in use, so the thief's
            # announcements update it.
            try:
                httpx.get(f"http://{address}:8000/", timeout=1)
            except httpx.HTTPError:
                pass
            return host_neighbours().get(address) == thief_mac.lower()

        # The host's own neighbour table now sends that address to the thief (what the attack
        # achieves; without it this test would prove nothing).
        poll(host_sees_thief, 30, 0.1)
        assert host_sees_thief(), (host_neighbours(), thief_mac, genuine_mac)
        assert "impostor" in httpx.get(f"http://{address}:8000/", timeout=5).text

        for _ in range(5):
            page = httpx.get(res["url"], timeout=10)
            assert page.text == "<h1>served from a sandbox computer</h1>\n", page.text


def host_neighbours() -> dict[str, str]:
    """The host's IPv4 neighbour table: address → hardware address of complete entries."""
    table = {}
    with open("/proc/net/arp") as arp:
        next(arp)
        for line in arp:
            fields = line.split()
            if len(fields) >= 4 and int(fields[2], 16) & 0x2:
                table[fields[0]] = fields[3].lower()
    return table


PODMAN_SOCKET = os.environ.get("KILNTAINERS_PODMAN_SOCKET", "unix:///run/podman/podman.sock")


def podman(*args: str) -> subprocess.CompletedProcess:
    """The docker CLI against Podman's Docker-compatible socket."""
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DOCKER_HOST": PODMAN_SOCKET})


def podman_network_exists(name: str) -> bool:
    # Podman's own CLI: a read through the Docker-compatible API would drop the network's
    # isolation (docs/auth.md, "Network").
    return subprocess.run(["podman", "network", "exists", name], capture_output=True, timeout=60).returncode == 0


async def test_podman_keeps_principals_apart_too(kbb, tmp_path):
    """Podman too (through its Docker-compatible API): each principal's network is created with
    `isolate`, and never read back through that API, which would turn the isolation off."""
    if not os.path.exists(PODMAN_SOCKET.removeprefix("unix://")):
        pytest.skip("no Podman socket")
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    web, peer, scanner = kbb.new_id("pweb"), kbb.new_id("ppeer"), kbb.new_id("pscan")
    alice_net, bob_net = network_of(ALICE), network_of(BOB)
    args = ["--engine", "podman", "--docker-host", PODMAN_SOCKET, "--image", "localhost/sandbox-busybox:full",
            "--shell", "/bin/sh"]
    try:
        async with kbb.http_server("--auth-tokens-file", str(tokens), *args) as srv:
            async with kbb.http_session(srv, headers=bearer(TOKENS[ALICE])) as alice, \
                    kbb.http_session(srv, headers=bearer(TOKENS[BOB])) as bob:
                await start_page(alice, web, SECRET)
                info = json.loads(podman("inspect", f"kilntainer-{web}.{tag(ALICE)}").stdout)[0]
                assert set(info["NetworkSettings"]["Networks"]) == {alice_net}
                address = next(iter(info["NetworkSettings"]["Networks"].values()))["IPAddress"]
                assert SECRET in await fetch(alice, peer, address)
                await bob.run("true", computer_id=scanner, temporary=True)
                seen = await fetch(bob, scanner, address)
                bob_info = json.loads(podman("inspect", f"kilntainer-{scanner}.{tag(BOB)}").stdout)[0]
                assert set(bob_info["NetworkSettings"]["Networks"]) == {bob_net}
                assert SECRET not in seen and "rc=0" not in seen, seen
            assert poll(lambda: not podman_network_exists(alice_net) and not podman_network_exists(bob_net), 20)
    finally:
        for name in (alice_net, bob_net):
            if podman_network_exists(name):
                subprocess.run(["podman", "network", "rm", name], capture_output=True, timeout=60)


@SHARED_NETWORKS  # the spares' network is every server's
async def test_a_warm_pool_spare_moves_to_its_owners_network(kbb, tmp_path):
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    computer = kbb.new_id("pooled")
    kbb.track(f"{computer}.{tag(ALICE)}", temporary=True)
    alice_net = network_of(ALICE)
    try:
        async with kbb.http_server("--auth-tokens-file", str(tokens), "--warm-pool", "1", *BUSYBOX_ARGS) as srv:

            def spares() -> list[str]:
                out = docker("ps", "-q", "--filter", f"label=kilntainers.instance={srv.instance_id}",
                             "--filter", "label=kilntainers.pooled=true").stdout.split()
                return [c for c in out if inspect(c)["Name"].startswith("/kilntainers-spare-")]

            assert poll(lambda: spares(), 60), "no spare was made"
            spare = spares()[0]
            # A spare waits on the internal pool network, owned by nobody.
            assert set(networks_of(spare)) == {"kilntainers-pool"}
            pool = json.loads(docker("network", "inspect", "kilntainers-pool").stdout)[0]
            assert pool["Internal"] is True and pool["Labels"]["kilntainers.network"] == "pool"
            async with kbb.http_session(srv, headers=bearer(TOKENS[ALICE])) as alice:
                await alice.run("true", computer_id=computer, temporary=True)
                container = f"kilntainer-{computer}.{tag(ALICE)}"
                # The spare itself, handed out, now only on alice's network.
                assert inspect(container)["Id"].startswith(spare)
                assert set(networks_of(container)) == {alice_net}
        assert not network_exists("kilntainers-pool")
        assert not network_exists(alice_net)
    finally:
        remove_network(alice_net)
        remove_network("kilntainers-pool")


async def test_a_computer_from_before_principals_moves_to_its_owners_network(kbb, tmp_path):
    tokens = tmp_path / "tokens"
    write_tokens(tokens, TOKENS)
    single = "single-" + "s" * 40
    legacy = kbb.new_id("legacy")
    kbb.python_style_container(legacy, "sandbox-busybox:full")
    assert set(networks_of(f"kilntainer-{legacy}")) == {"bridge"}
    default_net = network_of("default")
    try:
        async with kbb.http_server("--auth-tokens-file", str(tokens), "--auth-token", single, *BUSYBOX_ARGS) as srv:
            async with kbb.http_session(srv, headers=bearer(single)) as default:
                res = await default.run("echo still-mine", computer_id=legacy, temporary=False)
                assert res.structured["stdout"].strip() == "still-mine", res
                assert set(networks_of(f"kilntainer-{legacy}")) == {default_net}
        # Permanent: it and its network stay.
        assert network_exists(default_net)
    finally:
        docker("rm", "-f", f"kilntainer-{legacy}", check=False)
        remove_network(default_net)
