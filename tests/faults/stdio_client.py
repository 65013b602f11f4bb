"""A stdio MCP client that the vanishing-client scenario kills: it starts the server with the
official SDK (which puts the server in its own session, as real clients do), gives it two
temporary computers, starts a command that never ends, prints one JSON line
`{"ids": [...]}` on stdout and then waits to be killed.

    python stdio_client.py <server binary> <explicit temporary id> [server args...]
"""

from __future__ import annotations

import json
import os
import sys

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


async def main() -> None:
    binary, explicit_id, *server_args = sys.argv[1:]
    params = StdioServerParameters(command=binary, args=server_args, env=dict(os.environ))
    async with stdio_client(params, errlog=sys.stderr) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            ids = []
            for arguments in ({"command": "true"}, {"command": "true", "computer_id": explicit_id, "temporary": True}):
                result = await session.call_tool("terminal_execute", arguments)
                ids.append(result.structuredContent["computer_id"])
            async with anyio.create_task_group() as tg:
                tg.start_soon(session.call_tool, "terminal_execute", {"command": "sleep 900", "timeout": 900})
                print(json.dumps({"ids": ids}), flush=True)
                await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main)
