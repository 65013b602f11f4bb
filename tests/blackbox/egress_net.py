"""The fake internet of the egress tests (docs/egress.md, "Docker wiring"; spec egress §8): a
test network outside the private ranges with `allowed.test` and `other.test` web servers, the
server options that route a proxy to it, and the commands a computer reaches hosts with. The
`fake_internet` fixture (conftest.py) makes one per test and removes it after."""

from __future__ import annotations

import secrets
import subprocess
from contextlib import contextmanager

ALLOW_REFUSAL = "not in this computer's allow-list"


@contextmanager
def fake_internet_on(env: dict | None, image: str):
    """A test network outside the private ranges (198.18.0.0/15) with two web servers made from
    the local busybox image: `allowed.test` at .10 and `other.test` at .11. Removed after."""
    name = f"kbb-egress-{secrets.token_hex(4)}"
    subnet = None
    for _ in range(8):
        octet = secrets.randbelow(256)
        proc = subprocess.run(
            ["docker", "network", "create", "--subnet", f"198.18.{octet}.0/24", name],
            capture_output=True, text=True, env=env,
        )
        if proc.returncode == 0:
            subnet = octet
            break
    assert subnet is not None, proc.stderr
    hosts = {"allowed.test": f"198.18.{subnet}.10", "other.test": f"198.18.{subnet}.11"}
    made = []
    try:
        for host, ip in hosts.items():
            box = f"{name}-{host.split('.')[0]}"
            subprocess.run(
                ["docker", "run", "-d", "--name", box, "--network", name, "--ip", ip, image, "sh", "-c",
                 f"mkdir -p /www && echo hello-from-{host} > /www/index.html && exec httpd -f -p 80 -h /www"],
                check=True, capture_output=True, env=env,
            )
            made.append(box)
        yield {"network": name, "hosts": hosts}
    finally:
        for box in made:
            subprocess.run(["docker", "rm", "-f", box], capture_output=True, env=env)
        # A failed test may leave its server's proxy joined to this network (as its upstream).
        proxies = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"network={name}", "--filter", "label=kilntainers.egress-proxy"],
            capture_output=True, text=True, env=env,
        ).stdout.split()
        if proxies:
            subprocess.run(["docker", "rm", "-f", *proxies], capture_output=True, env=env)
        subprocess.run(["docker", "network", "rm", name], capture_output=True, env=env)


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
