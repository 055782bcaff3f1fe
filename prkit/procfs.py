"""A process's resources from /proc (Linux): resident memory and CPU time."""

from __future__ import annotations

import os
from pathlib import Path


def rss_kib(pid: int) -> int:
    """Resident memory (VmRSS) in KiB; 0 when /proc does not report it. Raises OSError when the
    process is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
