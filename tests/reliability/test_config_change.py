"""A config change (one more worker) applied by Envoy hot restart (`--restart-epoch 1`, same
`--base-id`) keeps serving: clients running through the restart see no failed request, the new
worker receives traffic from the new epoch, and the old epoch drains and exits.

A hot restart starts a new process, so the new epoch's filter starts with an empty prefix index
and zero loads (shared data is per process): nothing from the old worker set can be chosen. The
in-process reload case (old and new plugin configs on one shared-data store, entries held by a
removed worker) is tested on the real .wasm in harness/tests/reload.rs.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from prkit.wait import wait_until

from .common import (
    SimFleet,
    chat_body,
    free_port,
    gen_config,
    one_request,
    rng,
    run_load,
    start_envoy,
    vm_failures,
    wait_inflight_zero,
)


def test_hot_restart_with_an_added_worker_keeps_serving(capsys):
    workdir = Path(tempfile.mkdtemp(prefix="prefix-router-hot-"))
    fleet = SimFleet(4, workdir, ["--time-scale", "0.1"])
    fleet.start()
    listen, admin0, admin1 = free_port(), free_port(), free_port()
    three = {w: fleet.ports[w] for w in ("w0", "w1", "w2")}
    e0 = e1 = None
    stop = threading.Event()  # ends the clients (also when the test fails)
    try:
        e0 = start_envoy(gen_config(three, listen, admin0, "--health-interval", "1s"), workdir, listen, admin0)
        r0 = rng("hot")
        results: list = []
        lock = threading.Lock()

        def make(k):
            g = r0.randrange(48)
            return chat_body(g, k, stream=k % 3 == 0, max_tokens=8), g, {}

        threads = run_load(listen, threads=4, stop_at=time.monotonic() + 600, max_requests=1_000_000, make=make,
                           results=results, lock=lock, stop=stop)

        def done(pred) -> int:
            with lock:
                return sum(1 for r in results if pred(r))

        # Phases end on conditions (a loaded machine only makes them slower): traffic flowing,
        # then the new epoch ready, then enough requests answered after it.
        wait_until(lambda: done(lambda r: r.ok) >= 50, "50 requests served by epoch 0", 120)
        t_restart = time.monotonic()
        # epoch 1 on the same base id (Envoy.hot_restart); e0 drains and exits by itself
        e1 = e0.hot_restart(gen_config(fleet.ports, listen, admin1, "--health-interval", "1s"), admin_port=admin1)
        t_ready = time.monotonic()
        try:
            wait_until(lambda: done(lambda r: r.start > t_ready + 1.0) >= 100,
                       "100 requests answered after the new epoch was ready", 120)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        # the old epoch drains and exits (parent-shutdown-time 4 s)
        e0.proc.wait(timeout=30)

        failed = [r for r in results if not r.ok]
        after = [r for r in results if r.start > t_ready + 1.0]
        served_after = Counter(r.served_by for r in after)
        with capsys.disabled():
            print(f"\n[hot restart] sent {len(results)}, failed {len(failed)}, new epoch ready "
                  f"{t_ready - t_restart:.2f}s after launch; served after it: {dict(served_after)}")
        assert not failed, [(r.error, r.start - t_restart) for r in failed[:10]]
        assert after and served_after["w3"] > 0, served_after
        assert {r.cluster for r in after} <= {"llama_0", "llama_1", "llama_2", "llama_3"}
        # the new epoch serves alone now; its gauges are back to 0
        r = one_request(listen, chat_body(999, 0, False))
        assert r.ok, r
        assert all(v == 0 for v in wait_inflight_zero(e1).values())
        assert len(wait_inflight_zero(e1)) == 8 + 2  # 4 workers x (requests, tokens) + shared load
        assert not vm_failures(e1)
    finally:
        stop.set()
        for e in (e1, e0):
            if e is not None:
                e.stop()
        fleet.stop()
