"""Reliability harness: a fleet of real `sglang-sim` workers behind a real Envoy running the
compiled filter with a config rendered by envoy/gen (health checks, outlier detection, retries to
another worker), plus a small threaded HTTP client that records what happened to every request.

The fleet, the Envoy process, ports and binaries come from prkit.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prkit.build import wasm_path
from prkit.envoy import Envoy
from prkit.envoy import wait_inflight_zero as envoy_wait_inflight_zero
from prkit.envoy_config import run_gen
from prkit.fleet import SimFleet
from prkit.ports import free_port
from prkit.wait import wait_until

MODEL = "llama"
DECISION = "x-prefix-router-decision"


def gen_config(workers: dict[str, int], listen: int, admin: int, *extra: str) -> str:
    """envoy/gen output for 127.0.0.1 workers (model `llama`, clusters llama_0..), debug header on,
    no rate limit, no stats listener (the tests read the admin directly)."""
    spec = ",".join(f"127.0.0.1:{p}" for p in workers.values())
    return run_gen("--model", f"{MODEL}={spec}", "--listen", f"127.0.0.1:{listen}",
                   "--admin", f"127.0.0.1:{admin}", "--stats-listen", "none", "--wasm", str(wasm_path()),
                   "--debug-header", "--rate-limit", "0", *extra)


def start_envoy(config: str, workdir: Path, listen: int, admin: int) -> Envoy:
    """An Envoy for the reliability tests: warn logs, 2 s drain, 4 s parent shutdown (hot restart)."""
    return Envoy(config, listener_port=listen, admin_port=admin, workdir=workdir, log_level="warn",
                 drain_time_s=2, parent_shutdown_s=4).start()


def wait_inflight_zero(envoy: Envoy, timeout_s: float = 30.0) -> dict:
    """Waits (up to `timeout_s`) until every in-flight gauge, VM-side and shared-data, is 0;
    returns them as last seen (the caller asserts)."""
    return envoy_wait_inflight_zero(envoy, timeout_s, shared_load=True)


def vm_failures(envoy: Envoy) -> list[str]:
    """Wasm VM reloads (a trapped filter) and wasm error log lines: must stay empty."""
    return envoy.wasm_errors()


# --------------------------------------------------------------------------------------------
# Client side
# --------------------------------------------------------------------------------------------


@dataclass
class Result:
    start: float
    end: float = 0.0
    status: int = 0
    ok: bool = False
    error: str = ""
    cluster: str = ""  # the filter's first choice (debug header)
    reason: str = ""
    served_by: str = ""  # x-worker-id
    attempts: int = 0
    stream: bool = False
    group: int = -1
    aborted: bool = False


def chat_body(group: int, i: int, stream: bool, max_tokens: int = 16) -> dict:
    system = f"Prefix group {group}. " + "You are a careful assistant who answers briefly. " * 12
    return {"model": MODEL, "stream": stream, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]}


def _rst_close(sock):
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def one_request(port: int, body: dict, *, group: int = -1, abort_after_first: bool = False,
                timeout: float = 30.0, path: str = "/v1/chat/completions", method: str = "POST") -> Result:
    """One request on a fresh connection. Streaming: reads every SSE frame and requires [DONE];
    abort_after_first cuts the connection (RST) after the first body bytes."""
    res = Result(start=time.monotonic(), stream=bool(body.get("stream")), group=group)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = json.dumps(body).encode()
        conn.request(method, path, body=payload, headers={"content-type": "application/json"})
        r = conn.getresponse()
        res.status = r.status
        d = r.getheader(DECISION) or ""
        parts = dict(p.strip().split("=", 1) for p in d.split(";") if "=" in p)
        # the worker the filter chose: `chosen` when a fallback served (`worker` names that one)
        res.cluster, res.reason = parts.get("chosen") or parts.get("worker", ""), parts.get("reason", "")
        res.served_by = r.getheader("x-worker-id") or ""
        res.attempts = int(r.getheader("x-envoy-attempt-count") or 0)
        if abort_after_first:
            r.read(1)
            res.aborted = True
            _rst_close(conn.sock)
            conn.sock = None
            res.ok = True
            return res
        data = r.read()
        if r.status != 200:
            res.error = f"http {r.status}: {data[:160]!r}"
        elif res.stream:
            res.ok = data.rstrip().endswith(b"data: [DONE]")
            if not res.ok:
                res.error = f"incomplete stream: {data[-120:]!r}"
        else:
            res.ok = b'"choices"' in data
            if not res.ok:
                res.error = f"bad body {data[:160]!r}"
    except (OSError, http.client.HTTPException) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.end = time.monotonic()
        conn.close()
    return res


def run_load(port: int, *, threads: int, stop_at: float, max_requests: int, make, results: list,
             lock: threading.Lock, stop: threading.Event | None = None):
    """`threads` closed-loop clients until `stop_at` (monotonic), `stop` is set or `max_requests` in total;
    make(k) -> (body, group, kwargs) for the k-th request."""
    counter = itertools.count()

    def loop():
        while time.monotonic() < stop_at and not (stop is not None and stop.is_set()):
            k = next(counter)
            if k >= max_requests:
                return
            body, group, kw = make(k)
            r = one_request(port, body, group=group, **kw)
            with lock:
                results.append(r)

    ts = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    return ts


@dataclass
class Stack:
    fleet: SimFleet
    envoy: Envoy
    workdir: Path
    clusters: dict = field(default_factory=dict)  # worker name -> cluster name

    def close(self):
        self.envoy.stop()
        self.fleet.stop()


def gen_stack(workdir: Path, n: int, sim_args: list[str], per_worker: dict | None = None, *gen_extra: str) -> Stack:
    fleet = SimFleet(n, workdir, sim_args, models=MODEL, per_worker=per_worker)
    fleet.start()
    listen, admin = free_port(), free_port()
    clusters = {w: f"{MODEL}_{i}" for i, w in enumerate(fleet.names)}
    try:
        envoy = start_envoy(gen_config(fleet.ports, listen, admin, *gen_extra), workdir, listen, admin)
        wait_primaries_healthy(envoy, fleet, clusters)
    except Exception:
        fleet.stop()
        raise
    return Stack(fleet, envoy, workdir, clusters)


def wait_primaries_healthy(envoy: Envoy, fleet: SimFleet, clusters: dict, timeout_s: float = 120.0) -> None:
    """Every worker healthy in its own cluster before the first request: a first health check that
    times out on a loaded machine leaves the host unhealthy until a later one passes, and its
    cluster's traffic would go to the fallbacks meanwhile."""
    def health():
        return {w: envoy.host_health(c, f"127.0.0.1:{fleet.ports[w]}") for w, c in clusters.items()}

    wait_until(lambda: all(h == "healthy" for h in health().values()), lambda: f"workers healthy in Envoy: {health()}",
               timeout_s, 0.1)


def rng(seed: str) -> random.Random:
    return random.Random(seed)
