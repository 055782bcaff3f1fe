"""A retry's hit rate: where the next turn of a conversation goes when the worker holding it is
down, with the pool's load balancer override_host (envoy/gen's default) or the native module
(`--native-lb`, filter/src/native/lb/), on the native filter in the real Envoy 1.40.

A pool of 4 fake workers (one EDS cluster, --fallbacks 3); `--conversations` conversations open
on it; the worker holding the most of them goes down (connections refused); then each of its
conversations sends its next turn, one after another. A turn is a hit when the worker that served
it is the next host the filter listed after the dead one (its next holder by cached prefix, from
the destination header in Envoy's access log). Scenarios:
  refused    Envoy's health checks do not know yet (--health-interval 60s): only the failed
             attempt (and outlier detection, after 5 failures) tells;
  unhealthy  Envoy's health checks already hold it unhealthy (--health-interval 1s, the turns
             start as soon as the admin shows it) while the filter, which reads the pool's health
             every 4 s, still names it first.
Prints, per load balancer and scenario: turns, hits, turns that failed, and Envoy's attempts.

  benches/lb-retry                       # both scenarios, 24 conversations
  benches/lb-retry --conversations 60
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
import time
from pathlib import Path

from prkit.native_pool import NativePool, next_turn, opening
from prkit.wait import wait_until

SCENARIOS = {"refused": {"health_interval": "60s", "membership_ms": 4000},
             "unhealthy": {"health_interval": "1s", "membership_ms": 4000}}


def run(native_lb: bool, scenario: str, conversations: int, tmp: Path) -> dict:
    pool = NativePool(tmp, native_lb, n=4, fallbacks=3, **SCENARIOS[scenario])
    try:
        held = collections.defaultdict(list)
        for _ in range(conversations):
            msgs = opening()
            worker, _, _ = pool.chat(msgs)
            held[worker].append(msgs)
        down = max(held, key=lambda w: len(held[w]))
        pool.worker(down).close()
        if scenario == "unhealthy":
            wait_until(lambda: down not in pool.healthy(), f"Envoy's health checks failing {down}", 30, 0.02)
        out = {"turns": 0, "hits": 0, "failed": 0, "not_named_first": 0, "attempts": 0}
        tags = []
        for i, msgs in enumerate(held[down]):
            tag = f"{scenario}-{i}-{time.monotonic_ns()}"
            try:
                worker, _, attempts = pool.chat(next_turn(msgs), tag=tag)
            except AssertionError:
                out["failed"] += 1
                continue
            tags.append((tag, worker, attempts))
        for tag, worker, attempts in tags:
            listed = pool.listed(tag)
            if not listed or listed[0] != down:
                out["not_named_first"] += 1  # the filter already knew: not a retry measurement
                continue
            out["turns"] += 1
            out["attempts"] += attempts
            out["hits"] += int(len(listed) > 1 and worker == listed[1])
        out["lb_stats"] = pool.lb_stats() if native_lb else {}
        return out
    finally:
        pool.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pr-lb-retry-"))
    rows = []
    try:
        for scenario in args.scenarios:
            for native_lb in (False, True):
                r = run(native_lb, scenario, args.conversations, tmp / f"{scenario}-{native_lb}")
                rows.append((scenario, "native LB" if native_lb else "override_host", r))
                print(scenario, rows[-1][1], r, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| scenario | load balancer | turns of the down worker | retry on the next holder | failed | attempts/turn |")
    print("|---|---|---|---|---|---|")
    for scenario, lb, r in rows:
        n = r["turns"]
        rate = f"{r['hits']}/{n} ({r['hits'] / n:.0%})" if n else "-"
        att = f"{r['attempts'] / n:.2f}" if n else "-"
        print(f"| {scenario} | {lb} | {n} | {rate} | {r['failed']} | {att} |")


if __name__ == "__main__":
    main()
