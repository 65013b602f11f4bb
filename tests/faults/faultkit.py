"""Shared pieces of the fault suite: the black-box harness (`tests/blackbox/harness.py` as `bb`,
and the black-box conftest's fixtures and hooks as `blackbox_plumbing`, not copied), the figures
file every scenario writes into, memory readings of the server process, and a minimal
Streamable HTTP client that can walk away from a session without saying goodbye.

Figures go to `tests/faults/results/latest.json` (ignored by git; override with
`KILNTAINERS_FAULTS_RESULTS`); one entry per test with its scenario, outcome and the numbers it
measured.  `report.py` turns the file into a table (`latest.md` beside it), which
`docs/reliability.md` quotes only when a maintainer copies it there (`report.py --into-docs`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx

HERE = Path(__file__).resolve().parent
BLACKBOX = HERE.parent / "blackbox"


def _load(name: str, path: Path):
    """The module at `path`, under `name`, loaded once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The black-box harness under the name the black-box files import it by, then the black-box
# conftest under a name of its own (this suite has its own `conftest`) for its fixtures and
# hooks: that conftest's `from harness import …` finds the same module, so the globals (the
# per-run id prefix, the record of what the run made) are shared, not copied.
bb = _load("harness", BLACKBOX / "harness.py")
# The black-box conftest's own sibling import, found the same way.
_load("egress_net", BLACKBOX / "egress_net.py")
blackbox_plumbing = _load("kilntainers_blackbox_conftest", BLACKBOX / "conftest.py")

# Loaded after the black-box harness, which puts the repository root on sys.path.
from testkit.mcp_http import ACCEPT  # noqa: E402

RESULTS = Path(os.environ.get("KILNTAINERS_FAULTS_RESULTS") or HERE / "results" / "latest.json")
TOKEN = "faults-" + bb.RUN_PREFIX + "-token"
MIB = 1024 * 1024


# ---------------------------------------------------------------------------------------------
# figures


@contextmanager
def _locked_results() -> Iterator[dict]:
    """Read-modify-write of the results file under an exclusive lock."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        except ValueError:
            data = {}
        data.setdefault("tests", {})
        yield data
        tmp = RESULTS.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        os.replace(tmp, RESULTS)


def write_run_info(info: dict) -> None:
    with _locked_results() as data:
        data["run"] = info


class Figures:
    """The numbers one test measured, written through to the results file at every update so a
    test that fails half-way still leaves what it saw."""

    def __init__(self, nodeid: str, scenario: str, title: str):
        self.nodeid = nodeid
        self.entry: dict[str, Any] = {"scenario": scenario, "title": title, "outcome": "running", "figures": {}}
        self._flush()

    def __setitem__(self, key: str, value: Any) -> None:
        self.entry["figures"][key] = value
        self._flush()

    def __getitem__(self, key: str) -> Any:
        return self.entry["figures"][key]

    def update(self, values: dict | None = None, **more: Any) -> None:
        self.entry["figures"].update(values or {}, **more)
        self._flush()

    def finish(self, outcome: str, duration: float, message: str | None) -> None:
        self.entry["outcome"] = outcome
        self.entry["duration_s"] = round(duration, 1)
        if message:
            self.entry["message"] = message
        self._flush()

    def _flush(self) -> None:
        with _locked_results() as data:
            data["tests"][self.nodeid] = self.entry


# ---------------------------------------------------------------------------------------------
# measurements


def mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def instance_containers(instance: str) -> list[str]:
    return bb.containers_with_label(f"kilntainers.instance={instance}")


def lock_pid(home: Path, instance: str) -> int:
    """The server pid recorded in its instance lock file (docs/decisions.md, "Crash recovery")."""
    data = json.loads((home / bb.STATE_DIR_NAME / "instances" / f"{instance}.lock").read_text())
    return int(data["pid"])


def container_pids(container: str) -> dict[int, str]:
    """Live (non-zombie) processes inside a container as pid -> command line, read with a
    Docker exec of the container's own `sh` (not through the server under test).  The scanning
    shell leaves itself out."""
    script = (
        "for d in /proc/[0-9]*; do p=${d#/proc/}; [ \"$p\" = \"$$\" ] && continue; "
        "s=$(cat $d/stat 2>/dev/null) || continue; s=${s##*) }; "
        "case \"$s\" in Z*|X*) continue;; esac; "
        "c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null); echo \"$p $c\"; done; true"
    )
    proc = bb.docker("exec", container, "sh", "-c", script, check=False, timeout=60)
    found: dict[int, str] = {}
    for line in proc.stdout.splitlines():
        pid, _, cmd = line.partition(" ")
        if pid.isdigit():
            found[int(pid)] = cmd.strip()
    return found


# ---------------------------------------------------------------------------------------------
# a minimal Streamable HTTP client (docs/decisions.md, "HTTP transport"): enough to open a session, run one call and drop
# the connection without a DELETE, which the SDK's client does not let a test do at scale


def _messages_from(response: httpx.Response, body: bytes) -> list[dict]:
    ctype = response.headers.get("content-type", "")
    if ctype.startswith("application/json"):
        return [json.loads(body)] if body.strip() else []
    messages = []
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            if payload:
                messages.append(json.loads(payload))
    return messages


class RawHttpSession:
    """One MCP session over plain httpx.  `call` returns the JSON-RPC response to a request,
    reading an SSE answer only until that response arrives."""

    def __init__(self, client: httpx.AsyncClient, url: str, token: str | None):
        self.client = client
        self.url = url
        self.headers = {"Accept": ACCEPT, "Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.session_id: str | None = None
        self._next = 0

    async def request(self, method: str, params: dict | None = None) -> dict:
        self._next += 1
        rid = self._next
        body = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            body["params"] = params
        headers = dict(self.headers)
        if self.session_id:
            headers["Mcp-Session-Id"] = self.session_id
        async with self.client.stream("POST", self.url, json=body, headers=headers) as response:
            if response.status_code != 200:
                raise AssertionError(f"{method}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
            if method == "initialize":
                self.session_id = response.headers.get("mcp-session-id")
            if response.headers.get("content-type", "").startswith("application/json"):
                for msg in _messages_from(response, await response.aread()):
                    if msg.get("id") == rid:
                        return msg
                raise AssertionError(f"{method}: no response with id {rid}")
            buf = b""
            async for chunk in response.aiter_bytes():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for msg in _messages_from(response, event):
                        if msg.get("id") == rid:
                            return msg
        raise AssertionError(f"{method}: stream ended without a response with id {rid}")

    async def notify(self, method: str) -> int:
        headers = dict(self.headers)
        if self.session_id:
            headers["Mcp-Session-Id"] = self.session_id
        response = await self.client.post(self.url, json={"jsonrpc": "2.0", "method": method}, headers=headers)
        return response.status_code

    async def initialize(self) -> dict:
        msg = await self.request("initialize", {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "faults-raw", "version": "0"},
        })
        assert "result" in msg, msg
        assert self.session_id, "no Mcp-Session-Id header on the initialize response"
        status = await self.notify("notifications/initialized")
        assert status in (200, 202), f"notifications/initialized: HTTP {status}"
        return msg
