"""load/queue_sweep.py: one trace cell of load/compare --matrix replayed once per value of
`policy.cost.queue_weight` (λ in filter/src/policy/cost.rs), to see what a second of queue is
worth against the prefill the fleet computes.

Per λ: hit rate, share of the pooled-LRU bound, holder follow, TTFT mean / p50 / p90 / p99 (the
replay's, as load/compare reports them). With --waits, also the requests that had a holder, split
by the holder's queued prefill tokens when routed (the `x-prefix-router-decision` header's
`holder_load=<requests>/<capacity>/<queued tokens>`): followed (sent to the holder) or spilled
(`load_spill`), their mean and median TTFT, and the queue's tokens over the simulator's
zero-context prefill rate (what the cost model charges for it). From the repo root, in the
.venv that load/compare sets up:

    .venv/bin/python -m load.queue_sweep --cell conversation/x32/v1/completions/r1 --weights 0.125 0.25 0.5 --waits
    .venv/bin/python -m load.queue_sweep --cell conversation/x32/v1/completions/r1 --weights 0.25 --speed 40
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from load import matrix as m
from load.run_one import run_one
from load.trace_replay import SIM_PREFILL_TOKENS_PER_S
from prkit.client import parse_decision

BUCKETS = ((0, 1), (1, 1000), (1000, 3000), (3000, 6000), (6000, None))


def waits(records: list[dict]) -> list[str]:
    """TTFT of followed and spilled requests by their holder's queued prefill tokens."""
    rows: dict[str, list[tuple[int, float]]] = {"followed": [], "spilled": []}
    for r in records:
        d = parse_decision(r.get("d") or "")
        load = d.get("holder_load", "").split("/")
        if len(load) != 3 or not load[2].isdigit() or r.get("ttft") is None:
            continue
        followed = d.get("worker") == d.get("holder")
        kind = "followed" if followed else "spilled" if d.get("reason") == "load_spill" else None
        if kind:
            rows[kind].append((int(load[2]), r["ttft"]))
    out = ["| holder's queued tokens | routed | requests | TTFT mean / median | queue / prefill rate |",
           "|---|---|---|---|---|"]
    for lo, hi in BUCKETS:
        for kind, xs in rows.items():
            sel = [(q, t) for q, t in xs if q >= lo and (hi is None or q < hi)]
            if sel:
                ts = [t for _, t in sel]
                charged = statistics.mean(q for q, _ in sel) / SIM_PREFILL_TOKENS_PER_S * 1000
                span = f"{lo}+" if hi is None else str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}"
                out.append(f"| {span} | {kind} | {len(sel)} | {statistics.mean(ts):.0f} / "
                           f"{statistics.median(ts):.0f} ms | {charged:.0f} ms |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cell", required=True, help="a trace cell of load/compare --list")
    ap.add_argument("--weights", type=float, nargs="+", required=True, help="values of policy.cost.queue_weight")
    ap.add_argument("--requests", type=int, default=None, help=f"trace requests (default {m.TRACE_REQUESTS})")
    ap.add_argument("--waits", action="store_true", help="also the TTFT table by holder queue, per λ")
    ap.add_argument("--speed", type=float, default=None, help="replay speed instead of the cell's rate (x16: 16)")
    a = ap.parse_args()
    cells = [c for c in m.all_cells() if c.name == a.cell and c.trace]
    if not cells:
        raise SystemExit(f"queue_sweep: {a.cell!r} is not a trace cell (load/compare --list)")
    cell = cells[0]
    if a.speed:
        m.SPEEDS[cell.rate] = a.speed
    print("| λ | hit rate | share of pooled LRU | holder follow | TTFT mean / p50 / p90 / p99 |")
    print("|---|---|---|---|---|")
    tables = []
    workdir = Path(tempfile.mkdtemp(prefix="queue-sweep-"))
    try:
        # The trace, its bounds and the fleet's sizing are the same for every λ: set up once.
        c = m._setup(cell, False, a.requests, 1.0, {}, workdir)
        for lam in a.weights:
            pol = {**c["policy"], "cost": {**c["policy"].get("cost", {}), "queue_weight": lam}}
            row = run_one("prefix_router_2t", c["scen"], c["k6_env"], c["sim"], pol, cell.replicas, False, None,
                          c["sends"])
            s = m._summary(cell, row, c["trace"])
            print(f"| {lam:g} | {s['hit_rate']:.1%} | {s['share_of_pooled_lru']:.3f} | {s['follow_latest']:.0%} | "
                  f"{row['ttft'].get('avg', 0.0):.0f} / {s['ttft_p50']:.0f} / {s['ttft_p90']:.0f} / "
                  f"{s['ttft_p99']:.0f} ms |", flush=True)
            if a.waits:
                tables.append((lam, waits(row.get("records") or [])))
            shutil.rmtree(row["workdir"], ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for lam, lines in tables:
        print(f"\nλ = {lam:g}\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
