#!/usr/bin/env python3
"""Envoy RSS while many distinct prompt prefixes flow through the filter.

Envoy never deletes shared-data keys, so a filter that created one key per prefix would grow
without bound; prefix-router's index is a fixed slot table (`index.capacity` entries, capacity/4
keys per model), so RSS must flatten once the table is full, whatever the number of prefixes.

    .venv/bin/python -m tests.reliability.memory --prefixes 1000000    # the full run (repository root)
    .venv/bin/python -m tests.reliability.memory --prefixes 20000 --capacity 1024

Real Envoy (demo config, the plugin's index.capacity overridden) in front of 4 `sglang-sim`
workers answering at once (--time-scale 0, 1 output token); every prompt is distinct from its
first block on and ~1 KiB long (16 blocks -> 8 index checkpoints). Prints RSS samples and the
growth after the table filled. tests/reliability/test_memory.py runs a small slice in CI.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from prkit import envoy_config as ec
from prkit.build import wasm_path
from prkit.envoy import Envoy
from prkit.fleet import SimFleet
from prkit.ports import free_port
from prkit.procfs import rss_kib

FILLER = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor " * 13


def run(prefixes: int, capacity: int, threads: int = 4, samples: int = 20, log=print) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="prefix-router-mem-"))
    fleet = SimFleet(4, workdir, ["--time-scale", "0", "--max-total-tokens", "200000"])
    # the demo config's plugin names w0..w3 in model "llama"; the sims must serve that name
    fleet.start()
    listen, admin = free_port(), free_port()
    text = ec.render(ec.local_demo(fleet.ports, listen=listen, admin=admin, wasm=str(wasm_path()),
                                   plugin={"index": {"capacity": capacity}, "debug_header": None}))
    envoy = Envoy(text, listener_port=listen, admin_port=admin, workdir=workdir, log_level="warn")
    try:
        envoy.start()
        counter = itertools.count()
        errors = [0]
        done = [0]
        lock = threading.Lock()

        def worker():
            conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=30)
            while True:
                i = next(counter)
                if i >= prefixes:
                    break
                body = json.dumps({"model": "llama", "prompt": f"{i:09d} {FILLER}", "max_tokens": 1})
                try:
                    conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
                    r = conn.getresponse()
                    r.read()
                    ok = r.status == 200
                except (OSError, http.client.HTTPException):
                    ok = False
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=30)
                with lock:
                    done[0] += 1
                    errors[0] += not ok
            conn.close()

        t0 = time.monotonic()
        rss0 = rss_kib(envoy.proc.pid)
        ts = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
        for t in ts:
            t.start()
        points = []
        step = max(1, prefixes // samples)
        next_mark = step
        while any(t.is_alive() for t in ts):
            time.sleep(0.05)
            if done[0] >= next_mark:
                points.append((done[0], rss_kib(envoy.proc.pid)))
                log(f"  {done[0]:>9} prefixes  RSS {points[-1][1] / 1024:7.1f} MiB  "
                    f"({done[0] / (time.monotonic() - t0):.0f} req/s)")
                next_mark += step
        for t in ts:
            t.join()
        points.append((done[0], rss_kib(envoy.proc.pid)))
        stats = envoy.stats()
        writes = stats.get("prefix_router_index_writes", 0)
        # the table (capacity entries, 8 checkpoints per prompt) is surely full after
        # 4 * capacity / 8 prompts; growth is measured from the first sample past that
        full_at = max(capacity // 2, step)
        base = next((p for p in points if p[0] >= full_at), points[0])
        return {
            "prefixes": done[0], "errors": errors[0], "capacity": capacity,
            "seconds": round(time.monotonic() - t0, 1), "rss_start_kib": rss0,
            "rss_after_fill_kib": base[1], "rss_end_kib": points[-1][1],
            "growth_after_fill_kib": points[-1][1] - base[1], "max_rss_kib": max(p[1] for p in points),
            "index_writes": writes, "samples": points,
        }
    finally:
        envoy.stop()
        fleet.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", type=int, default=1_000_000)
    ap.add_argument("--capacity", type=int, default=262_144, help="index.capacity (entries per model)")
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    r = run(args.prefixes, args.capacity, args.threads)
    r.pop("samples")
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
