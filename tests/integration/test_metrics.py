"""The filter's Prometheus metrics on Envoy's admin /stats/prometheus (names per docs/design.md)."""

from __future__ import annotations

import threading

from prkit.client import Client
from prkit.envoy import wait_inflight_zero
from prkit.prom import delta, inflight_requests, reason_counters
from prkit.wait import poll

from . import workload as wl

MODEL = "llama"
REASONS = {"prefix_hit", "hash_affinity", "load_spill", "fallback", "passthrough", "parse_error", "rejected",
           "round_robin", "random"}


def test_request_counters_count_exactly_what_was_sent(env, client):
    before = env.envoy.stats()
    r = wl.rng("metrics")
    prefix = wl.text(r, 2500)
    inference = []
    for i in range(6):  # one new prefix, then 5 hits
        inference.append(client.post("/v1/completions", {"model": MODEL, "prompt": prefix + wl.text(r, 90)}))
    for i in range(4):  # distinct prefixes via chat
        inference.append(client.post("/v1/chat/completions",
                                     {"model": MODEL, "messages": [{"role": "user", "content": wl.text(r, 700)}]}))
    gets = [client.get("/v1/models") for _ in range(5)]
    malformed = [client.post("/v1/chat/completions", b'{"messages": [') for _ in range(3)]
    everything = inference + gets + malformed
    assert all(rep.status == 200 for rep in everything)

    wait_inflight_zero(env.envoy)
    after = env.envoy.stats()
    d = delta(after, before)
    reasons = {k: v for k, v in delta(reason_counters(after), reason_counters(before)).items() if v}
    info = f"reason deltas={reasons}"

    # One counter per reason of the contract, all defined up front (dashboards see zeros).
    assert set(reason_counters(after)) == REASONS, reason_counters(after)
    assert sum(reasons.values()) == len(everything), info
    assert reasons.get("passthrough", 0) == len(gets), info
    assert reasons.get("parse_error", 0) == len(malformed), info
    # The counters agree with the per-request debug header, reason by reason.
    from collections import Counter

    assert reasons == dict(Counter(rep.decision["reason"] for rep in everything)), info
    assert reasons.get("prefix_hit", 0) >= 5, info

    # Blocks: the counters are the sums of the per-request figures the debug header reports for
    # the inference requests; passthrough and unparseable requests have no prompt blocks.
    prompt_blocks = sum(rep.decision["total"] for rep in inference)
    matched_blocks = sum(rep.decision["matched"] for rep in inference)
    assert d["prefix_router_blocks_prompt"] == prompt_blocks > 0
    assert d["prefix_router_blocks_matched"] == matched_blocks > 0
    assert matched_blocks <= prompt_blocks

    assert "prefix_router_index_cas_conflicts" in after
    assert d["prefix_router_index_writes"] > 0


def test_inflight_gauges_exist_per_worker_and_return_to_zero(env, client):
    r = wl.rng("gauges")
    for _ in range(5):
        assert client.post("/v1/completions", {"model": MODEL, "prompt": wl.text(r, 1000)}).status == 200
    gauges = wait_inflight_zero(env.envoy)
    expected = {f"prefix_router_inflight_{kind}_{w}" for kind in ("requests", "tokens") for w in env.names}
    assert expected <= set(gauges), sorted(gauges)
    assert all(v == 0 for v in gauges.values()), gauges


def test_inflight_gauges_track_requests_in_progress(env):
    """While requests are held upstream, the gauges show them; once released they drain to 0.
    (The workers hold the requests until the gauges were seen: no race with a fixed delay.)"""
    r = wl.rng("gauges-live")
    prompts = [wl.text(r, 1000) for _ in range(4)]
    done = []
    env.pool.hold()

    def send(p):
        c = Client(env.envoy.listener_port)
        try:
            done.append(c.post("/v1/completions", {"model": MODEL, "prompt": p}).status)
        finally:
            c.close()

    threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    try:
        seen = poll(lambda: inflight_requests(env.envoy.stats_now()), lambda n: n >= 4, timeout_s=30)
    finally:
        env.pool.release()
        for t in threads:
            t.join(timeout=60)
    assert done == [200] * 4
    assert seen == 4, f"in-flight request gauges read {seen} with 4 requests held upstream"
    gauges = wait_inflight_zero(env.envoy)
    assert all(v == 0 for v in gauges.values()), gauges
