"""Egress policy (docs/egress.md; issue 33): the options and their startup checks, each naming
the flag and the value before any computer is touched; `--egress none` as `--no-network`; the
default (`open`, no rule) leaving the container exactly as before (no egress label, the
engine's network); Fly's refusal word for word; WASM accepting every mode (it behaves as
`none`). The proxy's own behaviour is unit-tested in helper/src/egress/."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import anyio
import pytest

from egress_net import ALLOW_REFUSAL, RAW, SHARED_NETWORKS, VIA_PROXY, egress_networks, egress_proxies, proxy_args
from harness import BIN, BUSYBOX_ARGS, container_for, inspect

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent, SHARED_NETWORKS]

FLY_REFUSAL = "Fly Machines have no outbound filtering; use --egress open or another backend"


def run_cli(kbb, *args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    home = kbb.home()
    return subprocess.run(
        [BIN, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        env=kbb.env(home, extra_env),
    )


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("kilntainers: error: ")]


STARTUP_ERRORS = [
    (["--egress", "wide"], "--egress must be 'open', 'allowlist' or 'none'; got 'wide'."),
    (
        ["--egress", "allowlist", "--egress-allow", "bad..example"],
        "--egress-allow: invalid pattern 'bad..example': it is not a valid host name (IDNA conversion failed).",
    ),
    (
        ["--egress", "allowlist", "--egress-allow", "*example.com"],
        "--egress-allow: invalid pattern '*example.com': '*' is allowed only as the whole first label, as in *.example.com.",
    ),
    (
        ["--egress-deny", "203.0.113.0/40"],
        "--egress-deny: invalid pattern '203.0.113.0/40': the prefix length must be a number from 0 to 32.",
    ),
    (
        ["--egress", "allowlist", "--egress-allow", "example.com:http"],
        "--egress-allow: invalid pattern 'example.com:http': the port must be a number from 1 to 65535.",
    ),
    (["--egress-ask"], "--egress-ask needs --egress allowlist; got --egress open."),
    (["--egress", "none", "--egress-ask"], "--egress-ask needs --egress allowlist; got --egress none."),
    (
        ["--egress-allow", "example.com"],
        "--egress-allow needs --egress allowlist; got --egress open. In open mode every host is allowed "
        "(--egress-deny makes a deny-list).",
    ),
    (["--egress", "allowlist", "--no-network"], "--egress allowlist conflicts with --no-network; use one of them."),
    (["--egress", "none", "--egress-deny", "a.test"], "--egress-deny has no effect with --egress none: computers have no network."),
    (
        ["--egress-dns", "8.8.8.8"],
        "--egress-dns configures the egress proxy, which runs only with --egress allowlist or --egress-deny "
        "rules; got --egress open without rules.",
    ),
    (
        ["--backend", "go_busybox", "--egress-deny", "a.test", "--egress-dns", "resolver.test"],
        "--egress-dns must be an IP address with an optional port, such as 192.0.2.53 or [2001:db8::53]:53; "
        "got 'resolver.test'.",
    ),
    (
        ["--backend", "go_busybox", "--egress-deny", "a.test", "--egress-resolve", "a.test"],
        "--egress-resolve must be HOST=IP, such as api.example.com=203.0.113.7; got 'a.test' (no '=').",
    ),
    (
        ["--backend", "go_busybox", "--egress-deny", "a.test", "--egress-upstream-ca", "/nonexistent/ca.pem"],
        "--egress-upstream-ca '/nonexistent/ca.pem': cannot read it: No such file or directory (os error 2).",
    ),
    (["--backend", "fly", "--egress", "allowlist", "--egress-allow", "a.test"], FLY_REFUSAL),
    (["--backend", "fly", "--egress-deny", "a.test"], FLY_REFUSAL),
    (["--backend", "fly", "--egress", "none"], FLY_REFUSAL),
    (
        ["--backend", "e2b", "--egress-deny", "a.test"],
        "--egress open: deny rule 'a.test' names a host, and E2B's denyOut takes only IP addresses and CIDR "
        "blocks; change that rule, or use the docker backend.",
    ),
    (
        ["--backend", "modal", "--egress", "allowlist", "--egress-allow", "a.test"],
        "--egress allowlist: 'a.test' names a host, and Modal's network allow-list takes only CIDR blocks; "
        "change that rule, or use the docker backend.",
    ),
]


@pytest.mark.parametrize("args,message", STARTUP_ERRORS, ids=[" ".join(a) for a, _ in STARTUP_ERRORS])
def test_issue_33_bad_egress_values_are_named_at_startup(kbb, args, message):
    # See: issue 33
    proc = run_cli(kbb, *args)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert error_lines(proc) == [f"kilntainers: error: {message}"], proc.stderr
    assert proc.stdout == ""


def test_issue_33_environment_variables_are_read(kbb):
    # See: issue 33
    proc = run_cli(kbb, extra_env={"KILNTAINERS_EGRESS": "sideways"})
    assert error_lines(proc) == ["kilntainers: error: --egress must be 'open', 'allowlist' or 'none'; got 'sideways'."]
    proc = run_cli(kbb, extra_env={"KILNTAINERS_EGRESS_ASK": "true"})
    assert error_lines(proc) == ["kilntainers: error: --egress-ask needs --egress allowlist; got --egress open."]
    proc = run_cli(
        kbb, "--egress", "allowlist", extra_env={"KILNTAINERS_EGRESS_ALLOW": "a.test,b..test"}
    )
    assert error_lines(proc) == [
        "kilntainers: error: --egress-allow: invalid pattern 'b..test': it is not a valid host name (IDNA conversion failed)."
    ]


def test_issue_33_help_lists_the_egress_options(kbb):
    # See: issue 33
    text = run_cli(kbb, "--help").stdout
    group = text.lower().index("egress options")
    for flag in ("--egress <MODE>", "--egress-allow", "--egress-deny", "--egress-ask", "--egress-allow-private",
                 "--egress-dns", "--egress-resolve", "--egress-upstream-ca", "--egress-upstream-network"):
        assert text.index(flag) > group, flag


async def test_issue_33_egress_none_is_no_network(kbb):
    # See: issue 33
    async with kbb.server(*BUSYBOX_ARGS, "--egress", "none") as srv:
        cid = (await srv.run("true")).structured["computer_id"]
        info = inspect(container_for(cid))
        assert info["HostConfig"]["NetworkMode"] == "none"
        assert "kilntainers.egress" not in info["Config"]["Labels"]
        res = await srv.run("cat /proc/net/dev | grep -c ':' ")
        assert res.structured["stdout"].strip() == "1", "only the loopback interface should exist"


async def test_issue_33_default_open_leaves_the_computer_as_before(kbb):
    # See: issue 33
    async with kbb.server(*BUSYBOX_ARGS) as srv:
        cid = (await srv.run("true")).structured["computer_id"]
        info = inspect(container_for(cid))
        assert not any(key.startswith("kilntainers.egress") for key in info["Config"]["Labels"])
        assert info["HostConfig"]["NetworkMode"] in ("default", "bridge"), info["HostConfig"]["NetworkMode"]
        assert not any("PROXY" in var.upper() for var in info["Config"]["Env"] or [])
        assert not info["HostConfig"].get("Dns")
    async with kbb.server(*BUSYBOX_ARGS, "--egress", "open") as srv:
        tools = await srv.list_tools()
        assert [t["name"] for t in tools] == ["terminal_execute"]


# -- Enforcement on Docker (the egress proxy beside the computers) ------------------------------

@pytest.mark.parametrize("helper", ["on", "off"])
async def test_issue_33_allowlist_reaches_only_allowed_hosts_and_says_why(kbb, fake_internet, helper):
    # See: issue 33
    net = fake_internet
    networks_before, proxies_before = egress_networks(), egress_proxies()
    async with kbb.server(
        *BUSYBOX_ARGS, "--exec-helper", helper, "--egress", "allowlist", "--egress-allow", "allowed.test",
        *proxy_args(net),
    ) as srv:
        res = await srv.run(RAW.format(host="allowed.test", target="allowed.test"))
        assert "hello-from-allowed.test" in res.structured["stdout"], res
        assert "[kilntainers:" not in res.structured["stderr"]
        res = await srv.run(VIA_PROXY.format(host="allowed.test"))
        assert "hello-from-allowed.test" in res.structured["stdout"], res

        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert "hello-from" not in res.structured["stdout"]
        assert res.structured["stderr"].endswith(
            f"[kilntainers: network access to other.test:80 was blocked: {ALLOW_REFUSAL}]\n"
        ), res
        # Host must name the host the connection was routed by.
        res = await srv.run(RAW.format(host="other.test", target="allowed.test"))
        assert "hello-from" not in res.structured["stdout"], res
        assert "network access to other.test:80 was blocked" in res.structured["stderr"], res
        # Other names do not resolve; addresses have no route.
        res = await srv.call({"command": "nslookup other.test"})
        assert "NXDOMAIN" in res.structured["stdout"] + res.structured["stderr"], res
        res = await srv.call({"command": RAW.format(host="other.test", target=net["hosts"]["other.test"])})
        assert "hello-from" not in res.structured["stdout"], res

        cid = res.structured["computer_id"]
        info = inspect(container_for(cid))
        assert json.loads(info["Config"]["Labels"]["kilntainers.egress"]) == {
            "mode": "allowlist", "allow": ["allowed.test"], "deny": [], "ask": False, "allow_private": False,
        }
        (network,) = info["NetworkSettings"]["Networks"]
        assert network.startswith("kilntainers-egress-")
        assert info["HostConfig"]["Dns"], info["HostConfig"]
        net_info = json.loads(subprocess.run(["docker", "network", "inspect", network], capture_output=True,
                                             text=True, check=True).stdout)[0]
        assert net_info["Internal"] is True
        assert net_info["Options"].get("com.docker.network.bridge.inhibit_ipv4") == "true"
        # The engine host has no address on the computer's network: a listener on every host
        # address is out of reach at the network's gateway address.
        gateway = net_info["IPAM"]["Config"][0]["Gateway"]
        with socket.create_server(("0.0.0.0", 0)) as listener:
            port = listener.getsockname()[1]
            res = await srv.call({"command": f"echo x | nc -w 2 {gateway} {port}; echo rc=$?"})
            listener.settimeout(0.5)
            with pytest.raises(TimeoutError):
                listener.accept()
        assert "rc=0" not in res.structured["stdout"], res
        # computer_network: the policy and the refusals, each host once with its count.
        tools = [t["name"] for t in await srv.list_tools()]
        assert tools == ["terminal_execute", "computer_network"], tools
        shown = (await srv.call({"computer_id": cid}, name="computer_network")).structured
        assert (shown["computer_id"], shown["mode"], shown["allow"], shown["deny"], shown["secrets"]) == (
            cid, "allowlist", ["allowed.test"], [], []
        )
        (other,) = [d for d in shown["denied"] if d["host"] == "other.test" and d["reason"] == ALLOW_REFUSAL]
        assert other["port"] == 80 and other["count"] == 2, shown
        assert other["first_at"] <= other["last_at"]
        implicit = (await srv.call({}, name="computer_network")).structured
        assert implicit["computer_id"] == cid
    # The temporary computer went with the server, and its network and proxy with it.
    assert egress_networks() <= networks_before
    assert egress_proxies() <= proxies_before


async def test_issue_33_deny_rules_in_open_mode(kbb, fake_internet):
    # See: issue 33
    async with kbb.server(*BUSYBOX_ARGS, "--egress-deny", "other.test", *proxy_args(fake_internet)) as srv:
        res = await srv.run(RAW.format(host="allowed.test", target="allowed.test"))
        assert "hello-from-allowed.test" in res.structured["stdout"], res
        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert "hello-from" not in res.structured["stdout"]
        assert res.structured["stderr"].endswith(
            "[kilntainers: network access to other.test:80 was blocked: denied by rule other.test]\n"
        ), res


async def test_issue_33_the_policy_survives_a_server_restart(kbb, fake_internet):
    # See: issue 33
    cid = kbb.new_id("egress")
    args = [*BUSYBOX_ARGS, "--lifecycle-tools", "--egress", "allowlist", "--egress-allow", "allowed.test", *proxy_args(fake_internet)]
    home = kbb.home()
    async with kbb.server(*args, home=home) as srv:
        await srv.run("true", computer_id=cid, temporary=False)
    async with kbb.server(*args, home=home) as srv:
        res = await srv.run(RAW.format(host="allowed.test", target="allowed.test"), computer_id=cid, temporary=False)
        assert "hello-from-allowed.test" in res.structured["stdout"], res
        res = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=cid, temporary=False)
        assert res.structured["stderr"].endswith(
            f"[kilntainers: network access to other.test:80 was blocked: {ALLOW_REFUSAL}]\n"
        ), res
        (network,) = inspect(container_for(cid))["NetworkSettings"]["Networks"]
        # A restart may give the computer another address; the proxy is told the new one.
        (await srv.call({"computer_id": cid}, name="computer_restart")).ok()
        res = await srv.run(RAW.format(host="allowed.test", target="allowed.test"), computer_id=cid, temporary=False)
        assert "hello-from-allowed.test" in res.structured["stdout"], res
        res = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=cid, temporary=False)
        assert "was blocked" in res.structured["stderr"], res
        await srv.call({"computer_id": cid}, name="computer_delete")
    assert network not in egress_networks()
    assert f"{network}-proxy" not in egress_proxies()


async def test_issue_33_a_killed_server_leaves_no_proxy_or_network_after_the_next_start(kbb, fake_internet):
    # See: issue 33
    args = [*BUSYBOX_ARGS, "--egress", "allowlist", "--egress-allow", "allowed.test", *proxy_args(fake_internet)]
    home = kbb.home()
    async with kbb.server(*args, home=home) as a:
        cid = (await a.run("true")).structured["computer_id"]
        (network,) = inspect(container_for(cid))["NetworkSettings"]["Networks"]
        assert f"{network}-proxy" in egress_proxies()
        os.kill(a.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while a.returncode() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.returncode() == -signal.SIGKILL
    assert network in egress_networks(), "the killed server could not clean up"
    async with kbb.server(*args, home=home) as b:
        deadline = time.monotonic() + 15
        while (network in egress_networks() or f"{network}-proxy" in egress_proxies()) and time.monotonic() < deadline:
            await anyio.sleep(0.2)
        assert network not in egress_networks()
        assert f"{network}-proxy" not in egress_proxies()
        res = await b.run(RAW.format(host="allowed.test", target="allowed.test"))
        assert "hello-from-allowed.test" in res.structured["stdout"], res


async def test_issue_33_two_servers_on_one_engine_take_turns_with_the_proxy(kbb, fake_internet):
    # See: issue 33. Two server processes for one principal share the principal's egress
    # network; each replaces the proxy when it finds the other's, and the one whose proxy was
    # replaced starts its own again on its next command: every command keeps its policy and
    # gets its refusal lines.
    args = [*BUSYBOX_ARGS, "--egress", "allowlist", "--egress-allow", "allowed.test", *proxy_args(fake_internet)]
    refusal = f"[kilntainers: network access to other.test:80 was blocked: {ALLOW_REFUSAL}]\n"
    async with kbb.server(*args) as a, kbb.server(*args) as b:
        networks = set()
        for srv in (a, b, a, b):
            res = await srv.run(VIA_PROXY.format(host="other.test"))
            assert "hello-from" not in res.structured["stdout"], res
            assert res.structured["stderr"].endswith(refusal), res
            res = await srv.run(RAW.format(host="allowed.test", target="allowed.test"))
            assert "hello-from-allowed.test" in res.structured["stdout"], res
            (network,) = inspect(container_for(res.structured["computer_id"]))["NetworkSettings"]["Networks"]
            networks.add(network)
        assert len(networks) == 1, networks


async def test_issue_33_computer_create_narrows_the_servers_policy(kbb, fake_internet):
    # See: issue 33
    args = [*BUSYBOX_ARGS, "--lifecycle-tools", "--egress", "allowlist", "--egress-allow", "allowed.test",
            "--egress-allow", "other.test", *proxy_args(fake_internet)]
    async with kbb.server(*args) as srv:
        create = next(t for t in await srv.list_tools() if t["name"] == "computer_create")
        assert "egress" in create["inputSchema"]["properties"]
        wide = await srv.call({"egress": {"allow": ["*.test"]}}, name="computer_create")
        assert wide.is_error
        assert "'*.test' is wider than this server allows" in wide.text, wide
        bad = await srv.call({"egress": {"allow": ["a..test"]}}, name="computer_create")
        assert bad.is_error and "egress.allow: invalid pattern 'a..test'" in bad.text, bad

        made = await srv.call({"egress": {"allow": ["allowed.test"]}}, name="computer_create")
        narrow = made.ok().structured["computer_id"]
        res = await srv.run(RAW.format(host="allowed.test", target="allowed.test"), computer_id=narrow)
        assert "hello-from-allowed.test" in res.structured["stdout"], res
        res = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=narrow)
        assert res.structured["stderr"].endswith(
            f"[kilntainers: network access to other.test:80 was blocked: {ALLOW_REFUSAL}]\n"
        ), res
        shown = (await srv.call({"computer_id": narrow}, name="computer_network")).structured
        assert (shown["mode"], shown["allow"]) == ("allowlist", ["allowed.test"]), shown
        # A computer without egress gets the server's policy.
        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert "hello-from-other.test" in res.structured["stdout"], res
        again = await srv.call({"computer_id": narrow, "egress": {"allow": ["allowed.test"]}}, name="computer_create")
        assert again.is_error and "already exists" in again.text, again
        # A factory reset keeps the narrowed policy: the model cannot widen it that way.
        (await srv.call({"computer_id": narrow}, name="computer_factory_reset")).ok()
        res = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=narrow)
        assert "hello-from" not in res.structured["stdout"], res
        assert f"other.test:80 was blocked: {ALLOW_REFUSAL}" in res.structured["stderr"], res
        shown = (await srv.call({"computer_id": narrow}, name="computer_network")).structured
        assert (shown["mode"], shown["allow"]) == ("allowlist", ["allowed.test"]), shown


async def test_issue_33_ip_literals_mismatched_tunnels_and_private_answers_are_refused(kbb, fake_internet):
    # See: issue 33
    net = fake_internet
    # `private.test` is allowed by name but resolves to loopback: refused after resolution, so
    # nothing is sent anywhere.
    async with kbb.server(
        *BUSYBOX_ARGS, "--egress", "allowlist", "--egress-allow", "allowed.test", "--egress-allow", "private.test",
        *proxy_args(net), "--egress-resolve", "private.test=127.0.0.1",
    ) as srv:
        other_ip = net["hosts"]["other.test"]
        res = await srv.run(VIA_PROXY.format(host=other_ip))
        assert "hello-from" not in res.structured["stdout"], res
        assert f"[kilntainers: network access to {other_ip}:80 was blocked: {ALLOW_REFUSAL}]" in res.structured["stderr"]
        # CONNECT to the allowed host, then a request for another one inside the tunnel.
        tunnel = (
            "p=${http_proxy#http://}; printf 'CONNECT allowed.test:80 HTTP/1.1\\r\\nHost: allowed.test:80\\r\\n\\r\\n"
            "GET / HTTP/1.0\\r\\nHost: other.test\\r\\n\\r\\n' | nc -w 5 ${p%:*} ${p##*:}"
        )
        res = await srv.run(tunnel)
        assert "hello-from" not in res.structured["stdout"], res
        assert "network access to allowed.test:80 was blocked" in res.structured["stderr"], res
        res = await srv.run(VIA_PROXY.format(host="private.test"))
        assert "hello-from" not in res.structured["stdout"], res
        assert "[kilntainers: network access to private.test:80 was blocked: private address]" in res.structured[
            "stderr"
        ], res


async def test_issue_33_a_finished_job_ends_with_the_refusals_of_its_lifetime(kbb, fake_internet):
    # See: issue 33. A job runs past the exec that appends a command's refusal lines; its
    # result gets those recorded for its computer while it ran, once it has ended.
    line = f"[kilntainers: network access to other.test:80 was blocked: {ALLOW_REFUSAL}]\n"
    args = [*BUSYBOX_ARGS, "--job-tools", "--egress", "allowlist", "--egress-allow", "allowed.test",
            *proxy_args(fake_internet)]
    async with kbb.server(*args) as srv:
        # A command that became a job and ended within yield_after: the report at its end.
        done = (await srv.call({"command": VIA_PROXY.format(host="other.test"), "yield_after": 30})).ok().structured
        assert done.get("running") is None and done["job_id"], done
        assert done["stderr"].endswith(line), done

        # A job still running when the call returns: the lines come with the read that shows
        # its end, not before.
        started = (await srv.call({
            "command": f"read go; {VIA_PROXY.format(host='other.test')}; echo finished",
            "yield_after": 0, "keep_stdin_open": True,
        })).ok().structured
        assert started["running"] is True and "[kilntainers:" not in started["stderr"], started
        job = started["job_id"]
        (await srv.call({"job_id": job, "stdin": "\n", "close_stdin": True, "wait": 0}, name="job_write")).ok()
        stderr, deadline = "", time.monotonic() + 60
        while time.monotonic() < deadline:
            read = (await srv.call({"job_id": job, "wait": 10}, name="job_output")).ok().structured
            stderr += read["stderr"]
            if not read["running"]:
                break
        assert read["running"] is False, read
        assert stderr.endswith(line), stderr
        assert stderr.count("[kilntainers: network access") == 1, stderr

        # A later job that reached only the allowed host shows none of the earlier refusals.
        clean = (await srv.call({
            "command": RAW.format(host="allowed.test", target="allowed.test"), "yield_after": 30,
        })).ok().structured
        assert "hello-from-allowed.test" in clean["stdout"], clean
        assert "[kilntainers:" not in clean["stderr"], clean


async def test_issue_33_a_warm_pool_spare_is_handed_out_behind_its_owners_proxy(kbb, fake_internet):
    # See: issue 33. Spares wait behind no proxy with the server's policy label; handed out,
    # one joins its owner's egress network, its proxy gets its policy, and names resolve
    # through that proxy (docs/warm-pool.md, "Egress").
    from test_warm_pool import full_pool

    args = [*BUSYBOX_ARGS, "--lifecycle-tools", "--warm-pool", "1", "--egress", "allowlist",
            "--egress-allow", "allowed.test", "--egress-allow", "other.test", *proxy_args(fake_internet)]
    async with kbb.server(*args) as srv:
        (spare,) = await full_pool(srv, srv.instance_id, size=1)
        waiting = inspect(spare)
        assert list(waiting["NetworkSettings"]["Networks"]) == ["kilntainers-pool"], waiting["NetworkSettings"]
        assert json.loads(waiting["Config"]["Labels"]["kilntainers.egress"])["allow"] == ["allowed.test", "other.test"]

        res = await srv.run(RAW.format(host="allowed.test", target="allowed.test"))
        cid = res.structured["computer_id"]
        assert container_for(cid) == spare, "the first call did not get the spare"
        assert "hello-from-allowed.test" in res.structured["stdout"], res
        res = await srv.run(VIA_PROXY.format(host="allowed.test"))
        assert "hello-from-allowed.test" in res.structured["stdout"], res
        (network,) = inspect(spare)["NetworkSettings"]["Networks"]
        assert network.startswith("kilntainers-egress-"), network

        # A narrowed computer is never a spare: it is made with its own label.
        await full_pool(srv, srv.instance_id, size=1)
        made = (await srv.call({"egress": {"allow": ["allowed.test"]}}, name="computer_create")).ok().structured
        narrow = made["computer_id"]
        assert "kilntainers.pooled" not in inspect(container_for(narrow))["Config"]["Labels"]
        res = await srv.run(VIA_PROXY.format(host="other.test"), computer_id=narrow)
        assert "hello-from" not in res.structured["stdout"], res
        assert res.structured["stderr"].endswith(
            f"[kilntainers: network access to other.test:80 was blocked: {ALLOW_REFUSAL}]\n"
        ), res
        # The spare-born computer keeps the server's policy: other.test is allowed there.
        res = await srv.run(VIA_PROXY.format(host="other.test"))
        assert "hello-from-other.test" in res.structured["stdout"], res
        res = await srv.run(VIA_PROXY.format(host="third.test"))
        assert res.structured["stderr"].endswith(
            f"[kilntainers: network access to third.test:80 was blocked: {ALLOW_REFUSAL}]\n"
        ), res
