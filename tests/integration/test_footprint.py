"""New prefixes fill the workers' caches evenly (policy/cache_aware.rs `two_choices`,
filter/src/footprint.rs), on a fresh Envoy with the default policy (the session stack turns the
rule off so that other tests do not depend on order)."""

from __future__ import annotations

from collections import Counter

from prkit.client import Client

from . import workload as wl

MODEL = "llama"


def test_distinct_prefixes_fill_the_caches_evenly(fresh):
    """Sequential distinct prompts of one size: plain rendezvous spreads them binomially (80 over
    4 workers: a spread of 10 or more between the most and the least loaded is common); with the
    footprint rule each of the two choices a prompt has goes to the worker sent fewer tokens, so
    per VM the counts stay within a few of each other."""
    r = wl.rng("footprint")
    c = Client(fresh.envoy.listener_port)
    seen = Counter()
    try:
        for _ in range(80):
            rep = c.post("/v1/completions", {"model": MODEL, "prompt": wl.text(r, 2048), "max_tokens": 4})
            assert rep.status == 200, rep.body
            assert rep.decision["reason"] == "hash_affinity", rep.decision
            seen[rep.worker] += 1
    finally:
        c.close()
    assert set(seen) == set(fresh.names), seen
    # Two Envoy threads balance separately: each within about one prompt, together within a few.
    assert max(seen.values()) - min(seen.values()) <= 6, seen
