"""load/compare --matrix: the cells it knows, picking them by glob, and a one-cell smoke run of
the real thing (smg and prefix-router on /get_load-only simulated workers, chat prompts, the
trace replayed by prkit.replay)."""

from __future__ import annotations

import json
import subprocess
import sys

from load import matrix
from load.trace_replay import trace_describe, trace_setup


def test_cells_cover_every_dimension_of_issue_35():
    names = [c.name for c in matrix.all_cells()]
    assert len(names) == len(set(names))
    trace = [c for c in matrix.all_cells() if c.trace]
    assert {c.trace for c in trace} == {"conversation", "synthetic"}
    assert {c.rate for c in trace} == {"x16", "x32"}
    assert {c.loads for c in trace} == {"v1", "get_load"}
    assert {c.api for c in trace} == {"completions", "chat"}
    assert {c.replicas for c in trace} == {1, 4}
    assert {c.workers for c in trace} == {None, 2, 16}
    assert {"agentic/chat/r1", "agentic/completions/r1"} <= set(names)
    for s in matrix.DOC_SCENARIOS:
        assert f"{s}/r1" in names


def test_held_out_cells_replay_later_stretches_of_the_conversation_trace(tmp_path):
    held = matrix.held_out_cells()
    tuned = [c for c in matrix.all_cells() if c.trace == "conversation" and not c.workers]
    assert {c.skip for c in held} == {4000, 8000}
    assert all(c.trace == "conversation" for c in held)
    # The matrix's conversation grid, once per stretch; no name shared with the matrix.
    for skip in (4000, 8000):
        names = sorted(c.name.replace(f"+{skip}", "") for c in held if c.skip == skip)
        assert names == sorted(c.name for c in tuned)
    assert not {c.name for c in held} & {c.name for c in matrix.all_cells()}
    # The replay plan starts after the skipped requests.
    t = trace_setup("conversation", 50, 16.0, 32, "completions", 8, tmp_path, skip=4000)
    assert t["skip"] == 4000 and t["requests"] == 50
    assert "requests 4001-4050 of the conversation trace" in trace_describe(t)


def test_select_by_globs_keeps_matrix_order():
    cells = matrix.all_cells()
    got = [c.name for c in matrix.select(cells, "agentic/*, conversation/x32/get_load/chat/*")]
    assert got == ["conversation/x32/get_load/chat/r1", "conversation/x32/get_load/chat/r4",
                   "agentic/chat/r1", "agentic/completions/r1", "agentic/chat/r4"]
    assert matrix.select(cells, None) == cells
    assert matrix.select(cells, "nothing/*") == []


def test_table_compares_each_router_with_smg_in_its_cell():
    rows = [{"cell": "c", "router": "smg_cache_aware", "label": "smg", "hit_rate": 0.2, "ttft_p50": 10.0,
             "ttft_p99": 200.0, "errors": 0},
            {"cell": "c", "router": "prefix_router_2t", "label": "pr", "hit_rate": 0.25, "ttft_p50": 9.0,
             "ttft_p99": 100.0, "errors": 0, "share_of_pooled_lru": 0.97, "follow_latest": 0.9,
             "follow_free": None, "follow_under_capacity": 0.95, "lateness_p99": 3.0,
             "routed_bound": 0.3, "infinite_bound": 0.4, "routed_lru_bound": 0.27, "held_lru_bound": 0.25,
             "share_of_held_lru": 1.0}]
    t = matrix.table(rows)
    assert ("| c | pr | 25.0% | 0.97 | 1.00 (bound 25.0%) | 30.0% / 40.0% | 27.0% | 90% / 95% / - | 9 / 100 ms "
            "| 0.50x | +5.0 pt | 3 ms | 0 |" in t), t
    # smg's row (no trace statistics) leaves the bounds' columns empty.
    assert "| c | smg | 20.0% | - | - | - | - | - |" in t, t


def test_medians_take_each_cell_and_router_over_its_runs():
    def row(cell, label, share, held, p99, hit=0.2):
        r = {"cell": cell, "router": label, "label": label, "hit_rate": hit, "ttft_p99": p99}
        if share is not None:
            r.update(share_of_pooled_lru=share, share_of_held_lru=held)
        return r
    rows = [row("t", "pr", 0.90, 0.95, 300.0), row("t", "smg", 0.50, 0.52, 900.0),
            row("t", "pr", 0.98, 1.00, 100.0), row("t", "smg", 0.40, 0.41, 800.0),
            row("t", "pr", 0.94, 0.97, 200.0), row("t", "smg", 0.45, 0.47, 700.0),
            row("s", "pr", None, None, 50.0, hit=0.8), row("s", "pr", None, None, 70.0, hit=0.9)]
    t = matrix.medians_table(rows)
    assert "| t | pr | 3 | 0.940 (0.900-0.980) | 0.970 (0.950-1.000) | 200 (100-300) |" in t, t
    assert "| t | smg | 3 | 0.450 (0.400-0.500) | 0.470 (0.410-0.520) | 800 (700-900) |" in t, t
    # A scenario cell (no trace bounds): its hit rate, and no held share.
    assert "| s | pr | 2 | 85.0% (80.0%-90.0%) | - | 60 (50-70) |" in t, t


def test_paired_table_gives_each_runs_difference_against_the_first_prefix_router():
    def row(cell, router, run, share, p99, hit=0.2):
        r = {"cell": cell, "router": router, "label": router.replace("prefix_router_2t", "pr"), "run": run,
             "hit_rate": hit, "ttft_p99": p99}
        if share is not None:
            r["share_of_pooled_lru"] = share
        return r
    new = "prefix_router_2t@/b/new.wasm"
    routers = ["smg_cache_aware", "prefix_router_2t", new]
    rows = [row("t", "smg_cache_aware", 1, 0.5, 900.0),
            row("t", "prefix_router_2t", 1, 0.90, 200.0), row("t", new, 1, 0.95, 100.0),
            row("t", "prefix_router_2t", 2, 0.94, 200.0), row("t", new, 2, 0.93, 300.0),
            row("s", "prefix_router_2t", 1, None, 50.0, hit=0.80), row("s", new, 1, None, 50.0, hit=0.78)]
    t = matrix.paired_table(rows, routers)
    assert "Paired against `prefix_router_2t`" in t, t
    assert "| t | pr@/b/new.wasm | +0.050 (0.50x), -0.010 (1.50x) | +0.020 | 1 of 2 | 1.00x |" in t, t
    # A scenario cell (no trace): hit rate in points.
    assert "| s | pr@/b/new.wasm | -2.0 (1.00x) | -2.0 | 0 of 1 | 1.00x |" in t, t
    assert f"- `{new}`: ahead on the mean in 1 of 2 cells, behind in 1." in t, t
    # A difference that rounds to zero is a tie: not a run ahead, not a cell led.
    tie = [row("t", "prefix_router_2t", 1, 0.9000, 100.0), row("t", new, 1, 0.90004, 100.0)]
    t = matrix.paired_table(tie, routers)
    assert "| +0.000 | 0 of 1 |" in t and "ahead on the mean in 0 of 1 cells, behind in 0." in t, t
    # A run whose reference p99 is 0 keeps its difference, with no ratio.
    zero = [row("t", "prefix_router_2t", 1, 0.90, 0.0), row("t", new, 1, 0.95, 100.0),
            row("t", "prefix_router_2t", 2, 0.90, 100.0), row("t", new, 2, 0.92, 50.0)]
    t = matrix.paired_table(zero, routers)
    assert "| +0.050 (nanx), +0.020 (0.50x) | +0.035 | 2 of 2 | 0.50x |" in t, t
    # One prefix-router (the usual matrix): no paired table.
    assert matrix.paired_table(rows, ["smg_cache_aware", "prefix_router_2t"]) == ""


def test_a_router_may_name_its_filter_build(tmp_path):
    from load.run_one import router_label
    from load.scenarios import router_error, split_router
    wasm = tmp_path / "b.wasm"
    wasm.write_bytes(b"\0asm")
    assert split_router("prefix_router_2t") == ("prefix_router_2t", None)
    assert split_router(f"prefix_router_2t@{wasm}") == ("prefix_router_2t", wasm)
    assert router_error(f"prefix_router_2t@{wasm}") is None
    assert "no filter build" in router_error(f"prefix_router_2t@{tmp_path / 'missing.wasm'}")
    assert "only a prefix_router" in router_error(f"smg_cache_aware@{wasm}")
    assert "unknown router" in router_error("nginx")
    assert router_label(f"prefix_router_2t@{wasm}", 4, False) == f"prefix-router (2 threads) [{wasm}] x4 replicas"


def test_matrix_smoke_one_cell(repo_root, tmp_path):
    # smg, prefix-router, and prefix-router named with its build (the A/B path: the same build
    # here, so the paired table is there and the runs are like).
    from prkit.build import wasm_path
    out = tmp_path / "results"
    ab = f"prefix_router_2t@{wasm_path()}"
    routers = [*matrix.ROUTERS, ab]
    proc = subprocess.run(
        [str(repo_root / "load" / "compare"), "--matrix", "--quick", "--requests", "80",
         "--cells", "conversation/x16/get_load/chat/r1", "--out", str(out), "--routers", ",".join(routers)],
        cwd=repo_root, capture_output=True, text=True, timeout=600)
    sys.stdout.write(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "matrix.json").read_text())
    assert [r["router"] for r in rows] == routers
    assert f"[{wasm_path()}]" in rows[-1]["label"]
    md = (out / "matrix.md").read_text()
    assert f"| conversation/x16/get_load/chat/r1 | {rows[-1]['label']} |" in md and "Paired against" in md
    for r in rows:
        assert r["cell"] == "conversation/x16/get_load/chat/r1" and r["client"] == "prkit.replay"
        assert r["requests"] == 80 and r["errors"] == 0, r
        assert 0 < r["pooled_lru_bound"] < 1 and 0 <= r["share_of_pooled_lru"] <= 1.5
        assert r["lateness_p99"] >= 0 and 0 < r["ttft_p50"] <= r["ttft_p99"]
        # Delivered <= what the routing left reachable <= one infinite cache; the workers'
        # LRUs fed what they were sent keep at most the latter.
        assert r["hit_rate"] <= r["routed_bound"] + 1e-9 <= r["infinite_bound"] + 2e-9, r
        assert 0 <= r["routed_lru_bound"] <= r["routed_bound"] + 1e-9, r
        # The pooled cache with running requests' KV held: no cache serves more than the
        # infinite one; the share is the hit rate over it.
        assert 0 < r["held_lru_bound"] <= r["infinite_bound"] + 1e-9, r
        assert abs(r["share_of_held_lru"] - r["hit_rate"] / r["held_lru_bound"]) < 1e-9, r
    md = (out / "matrix.md").read_text()
    # The command line as run (prefixed by the build variables it ran with, e.g. PREFIX_ROUTER_WASM).
    command = next(line for line in md.splitlines() if line.startswith("Command: `"))
    assert "load/compare --matrix" in command and "p99 / smg's" in md
