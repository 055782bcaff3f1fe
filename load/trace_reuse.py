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


def reuse(name: str, requests: int) -> list[tuple[str, int, float]]:
    """Per bucket of earlier users: its label, the requests in it and their reused tokens' share of
    every prompt token of the first `requests`."""
    seen: Counter[tuple[int, ...]] = Counter()
    by: Counter[tuple[int, int | None]] = Counter()
    toks: Counter[tuple[int, int | None]] = Counter()
    total = 0
    for r in load_trace(name, requests):
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
    return [(f"{lo}" if hi == lo else f"{lo}+" if hi is None else f"{lo}-{hi}", by[(lo, hi)],
             toks[(lo, hi)] / max(total, 1)) for lo, hi in BUCKETS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=m.TRACE_REQUESTS, help="first requests of each trace")
    a = ap.parse_args()
    print("| trace | earlier requests on the deepest reused prefix | requests | reused tokens, of all prompt tokens |")
    print("|---|---|---|---|")
    for name in TRACES:
        n = len(load_trace(name, a.requests))
        for span, reqs, share in reuse(name, a.requests):
            print(f"| {name} | {span} | {reqs} of {n} | {share:.1%} |")


if __name__ == "__main__":
    main()
