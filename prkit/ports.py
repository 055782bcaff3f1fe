"""Free loopback ports.

`free_port()` asks the kernel for an unused port and never returns one this process handed out
before: nothing is bound between the call and the server's start, so the kernel may give the same
ephemeral port to two calls in a row (a 16-worker fleet once got two workers on one port). Other
processes can still take a port in that window; callers start their servers promptly.
"""

from __future__ import annotations

import socket
import threading

_HANDED_OUT: set[int] = set()
_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        with _LOCK:
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


def port_pair() -> int:
    """A free port P whose successor P + 1 is free too (for consecutive-port fleets)."""
    while True:
        base = free_port()
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        with _LOCK:
            if base + 1 in _HANDED_OUT:
                continue
            _HANDED_OUT.add(base + 1)
        return base
