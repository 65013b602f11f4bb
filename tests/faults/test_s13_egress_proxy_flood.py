"""Scenario 13: a hostile computer against its egress proxy (issue 33; docs/egress.md, "The
proxy"). Computer A, behind an allow-list, first offers 1 GiB of request head on each of 8
connections at once (8 GiB in all), then opens 10,000 connections to the proxy's port and holds
every one it gets. Meanwhile computer B, behind the same proxy (same principal, same network),
fetches the allowed host through it and is refused the other host with the reason line.

The contract: each head is refused at the proxy's 16 KiB cap, A holds no more than the
per-computer cap of 256 connections, B keeps being served, and both the proxy's peak resident
set (`VmHWM` of its process, read from the host) and the server's stay bounded: under 64 MiB
for the proxy (a quarter of its container's 256 MiB limit) and under 100 MiB for the server."""

from __future__ import annotations

import subprocess

import anyio
import pytest

from egress_net import ALLOW_REFUSAL, egress_proxies, proxy_args
from faultkit import bb, mib, ms
from test_s4_output_flood import RssSampler
from testkit.fake_internet import fake_internet_on
from testkit.procfs import status_kib
from testkit.stats import percentile

pytestmark = [pytest.mark.anyio, pytest.mark.scenario("13")]

PROXY_PEAK_BOUND_MIB = 64
SERVER_PEAK_BOUND_MIB = 100
PER_COMPUTER_CAP = 256
CONNECTIONS = 10_000
HEAD_STREAMS = 8
GIB = 1 << 30

# The proxy's address and port, from the settings the computer was given (braces doubled: the
# commands below are format strings).
PROXY = 'p=${{http_proxy#http://}}; h=${{p%:*}}; port=${{p##*:}}; '
# Eight connections at once, each offered a request line and then 1 GiB of header lines; what
# the proxy answers before closing is printed (its first line).
HEAD_FLOOD = PROXY + (
    "for i in $(seq {streams}); do ("
    "exec 3<>/dev/tcp/$h/$port || exit 1; "
    "{{ printf 'GET http://allowed.test/ HTTP/1.1\\r\\nHost: allowed.test\\r\\n'; "
    "yes 'X-Pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa' | head -c {size}; }} >&3 2>/dev/null; "
    "head -n 1 <&3 | tr -d '\\r'; echo; exec 3<&-"
    ") & done; wait"
)
# 10,000 connections opened by one process and held; counts what was opened, then how many the
# proxy still holds open (ESTABLISHED in the computer's /proc/net/tcp; one the proxy closed is in
# CLOSE_WAIT), then waits to be killed. The proxy also closes a connection that sends no head
# within 10 s, so `held` is what remains at the end, not the most held at once.
CONNECTION_FLOOD = PROXY + (
    "echo $BASHPID > /tmp/flood.pid; ulimit -n 20000; opened=0; failed=0; "
    "for i in $(seq {n}); do if exec {{fd}}<>/dev/tcp/$h/$port; then opened=$((opened+1)); "
    "else failed=$((failed+1)); fi; done 2>/dev/null; "
    "hexport=$(printf ':%04X' $port); "
    "held=$(awk -v p=$hexport 'substr($3, length($3) - 4) == p && $4 == \"01\"' /proc/net/tcp | wc -l); "
    "echo opened=$opened failed=$failed held=$held > /tmp/flood; "
    "exec sleep 600"
)
FETCH = PROXY + (
    "exec 3<>/dev/tcp/$h/$port && printf 'GET http://{host}/ HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n' >&3 && "
    "timeout 10 cat <&3"
)


async def fetch_until(srv, cid: str, fetches: list[float], stop: anyio.Event) -> None:
    """Computer `cid` fetches the allowed host through its proxy every 0.2 s until `stop`,
    recording each call's time; any failure fails the test."""
    while not stop.is_set():
        res = await srv.call({"command": FETCH.format(host="allowed.test"), "computer_id": cid}, timeout=60)
        assert "hello-from-allowed.test" in res.ok().structured["stdout"], res
        fetches.append(res.elapsed)
        await anyio.sleep(0.2)


async def flood_counts(srv, cid: str) -> dict[str, str]:
    """The `key=value` counts a flood running in computer `cid` wrote to /tmp/flood once done."""
    with anyio.fail_after(600):
        while True:
            seen = (await srv.run("cat /tmp/flood 2>/dev/null || true", computer_id=cid)).structured["stdout"]
            if seen.startswith("opened="):
                return dict(part.split("=") for part in seen.split())
            await anyio.sleep(1)


def proxy_pid(network_proxies: set[str]) -> int:
    (name,) = network_proxies
    out = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", name], capture_output=True, text=True,
                         check=True).stdout
    return int(out.strip())


async def test_egress_proxy_under_head_and_connection_floods(kbb, figures):
    """A computer offers 8 x 1 GiB of request head, then opens 10,000 connections to its egress
    proxy while a neighbour behind the same proxy fetches: heads refused at the cap, at most 256
    connections held, the neighbour served, the proxy's peak RSS under 64 MiB and the server's
    under 100 MiB."""
    a, b = kbb.new_id("s13-a"), kbb.new_id("s13-b")
    proxies_before = egress_proxies()
    with fake_internet_on(None, bb.BUSYBOX) as net:
        args = ["--image", bb.DEBIAN, "--egress", "allowlist", "--egress-allow", "allowed.test", *proxy_args(net)]
        async with kbb.server(*args) as srv:
            for cid in (a, b):
                await srv.run("true", computer_id=cid)
            pid = proxy_pid(egress_proxies() - proxies_before)
            figures["proxy_rss_before_mib"] = mib(status_kib(pid, "VmRSS"))
            figures["server_rss_before_mib"] = mib(status_kib(srv.pid, "VmRSS"))
            fetches: list[float] = []
            stop = anyio.Event()

            with RssSampler(srv.pid) as server_rss, RssSampler(pid) as proxy_rss:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(fetch_until, srv, b, fetches, stop)
                    res = await srv.call(
                        {"command": HEAD_FLOOD.format(streams=HEAD_STREAMS, size=GIB), "computer_id": a, "timeout": 600},
                        timeout=660,
                    )
                    # The proxy answers 403 and closes; the close of a socket with unread bytes
                    # can reach the computer first (a reset), so an answer may be empty. What the
                    # model is told does not depend on it.
                    figures["head_answers"] = sorted(set(res.ok().structured["stdout"].splitlines()))
                    assert "was blocked: request head too large]" in res.structured["stderr"], res
                    # The connection flood runs as a job-like background command; its counts are
                    # in /tmp/flood once every connection it could open is open.
                    await srv.call({"command": f"({CONNECTION_FLOOD.format(n=CONNECTIONS)}) >/dev/null 2>&1 &",
                                    "computer_id": a})
                    counts = await flood_counts(srv, a)
                    # While A holds what it got: B fetches the allowed host and is refused the other.
                    during_hold = len(fetches)
                    res = await srv.call({"command": FETCH.format(host="other.test"), "computer_id": b}, timeout=60)
                    assert f"network access to other.test:80 was blocked: {ALLOW_REFUSAL}" in res.structured["stderr"], res
                    with anyio.fail_after(60):
                        while len(fetches) < during_hold + 2:
                            await anyio.sleep(0.2)
                    stop.set()
                await srv.run("kill $(cat /tmp/flood.pid)", computer_id=a)
            figures.update(
                connections_offered=CONNECTIONS,
                connections_opened=int(counts["opened"]),
                connections_failed=int(counts["failed"]),
                connections_held=int(counts["held"]),
                head_bytes_offered=HEAD_STREAMS * GIB,
                neighbour_fetches=len(fetches),
                neighbour_p50_ms=ms(percentile(fetches, 50)),
                neighbour_max_ms=ms(max(fetches)),
                proxy_sampled_peak_rss_mib=mib(proxy_rss.peak_kib),
                proxy_peak_rss_mib=mib(status_kib(pid, "VmHWM")),
                server_sampled_peak_rss_mib=mib(server_rss.peak_kib),
                server_peak_rss_mib=mib(status_kib(srv.pid, "VmHWM")),
            )
            assert int(counts["held"]) <= PER_COMPUTER_CAP, counts
            assert status_kib(pid, "VmHWM") <= PROXY_PEAK_BOUND_MIB * 1024, figures
            assert status_kib(srv.pid, "VmHWM") <= SERVER_PEAK_BOUND_MIB * 1024, figures
        assert srv.returncode() == 0
    assert egress_proxies() <= proxies_before
