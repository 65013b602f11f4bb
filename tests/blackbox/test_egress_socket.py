"""Egress on the socket wiring (docs/egress.md, "Socket wiring"; issue 33): Podman, and gVisor
(`--runtime runsc`), where a computer has no network at all and a relay inside it carries its
loopback connections to the proxy's Unix socket on a volume of its principal's. The core case
on each, on a fake internet made on the same engine (testkit/fake_internet.py): the allowed
host reached through the proxy port and by a raw `nc` that ignores proxy settings; another host
refused with the reason line; its name NXDOMAIN; its address unreachable; the computer without
any interface but loopback; the policy found again after a restart of the computer; nothing left
on the engine after the server ends. On Podman also with the exec helper off, and crash GC of a
killed server's proxy and volume; under gVisor also ask-to-allow through the relay, and the startup
refusal of a runtime Docker does not have."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import anyio
import pytest

from egress_net import ALLOW_REFUSAL, RAW, SHARED_NETWORKS, VIA_PROXY, proxy_args
from harness import BIN, BUSYBOX_ARGS
from test_egress_ask import Person
from testkit.fake_internet import fake_internet_on

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent, SHARED_NETWORKS]

PODMAN_SOCKET = os.environ.get("KILNTAINERS_PODMAN_SOCKET", "unix:///run/podman/podman.sock")
PODMAN_IMAGE = "localhost/sandbox-busybox:full"
PODMAN_ENV = {**os.environ, "DOCKER_HOST": PODMAN_SOCKET}


def engine(env: dict | None, *args: str) -> subprocess.CompletedProcess:
    """The `docker` CLI against the engine under test (Podman through its compatible API)."""
    return subprocess.run(["docker", *args], capture_output=True, text=True, env=env, timeout=60)


def leftovers(env: dict | None) -> set[str]:
    """The egress proxies and volumes on the engine."""
    proxies = engine(env, "ps", "-a", "--filter", "label=kilntainers.egress-proxy", "--format", "{{.Names}}")
    volumes = engine(env, "volume", "ls", "--filter", "label=kilntainers.egress-proxy", "--format", "{{.Name}}")
    return set(proxies.stdout.split()) | set(volumes.stdout.split())


async def core_case(kbb, net, env, server_args, check_restart: bool) -> None:
    before = leftovers(env)
    args = [*server_args, "--lifecycle-tools", "--egress", "allowlist", "--egress-allow", "allowed.test",
            *proxy_args(net)]
    permanent = kbb.new_id("sock")
    try:
        await core_steps(kbb, net, env, args, permanent if check_restart else None)
    finally:
        # The harness removes what a test left on the Docker engine; this is the computer the
        # case makes permanent, on whichever engine, should the case stop half-way.
        left = engine(env, "ps", "-aq", "--filter", f"label=kilntainers.computer-id={permanent}").stdout.split()
        if left:
            engine(env, "rm", "-f", *left)
    # The computers went (the temporary one with the server), and the proxy and its volume with
    # the last of them.
    assert leftovers(env) <= before


async def core_steps(kbb, net, env, args: list[str], permanent: str | None) -> None:
    async with kbb.server(*args) as srv:
        res = await srv.run(RAW.format(host="allowed.test", target="allowed.test"))
        assert "hello-from-allowed.test" in res.structured["stdout"], res
        assert "[kilntainers:" not in res.structured["stderr"], res
        cid = res.structured["computer_id"]
        at = {"computer_id": cid}
        if permanent:
            # A permanent computer: Podman removes an auto-removed (temporary) one it restarts.
            cid = permanent
            at = {"computer_id": cid, "temporary": False}
        res = await srv.run(VIA_PROXY.format(host="allowed.test"), **at)
        assert "hello-from-allowed.test" in res.structured["stdout"], res
        res = await srv.run("wget -q -O - http://allowed.test/", **at)
        assert "hello-from-allowed.test" in res.structured["stdout"], res

        res = await srv.run(VIA_PROXY.format(host="other.test"), **at)
        assert "hello-from" not in res.structured["stdout"], res
        assert res.structured["stderr"].endswith(
            f"[kilntainers: network access to other.test:80 was blocked: {ALLOW_REFUSAL}]\n"
        ), res
        res = await srv.run(RAW.format(host="other.test", target="allowed.test"), **at)
        assert "hello-from" not in res.structured["stdout"], res
        assert "network access to other.test:80 was blocked" in res.structured["stderr"], res
        res = await srv.call({"command": "nslookup other.test", **at})
        assert "NXDOMAIN" in res.structured["stdout"] + res.structured["stderr"], res
        res = await srv.call({"command": RAW.format(host="other.test", target=net["hosts"]["other.test"]), **at})
        assert "hello-from" not in res.structured["stdout"], res
        # No interface but loopback: nothing to route around the relay with.
        res = await srv.run("cat /proc/net/dev", **at)
        interfaces = {line.split(":")[0].strip() for line in res.structured["stdout"].splitlines() if ":" in line}
        assert interfaces == {"lo"}, res

        info = json.loads(engine(env, "inspect", f"kilntainer-{cid}").stdout)[0]
        assert info["HostConfig"]["NetworkMode"] == "none"
        (mount,) = [m for m in info["Mounts"] if m.get("Name", "").startswith("kilntainers-egress-")]
        assert mount["Destination"] == "/run/kilntainers-egress" and mount["RW"] is False, mount
        assert len(info["Config"]["Labels"]["kilntainers.egress-token"]) == 32
        # The token is on the container, not in the computer's environment.
        res = await srv.run("env", **at)
        assert info["Config"]["Labels"]["kilntainers.egress-token"] not in res.structured["stdout"]

        shown = (await srv.call({"computer_id": cid}, name="computer_network")).structured
        (other,) = [d for d in shown["denied"] if d["host"] == "other.test" and d["reason"] == ALLOW_REFUSAL]
        assert other["count"] == 2, shown

        if permanent:
            # A restart rewrites the resolver and ends the relay; the server starts it again.
            (await srv.call({"computer_id": cid}, name="computer_restart")).ok()
            res = await srv.run(RAW.format(host="allowed.test", target="allowed.test"), **at)
            assert "hello-from-allowed.test" in res.structured["stdout"], res
            res = await srv.run(VIA_PROXY.format(host="other.test"), **at)
            assert "was blocked" in res.structured["stderr"], res
            (await srv.call({"computer_id": cid}, name="computer_delete")).ok()


@pytest.mark.parametrize("helper", ["on", "off"])
async def test_issue_33_podman_allowlist_core_case(kbb, helper):
    # See: issue 33
    if not os.path.exists(PODMAN_SOCKET.removeprefix("unix://")):
        pytest.skip("no Podman socket")
    with fake_internet_on(PODMAN_ENV, PODMAN_IMAGE) as net:
        server_args = ["--engine", "podman", "--docker-host", PODMAN_SOCKET, "--image", PODMAN_IMAGE,
                       "--shell", "/bin/sh", "--exec-helper", helper]
        await core_case(kbb, net, PODMAN_ENV, server_args, check_restart=helper == "on")


async def test_issue_33_gvisor_allowlist_core_case(kbb, fake_internet):
    # See: issue 33
    if os.environ.get("KILNTAINERS_IT_RUNSC") != "1":
        pytest.skip("runsc is not registered with this Docker (scripts/ensure-dockerd.sh)")
    await core_case(kbb, fake_internet, None, [*BUSYBOX_ARGS, "--runtime", "runsc"], check_restart=True)


async def test_issue_33_podman_a_killed_server_leaves_no_proxy_or_volume_after_the_next_start(kbb):
    # See: issue 33
    if not os.path.exists(PODMAN_SOCKET.removeprefix("unix://")):
        pytest.skip("no Podman socket")
    with fake_internet_on(PODMAN_ENV, PODMAN_IMAGE) as net:
        args = ["--engine", "podman", "--docker-host", PODMAN_SOCKET, "--image", PODMAN_IMAGE, "--shell", "/bin/sh",
                "--egress", "allowlist", "--egress-allow", "allowed.test", *proxy_args(net)]
        before = leftovers(PODMAN_ENV)
        home = kbb.home()
        async with kbb.server(*args, home=home) as a:
            await a.run("true")
            made = leftovers(PODMAN_ENV) - before
            assert len(made) == 2, made  # the proxy and its volume
            os.kill(a.pid, signal.SIGKILL)
            with anyio.fail_after(10):
                while a.returncode() is None:
                    await anyio.sleep(0.05)
        assert leftovers(PODMAN_ENV) - before == made, "the killed server could not clean up"
        async with kbb.server(*args, home=home) as b:
            with anyio.fail_after(30):
                while leftovers(PODMAN_ENV) & made:
                    await anyio.sleep(0.2)
            res = await b.run(RAW.format(host="allowed.test", target="allowed.test"))
            assert "hello-from-allowed.test" in res.structured["stdout"], res
        assert leftovers(PODMAN_ENV) <= before


def test_issue_33_gvisor_without_a_usable_runtime_is_refused_at_startup(kbb):
    # See: issue 33. The server reads the runtime's arguments from the engine before serving;
    # a runtime Docker does not have is named (the runsc registered here has --host-uds=open).
    home = kbb.home()
    proc = subprocess.run(
        [BIN, *BUSYBOX_ARGS, "--runtime", "runsc-not-registered", "--egress", "allowlist", "--egress-allow", "a.test"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, env=kbb.env(home, None),
    )
    assert proc.returncode == 1, proc
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kilntainers: error: ")]
    assert errors == [
        "kilntainers: error: --runtime runsc-not-registered: Docker has no runtime of that name; register it in "
        "/etc/docker/daemon.json (\"runtimes\") with \"--host-uds=open\" among its \"runtimeArgs\" "
        "(docs/egress.md, \"Socket wiring\")."
    ], proc.stderr


async def test_issue_33_gvisor_ask_to_allow_through_the_relay(kbb, fake_internet):
    # See: issue 33. Questions come from the socket-wired proxy as from the bridged one, and the
    # person's "allow for this computer" holds for the next connection, made past proxy settings.
    if os.environ.get("KILNTAINERS_IT_RUNSC") != "1":
        pytest.skip("runsc is not registered with this Docker (scripts/ensure-dockerd.sh)")
    person = Person(("accept", "allow for this computer"))
    args = [*BUSYBOX_ARGS, "--runtime", "runsc", "--egress", "allowlist", "--egress-allow", "allowed.test",
            "--egress-ask", *proxy_args(fake_internet)]
    async with kbb.server(*args, elicitation=person) as srv:
        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert "hello-from-other.test" in res.structured["stdout"], res
        cid = res.structured["computer_id"]
        (asked,) = person.asked
        assert asked["message"] == f"The computer `{cid}` wants to reach `other.test:80`.", asked
        res = await srv.run(RAW.format(host="other.test", target="other.test"), computer_id=cid)
        assert "hello-from-other.test" in res.structured["stdout"], res
        assert len(person.asked) == 1
