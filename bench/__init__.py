"""Benchmarks of the server (run from the repository root; scripts/bench*.sh install first):

    python -m bench                 this server against the Python reference over stdio
    python -m bench.http_sessions   many Streamable HTTP sessions at once, half abandoned
    python -m bench.wasm            go_busybox latency

Engine-API, /proc and statistics helpers come from `testkit`, which the test suites share.
"""
