#!/usr/bin/env python3
"""Mirrors this checkout's files into DIR, where scripts/test.sh builds (docs/testing.md, "Time
budget"): every file git tracks or would track (untracked ones not ignored), byte for byte, and
nothing else but DIR/target, cargo's output, which stays.

    python3 scripts/mirror-checkout.py DIR

A file whose bytes are already there is left alone, modification time included, and one that
differs is written anew (its time is now): cargo, which decides what to rebuild by comparing
times, then rebuilds exactly what changed since the last build in DIR, whichever checkout that
build came from. Files in DIR that are no longer in the checkout are removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

KEEP = "target"  # DIR/target: the build itself


def checkout_files(root: Path) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, check=True, capture_output=True,
    ).stdout.split(b"\0")
    # A tracked file deleted in the working tree is not there to mirror.
    return sorted(name.decode() for name in listed if name and (root / name.decode()).is_file())


def same_bytes(a: Path, b: Path) -> bool:
    if not b.is_file() or b.is_symlink() or a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            chunk = fa.read(1 << 20)
            if chunk != fb.read(1 << 20):
                return False
            if not chunk:
                return True


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[1]
    dest = Path(sys.argv[1]).resolve()
    if dest == root or root in dest.parents:
        print(f"mirror-checkout: {dest} is inside the checkout", file=sys.stderr)
        return 2
    files = checkout_files(root)
    wanted = set(files)
    written = 0
    for name in files:
        source, target = root / name, dest / name
        if same_bytes(source, target):
            if (os.stat(target).st_mode & 0o777) != (os.stat(source).st_mode & 0o777):
                shutil.copymode(source, target)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.is_symlink():
            target.unlink()
        shutil.copyfile(source, target)
        shutil.copymode(source, target)
        written += 1
    removed = 0
    for directory, subdirectories, names in os.walk(dest, topdown=False):
        here = Path(directory)
        if here == dest / KEEP or dest / KEEP in here.parents:
            continue
        for name in names:
            path = here / name
            if str(path.relative_to(dest)) not in wanted:
                path.unlink()
                removed += 1
        for name in subdirectories:
            path = here / name
            if path != dest / KEEP and path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()
    print(f"mirror-checkout: {len(files)} files in {dest}: {written} written, {removed} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
