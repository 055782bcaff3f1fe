"""The same demo config with other plugin settings (multi-model, reject, passthrough cluster, no
debug header, comparison policies): each module-scoped Envoy is rendered from envoy/envoy.yaml."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from prkit.client import Client
from prkit.envoy import wait_inflight_zero
from prkit.prom import delta, reason_counters
from prkit.stack import Stack

from . import workload as wl
from .conftest import _ACTIVE_STACKS


def _stack(overrides):
    s = Stack(plugin_overrides=overrides).start()
    _ACTIVE_STACKS.append(s)
    return s


def _stop(s, keep_logs=True):
    _ACTIVE_STACKS.remove(s)
    s.close(keep_logs=keep_logs)


@pytest.fixture(scope="module")
def multi(request):
    s = _stack(
        {
            "models": {"llama": {"workers": ["w0", "w1"]}, "qwen": {"workers": ["w2", "w3"]}},
            "default_model": "llama",
            "unknown_model": "reject",
            "passthrough_cluster": "w3",
            "debug_header": None,
        }
    )
    yield s
    _stop(s, keep_logs=request.session.testsfailed > 0)


def test_models_route_only_to_their_own_workers(multi):
    multi.pool.reset()
    c = Client(multi.envoy.listener_port)
    r = wl.rng("multi")
    for i in range(24):
        for model, allowed in (("llama", {"w0", "w1"}), ("qwen", {"w2", "w3"})):
            rep = c.post("/v1/completions", {"model": model, "prompt": wl.text(r, 800)})
            assert rep.status == 200 and rep.worker in allowed, (model, rep.worker)
            # debug_header is null: no decision header leaks to clients.
            assert "x-prefix-router-decision" not in rep.headers
    c.close()
    counts = multi.pool.counts()
    assert all(counts[w] > 0 for w in ("w0", "w1", "w2", "w3")), counts


def test_generate_without_model_uses_the_default_model(multi):
    multi.pool.reset()
    c = Client(multi.envoy.listener_port)
    r = wl.rng("multi-gen")
    for _ in range(12):
        rep = c.post("/generate", {"text": wl.text(r, 800)})
        assert rep.status == 200 and rep.worker in {"w0", "w1"}, rep.worker
    c.close()


def test_unknown_model_is_rejected_with_openai_error(multi):
    multi.pool.reset()
    before = multi.envoy.stats()
    c = Client(multi.envoy.listener_port)
    rep = c.post("/v1/chat/completions", {"model": "gpt-nope", "messages": [{"role": "user", "content": "hi"}]})
    c.close()
    assert rep.status == 404, (rep.status, rep.body)
    assert rep.worker is None
    err = json.loads(rep.body)
    assert "error" in err or err.get("object") == "error", err
    assert "gpt-nope" in rep.body.decode(), err
    assert sum(multi.pool.counts().values()) == 0
    d = delta(reason_counters(multi.envoy.stats()), reason_counters(before))
    assert d.get("rejected") == 1, d
    assert wait_inflight_zero(multi.envoy) and all(v == 0 for v in wait_inflight_zero(multi.envoy).values())


def test_passthrough_cluster_takes_all_non_inference(multi):
    multi.pool.reset()
    c = Client(multi.envoy.listener_port)
    for path in ("/v1/models", "/health", "/v1/models?x=1"):
        rep = c.get(path, headers=[("x-prefix-router-cluster", "w0")])
        assert rep.status == 200 and rep.worker == "w3", (path, rep.worker)
    c.close()


@pytest.mark.parametrize("policy", ["round_robin", "random"])
def test_comparison_policies(policy):
    s = _stack({"policy": {"name": policy}})
    try:
        c = Client(s.envoy.listener_port)
        r = wl.rng(f"policy-{policy}")
        prefix = wl.text(r, 2000)
        reps = [c.post("/v1/completions", {"model": "llama", "prompt": prefix + wl.text(r, 50)}) for _ in range(40)]
        c.close()
        assert all(rep.status == 200 for rep in reps)
        assert {rep.decision["reason"] for rep in reps} == {policy}, Counter(rep.decision["reason"] for rep in reps)
        seen = Counter(rep.worker for rep in reps)
        # A shared prefix does not stick under these policies: they ignore the cache.
        assert len(seen) >= 3, seen
        if policy == "round_robin":
            # One connection, one Envoy worker thread: a strict rotation over the 4 workers.
            assert max(seen.values()) - min(seen.values()) <= 1 and len(seen) == 4, seen
        stats = s.envoy.stats()
        assert stats.get(f"prefix_router_requests_{policy}") == 40, reason_counters(stats)
    except BaseException:
        _stop(s, keep_logs=True)
        raise
    _stop(s, keep_logs=False)
