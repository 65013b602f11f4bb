"""Local fakes of the providers' APIs, for tests only: `fly` (Fly's Machines REST API) and `e2b`
(E2B's control plane and envd), in Python with the standard library only, and what they share
(`child`). Modal's fake is the Rust crate beside them (`fakes/modal/`), a tonic server of the
same `.proto` as the client.

The black-box tests import them from the repository root (`from fakes.fly import FakeFly`,
`tests/blackbox/harness.py` puts the root on `sys.path`) and run them in process; the Rust suites start them as
child processes (`python -m fakes.fly --port-file F`, from the root)."""
