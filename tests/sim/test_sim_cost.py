"""The simulator's worker surface that routers read: older-SGLang mode (only `/get_load`, capacity
in `/get_server_info`), and prefill time that grows with the cached context (sim/README.md)."""

from __future__ import annotations

import time

import httpx

from prkit.prom import sum_by_name


def _metric(base: str, name: str) -> float:
    return sum_by_name(httpx.get(base + "/metrics", timeout=5).text).get(name, 0.0)


def test_get_load_only_worker_reports_capacity_in_server_info(sim_factory):
    s = sim_factory("--time-scale", "0.01", "--no-v1-loads", "--max-running-requests", "16",
                    "--max-total-tokens", "40960")
    assert httpx.get(s.base + "/v1/loads", timeout=5).status_code == 404
    load = httpx.get(s.base + "/get_load", timeout=5).json()
    assert load[0]["num_reqs"] == 0
    info = httpx.get(s.base + "/get_server_info", timeout=5).json()
    assert (info["max_running_requests"], info["max_total_num_tokens"]) == (16, 40960)
    assert info["simulator"]["prefill_context_per_1k_tokens"] > 0


def _ttft(base: str, prompt: str) -> float:
    t0 = time.monotonic()
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 1, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        for _ in r.iter_raw():
            break
    return time.monotonic() - t0


def test_follow_up_on_a_long_history_prefills_slower_per_token(sim_factory):
    """Same 2k new tokens, on nothing and on a cached 24k history: at the H200 shape (1.53 us per
    token per 1k context on 29 us) the second costs ~2.3x the first; with the context term off
    both cost the same. At 20k tokens/s the prefills take 0.1-0.25 s, well above timer noise."""
    tok = [f"{i:04x}" for i in range(28000)]  # the simulator's tokens are 4 bytes each
    history, new_a, new_b = "".join(tok[:24000]), "".join(tok[24000:26000]), "".join(tok[26000:])
    ratios = {}
    for k in ("0.053", "0"):
        s = sim_factory("--prefill-tokens-per-sec", "20000", "--context-length", "65536",
                        "--max-total-tokens", "131072", "--chunked-prefill-size", "-1",
                        "--max-prefill-tokens", "65536", "--prefill-context-per-1k-tokens", k,
                        worker_id=f"sim-ctx-{k}")
        _ttft(s.base, "".join(tok[27990:]))  # a first request pays for the connection
        fresh = _ttft(s.base, new_a)
        _ttft(s.base, history)
        follow = _ttft(s.base, history + new_b)
        cached = _metric(s.base, "sglang:cached_tokens_total")
        prompt = _metric(s.base, "sglang:prompt_tokens_total")
        assert cached >= 24000 and prompt >= cached, (cached, prompt)
        ratios[k] = follow / fresh
    assert ratios["0.053"] > 1.6, ratios
    assert ratios["0"] < 1.4, ratios
