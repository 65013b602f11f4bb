"""What the Python fakes of provider APIs (`fly.py`, `e2b.py`) share: the quiet HTTP/1.1
request handler they build on, and running as a child process of a test.

As a child process (`python -m fakes.fly --port-file F …` from the repository root, the way the
Rust suites start them through `tests/common::PythonFake`), a fake takes `--port-file`, writes
where it listens into that file once it listens (atomically, so the parent never reads half of
it), and runs until SIGTERM, SIGINT or the end of its stdin (the parent died without signalling
it); then it stops, removing the containers it made. Started in process (`FakeFly().start()`,
the black-box tests), it uses only the handler.

Standard library only, like the fakes."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 (connections kept alive, as the server's clients keep them), no access log on
    stderr, and every method the fakes serve handed to `answer`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # quiet
        pass

    def handle(self):
        try:
            super().handle()
        except (ConnectionResetError, BrokenPipeError):
            pass  # the client went away between two requests: nothing to answer, nothing to report

    def answer(self, method: str) -> None:
        raise NotImplementedError

    def do_GET(self):
        self.answer("GET")

    def do_POST(self):
        self.answer("POST")

    def do_DELETE(self):
        self.answer("DELETE")


def listen(handler: type[QuietHandler], port: int, name: str, **attributes) -> ThreadingHTTPServer:
    """A threaded HTTP server on 127.0.0.1:`port` (0: any) serving a subclass of `handler` that
    carries `attributes` (the fake it answers for, …), already serving in a daemon thread."""
    bound = type(f"{handler.__name__}For{name.title().replace('-', '')}", (handler,), attributes)
    server = ThreadingHTTPServer(("127.0.0.1", port), bound)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


def close(server: ThreadingHTTPServer | None) -> None:
    """Stops a server `listen` started (None: nothing to stop)."""
    if server is not None:
        server.shutdown()
        server.server_close()


class Fake(Protocol):
    def stop(self) -> None: ...


def arguments(doc: str, listening: str) -> argparse.ArgumentParser:
    """A fake's option parser with `--port-file`: described by the first paragraph of the fake's
    `doc`, the file written with `listening` (what the fake writes there, for `--help`)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--port-file", required=True, help=f"written (atomically) with {listening} once listening")
    return parser


def serve(fake: Fake, port_file: str, listening: str) -> int:
    """Writes `listening` (where the started `fake` listens) into `port_file`, waits for
    SIGTERM, SIGINT or the end of stdin, then stops the fake; the exit status."""
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(listening)
    os.replace(tmp, port_file)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    # Also end when the parent closes our stdin (it died without signalling us).
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait()
    fake.stop()
    return 0
