"""load/placement_loss.py: where a trace cell's placement gave up prefix blocks, and why.

Runs matrix cells (`load/compare --matrix` cells, the same setup) with per-request records and
the decision header, then walks the requests in arrival order. A request *lost by placement*
went to a worker that had been sent less of its prefix (in the trace's blocks) than another
worker had; the blocks between are what placement gave up, whatever the workers' caches then
did. Each loss is classified by that other worker's earlier request:

- `in flight`: its first token had not come back when this request was sent (nothing indexed
  yet: the index learns a prompt from its answer; only a placement of the prompt can tell);
- `answered <300 ms`: it had, less than 300 ms before (index writes, peer batches in flight);
- `answered`: earlier still (the router knew and chose otherwise: a load spill, or a holder the
  cost ranked below recomputing).

and by the request's decision reason. Pure over (hash ids, records): `placement_losses`. From
the repository root (a router may name its filter build, `prefix_router_2t@PATH.wasm`):

    .venv/bin/python -m load.placement_loss --cells 'synthetic/x32/v1/completions/r4' --runs 2
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Sequence

from load import matrix as m
from load.run_one import run_one

RECENT_MS = 300.0
KINDS = ("in flight", "answered <300 ms", "answered")


def _known_at(r: dict) -> float | None:
    """When the request's prompt could be indexed: its first token, else its end."""
    if r.get("ttft") is not None and r.get("t0") is not None:
        return r["t0"] + r["ttft"]
    return r.get("t1")


def placement_losses(hash_seqs: Sequence[Sequence[int]], records: Sequence[dict]) -> dict:
    """`hash_seqs[i]`: request i's trace block ids (arrival order); `records`: the run's records
    (`i`, worker `w`, status `s`, send time `t0`, `ttft`, end `t1` in ms, decision header `d`).
    Returns the blocks sent (of successful requests), and per kind and per (kind, reason) the
    requests lost by placement and their lost blocks."""
    recs = {r["i"]: r for r in records}
    tries: dict[str, dict] = {}  # worker -> trie node: block -> [children, earliest known-at]
    blocks = 0
    lost: Counter = Counter()
    reqs: Counter = Counter()
    by_reason: Counter = Counter()
    for i, ids in enumerate(hash_seqs):
        r = recs.get(i)
        if r is None or not r.get("w") or r.get("s") != 200:
            continue
        blocks += len(ids)
        depth: dict[str, tuple[int, float | None]] = {}
        for w, root in tries.items():
            node, d, known = root, 0, None
            for h in ids:
                nxt = node.get(h)
                if nxt is None:
                    break
                node, known, d = nxt[0], nxt[1], d + 1
            depth[w] = (d, known)
        mine = depth.get(r["w"], (0, None))[0]
        best_w = max(depth, key=lambda w: depth[w][0], default=None)
        if best_w is not None and depth[best_w][0] > mine:
            d, known = depth[best_w]
            t0 = r.get("t0") or 0.0
            kind = ("in flight" if known is None or known > t0
                    else "answered <300 ms" if t0 - known < RECENT_MS else "answered")
            found = re.search(r"reason=([a-z_]+)", r.get("d") or "")
            reason = found.group(1) if found else "-"
            lost[kind] += d - mine
            reqs[kind] += 1
            by_reason[(kind, reason)] += d - mine
        known = _known_at(r)
        node = tries.setdefault(r["w"], {})
        for h in ids:
            entry = node.get(h)
            if entry is None:
                entry = node[h] = [{}, known]
            elif known is not None and (entry[1] is None or known < entry[1]):
                entry[1] = known
            node = entry[0]
    return {"blocks": blocks, "lost": lost, "requests": reqs, "by_reason": by_reason}


def run_cell(cell: m.Cell, router: str) -> tuple[dict, float]:
    """One run of `cell` through `router`: its placement losses and hit rate."""
    workdir = Path(tempfile.mkdtemp(prefix="placement-loss-"))
    try:
        c = m._setup(cell, False, None, 1.0, {}, workdir)
        row = run_one(router, c["scen"], c["k6_env"], c["sim"], c["policy"], cell.replicas, False, None,
                      c["sends"])
        shutil.rmtree(row["workdir"], ignore_errors=True)
        return placement_losses(c["trace"]["hash_seqs"], row.get("records") or []), row["hit_rate"]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", required=True, help="comma-separated globs over the matrix's trace cells")
    ap.add_argument("--routers", default="prefix_router_2t", help="comma-separated; runs interleave them")
    ap.add_argument("--runs", type=int, default=1)
    a = ap.parse_args()
    cells = [c for c in m.select(m.all_cells(), a.cells) if c.trace]
    if not cells:
        raise SystemExit(f"no trace cell matches {a.cells!r}")
    print("| cell | router | run | hit rate | blocks lost by placement: "
          + " / ".join(KINDS) + " (requests) | of blocks sent | largest (kind, reason) |")
    print("|---|---|---|---|---|---|---|")
    for cell in cells:
        for run in range(1, a.runs + 1):
            for router in a.routers.split(","):
                res, hit = run_cell(cell, router)
                parts = " / ".join(f"{res['lost'][k]} ({res['requests'][k]})" for k in KINDS)
                total = sum(res["lost"].values())
                top = ", ".join(f"{k} {r}: {v}" for (k, r), v in res["by_reason"].most_common(3))
                print(f"| {cell.name} | {router} | {run} | {hit:.1%} | {parts} | "
                      f"{total / max(res['blocks'], 1):.2%} | {top} |", flush=True)


if __name__ == "__main__":
    main()
