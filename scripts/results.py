"""What every benchmark script records beside its figures: when, where and how it ran.

A result file committed under docs/results/ holds `{"meta": meta(), ...}`, so the table
that scripts/tables.py rebuilds from it can say which machine and command produced it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str | None:
    """The repository's commit, with '+' when the working tree differs from it."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def meta(**extra) -> dict:
    """The date, the command line, the machine and the commit; plus `extra`."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": [Path(sys.argv[0]).as_posix(), *sys.argv[1:]],
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "commit": commit(),
        **extra,
    }
