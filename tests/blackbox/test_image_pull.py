"""First use of an image the engine does not have yet (docs/decisions.md, "Docker and Podman").

The server pulls it and says how far it got, on stderr and as MCP progress; a failed pull
names the image and suggests `--image`. No registry is reachable from the test machines, so
the images come from `testkit.registry`, a local registry speaking the Registry HTTP API v2
on loopback, which the engine pulls from like any other.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import RUN_PREFIX, docker, dump, image_exists
from testkit.engine import Engine
from testkit.registry import Registry

pytestmark = pytest.mark.anyio

FRESH_LAYER = 4 << 20


@pytest.fixture
def registry():
    # A repository of this run's own, so an image left by an earlier run cannot make the pull
    # unnecessary.
    with Registry(Engine(), "sandbox-busybox:full", f"kiln-pull/{RUN_PREFIX}", "v1", FRESH_LAYER) as reg:
        assert not image_exists(reg.image)
        try:
            yield reg
        finally:
            docker("rmi", "-f", reg.image, check=False)


async def test_first_use_pulls_the_image_with_progress_on_stderr_and_to_the_client(kbb, registry):
    async with kbb.server("--image", registry.image, "--shell", "/bin/sh") as srv:
        messages: list[str | None] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            messages.append(message)

        raw = dump(
            await srv.session.call_tool(
                "terminal_execute",
                {"command": "wc -c < /kiln-pull-fresh-layer"},
                progress_callback=on_progress,
            )
        )
        assert not raw.get("isError"), raw
        # The command ran in a computer made from the pulled image.
        assert json.loads(raw["content"][0]["text"])["stdout"].strip() == str(FRESH_LAYER)
        pulling = [m for m in messages if m and m.startswith(f"Pulling {registry.image}: ")]
        assert pulling, messages
        assert re.fullmatch(rf"Pulling {re.escape(registry.image)}: (\d+)/\1 layers complete", pulling[-1]), pulling
        log = srv.stderr()
    assert any(r.startswith(f"GET /v2/{registry.repository}/blobs/") for r in registry.requests), registry.requests
    assert f"kilntainers: image {registry.image} is not on the engine yet; pulling it (first use only)" in log, log
    assert re.search(rf"kilntainers: pulling {re.escape(registry.image)}: \w+ Pull complete", log), log
    assert re.search(rf"kilntainers: pulled {re.escape(registry.image)} \(\d+ layers\) in \d", log), log


async def test_a_failed_pull_names_the_image_and_suggests_the_image_flag(kbb, registry):
    missing = f"127.0.0.1:{registry.port}/{registry.repository}:no-such-tag"
    async with kbb.server("--image", missing, "--shell", "/bin/sh") as srv:
        res = await srv.call({"command": "true"})
        assert res.is_error, res
        lines = res.text.splitlines()
        assert lines[0] == (
            f"Failed to pull image '{missing}'. Check that the image name is correct and the registry is reachable."
        ), res.text
        assert "manifest unknown" in res.text, res.text
        assert lines[-1].startswith("To use another image, start the server with --image <name>"), res.text
        # Nothing was half made, and the server is still there for the next call.
        assert srv.containers() == []
        again = await srv.call({"command": "true"})
        assert again.is_error and again.text.startswith("Failed to pull image"), again
