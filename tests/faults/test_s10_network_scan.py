"""Scenario 10: one principal scans another's network.  Two principals from a tokens file over
HTTP; alice runs three computers, each serving a page on port 8000 and a second listener on
port 22; bob's computer scans the whole /24 of alice's addresses on both ports, and tries the
addresses of alice's computers directly.  Alice's own fourth computer runs the same scan as the
control.  Recorded: what each reached (bob: 0), the raw-socket capability of the computers, and
the networks each principal's computers sit on."""

from __future__ import annotations

import hashlib

import pytest

from faultkit import bb

pytestmark = [pytest.mark.anyio, pytest.mark.scenario("10")]

TOKENS = {"alice": "alice-" + "a" * 40, "bob": "bob-" + "b" * 40}
PORTS = (8000, 22)
CAP_NET_RAW = 13


def tag(principal: str) -> str:
    return hashlib.sha256(principal.encode()).hexdigest()[:16]


def network_of(principal: str) -> str:
    return "kilntainers-net-" + tag(principal)


def address_of(container: str) -> str:
    networks = bb.inspect(container)["NetworkSettings"]["Networks"]
    return next(n["IPAddress"] for n in networks.values() if n.get("IPAddress"))


def scan(prefix: str) -> str:
    probes = " ".join(str(p) for p in PORTS)
    return (
        f"for i in $(seq 1 254); do for p in {probes}; do "
        f"(nc -w 1 {prefix}.$i $p </dev/null >/dev/null 2>&1 && echo open {prefix}.$i:$p) & done; "
        f"if [ $((i % 32)) = 0 ]; then wait; fi; done; wait; echo scanned"
    )


def opened(stdout: str) -> list[str]:
    return sorted(line.split()[1] for line in stdout.splitlines() if line.startswith("open "))


async def test_a_principal_scans_anothers_network(kbb, figures, tmp_path):
    """bob's computer reaches none of alice's listeners, by scan or by address; alice's own
    computer reaches all of them."""
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{p} {t}\n" for p, t in TOKENS.items()))
    tokens.chmod(0o600)
    alice_ids = [kbb.new_id(f"victim{i}") for i in range(3)]
    control, attacker = kbb.new_id("control"), kbb.new_id("attacker")
    for cid in (*alice_ids, control):
        kbb.track(f"{cid}.{tag('alice')}", temporary=True)
    kbb.track(f"{attacker}.{tag('bob')}", temporary=True)
    try:
        async with kbb.http_server("--auth-tokens-file", str(tokens), *bb.BUSYBOX_ARGS) as srv:
            async with kbb.http_session(srv, headers={"Authorization": f"Bearer {TOKENS['alice']}"}) as alice, \
                    kbb.http_session(srv, headers={"Authorization": f"Bearer {TOKENS['bob']}"}) as bob:
                listen = "; ".join(f"httpd -p {p} -h /w" for p in PORTS)
                targets = []
                for cid in alice_ids:
                    res = await alice.run(f"mkdir -p /w && echo private > /w/index.html && {listen} && echo up",
                                          computer_id=cid, temporary=True)
                    assert res.structured["stdout"].strip() == "up", res
                    targets.append(address_of(f"kilntainer-{cid}.{tag('alice')}"))
                prefix = targets[0].rsplit(".", 1)[0]
                expected = sorted(f"{a}:{p}" for a in targets for p in PORTS)

                own = await alice.run(scan(prefix), computer_id=control, temporary=True, timeout=180)
                assert own.structured["stdout"].strip().endswith("scanned"), own
                figures["alice_listeners"] = len(expected)
                figures["reached_by_alice_own_computer"] = len(opened(own.structured["stdout"]))
                assert opened(own.structured["stdout"]) == expected, own.structured["stdout"]

                theirs = await bob.run(scan(prefix), computer_id=attacker, temporary=True, timeout=180)
                assert theirs.structured["stdout"].strip().endswith("scanned"), theirs
                direct = await bob.run(
                    " ; ".join(f"timeout 2 wget -q -O - http://{a}:8000/ && echo reached {a}" for a in targets) + "; true",
                    computer_id=attacker, temporary=True, timeout=60,
                )
                figures["addresses_probed_by_bob"] = 254 * len(PORTS)
                figures["reached_by_bob_scan"] = len(opened(theirs.structured["stdout"]))
                figures["reached_by_bob_direct"] = direct.structured["stdout"].count("reached")
                caps = await bob.run("grep CapEff /proc/self/status", computer_id=attacker, temporary=True)
                effective = int(caps.structured["stdout"].split()[1], 16)
                figures["net_raw_in_computers"] = bool(effective >> CAP_NET_RAW & 1)
                bob_networks = sorted(bb.inspect(f"kilntainer-{attacker}.{tag('bob')}")["NetworkSettings"]["Networks"])
                alice_networks = sorted(bb.inspect(f"kilntainer-{alice_ids[0]}.{tag('alice')}")["NetworkSettings"]["Networks"])
                figures["networks"] = {"alice": ", ".join(alice_networks), "bob": ", ".join(bob_networks)}
                assert figures["reached_by_bob_scan"] == 0, theirs.structured["stdout"]
                assert figures["reached_by_bob_direct"] == 0, direct.structured["stdout"]
                assert not figures["net_raw_in_computers"]
                assert alice_networks == [network_of("alice")] and bob_networks == [network_of("bob")]
    finally:
        for principal in TOKENS:
            if bb.docker("network", "inspect", network_of(principal), check=False).returncode == 0:
                bb.docker("network", "rm", network_of(principal), check=False)
