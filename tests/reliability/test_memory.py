"""Bounded memory in the real Envoy: with a small index.capacity (256 entries = 64 shared-data
keys), thousands of distinct prefixes leave Envoy's RSS flat once the table is full. A filter that
kept one key per prefix (Envoy never deletes shared-data keys) would add ~48k keys here, well over
the 8 MiB allowed. The full run (1M prefixes, default capacity) is tests/reliability/memory.py."""

from __future__ import annotations

import os

from .memory import run


def test_rss_flat_once_the_index_table_is_full(capsys):
    n = int(os.environ.get("PREFIX_ROUTER_MEMORY_PREFIXES", "6000"))
    r = run(n, 256, log=lambda *_: None)
    with capsys.disabled():
        r2 = dict(r)
        r2.pop("samples")
        print(f"\n[memory] {r2}")
    assert r["errors"] == 0, r
    assert r["index_writes"] >= n, r  # every prompt wrote index checkpoints
    assert r["growth_after_fill_kib"] < 8 * 1024, r
