"""Python helpers shared by the test suites (`tests/blackbox`, `tests/faults`) and the
benchmarks (`bench/`): the Docker Engine API over its unix socket, readings from `/proc`,
percentiles, a description of the machine, raw Streamable HTTP requests, and a local OAuth
authorization server with a client for its tokens (`oauth`).

Both sides import it from the repository root (`python -m bench`, and the black-box harness
and the install tests' conftest put the root on `sys.path`), so one fix reaches every caller. Standard library only, apart from
`httpx` in `mcp_http` and `oauth`, which every venv of the project has (`oauth` also runs
node with tests/oauth's packages).
"""
