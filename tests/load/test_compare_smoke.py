"""CI smoke of the router comparison: `load/compare --quick` on the shared-prefix scenario for
Envoy round robin, prefix-router (2 threads) and smg cache_aware (installed into .venv-smg on
first use, ~25 s); then `--replicas 2` on the agentic scenario for prefix-router and smg (two
router processes each, k6 spraying requests over both); then the trace replay (`--scenario trace
--quick --requests 600`: the conversation trace's first 600 requests,
sent by prkit.replay) for round robin and prefix-router. Seconds
per router; the full comparison (all routers, full sizing) is not a CI step (docs/results.md has its
command). Last, live pool membership (`--membership 4:8:4`) on the multi-turn scenario."""

from __future__ import annotations

import json
import subprocess
import sys

ROUTERS = ["round_robin", "prefix_router_2t", "smg_cache_aware"]


def run_compare(repo_root, out, stem: str, *args: str) -> tuple[str, list[dict]]:
    """Runs `load/compare --quick ARGS --out OUT` and returns its report `<stem>.md` and rows."""
    proc = subprocess.run(
        [str(repo_root / "load" / "compare"), "--quick", *args, "--out", str(out)],
        cwd=repo_root, capture_output=True, text=True, timeout=600,
    )
    sys.stdout.write(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return (out / f"{stem}.md").read_text(), json.loads((out / f"{stem}.json").read_text())


def test_compare_quick_produces_sane_results(repo_root, tmp_path):
    out = tmp_path / "results"
    md, rows = run_compare(repo_root, out, "shared_prefix", "--scenario", "shared_prefix",
                           "--routers", ",".join(ROUTERS))
    assert [r["router"] for r in rows] == ROUTERS
    for png in ("shared_prefix-ttft-cdf.png", "shared_prefix-worker-load.png"):
        assert (out / png).stat().st_size > 1000
        assert png in md
    for r in rows:
        assert r["label"] in md
        assert r["errors"] == 0 and r["k6_exit"] == 0, r
        assert 0.0 <= r["hit_rate"] <= 1.0, r
        # Every request k6 planned was answered, and every one reached exactly one worker.
        assert r["expected_requests"] and r["requests"] == r["expected_requests"], r
        assert sum(r["worker_requests"]) == r["requests"], r
        assert 0 < r["ttft"]["med"] <= r["ttft"]["p(99)"] <= r["e2e"]["max"], r
        assert r["max_over_mean"] >= 1.0
    by = {r["router"]: r for r in rows}
    # Cache-aware routing reuses more prefix cache than round robin even at smoke sizing.
    assert by["prefix_router_2t"]["hit_rate"] > by["round_robin"]["hit_rate"]


REPLICA_ROUTERS = ["prefix_router_2t", "smg_cache_aware"]


def test_compare_quick_two_replicas_agentic(repo_root, tmp_path):
    """`--replicas 2` on the agentic scenario (16 workers): two Envoy processes / two smg processes,
    k6 spreading requests over both at random."""
    out = tmp_path / "results"
    md, rows = run_compare(repo_root, out, "agentic-2replicas", "--scenario", "agentic", "--replicas", "2",
                           "--routers", ",".join(REPLICA_ROUTERS), "--no-plots")
    assert [r["router"] for r in rows] == REPLICA_ROUTERS
    for r in rows:
        assert r["label"] in md and "x2 replicas" in r["label"], r["label"]
        assert r["errors"] == 0 and r["k6_exit"] == 0, r
        assert r["expected_requests"] and r["requests"] == r["expected_requests"], r
        assert sum(r["worker_requests"]) == r["requests"], r
        assert len(r["worker_requests"]) == 16 and 1 <= r["workers_used"] <= 16, r
        # Two router processes, and k6 sent requests to both.
        assert r["replicas"] == 2 and r["replica_mode"] == "random", r
        assert len(r["replica_requests"]) == 2 and min(r["replica_requests"]) > 0, r
        assert sum(r["replica_requests"]) == r["requests"], r
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["max_over_mean"] >= 1.0, r


TRACE_ROUTERS = ["round_robin", "prefix_router_2t"]


def test_compare_quick_trace_replay(repo_root, tmp_path):
    """`--scenario trace --quick`: every request replayed and recorded (worker, decision, lateness),
    the workers saw exactly the planned prompt tokens, the bounds and holder follow are computed."""
    out = tmp_path / "results"
    # 600 requests: about 100 share more than the first block with an earlier one (200 gave 7, too
    # few for holder follow to tell routers apart)
    md, rows = run_compare(repo_root, out, "trace-conversation", "--scenario", "trace", "--trace", "conversation",
                           "--requests", "600", "--routers", ",".join(TRACE_ROUTERS), "--no-plots")
    assert [r["router"] for r in rows] == TRACE_ROUTERS
    assert "share of infinite" in md and "running KV held" in md and "Decision reasons" in md
    for r in rows:
        s = r["trace"]
        assert r["label"] in md
        assert r["errors"] == 0 and r["k6_exit"] == 0, r["label"]
        assert r["expected_requests"] == r["requests"] == s["records"] == len(r["records"]) > 0
        assert sorted(x["i"] for x in r["records"]) == list(range(r["requests"]))
        assert {x["w"] for x in r["records"]} <= {f"w{i}" for i in range(8)}
        # The block texts tokenize in the simulator exactly as planned.
        assert r["prompt_tokens"] == s["planned_prompt_tokens"], r["label"]
        assert 0 < s["pooled_lru_bound"] <= s["infinite_bound"] < 1
        assert 0 < s["held_lru_bound"] <= s["infinite_bound"]  # the same cache, running KV held
        assert 0 <= r["hit_rate"] <= 1 and s["eligible"] > 0
        assert s["lateness_max_ms"] >= 0
    by = {r["router"]: r for r in rows}
    assert all(x["d"] for x in by["prefix_router_2t"]["records"])  # the decision header is on
    assert not any(x["d"] for x in by["round_robin"]["records"])
    # prefix-router sends more of the requests with a served prefix to a worker that served it.
    assert by["prefix_router_2t"]["trace"]["follow_any"] > by["round_robin"]["trace"]["follow_any"]


def test_compare_quick_live_membership(repo_root, tmp_path):
    """`--membership 4:8:4 --quick` (30 s of multi-turn load, no baseline): the pool grows from 4
    to 8 workers at 10 s and shrinks back at 20 s (EDS file). No request fails outside a removed
    worker, every added worker serves requests within 5 s of its change (issue 27's target), and
    the removed workers get nothing sent more than a few seconds after their removal."""
    out = tmp_path / "results"
    md, rows = run_compare(repo_root, out, "multi_turn-membership-4-8-4", "--scenario", "multi_turn",
                           "--membership", "4:8:4", "--no-baseline", "--no-plots")
    (r,) = rows
    ms = r["membership"]
    assert "pool 4:8:4" in r["label"] and "Live membership" in md, r["label"]
    assert ms["records"] == r["requests"] > 0
    assert ms["failed_elsewhere"] == 0, ms["failed_detail"]
    assert [c["phase"] for c in ms["changes"]] == [1, 2]
    assert sorted(a["worker"] for a in ms["added"]) == ["w4", "w5", "w6", "w7"]
    for a in ms["added"]:
        assert a["requests"] >= 1 and a["first_request_s"] is not None and a["first_request_s"] < 5, a
    for x in ms["removed"]:
        assert x["last_sent_after_s"] is None or x["last_sent_after_s"] < 5, x
    p1, p2, _ = ms["phases"]
    # Only the pool's workers served: the first four in phase 1, all eight in phase 2.
    assert p1["worker_requests"][4:] == [0, 0, 0, 0], p1
    assert all(n > 0 for n in p2["worker_requests"]), p2
    assert ms["envoy"].get("membership.answers", 0) >= 20 and ms["envoy"].get("membership.rebuilds", 0) >= 2
