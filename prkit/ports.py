"""Free loopback ports for the fleets, Envoys and clients that tests, load tools and benches start.

A port handed out here is free when handed out, is never handed out again by any prkit process
while this process lives, and lies outside the kernel's ephemeral range:

- Outside `/proc/sys/net/ipv4/ip_local_port_range`: the kernel gives ephemeral ports to every
  outgoing connection (clients, Envoy's upstream pools, k6), and one of them can take a port
  between the hand-out and the server's bind; a listener that then fails to bind, or a test that
  reaches another test's listener on that port, is a false failure.
- Claimed across processes: each port is claimed by an fcntl record lock on its byte in one lock
  file per user, held until this process exits (the kernel drops it even on SIGKILL). Parallel
  pytest workers, the load tools they start and anything else importing prkit never share one.
  A process's own locks never conflict with each other, so a set keeps one process from handing
  out a port twice. POSIX locks end when the process closes any descriptor of the file: the file
  is opened once and never closed.

Nothing is bound between the hand-out and the server's start, so a process outside prkit can
still take the port; callers start their servers promptly. Cost: one lock and one bind per call.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import threading
from pathlib import Path

# The lowest port handed out: below it sit the ports services and demos listen on by convention.
FLOOR = 15000
# A range narrower than this is not worth using; the whole unprivileged range is used instead.
MIN_SPAN = 2048
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_LOCK = threading.Lock()
_HANDED_OUT: set[int] = set()
_state: dict = {}


def candidate_range(ephemeral: tuple[int, int] | None) -> range:
    """Ports to hand out: below the ephemeral range (from FLOOR), else above it, else (a range
    too narrow either side, or none known) all unprivileged ports."""
    if ephemeral is not None:
        lo, hi = ephemeral
        if lo - FLOOR >= MIN_SPAN:
            return range(FLOOR, lo)
        if 65535 - hi >= MIN_SPAN:
            return range(hi + 1, 65536)
    return range(1024, 65536)


def _ephemeral() -> tuple[int, int] | None:
    try:
        lo, hi = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return None
    return lo, hi


def _lock_fd() -> int:
    fd = _state.get("fd")
    if fd is None:
        path = Path(tempfile.gettempdir()) / f"prkit-ports-{os.getuid()}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        _state["fd"] = fd
    return fd


def _claim(port: int) -> bool:
    """Locks `port`'s byte (False if another process holds it)."""
    try:
        fcntl.lockf(_lock_fd(), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return False
    return True


def _release(port: int) -> None:
    fcntl.lockf(_lock_fd(), fcntl.LOCK_UN, 1, port)


def _bindable(host: str, port: int) -> bool:
    # No SO_REUSEADDR: a port with a live socket of any state (TIME_WAIT included) is skipped.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _take(host: str, port: int) -> bool:
    """Claims `port` for this process if nobody (here or elsewhere) has it and it binds now."""
    if port in _HANDED_OUT or not _claim(port):
        return False
    if not _bindable(host, port):
        _release(port)
        return False
    _HANDED_OUT.add(port)
    return True


def _scan(host: str, width: int) -> int:
    """The next port P (from a per-process random start) with P .. P + width - 1 all taken."""
    ports = _state.get("range")
    if ports is None:
        ports = _state["range"] = candidate_range(_ephemeral())
        _state["next"] = random.randrange(len(ports))
    n = len(ports)
    for _ in range(n):
        i = _state["next"]
        _state["next"] = (i + 1) % n
        base = ports[i]
        if base + width - 1 > ports[-1]:
            continue
        taken = []
        for p in range(base, base + width):
            if not _take(host, p):
                break
            taken.append(p)
        if len(taken) == width:
            return base
        for p in taken:  # a pair half-taken: give the first half back
            _HANDED_OUT.discard(p)
            _release(p)
    raise RuntimeError(f"no free port left in {ports.start}..{ports.stop - 1}")


def free_port(host: str = "127.0.0.1") -> int:
    with _LOCK:
        return _scan(host, 1)


def port_pair() -> int:
    """A free port P whose successor P + 1 is free too (for consecutive-port fleets)."""
    with _LOCK:
        return _scan("127.0.0.1", 2)
