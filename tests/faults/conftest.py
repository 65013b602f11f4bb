"""pytest plumbing of the fault suite: the black-box fixtures (`kbb`, the environment check,
the session-level leak check) re-exported from `tests/blackbox/conftest.py` (loaded by
`faultkit.py`), a `figures` fixture that records each test's numbers and outcome, and the run's
description (date, machine, engine, binary) at the top of the results file.

Every test carries `pytest.mark.scenario("<n>")`, the scenario number of `report.py`."""

from __future__ import annotations

import datetime
import os
import platform
import time

import pytest

from faultkit import Figures, bb, blackbox_plumbing, write_run_info
from testkit import machine, procfs

# Re-exported so pytest finds them in this conftest (fixtures and the report hook are looked up
# by name on the plugin module).
anyio_backend = blackbox_plumbing.anyio_backend
environment_ready = blackbox_plumbing.environment_ready
suite_leak_check = blackbox_plumbing.suite_leak_check
kbb = blackbox_plumbing.kbb
pytest_runtest_makereport = blackbox_plumbing.pytest_runtest_makereport
# The whole run's check that no network of a principal is left behind.
pytest_sessionstart = blackbox_plumbing.pytest_sessionstart
pytest_sessionfinish = blackbox_plumbing.pytest_sessionfinish


def pytest_configure(config):
    config.addinivalue_line("markers", "scenario(number): the fault scenario a test belongs to (report.py)")


def _mem_total_gib() -> float | None:
    kib = procfs.meminfo_kib("MemTotal")
    return round(kib / 1024 / 1024, 1) if kib else None


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
        "cpu": procfs.cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _mem_total_gib(),
        "kernel": platform.release(),
        "docker": machine.run(["docker", "version", "--format", "{{.Server.Version}}"]) or "",
        "binary": os.path.relpath(binary, bb.REPO) if binary.startswith(str(bb.REPO)) else binary,
        "binary_built": built_text,
        "commit": machine.run(["git", "rev-parse", "--short", "HEAD"]) or "",
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
