"""What the egress tests share beside their fake internet (docs/egress.md, "Docker wiring"; spec
egress §8; the network and its hosts are made by testkit/fake_internet.py): the server options
that route a proxy to it, the engine's egress networks and proxies, and the commands a computer
reaches hosts with. The `fake_internet` fixture (conftest.py) makes one per test and removes it
after."""

from __future__ import annotations

import subprocess

import pytest

# The tests whose servers use a network that every server process on the engine shares, and
# take turns with: the egress network and proxy of the single user (over stdio every server is
# the one principal `default`, and a principal's egress network is one per engine; docs/egress.md,
# "The proxy"), on Docker, Podman or gVisor, and `kilntainers-pool`, where every server's warm-pool
# spares wait with several principals (docs/warm-pool.md). These run on one xdist worker, one
# after another (scripts/test.sh runs the black-box tests on several), beside the others.
SHARED_NETWORKS = pytest.mark.xdist_group("networks-every-server-shares")

ALLOW_REFUSAL = "not in this computer's allow-list"


def proxy_args(net) -> list[str]:
    args = ["--egress-upstream-network", net["network"]]
    for host, ip in net["hosts"].items():
        args += ["--egress-resolve", f"{host}={ip}"]
    return args


def egress_networks() -> set[str]:
    out = subprocess.run(["docker", "network", "ls", "--format", "{{.Name}}"], capture_output=True, text=True)
    return {n for n in out.stdout.split() if n.startswith("kilntainers-egress-")}


def egress_proxies() -> set[str]:
    out = subprocess.run(
        ["docker", "ps", "-a", "--filter", "label=kilntainers.egress-proxy", "--format", "{{.Names}}"],
        capture_output=True, text=True,
    )
    return set(out.stdout.split())


# Through the proxy's own port, as a program honouring http_proxy does (busybox nc does not).
VIA_PROXY = (
    "p=${{http_proxy#http://}}; printf 'GET http://{host}/ HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n' "
    "| nc -w 5 ${{p%:*}} ${{p##*:}}"
)
# Straight to port 80 of a name, ignoring proxy settings.
RAW = "printf 'GET / HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n' | nc -w 5 {target} 80"
