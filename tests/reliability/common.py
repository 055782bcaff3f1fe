"""Reliability harness: a fleet of real `sglang-sim` workers behind a real Envoy running the
compiled filter with a config rendered by envoy/gen (health checks, outlier detection, retries to
another worker), plus a small threaded HTTP client that records what happened to every request.

Reuses tests/integration/harness.py (config rendering helpers, prometheus parsing, wasm path) and
tests/sim/conftest.py (simulator binary). Envoys started here take their own --base-id range so
they never collide with the integration suite's session Envoy.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import tests.integration.harness as _it_harness  # noqa: E402
from tests.integration.harness import envoy_binary, free_port, parse_prometheus, wasm_path  # noqa: E402

# Imported here as `tests.integration.harness`, a second module object beside the integration
# suite's `integration.harness`: move its Envoy base-id sequence away from the one the
# integration suite's session Envoy uses (same pid, sequence 0 -> same base id otherwise).
_it_harness._ENVOY_SEQ = itertools.count(40)
from tests.sim.conftest import sim_binary  # noqa: E402

GEN = REPO / "envoy" / "gen"
MODEL = "llama"
DECISION = "x-prefix-router-decision"
_SEQ = itertools.count()


def new_base_id() -> int:
    # integration's harness uses (pid % 100000) * 100 + 1000 + [0, 100); take the top of that range
    return (os.getpid() % 100_000) * 100 + 1000 + 70 + next(_SEQ) % 30


class SimFleet:
    """N simulated SGLang workers w0..w(N-1) on fixed loopback ports; each can be killed and
    restarted on its port, and started with its own extra flags."""

    def __init__(self, n: int, workdir: Path, common: list[str], per_worker: dict | None = None):
        self.names = [f"w{i}" for i in range(n)]
        self.ports = {w: free_port() for w in self.names}
        self.common = common
        self.per_worker = per_worker or {}
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str | None = None, timeout_s: float = 30.0):
        for w in [name] if name else self.names:
            log = open(self.workdir / f"{w}.log", "ab")
            self.procs[w] = subprocess.Popen(
                [str(sim_binary()), "--port", str(self.ports[w]), "--model", MODEL, "--worker-id", w,
                 *self.common, *self.per_worker.get(w, [])],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
            log.close()
        deadline = time.monotonic() + timeout_s
        for w in [name] if name else self.names:
            while not self.healthy(w):
                if self.procs[w].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sim {w} did not start: {(self.workdir / f'{w}.log').read_text()[-2000:]}")
                time.sleep(0.05)

    def healthy(self, w: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[w]}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self, w: str, sig=signal.SIGKILL):
        p = self.procs[w]
        p.send_signal(sig)
        p.wait(timeout=30)

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def gen_config(workers: dict[str, int], listen: int, admin: int, *extra: str) -> str:
    """envoy/gen output for 127.0.0.1 workers (model `llama`, clusters llama_0..), debug header on,
    no rate limit, no stats listener (the tests read the admin directly)."""
    spec = ",".join(f"127.0.0.1:{p}" for p in workers.values())
    args = [str(GEN), "--model", f"{MODEL}={spec}", "--listen", f"127.0.0.1:{listen}",
            "--admin", f"127.0.0.1:{admin}", "--stats-listen", "none", "--wasm", str(wasm_path()),
            "--debug-header", "--rate-limit", "0", *extra]
    r = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


class EnvoyProc:
    """One Envoy process (one hot-restart epoch) on a given config file."""

    def __init__(self, config: str, workdir: Path, listen: int, admin: int, *, base_id: int,
                 epoch: int = 0, concurrency: int = 2):
        self.listen, self.admin, self.base_id, self.epoch = listen, admin, base_id, epoch
        self.workdir = workdir
        self.config_path = workdir / f"envoy-{epoch}.yaml"
        self.config_path.write_text(config)
        self.log_path = workdir / f"envoy-{epoch}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [envoy_binary(), "-c", str(self.config_path), "--concurrency", str(concurrency),
                 "--base-id", str(base_id), "--restart-epoch", str(epoch), "--log-level", "warn",
                 "--drain-time-s", "2", "--parent-shutdown-time-s", "4"],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if self.admin_get("/ready", 1.0) == (200, "LIVE\n"):
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"envoy not ready in {timeout_s}s:\n{self.log()[-4000:]}")

    def admin_get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        c = http.client.HTTPConnection("127.0.0.1", self.admin, timeout=timeout)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            c.close()

    def stats(self) -> dict:
        # The filter flushes its batched metric increments on a 200 ms tick: wait one period.
        time.sleep(0.3)
        status, text = self.admin_get("/stats/prometheus")
        assert status == 200, text
        return parse_prometheus(text)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def inflight(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k.startswith("prefix_router_inflight_")}


def wait_inflight_zero(envoy: EnvoyProc, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        g = inflight(envoy.stats())
        if g and all(v == 0 for v in g.values()):
            return g
        if time.monotonic() > deadline:
            return g
        time.sleep(0.2)


def vm_failures(envoy: EnvoyProc) -> list[str]:
    """Wasm VM reloads (a trapped filter) and wasm error log lines: must stay empty."""
    bad = [f"{k}={v}" for k, v in envoy.stats().items() if k.startswith("envoy_wasm_prefix_router_vm_reload") and v]
    bad += [line for line in envoy.log().splitlines() if "][wasm]" in line and ("][error]" in line or "][critical]" in line)]
    return bad


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
    cluster: str = ""  # the filter's decision (debug header)
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
        res.cluster, res.reason = parts.get("worker", ""), parts.get("reason", "")
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
             lock: threading.Lock):
    """`threads` closed-loop clients until `stop_at` (monotonic) or `max_requests` in total;
    make(k) -> (body, group, kwargs) for the k-th request."""
    counter = itertools.count()

    def loop():
        while time.monotonic() < stop_at:
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
    envoy: EnvoyProc
    workdir: Path
    clusters: dict = field(default_factory=dict)  # worker name -> cluster name

    def close(self):
        self.envoy.stop()
        self.fleet.stop()


def gen_stack(workdir: Path, n: int, sim_args: list[str], per_worker: dict | None = None, *gen_extra: str) -> Stack:
    fleet = SimFleet(n, workdir, sim_args, per_worker)
    fleet.start()
    listen, admin = free_port(), free_port()
    try:
        envoy = EnvoyProc(gen_config(fleet.ports, listen, admin, *gen_extra), workdir, listen, admin,
                          base_id=new_base_id()).wait_ready()
    except Exception:
        fleet.stop()
        raise
    return Stack(fleet, envoy, workdir, {w: f"{MODEL}_{i}" for i, w in enumerate(fleet.names)})


def rng(seed: str) -> random.Random:
    return random.Random(seed)
