"""Raw Streamable HTTP requests to /mcp, outside the SDK, for tests that need to see status
codes and bodies exactly."""

from __future__ import annotations

import httpx

ACCEPT = "application/json, text/event-stream"
PROTOCOL_VERSION = "2025-11-25"


def initialize_body(request_id: int = 1, client_name: str = "kilntainers-raw") -> dict:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "initialize",
        "params": {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": client_name, "version": "0"},
        },
    }


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 30) -> httpx.Response:
    """One JSON-RPC POST with the headers the transport requires, plus `headers`."""
    all_headers = {"Content-Type": "application/json", "Accept": ACCEPT, **(headers or {})}
    return httpx.post(url, json=body, headers=all_headers, timeout=timeout)
