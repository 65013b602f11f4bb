"""Scenario 14: a hostile computer against the socket wiring of its egress proxy (issue 33;
docs/egress.md, "Socket wiring"). Under gVisor a computer behind the proxy has no network; the
proxy's socket is mounted in every computer of the principal, so a computer can skip its relay
and speak to the socket itself. Computer A, root in a Debian computer, keeps up to 4,000
connections open on the socket for 15 s without ever naming a token, replacing each one the proxy
shuts down, then offers 1 GiB of request head on 4 connections that name its own token (it can
read that from its relay's environment). Meanwhile computer B, of the same principal behind the
same proxy, fetches the allowed host through its relay.

The contract: silent connections never lock B's relay out (the proxy keeps at most 128 of them,
shutting the oldest down when more come, and gives each 2 s), every head is refused at the
16 KiB cap, B keeps being served, and the proxy's peak resident set stays under 64 MiB and the
server's under 100 MiB."""

from __future__ import annotations

import os

import anyio
import pytest

from egress_net import egress_proxies, proxy_args
from faultkit import bb, mib, ms
from test_s4_output_flood import RssSampler
from test_s13_egress_proxy_flood import fetch_until, flood_counts, proxy_pid
from testkit.fake_internet import fake_internet_on
from testkit.procfs import status_kib
from testkit.stats import percentile

pytestmark = [pytest.mark.anyio, pytest.mark.scenario("14")]

PROXY_PEAK_BOUND_MIB = 64
SERVER_PEAK_BOUND_MIB = 100
SILENT = 4_000
SILENT_SECONDS = 15
HEAD_STREAMS = 4
GIB = 1 << 30

SOCKET = "/run/kilntainers-egress/proxy.sock"
# For SECONDS seconds keeps up to N connections open on the proxy's socket, never writing: each
# one the proxy shuts down (a read returns at once) is closed and replaced by a new one. Records
# how many it opened in all, how many failed to open and the most it held at once, then waits to
# be killed. The `@NAME@` placeholders are filled by `command`.
SILENT_FLOOD = (
    "ulimit -n 20000 2>/dev/null; echo $$ > /tmp/flood.pid; exec perl -MIO::Socket::UNIX -MIO::Select -e '"
    "my ($n, $path, $seconds) = @ARGV; my $sel = IO::Select->new; my ($opened, $failed, $most) = (0, 0, 0); "
    "my $end = time + $seconds; while (time < $end) { "
    "while ($sel->count < $n) { my $s = IO::Socket::UNIX->new(Peer => $path); "
    "if ($s) { $sel->add($s); $opened++ } else { $failed++; last } } "
    "$most = $sel->count if $sel->count > $most; "
    "for my $s ($sel->can_read(0.2)) { $sel->remove($s); close $s } } "
    'open(my $f, ">", "/tmp/flood.new"); print $f "opened=$opened failed=$failed most=$most\\n"; '
    "close $f; rename q(/tmp/flood.new), q(/tmp/flood); sleep 600;"
    "' @N@ @SOCKET@ @SECONDS@"
)
# STREAMS connections naming the computer's own token (read from its relay's environment), each
# offered a request line and then SIZE bytes of header lines; prints each answer's first line.
HEAD_FLOOD = (
    "token=$(cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' "
    "| sed -n 's/^KILNTAINERS_EGRESS_TOKEN=//p' | head -n 1); "
    "perl -MIO::Socket::UNIX -e '"
    "my ($token, $path, $streams, $size) = @ARGV; my @kids; "
    "for (1..$streams) { my $pid = fork(); if (!$pid) { "
    "my $s = IO::Socket::UNIX->new(Peer => $path) or exit 1; $SIG{PIPE} = q(IGNORE); "
    'print $s "$token proxy\\n" . "GET http://allowed.test/ HTTP/1.1\\r\\nHost: allowed.test\\r\\n"; '
    'my $pad = "X-Pad: " . ("a" x 120) . "\\r\\n"; my $sent = 0; '
    "while ($sent < $size) { last unless print $s $pad; $sent += length $pad } "
    "shutdown($s, 1); my $line = <$s>; $line //= q(); $line =~ s/\\r?\\n//; print qq($line\\n); exit 0 } "
    "push @kids, $pid } waitpid($_, 0) for @kids;"
    "' \"$token\" @SOCKET@ @STREAMS@ @SIZE@"
)


def command(template: str, **values: int) -> str:
    """`template` with @SOCKET@ and each of `values` (as @NAME@) filled in."""
    out = template.replace("@SOCKET@", SOCKET)
    for name, value in values.items():
        out = out.replace(f"@{name.upper()}@", str(value))
    return out


async def test_egress_socket_under_silent_and_head_floods(kbb, figures):
    """A computer without a network keeps 4,000 silent connections open on its proxy's socket
    for 15 s and offers 4 x 1 GiB of request head through it while a neighbour fetches through
    its relay:
    the neighbour is served throughout, heads are refused at the cap, and the proxy's and the
    server's peak RSS stay bounded."""
    if os.environ.get("KILNTAINERS_IT_RUNSC") != "1":
        pytest.skip("runsc is not registered with this Docker (scripts/ensure-dockerd.sh)")
    a, b = kbb.new_id("s14-a"), kbb.new_id("s14-b")
    proxies_before = egress_proxies()
    with fake_internet_on(None, bb.BUSYBOX) as net:
        args = ["--image", bb.DEBIAN, "--runtime", "runsc", "--egress", "allowlist", "--egress-allow",
                "allowed.test", *proxy_args(net)]
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
                    await srv.call({"command": f"({command(SILENT_FLOOD, n=SILENT, seconds=SILENT_SECONDS)}) >/dev/null 2>&1 &",
                                    "computer_id": a})
                    before_flood = len(fetches)
                    counts = await flood_counts(srv, a)
                    # B was served while A kept its connections open.
                    during_flood = len(fetches) - before_flood
                    res = await srv.call(
                        {"command": command(HEAD_FLOOD, streams=HEAD_STREAMS, size=GIB), "computer_id": a,
                         "timeout": 600},
                        timeout=660,
                    )
                    figures["head_answers"] = sorted(set(res.ok().structured["stdout"].splitlines()))
                    assert "was blocked: request head too large]" in res.structured["stderr"], res
                    during_heads = len(fetches)
                    with anyio.fail_after(60):
                        while len(fetches) < during_heads + 2:
                            await anyio.sleep(0.2)
                    stop.set()
                await srv.run("kill $(cat /tmp/flood.pid) 2>/dev/null; true", computer_id=a)
            figures.update(
                silent_held_target=SILENT,
                silent_seconds=SILENT_SECONDS,
                silent_opened=int(counts["opened"]),
                silent_failed=int(counts["failed"]),
                silent_most_held=int(counts["most"]),
                neighbour_fetches_during_silent_flood=during_flood,
                head_bytes_offered=HEAD_STREAMS * GIB,
                neighbour_fetches=len(fetches),
                neighbour_p50_ms=ms(percentile(fetches, 50)),
                neighbour_max_ms=ms(max(fetches)),
                proxy_sampled_peak_rss_mib=mib(proxy_rss.peak_kib),
                proxy_peak_rss_mib=mib(status_kib(pid, "VmHWM")),
                server_sampled_peak_rss_mib=mib(server_rss.peak_kib),
                server_peak_rss_mib=mib(status_kib(srv.pid, "VmHWM")),
            )
            # The silent connections were replaced as the proxy shut them down, and B was served
            # all along (the 128-connection cap on them is unit-tested in helper/src/egress).
            assert int(counts["opened"]) > SILENT, counts
            assert during_flood >= 5, figures
            assert status_kib(pid, "VmHWM") <= PROXY_PEAK_BOUND_MIB * 1024, figures
            assert status_kib(srv.pid, "VmHWM") <= SERVER_PEAK_BOUND_MIB * 1024, figures
        assert srv.returncode() == 0
    assert egress_proxies() <= proxies_before
