"""What a benchmark result records about the machine it ran on."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import version
from pathlib import Path
from typing import Any

from testkit import procfs
from testkit.engine import Engine

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("src", "helper", "Cargo.toml", "Cargo.lock", "build.rs")


def run(args: list[str]) -> str | None:
    """A command's stdout, stripped; None when it fails or prints nothing."""
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=30, cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def project_commit() -> str | None:
    """The checked-out commit, marked `+dirty` when the server's sources differ from it."""
    commit = run(["git", "rev-parse", "--short=12", "HEAD"])
    if not commit:
        return None
    dirty = run(["git", "status", "--porcelain", "--untracked-files=no", "--", *SOURCES])
    return commit + ("+dirty" if dirty else "")


def last_source_commit_time() -> int | None:
    ct = run(["git", "log", "-1", "--format=%ct", "--", *SOURCES])
    return int(ct) if ct and ct.isdigit() else None


def describe(engine: Engine) -> dict[str, Any]:
    ver = engine.version()
    components = {c["Name"]: c.get("Version") for c in ver.get("Components") or []}
    mem_kib = procfs.meminfo_kib("MemTotal")
    return {
        "cpu_model": procfs.cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 1024 / 1024, 1) if mem_kib else None,
        "kernel": platform.release(),
        "os": run(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "docker_engine": ver.get("Version"),
        "docker_api": ver.get("ApiVersion"),
        "containerd": components.get("containerd"),
        "runc": components.get("runc"),
        "python": platform.python_version(),
        "mcp_client": version("mcp"),
        "project_commit": project_commit(),
    }
