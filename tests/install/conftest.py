"""Shared pieces of the install-path tests (docs/install.md): a stdio MCP session with the
official Python client against a server started by any command, and the computer's container
checks. Nothing here knows the server's internals; containers are read through the Engine API
(`testkit.engine`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from testkit.engine import Engine  # noqa: E402

BINARY_NAME = "mcp-sandbox-computer-vm-for-ai"
ENGINE = Engine()
REQUIRE_ALL = os.environ.get("KILNTAINERS_REQUIRE_ALL") == "1"
# A PATH with the system's tools and none of the Rust toolchain (rustup puts it in ~/.cargo/bin).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def cargo_version() -> str:
    for line in (REPO / "Cargo.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise AssertionError("no version in Cargo.toml")


def skip_or_fail(reason: str) -> None:
    if REQUIRE_ALL:
        pytest.fail(f"{reason} (KILNTAINERS_REQUIRE_ALL=1)")
    pytest.skip(reason)


def containers_of(computer_id: str) -> list[str]:
    return [c["Id"] for c in ENGINE.list_containers(f"kilntainers.computer-id={computer_id}")]


def wait_no_containers(computer_id: str, timeout: float = 15) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := containers_of(computer_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def force_remove(computer_id: str) -> None:
    for container in containers_of(computer_id):
        ENGINE.force_remove(container)


@asynccontextmanager
async def mcp_session(command: str, args: list[str], env: dict, errlog: Path) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=command, args=args, env=env)
    with open(errlog, "a") as err:
        async with stdio_client(params, errlog=err) as (read, write):
            async with ClientSession(read, write) as session:
                with anyio.fail_after(120):
                    await session.initialize()
                yield session


async def terminal_execute(session: ClientSession, command: str) -> dict:
    result = await session.call_tool("terminal_execute", {"command": command})
    raw = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert not raw.get("isError"), raw
    return json.loads(raw["content"][0]["text"])
