"""No leaked state: every per-worker in-flight gauge (requests and tokens) and the load in Envoy's
shared data (`prefix_router_load_{requests,tokens}`, summed from the VMs' load leases: nonzero if
a release never reached shared data, whatever the VM-side gauges say) return to exactly 0 after a
run full of client aborts mid-stream, client timeouts, upstream 500s, upstream resets
(a worker SIGKILLed and restarted again and again) and per-try idle timeouts (a worker 1.5 s slow,
abandoned after 0.5 s and retried elsewhere).

CI runs 2,000 requests; the full run: PREFIX_ROUTER_LEAK_REQUESTS=20000 .venv/bin/pytest -s
tests/reliability/test_no_leaks.py
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from prkit.prom import inflight_and_shared_load as inflight

from .common import chat_body, gen_stack, rng, run_load, vm_failures, wait_inflight_zero

SIM = ["--time-scale", "0.1", "--max-running-requests", "64"]


def test_inflight_gauges_return_to_zero_after_aborts_resets_and_timeouts(capsys):
    n = int(os.environ.get("PREFIX_ROUTER_LEAK_REQUESTS", "2000"))
    workdir = Path(tempfile.mkdtemp(prefix="prefix-router-leak-"))
    s = gen_stack(
        workdir, 4, SIM,
        {"w1": ["--fail-rate", "0.1", "--seed", "7"], "w2": ["--slow-ms", "1500"]},
        "--health-interval", "0.5s", "--per-try-idle-timeout", "0.5s", "--stream-idle-timeout", "5s",
    )
    stop = threading.Event()
    kills = 0

    def chaos():
        nonlocal kills
        delay = 0.5  # first kill early (the CI slice is short), then every ~2 s
        while not stop.wait(delay):
            delay = 1.0
            s.fleet.kill("w3")
            kills += 1
            if stop.wait(1.0):
                break
            s.fleet.start("w3")
        if s.fleet.procs["w3"].poll() is not None:
            s.fleet.start("w3")

    try:
        r0 = rng("leak")
        lock = threading.Lock()
        results: list = []

        def make(k):
            roll = r0.random()
            g = r0.randrange(64)
            stream = roll < 0.6
            kw = {}
            if roll < 0.10:
                kw = {"abort_after_first": True}  # client abort mid-stream (RST)
            elif roll < 0.15:
                kw = {"timeout": 0.02}  # client gives up before the answer
            return chat_body(g, k, stream=stream, max_tokens=8 + k % 24), g, kw

        chaos_t = threading.Thread(target=chaos, daemon=True)
        chaos_t.start()
        t0 = time.monotonic()
        threads = run_load(s.envoy.listener_port, threads=8, stop_at=t0 + 600, max_requests=n, make=make,
                           results=results, lock=lock)
        for t in threads:
            t.join(timeout=660)
        stop.set()
        chaos_t.join(timeout=60)
        elapsed = time.monotonic() - t0
        assert len(results) == n

        gauges = wait_inflight_zero(s.envoy, timeout_s=30)
        stats = s.envoy.stats()
        errors = Counter(r.error.split(":")[0] for r in results if not r.ok)
        summary = {
            "sent": n,
            "aborted_by_client": sum(r.aborted for r in results),
            "succeeded": sum(r.ok and not r.aborted for r in results),
            "failed": sum(not r.ok for r in results),
            "errors": dict(errors),
            "worker_kills": kills,
            "upstream_retries": sum(v for k, v in stats.items() if k.startswith("envoy_cluster_upstream_rq_retry{")),
            "per_try_idle_timeouts": sum(v for k, v in stats.items()
                                         if k.startswith("envoy_cluster_upstream_rq_per_try_idle_timeout{")),
            "seconds": round(elapsed, 1),
        }
        with capsys.disabled():
            print(f"\n[no leaks] {summary}\n[no leaks] gauges after: {gauges}")
        # requests + tokens for llama_0..llama_3, and the shared-data load
        assert len(gauges) == 8 + 2, gauges
        assert gauges["prefix_router_load_requests"] == 0 and gauges["prefix_router_load_tokens"] == 0
        assert all(v == 0 for v in gauges.values()), gauges
        # the faults really happened
        assert summary["aborted_by_client"] > 0 and kills > 0 and summary["failed"] > 0
        assert not vm_failures(s.envoy)
        # and nothing is charged any more: a burst of fresh requests sees all workers idle
        assert inflight(s.envoy.stats()) == gauges
    finally:
        stop.set()
        s.close()
