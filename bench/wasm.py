"""go_busybox latency: first call (server start, module load, first `echo`) and warm `echo`
round trips, over stdio with the official MCP client. Prints figures; asserts nothing.

    python -m bench.wasm [--bin target/release/mcp-sandbox-computer-vm-for-ai] [-n 50]

Run it with a Python that has `mcp` installed (e.g. .test-env/venv or .bench-env/client). The
module comes from the server's normal cache (fetched with pip on first use); the first run
after a fresh cache also pays the download and the compile.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

REPO = Path(__file__).resolve().parents[1]


async def measure(binary: str, n: int) -> None:
    params = StdioServerParameters(command=binary, args=["--backend", "go_busybox"], env=None)
    started = time.perf_counter()
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            ready = time.perf_counter()
            first = await session.call_tool("terminal_execute", {"command": "echo hi"})
            first_done = time.perf_counter()
            assert not first.isError, first
            warm = []
            for _ in range(n):
                t0 = time.perf_counter()
                result = await session.call_tool("terminal_execute", {"command": "echo hi"})
                warm.append((time.perf_counter() - t0) * 1000)
                assert not result.isError, result
            pipe = []
            for _ in range(max(n // 5, 1)):
                t0 = time.perf_counter()
                await session.call_tool("terminal_execute", {"command": "printf '%s\\n' 5 3 9 1 | sort -rn | head -3"})
                pipe.append((time.perf_counter() - t0) * 1000)
    print(f"go_busybox start → initialize answered: {(ready - started) * 1000:.0f} ms")
    print(f"go_busybox first call (computer created): {(first_done - ready) * 1000:.0f} ms")
    print(f"go_busybox start → first result: {(first_done - started) * 1000:.0f} ms")
    print(
        f"go_busybox warm `echo hi` round trip, n={n}: median {statistics.median(warm):.1f} ms, "
        f"min {min(warm):.1f}, max {max(warm):.1f}"
    )
    print(f"go_busybox warm 3-stage pipeline, n={len(pipe)}: median {statistics.median(pipe):.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wasm", description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default=str(REPO / "target" / "release" / "mcp-sandbox-computer-vm-for-ai"))
    parser.add_argument("-n", type=int, default=50)
    args = parser.parse_args()
    if not Path(args.bin).exists():
        print(f"no server binary at {args.bin}; build it or pass --bin", file=sys.stderr)
        return 1
    asyncio.run(measure(args.bin, args.n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
