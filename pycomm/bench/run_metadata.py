"""Where and how a run was made: the host, the checkout's git state, the command and the
configuration; parent side, torch-free (the library versions come from the caller).
"""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from typing import Dict, Optional

from .config import MODES, Config


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; all of them where the platform
    has no sched_getaffinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def git_state() -> Optional[dict]:
    """Commit and dirtiness of the checkout this package runs from (best effort)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", ".."],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def environment(cfg: Config, versions: Dict[str, str]) -> dict:
    """Where and how the run was made: every JSON line carries it, the document holds it."""
    from dataclasses import asdict

    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_state(),
        "command": cfg.command,
        "world_size": cfg.nranks,
        "launcher": cfg.launcher,
        "mode": {"name": cfg.mode, "meaning": MODES[cfg.mode]},
        "host": {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
                 "usable_cpus": usable_cpus(), "platform": platform.platform(),
                 "python": sys.version.split()[0], "versions": versions},
        "config": asdict(cfg),
    }
