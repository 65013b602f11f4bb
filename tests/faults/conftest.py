"""pytest plumbing of the fault suite: the black-box fixtures (`kbb`, the environment check,
the session-level leak check) re-exported from `tests/blackbox/conftest.py`, a `figures` fixture
that records each test's numbers and outcome, and the run's description (date, machine, engine,
binary) at the top of the results file.

Every test carries `pytest.mark.scenario("<n>")`, the scenario number of `report.py`."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time

import pytest

from faultkit import Figures, bb, write_run_info

# Re-exported so pytest finds them in this conftest (fixtures and the report hook are looked up
# by name on the plugin module).
anyio_backend = bb.anyio_backend
environment_ready = bb.environment_ready
suite_leak_check = bb.suite_leak_check
kbb = bb.kbb
pytest_runtest_makereport = bb.pytest_runtest_makereport


def pytest_configure(config):
    config.addinivalue_line("markers", "scenario(number): the fault scenario a test belongs to (report.py)")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _output(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


@pytest.fixture(scope="session", autouse=True)
def run_info():
    """Describes the run once per session; tests of earlier sessions in the same file stay."""
    binary = bb.BIN
    try:
        built = datetime.datetime.fromtimestamp(os.path.getmtime(binary), datetime.timezone.utc)
        built_text = built.strftime("%Y-%m-%d %H:%M:%S UTC")
    except OSError:
        built_text = "missing"
    write_run_info({
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _mem_total_gib(),
        "kernel": platform.release(),
        "docker": _output("docker", "version", "--format", "{{.Server.Version}}"),
        "binary": os.path.relpath(binary, bb.REPO) if binary.startswith(str(bb.REPO)) else binary,
        "binary_built": built_text,
        "commit": _output("git", "-C", str(bb.REPO), "rev-parse", "--short", "HEAD"),
    })
    yield


@pytest.fixture
def figures(request) -> Figures:
    marker = request.node.get_closest_marker("scenario")
    assert marker, f"{request.node.nodeid} has no scenario marker"
    doc = (request.node.function.__doc__ or request.node.name).strip().split("\n\n")[0]
    record = Figures(request.node.nodeid, str(marker.args[0]), " ".join(doc.split()))
    started = time.monotonic()
    yield record
    rep = getattr(request.node, "rep_call", None)
    outcome = rep.outcome if rep is not None else "error"
    message = None
    if rep is not None and rep.failed:
        crash = getattr(rep.longrepr, "reprcrash", None)
        message = (crash.message if crash else str(rep.longrepr)).strip().splitlines()[0][:400]
    record.finish(outcome, time.monotonic() - started, message)
