"""Egress policy against the fuller fake internet of spec egress §8 (docs/egress.md, "Tests"):
a DNS logger that records every query reaching it, and a TLS host with a certificate from a test
CA (testkit/fake_internet.py), beside the BusyBox web servers of egress_net.py. A computer asks
for names of every record type, including the ones a DNS-exfiltration would use; the logger
must see only the allowed name it connected to. TLS goes to the allowed host by its SNI, raw or
through `CONNECT`, and a ClientHello naming another host is refused with the reason line."""

from __future__ import annotations

import pytest

from egress_net import ALLOW_REFUSAL, SHARED_NETWORKS
from harness import BUSYBOX_ARGS
from testkit.fake_internet import CA_NAME, DnsLogger, client_hello, gateway_of, printf_octal, tls_host

pytestmark = [pytest.mark.anyio, pytest.mark.client_independent, SHARED_NETWORKS]

# Names a computer might use to smuggle data out in the query itself.
EXFIL = ["other.test", "c2VjcmV0.other.test", "c2VjcmV0.allowed.test", "x.c2VjcmV0.tls.test"]


def proxy_endpoint() -> str:
    return "p=${http_proxy#http://}; "


async def test_issue_33_the_upstream_resolver_hears_only_allowed_names_it_connects_to(kbb, fake_internet):
    # See: issue 33 ("the DNS logger never sees a non-allowed name (A, AAAA, TXT)")
    net = fake_internet
    gateway = gateway_of(net["network"])
    answers = {**net["hosts"], "tls.test": gateway}
    with DnsLogger(gateway, answers) as dns:
        async with kbb.server(
            *BUSYBOX_ARGS, "--egress", "allowlist", "--egress-allow", "allowed.test",
            "--egress-upstream-network", net["network"], "--egress-dns", gateway,
        ) as srv:
            for name in EXFIL:
                for kind in ("A", "AAAA", "TXT"):
                    res = await srv.call({"command": f"nslookup -type={kind} {name}; echo rc=$?"})
                    out = res.structured["stdout"] + res.structured["stderr"]
                    assert "NXDOMAIN" in out, (name, kind, res)
            assert dns.seen() == [], "a query reached the upstream resolver before any connection"
            # The allowed name is resolved upstream (there is no --egress-resolve for it) when a
            # connection to it is made, and only then.
            res = await srv.run("wget -q -O- http://allowed.test/")
            assert "hello-from-allowed.test" in res.structured["stdout"], res
    names = {name for name, _kind in dns.seen()}
    assert names == {"allowed.test"}, dns.seen()


async def test_issue_33_tls_reaches_the_allowed_host_by_sni_and_another_sni_is_refused(kbb, fake_internet):
    # See: issue 33 ("SNI/Host/CONNECT mismatch refused"; "a TLS host with a test CA")
    net = fake_internet
    gateway = gateway_of(net["network"])
    hello = {sni: printf_octal(client_hello(sni)) for sni in ("tls.test", "other.test")}
    connect = "printf 'CONNECT tls.test:443 HTTP/1.1\\r\\nHost: tls.test:443\\r\\n\\r\\n'; "
    ca_seen = f" | grep -a -c '{CA_NAME}'"
    with tls_host(gateway, ["tls.test"]) as tls:
        async with kbb.server(
            *BUSYBOX_ARGS, "--egress", "allowlist", "--egress-allow", "tls.test",
            "--egress-upstream-network", net["network"], "--egress-resolve", f"tls.test={gateway}",
            "--egress-resolve", f"other.test={net['hosts']['other.test']}",
        ) as srv:
            # A program ignoring proxy settings: the name resolves to the proxy, which routes
            # port 443 by the SNI to the real host, whose certificate names the test CA.
            res = await srv.run(f"printf '{hello['tls.test']}' | nc -w 3 tls.test 443{ca_seen}")
            assert int(res.structured["stdout"].strip() or 0) >= 1, res
            assert "[kilntainers:" not in res.structured["stderr"], res
            # Through the CONNECT proxy with the same SNI.
            res = await srv.run(
                proxy_endpoint() + f"{{ {connect}printf '{hello['tls.test']}'; }} | nc -w 3 ${{p%:*}} ${{p##*:}}{ca_seen}"
            )
            assert int(res.structured["stdout"].strip() or 0) >= 1, res
            # A whole HTTPS request (BusyBox wget's TLS client sends the SNI). BusyBox wget
            # speaks TLS to an HTTPS proxy instead of sending CONNECT, which the proxy refuses
            # ("not an HTTP request"), so it goes by name, as a program ignoring the settings.
            res = await srv.run("env -u https_proxy -u HTTPS_PROXY -u http_proxy -u HTTP_PROXY -u all_proxy -u ALL_PROXY wget -q -O- https://tls.test/")
            assert "hello-from-tls.test" in res.structured["stdout"], res

            # The allowed name's port 443, but the ClientHello names another host.
            res = await srv.call({"command": f"printf '{hello['other.test']}' | nc -w 3 tls.test 443{ca_seen}"})
            assert res.structured["stdout"].strip() in ("", "0"), res
            assert f"[kilntainers: network access to other.test:443 was blocked: {ALLOW_REFUSAL}]" in res.structured[
                "stderr"
            ], res
            # CONNECT to the allowed host carrying a ClientHello for another one.
            res = await srv.call({
                "command": proxy_endpoint()
                + f"{{ {connect}printf '{hello['other.test']}'; }} | nc -w 3 ${{p%:*}} ${{p##*:}}{ca_seen}"
            })
            assert res.structured["stdout"].strip() in ("", "0"), res
            assert "network access to" in res.structured["stderr"] and "was blocked" in res.structured["stderr"], res
        # The host only ever completed handshakes naming itself.
        assert set(tls.snis) <= {"tls.test"}, tls.snis
