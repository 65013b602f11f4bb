"""Readings from /proc: memory and CPU of a process, its children, and processes found by
their environment (how the suites and benchmarks find the servers they started)."""

from __future__ import annotations

import os
from pathlib import Path


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and
    parentheses): [0] is the state, [1] the parent pid, [11..14] the CPU ticks."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def _kib_field(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def status_kib(pid: int, key: str = "VmRSS") -> int | None:
    """A `kB` field of /proc/<pid>/status (VmRSS = resident now, VmHWM = peak resident)."""
    return _kib_field(f"/proc/{pid}/status", key)


def meminfo_kib(key: str) -> int | None:
    """A field of /proc/meminfo (MemTotal, MemAvailable, …), in KiB."""
    return _kib_field("/proc/meminfo", key)


def ppid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def alive(pid: int) -> bool:
    """The process exists and is neither a zombie nor dead."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def cpu_ticks(pid: int, children: bool = False) -> int | None:
    """utime + stime, and cutime + cstime of reaped children if asked, in clock ticks."""
    fields = _stat_fields(pid)
    if not fields:
        return None
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks


def cpu_seconds(pid: int) -> float | None:
    ticks = cpu_ticks(pid)
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


def pids_with_environ(needle: str, *, whole_entry: bool = False) -> list[int]:
    """Live processes (other than this one) whose environment contains `needle`: anywhere in
    it, or, with `whole_entry`, as one complete `NAME=value` entry."""
    me = os.getpid()
    found = []
    for pid in _pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if whole_entry:
            matched = needle.encode() in environ.split(b"\0")
        else:
            matched = needle.encode() in environ
        if matched and alive(pid):
            found.append(pid)
    return found


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for candidate in _pids():
        parent = ppid(candidate)
        if parent is not None:
            children.setdefault(parent, []).append(candidate)
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def pids_by_comm(comm: str) -> list[int]:
    found = []
    for pid in _pids():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                found.append(pid)
        except OSError:
            pass
    return found


def pid_with_cmdline(program_part: bytes, argument: bytes) -> int | None:
    """The first process whose argv[0] contains `program_part` and which has `argument` as
    one of its arguments (e.g. the containerd shim of one container)."""
    for pid in _pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and program_part in argv[0] and argument in argv:
            return pid
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"
