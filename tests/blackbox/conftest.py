"""pytest plumbing of the black-box MCP tests: the `kbb` fixture (a `harness.KBB` per test,
cleaned up and checked for leaks after it), the check that the binary, docker and the images
are there, the session-level leak check, and the rule of the full run that no test may skip.
The servers, sessions and helpers themselves are in `harness.py`, which the tests import."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from harness import (
    BIN,
    BUSYBOX,
    DEBIAN,
    KBB,
    MADE,
    MINIMAL,
    RUN_PREFIX,
    checkpoint_images,
    containers_made_by_tests,
    docker,
    force_remove,
    image_exists,
    poll,
    server_networks,
)

# Imported after the harness, which puts the repository root on sys.path.
from testkit import procfs
from testkit.fake_internet import fake_internet_on


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def fake_internet():
    """A fake internet for the egress tests (egress_net.py), removed after the test."""
    with fake_internet_on(None, BUSYBOX) as net:
        yield net


# The full run (scripts/test.sh) allows no skip: a skipped test there means a missing piece of
# the environment, which must fail the run rather than pass it quietly. A test whose skip is a
# legitimate outcome of a race says so with `@pytest.mark.may_skip(reason)`.
REQUIRE_ALL = os.environ.get("KILNTAINERS_REQUIRE_ALL") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "may_skip(reason): a skip that is an allowed outcome even in the full run")
    # What a file's tests check does not depend on the MCP client's generation (engines,
    # backends, networks, their fakes: the client only calls tools), so the full run
    # (scripts/test.sh) runs it with client 1.x only; everything else runs with 1.x and 2.x.
    config.addinivalue_line(
        "markers", "client_independent: run with one client generation only in the full run (docs/testing.md)"
    )


def pytest_collection_finish(session):
    """Under `--dist loadgroup` (scripts/test.sh), a test marked `xdist_group` must carry its
    group in its id, which is how pytest-xdist keeps a group on one worker: a pytest that
    ignores the renaming would let the group's tests run at once, and fail them by chance."""
    if not session.config.getoption("loadgroup", default=False):
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
            raise pytest.UsageError(
                f"{item.nodeid} is in an xdist group but runs outside it: pytest-xdist cannot rename "
                "tests under this pytest (scripts/setup-test-env.sh pins the versions that work)"
            )


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if REQUIRE_ALL and rep.skipped and not hasattr(rep, "wasxfail") and item.get_closest_marker("may_skip") is None:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped in the full run (KILNTAINERS_REQUIRE_ALL=1 allows no skip): {reason}"
    setattr(item, "rep_" + rep.when, rep)


_SESSION: dict = {}


@pytest.fixture(scope="session")
def environment_ready():
    """Fails (not skips) with a clear message when the binary, docker or the images are missing."""
    if not (os.path.isfile(BIN) and os.access(BIN, os.X_OK)):
        pytest.fail(
            f"server binary not found at {BIN}; build it with `cargo build` or set KILNTAINERS_BIN",
            pytrace=False,
        )
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("docker is not reachable (`docker info` fails); run scripts/ensure-dockerd.sh", pytrace=False)
    missing = [img for img in (BUSYBOX, MINIMAL, DEBIAN) if not image_exists(img)]
    if missing:
        pytest.fail(f"local test images missing: {missing}; run scripts/setup-test-env.sh", pytrace=False)
    return True


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


# Networks of principals (docs/auth.md, "Network") go with their last computer. A network is
# shared by the servers of its principal, so this check is the whole run's: it runs in the
# process that started the run (the xdist controller, or the only process) once every test is
# done, over the networks made meanwhile by this run's servers (a network names the server
# process that made it; the workers report theirs) or by a server that did not say.
_NETWORKS_BEFORE: set[str] = set()
_RUN_INSTANCES: set[str] = set()


def pytest_sessionstart(session):
    if not _is_xdist_worker(session.config):
        _NETWORKS_BEFORE.update(server_networks())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist, in the controller: a worker's servers, as its `pytest_sessionfinish` sent them."""
    _RUN_INSTANCES.update(getattr(node, "workeroutput", {}).get("instances", []))


def _made_by_this_run(network: str) -> bool:
    out = docker("network", "inspect", "--format", '{{index .Labels "kilntainers.instance"}}', network, check=False)
    maker = out.stdout.strip()
    return out.returncode == 0 and (maker in ("", "<no value>") or maker in _RUN_INSTANCES)


def pytest_sessionfinish(session, exitstatus):
    if _is_xdist_worker(session.config):
        session.config.workeroutput["instances"] = sorted(MADE["instances"])
        return
    _RUN_INSTANCES.update(MADE["instances"])

    def left() -> list[str]:
        return sorted(n for n in server_networks() - _NETWORKS_BEFORE if _made_by_this_run(n))

    if poll(lambda: not left(), 10, 0.2) is False:
        networks = left()
        for network in networks:
            docker("network", "rm", network, check=False)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"suite leak check failed: networks left behind: {networks}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def suite_leak_check():
    """Session-level check (each xdist worker's own): nothing made by its tests is left
    behind. What a worker's tests made is told apart by the run prefix and the records in
    `harness.MADE`, which are the worker's own."""
    base = Path(tempfile.mkdtemp(prefix=f"kbb-{RUN_PREFIX}-"))
    _SESSION["base"] = base
    yield
    problems = []
    try:
        poll(lambda: not containers_made_by_tests(), 10, 0.2)  # async --rm removal on Docker 20.10
        leftovers = containers_made_by_tests()
        if leftovers:
            names = [docker("inspect", "-f", "{{.Name}}", c, check=False).stdout.strip() for c in leftovers]
            problems.append(f"containers left behind: {names}")
            force_remove(leftovers)
    except Exception as exc:  # pragma: no cover - docker vanished
        problems.append(f"could not list containers: {exc}")
    images = checkpoint_images()
    if images:
        problems.append(f"checkpoint images left behind: {images}")
        docker("rmi", "-f", *images, check=False)
    procs = procfs.pids_with_environ(str(base))
    if procs:
        cmdlines = []
        for pid in procs:
            try:
                cmdlines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                cmdlines.append("?")
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        problems.append(f"processes started by the tests still running: {list(zip(procs, cmdlines))}")
    if os.environ.get("KBB_KEEP") != "1":
        shutil.rmtree(base, ignore_errors=True)
        if base.exists():
            problems.append(f"could not remove temp dir {base}")
    else:
        print(f"\nkept black-box test dir: {base}")
    leftovers_tmp = [p for p in Path(tempfile.gettempdir()).glob(f"kbb-{RUN_PREFIX}-*")]
    if leftovers_tmp and os.environ.get("KBB_KEEP") != "1":
        problems.append(f"temp dirs left behind: {leftovers_tmp}")
    assert not problems, "suite leak check failed:\n  " + "\n  ".join(problems)


@pytest.fixture
def kbb(request, environment_ready) -> KBB:
    helper = KBB(_SESSION["base"], request.node.name)
    yield helper
    rep = getattr(request.node, "rep_call", None)
    passed = bool(rep and rep.passed)
    problems = helper.cleanup(check_leaks=passed)
    if (rep is not None and rep.failed) or problems:
        for errlog in helper.errlogs:
            err = errlog.read_text(errors="replace") if errlog.exists() else "<no stderr file>"
            rcfile = errlog.with_suffix(".rc")
            rc = rcfile.read_text().strip() if rcfile.exists() else "unknown"
            print(f"\n----- stderr of {errlog.name}, exit status {rc} (last 4000 chars) -----\n{err[-4000:]}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
