"""Waiting for a condition up to a deadline.

Tests on a loaded 2-core machine must not assert how long something took; they wait for the
state they expect, with a generous deadline, and fail naming what never happened.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Callable, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0


class Timeout(AssertionError):
    """A condition did not hold by its deadline (an AssertionError: tests report it as a failure)."""


def wait_until(cond: Callable[[], T], what: str | Callable[[], str] = "condition",
               timeout_s: float = DEFAULT_TIMEOUT_S, every_s: float = 0.05) -> T:
    """Polls `cond` until it returns something truthy, and returns that. At the deadline raises
    Timeout naming `what` (a string, or a callable evaluated then, e.g. to show the last state)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            msg = what() if callable(what) else what
            raise Timeout(f"timed out after {timeout_s:.0f}s waiting for: {msg}")
        time.sleep(every_s)


def poll(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float = DEFAULT_TIMEOUT_S,
         every_s: float = 0.1) -> T:
    """Reads `read()` until `done(value)` or the deadline; returns the last value either way (for
    callers that assert on it and show it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = read()
        if done(v) or time.monotonic() > deadline:
            return v
        time.sleep(every_s)


def http_ok(url: str, timeout_s: float = 1.0, method: str = "GET", body: bytes | None = None) -> bool:
    """True when `url` answers 200 (any connection error or other status: False)."""
    try:
        req = urllib.request.Request(url, data=body, method=method,
                                     headers={"content-type": "application/json"} if body else {})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def wait_http(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, method: str = "GET",
              body: bytes | None = None) -> None:
    """Waits until `url` answers 200."""
    wait_until(lambda: http_ok(url, 2.0, method, body), f"{method} {url} answering 200", timeout_s, 0.1)
