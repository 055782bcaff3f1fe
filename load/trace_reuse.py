"""load/trace_reuse.py: what kind of reuse a trace holds, by how many earlier requests reached the
same prefix. A prefix reused by one earlier request is a conversation's own history (its second
copy serves nobody else); one reused by many is a hot prefix (a second copy shares its load).
For each trace, over the first `--requests` (the matrix's 4000 by default): the requests that
reuse a prefix seen before, and the reused tokens (512 per block) split by the number of earlier
requests whose prompts reached that deepest prefix. From the repo root:

    .venv/bin/python -m load.trace_reuse
"""

from __future__ import annotations

import argparse
from collections import Counter

from load import matrix as m
from prkit.trace import TRACE_BLOCK, TRACES, load_trace

BUCKETS = ((1, 1), (2, 4), (5, 49), (50, None))


def reuse(name: str, requests: int) -> list[str]:
    """One row per bucket of earlier users: requests and reused tokens in it."""
    seen: Counter[tuple[int, ...]] = Counter()
    by: Counter[tuple[int, int | None]] = Counter()
    toks: Counter[tuple[int, int | None]] = Counter()
    reqs = load_trace(name, requests)
    total = 0
    for r in reqs:
        h = r.hash_ids
        depth = 0
        while depth < len(h) and seen[h[: depth + 1]]:
            depth += 1
        total += r.input_length
        if depth:
            users = seen[h[:depth]]
            b = next(b for b in BUCKETS if users >= b[0] and (b[1] is None or users <= b[1]))
            by[b] += 1
            toks[b] += min(depth * TRACE_BLOCK, r.input_length)
        for k in range(1, len(h) + 1):
            seen[h[:k]] += 1
    out = []
    for lo, hi in BUCKETS:
        span = f"{lo}" if hi == lo else f"{lo}+" if hi is None else f"{lo}-{hi}"
        out.append(f"| {name} | {span} | {by[(lo, hi)]} of {len(reqs)} | {toks[(lo, hi)] / total:.1%} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=m.TRACE_REQUESTS, help="first requests of each trace")
    a = ap.parse_args()
    print("| trace | earlier requests on the deepest reused prefix | requests | reused tokens, of all prompt tokens |")
    print("|---|---|---|---|")
    for name in TRACES:
        print("\n".join(reuse(name, a.requests)))


if __name__ == "__main__":
    main()
