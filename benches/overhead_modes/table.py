"""The table mode (`benches/overhead`): rps at -c16, p50/p99 at -c1 and the proxy's CPU per
request, per prompt size, for every proxy, with the ratio columns."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from prkit.procfs import cpu_seconds

from .common import KINDS, all_proxies, body_of_size, rotated, wrk


WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("{body}", "rb"); wrk.body = f:read("*a"); f:close()
"""


# The ratio columns of the table, (numerator, denominator), where both kinds ran.
RATIOS = [("prefix_router", "envoy_buffer"), ("wasm_floor", "envoy_buffer"), ("dm_floor", "envoy_buffer"),
          ("prefix_router_dm", "envoy_buffer"), ("prefix_router", "wasm_floor"), ("prefix_router_dm", "dm_floor"),
          ("prefix_router", "smg"), ("prefix_router_dm", "smg")]


def run_table(args, tmp: Path, upstream: int):
    """Every proxy runs for the whole bench; each round measures every kind once per size in a
    rotated order. Cells are medians over rounds; the ratio columns are medians of each round's
    ratio (both sides measured in the same round), with their range when there are rounds."""
    kinds = [k for k, _ in KINDS if k in args.kinds]
    labels = dict(KINDS)
    runs: dict = {}
    with all_proxies(kinds, tmp, upstream) as proxies:
        for r in range(args.rounds):
            for kb in args.sizes:
                bf = tmp / f"body-{kb}.json"
                bf.write_bytes(body_of_size(kb))
                lua = tmp / f"wrk-{kb}.lua"
                lua.write_text(WRK_LUA.format(body=bf))
                for kind in rotated(kinds, r):
                    proc, url = proxies[kind]
                    wrk(url, lua, 4, 1)  # warm-up (index the prompt, JIT, pools)
                    c0 = cpu_seconds(proc.p.pid)
                    thr = wrk(url, lua, args.conns, args.secs)
                    # The proxy's own CPU per request over the throughput run: steadier than rps on
                    # a shared machine (another tenant's load slows every proxy's wall clock).
                    cpu_us = (cpu_seconds(proc.p.pid) - c0) / max(thr["requests"], 1) * 1e6
                    lat = wrk(url, lua, 1, args.secs)
                    res = {"rps": thr["rps"], "p50": lat["p50"], "p99": lat["p99"], "rps_c1": lat["rps"],
                           "p99_cN": thr["p99"], "bad": thr["non2xx"] + lat["non2xx"], "cpu_us": cpu_us}
                    runs.setdefault((kind, kb), []).append(res)
                    print(f"round {r + 1} {labels[kind]:32s} {kb:3d} KB  rps(-c{args.conns}) {res['rps']:9.0f}  "
                          f"CPU {cpu_us:6.1f} us/req  "
                          f"p50(-c1) {res['p50']:7.0f} us  p99(-c1) {res['p99']:7.0f} us  non-2xx {res['bad']}",
                          flush=True)
    med = statistics.median

    def m(k, kb, f):
        return med(x[f] for x in runs[(k, kb)])

    def ratio(a, b, kb, f="rps"):
        rs = [x[f] / y[f] for x, y in zip(runs[(a, kb)], runs[(b, kb)])]
        return f"{med(rs):.2f}" + (f" ({min(rs):.2f}-{max(rs):.2f})" if len(rs) > 1 else "")

    print()
    print(f"Medians over {args.rounds} round(s):")
    print(f"| prompt | proxy | rps (-c{args.conns}) | CPU us/request (-c{args.conns}) | p50 (-c1) us | p99 (-c1) us |")
    print("|---|---|---|---|---|---|")
    for kb in args.sizes:
        for k in kinds:
            print(f"| {kb} KB | {labels[k]} | {m(k, kb, 'rps'):.0f} | {m(k, kb, 'cpu_us'):.1f} | "
                  f"{m(k, kb, 'p50'):.0f} | {m(k, kb, 'p99'):.0f} |")
    print()
    print("Ratios: medians of each round's ratio (both sides measured in the same round), with their range;"
          " added p50: median of each round's p50 difference to plain Envoy:")
    pairs = [(a, b) for a, b in RATIOS if a in kinds and b in kinds]
    added = [k for k in ("prefix_router", "prefix_router_dm") if k in kinds and "envoy" in kinds]
    short = {k: label.split(" ", 1)[0] for k, label in KINDS}
    print("| prompt | " + " | ".join(f"{short[a]}/{short[b]} rps" for a, b in pairs)
          + "".join(f" | {short[a]}/{short[b]} CPU per request" for a, b in pairs)
          + "".join(f" | added p50 {short[k]} us" for k in added) + " |")
    print("|---|" + "---|" * (2 * len(pairs) + len(added)))
    for kb in args.sizes:
        cells = [ratio(a, b, kb) for a, b in pairs] + [ratio(a, b, kb, "cpu_us") for a, b in pairs]
        cells += [f"{med(c['p50'] - e['p50'] for e, c in zip(runs[('envoy', kb)], runs[(k, kb)])):.0f}"
                  for k in added]
        print(f"| {kb} KB | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k}/{kb}": v for (k, kb), v in runs.items()}, indent=1))
