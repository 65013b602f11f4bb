"""Egress policy (docs/egress.md; issue 33): the options and their startup checks, each naming
the flag and the value before any computer is touched; `--egress none` as `--no-network`; the
default (`open`, no rule) leaving the container exactly as before (no egress label, the
engine's network); Fly's refusal word for word; WASM accepting every mode (it behaves as
`none`). The proxy's own behaviour is unit-tested in helper/src/egress/."""

from __future__ import annotations

import subprocess

import pytest

from harness import BIN, BUSYBOX_ARGS, container_for, inspect

pytestmark = pytest.mark.anyio

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
        ["--egress", "allowlist", "--egress-allow", "a.test"],
        "--egress allowlist is not enforced by the docker backend in this version; use --egress open without "
        "rules, or --egress none.",
    ),
    (
        ["--backend", "e2b", "--egress-deny", "a.test"],
        "--egress open with --egress-deny is not enforced by the e2b backend in this version; use --egress "
        "open without rules, or --egress none.",
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
