"""The callgrind table (`benches/overhead --callgrind`): Envoy's instructions per request."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from .common import KINDS, all_proxies, body_of_size, meter, rotated


def sequential(url: str, body: bytes, n: int):
    """n POSTs one after another on one keep-alive connection; raises on anything but 200."""
    import http.client
    from urllib.parse import urlparse
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        for _ in range(n):
            c.request("POST", u.path, body, {"content-type": "application/json"})
            r = c.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"status {r.status}")
    finally:
        c.close()


def upstream_requests(admin: int) -> tuple[int, dict]:
    """Envoy's upstream requests over all clusters (the requests sent plus the filter's HTTP
    calls: load polls and counter reads go to the worker clusters) and the filter's poll
    counters, from the admin's /stats (read outside the counted window: it costs instructions)."""
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats", timeout=120).read().decode()
    rq, polls = 0, {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if name.startswith("cluster.") and name.endswith(".upstream_rq_total"):
            rq += int(value)
        elif ("prefix_router.load_poll." in name or "prefix_router.hit_check.failures" in name) and value.isdigit():
            # Envoy may prefix a Wasm filter's metric names (`wasmcustom.`)
            polls[name.partition("prefix_router.")[2]] = int(value)
    return rq, polls


def run_count_table(args, tmp: Path, upstream: int):
    """`--callgrind`: Envoy's instructions per request (all its threads, so the main thread's
    timers and load polls count too), `--requests` requests sent one after another after 50
    warm-up requests; each round counts every kind once, in a rotated order. Each line also
    prints the window's requests per second under valgrind: the per-second costs are divided
    by it, so it moves with the machine's load."""
    kinds = [k for k, _ in KINDS if k in args.kinds]
    labels = dict(KINDS)
    runs: dict = {}
    with all_proxies(kinds, tmp, upstream, callgrind=True) as proxies:
        meters = {k: meter(p, k, tmp, True) for k, (p, _) in proxies.items()}
        for r in range(args.rounds):
            for kb in args.sizes:
                body = body_of_size(kb)
                for kind in rotated(kinds, r):
                    proc, url = proxies[kind]
                    start, stop = meters[kind]
                    sequential(url, body, 50)
                    rq0, polls0 = upstream_requests(proc.admin)
                    start()
                    t0 = time.monotonic()
                    sequential(url, body, args.requests)
                    secs = time.monotonic() - t0
                    per = stop() / args.requests
                    rq1, polls1 = upstream_requests(proc.admin)
                    runs.setdefault((kind, kb), []).append(per)
                    # The window's rate: per-second costs (timers, load polls) are divided by it;
                    # the filter's HTTP calls (upstream requests beyond the ones sent) per second.
                    calls = rq1 - rq0 - args.requests
                    moved = {k: v - polls0.get(k, 0) for k, v in polls1.items() if v != polls0.get(k, 0)}
                    print(f"round {r + 1} {labels[kind]:52s} {kb:3d} KB  {per:10,.0f} instructions/request"
                          f"  ({args.requests / secs:,.0f} requests/s; filter HTTP calls {calls} in {secs:.1f} s"
                          f"{', ' + ', '.join(f'{k} +{v}' for k, v in sorted(moved.items())) if moved else ''})",
                          flush=True)
    med = statistics.median
    print()
    print(f"Envoy instructions per request, medians over {args.rounds} round(s); (x): median of each round's "
          "ratio to (ii) Envoy + buffer filter [range]:")
    print("| prompt | proxy | instructions / request | vs (ii) |")
    print("|---|---|---|---|")
    for kb in args.sizes:
        base = runs.get(("envoy_buffer", kb))
        for k in kinds:
            v = med(runs[(k, kb)])
            rs = [a / b for a, b in zip(runs[(k, kb)], base)] if base else []
            ratio = f"{med(rs):.3f}x [{min(rs):.3f}-{max(rs):.3f}]" if rs else ""
            print(f"| {kb} KB | {labels[k]} | {v:,.0f} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k}/{kb}": v for (k, kb), v in runs.items()}, indent=1))
