"""First use of an image the engine does not have yet (docs/decisions.md, "Docker and Podman"),
against a real registry: Debian's `docker-registry` on loopback (`testkit.registry`), to which
each test pushes an image it has just built, so the engine really has to pull it.

On Docker and on Podman (a Podman API service of the test's own, whose registries.conf lets it
pull from the loopback registry): the pull reaches the client as MCP progress and stderr; an
unknown tag or repository gives an error naming the image; an unreachable registry and one that
accepts connections but never answers both end with a clear message, the second after
`--pull-timeout` seconds without progress; nothing is left behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass

import pytest

from harness import BIN, BUSYBOX_ARGS, RUN_PREFIX, containers_with_label, docker, dump, free_port
from testkit.registry import PodmanService, Registry, SilentRegistry

# One worker runs the whole file: its module fixture (a second engine, or a registry) is made
# once rather than on every worker that takes one of its tests.
pytestmark = [pytest.mark.anyio, pytest.mark.client_independent, pytest.mark.xdist_group("image-pull-registry")]

FRESH_LAYER = 4 << 20
PULL_FAILED = "Failed to pull image '{}'. Check that the image name is correct and the registry is reachable."
SUGGESTION = "To use another image, start the server with --image <name>"


@dataclass
class EngineUnderTest:
    name: str
    args: list[str]
    podman: PodmanService | None = None

    def image_exists(self, image: str) -> bool:
        if self.podman:
            return self.podman.image_exists(image)
        return docker("image", "inspect", image, check=False).returncode == 0

    def remove_image(self, image: str) -> None:
        if self.podman:
            self.podman.podman("rmi", "-f", image, check=False)
        else:
            docker("rmi", "-f", image, check=False)

    def containers(self, instance: str) -> list[str]:
        label = f"kilntainers.instance={instance}"
        if self.podman:
            out = self.podman.podman("ps", "-aq", "--filter", f"label={label}").stdout
            return [line for line in out.split() if line]
        return containers_with_label(label)


@pytest.fixture(scope="module")
def registry():
    with Registry() as reg:
        yield reg


@pytest.fixture(scope="module")
def silent():
    with SilentRegistry() as reg:
        yield reg


@pytest.fixture(scope="module")
def refusing():
    """A loopback address where nothing listens."""
    return f"127.0.0.1:{free_port('127.0.0.1')}"


@pytest.fixture(scope="module", params=["docker", "podman"])
def engine(request, registry, silent, refusing):
    if request.param == "docker":
        yield EngineUnderTest("docker", [])
        return
    if os.environ.get("KILNTAINERS_IT_PODMAN") != "1":
        pytest.skip("Podman is not set up (KILNTAINERS_IT_PODMAN=1 from scripts/setup-test-env.sh)")
    with PodmanService(insecure=[registry.address, silent.address, refusing]) as podman:
        yield EngineUnderTest("podman", ["--engine", "podman", "--docker-host", podman.host], podman)


@pytest.fixture
def pushed(request, registry, engine):
    """An image just built and pushed, which the engine under test does not have."""
    repository = f"kiln-pull/{RUN_PREFIX}-{engine.name}"
    # A tag of the test's name: letters, digits, `.`, `_` and `-`, starting with a letter.
    tag = "t-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[-60:]
    image = registry.push(repository, tag, fresh_layer_bytes=FRESH_LAYER)
    assert not engine.image_exists(image)
    try:
        yield image
    finally:
        engine.remove_image(image)


def server_args(engine: EngineUnderTest, image: str, *extra: str) -> list[str]:
    return [*engine.args, "--image", image, "--shell", "/bin/sh", *extra]


async def test_first_use_pulls_the_image_with_progress_on_stderr_and_to_the_client(kbb, registry, engine, pushed):
    async with kbb.server(*server_args(engine, pushed)) as srv:
        messages: list[str | None] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            messages.append(message)

        raw = dump(
            await srv.session.call_tool(
                "terminal_execute", {"command": "wc -c < /kiln-pull-fresh-layer"}, progress_callback=on_progress
            )
        )
        assert not raw.get("isError"), raw
        # The command ran in a computer made from the pulled image.
        assert json.loads(raw["content"][0]["text"])["stdout"].strip() == str(FRESH_LAYER)
        pulling = [m for m in messages if m and m.startswith(f"Pulling {pushed}: ")]
        assert pulling, messages
        assert re.fullmatch(rf"Pulling {re.escape(pushed)}: (\d+)/\1 layers complete", pulling[-1]), pulling
        assert engine.image_exists(pushed)
        log = srv.stderr()
    repository = pushed.split("/", 1)[1].rsplit(":", 1)[0]
    assert any(r.startswith(f"GET /v2/{repository}/blobs/sha256:") for r in registry.requests()), registry.requests()
    assert f"kilntainers: image {pushed} is not on the engine yet; pulling it (first use only)" in log, log
    assert re.search(rf"kilntainers: pulling {re.escape(pushed)}: \w+ \w", log), log
    assert re.search(rf"kilntainers: pulled {re.escape(pushed)} \(\d+ layers\) in \d", log), log


async def assert_pull_fails(kbb, engine: EngineUnderTest, image: str, *extra: str, reason: str) -> str:
    """The first call fails with the pull message naming `image` and containing `reason`, nothing
    is left, and the next call tries again and fails the same way. Returns the error text."""
    async with kbb.server(*server_args(engine, image, *extra)) as srv:
        res = await srv.call({"command": "true"}, timeout=120)
        assert res.is_error, res
        lines = res.text.splitlines()
        assert lines[0] == PULL_FAILED.format(image), res.text
        assert re.search(reason, res.text, re.IGNORECASE), res.text
        assert lines[-1].startswith(SUGGESTION), res.text
        assert engine.containers(srv.instance_id) == []
        again = await srv.call({"command": "true"}, timeout=120)
        assert again.is_error and again.text.startswith(PULL_FAILED.format(image)), again
        assert not engine.image_exists(image)
        return res.text


async def test_an_unknown_tag_names_the_image(kbb, registry, engine, pushed):
    missing = pushed.rsplit(":", 1)[0] + ":no-such-tag"
    await assert_pull_fails(kbb, engine, missing, reason="manifest unknown")


async def test_an_unknown_repository_names_the_image(kbb, registry, engine):
    missing = f"{registry.address}/kiln-pull/{RUN_PREFIX}-never-pushed:v1"
    await assert_pull_fails(kbb, engine, missing, reason="not found|unknown")


async def test_an_unreachable_registry_says_so(kbb, engine, refusing):
    image = f"{refusing}/kiln-pull/nothing:v1"
    await assert_pull_fails(kbb, engine, image, reason="connection refused")


async def test_a_registry_that_never_answers_ends_after_the_pull_timeout(kbb, engine, silent):
    image = f"{silent.address}/kiln-pull/{RUN_PREFIX}-silent:v1"
    before = silent.accepted
    text = await assert_pull_fails(
        kbb, engine, image, "--pull-timeout", "3",
        reason=r"no progress for 3 s \(--pull-timeout\)",
    )
    assert "the registry may be unreachable or too slow" in text, text
    assert silent.accepted > before, "the engine never connected to the silent registry"


async def test_the_pull_timeout_must_be_positive(kbb):
    home = kbb.home()
    proc = subprocess.run(
        [BIN, *BUSYBOX_ARGS, "--pull-timeout", "0"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=30, env=kbb.env(home),
    )
    assert proc.returncode == 1, proc.stderr
    assert "kilntainers: error: --pull-timeout must be at least 1 second." in proc.stderr, proc.stderr
