"""Clients cannot choose the worker: a spoofed x-prefix-router-cluster header is ignored."""

from __future__ import annotations

from collections import Counter

import pytest

from . import workload as wl

MODEL = "llama"

VARIANTS = {
    "lower": lambda w: [("x-prefix-router-cluster", w)],
    "title": lambda w: [("X-Prefix-Router-Cluster", w)],
    "upper": lambda w: [("X-PREFIX-ROUTER-CLUSTER", w)],
    "duplicated": lambda w: [("x-prefix-router-cluster", w), ("x-prefix-router-cluster", w)],
    "duplicated-mixed": lambda w: [("X-Prefix-Router-Cluster", w), ("x-prefix-router-cluster", "w0")],
    "comma-list": lambda w: [("x-prefix-router-cluster", f"{w},{w}")],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_spoofed_cluster_header_is_ignored_on_inference(env, client, variant):
    r = wl.rng(f"spoof-{variant}")
    prefix = wl.text(r, 3000)
    first = client.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": prefix}]})
    assert first.status == 200
    owner = first.worker
    for other in [w for w in env.names if w != owner] + ["no-such-cluster"]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prefix + wl.text(r, 50)}]}
        headers = VARIANTS[variant](other) + [("x-prefix-router-decision", f"worker={other}; reason=prefix_hit")]
        rep = client.post("/v1/chat/completions", body, headers=headers)
        assert rep.status == 200, (variant, other, rep.status, rep.body)
        assert rep.worker == owner, (variant, other, rep.decision)
        # The response's debug header is the filter's own, one value, not the client's echo.
        assert len(rep.headers.get("x-prefix-router-decision", [])) == 1, rep.headers
        assert rep.decision["reason"] == "prefix_hit", rep.decision
    # env's teardown also checks every upstream request carried exactly one cluster header = itself.


def test_spoofed_cluster_header_is_ignored_on_passthrough(env, client):
    """Passthrough requests are routed by the filter too (round robin), never by the client header."""
    seen = Counter()
    for _ in range(16):
        rep = client.get("/v1/models", headers=[("X-Prefix-Router-Cluster", "w3"), ("x-prefix-router-cluster", "w3")])
        assert rep.status == 200, rep.body
        assert rep.decision.get("reason") == "passthrough", rep.decision
        seen[rep.worker] += 1
    assert set(seen) != {"w3"}, f"all passthrough requests went to the spoofed cluster: {seen}"
    rep = client.get("/health", headers=[("x-prefix-router-cluster", "no-such-cluster")])
    assert rep.status == 200 and rep.worker in env.names
