"""load/compare --matrix: the workloads a router must hold on at once, run cell by cell, with one
table of every cell and router against smg.

A cell is one workload on one fleet shape:
* trace cells `TRACE/RATE/LOADS/API/rR[/wN]`: the first --requests requests (default 4000: issue
  35's sizes, the first 4000 of the conversation trace and the whole synthetic trace, 3993, whose
  prefix reuse mostly comes late: a pooled-LRU bound of 5.6% in its first 1000 requests, 39.6% in
  all; quick 200) of the Mooncake `conversation` or `synthetic` trace, replayed open-loop by
  prkit.replay at speed 16 (`x16`) or 32 (`x32`), the rates of issue 35's table; the estimated prefill
  utilisation at each is in the table (trace_replay.prefill_seconds); workers answering newer
  SGLang's `/v1/loads` (`v1`) or only older SGLang's `/get_load` (`get_load`: sglang-sim
  --no-v1-loads; capacity only in `/get_server_info`); prompts as `/v1/completions` text or as
  chat with one user message; R router replicas (each router's processes, requests spread at
  random); 8 workers unless `wN`.
* `agentic/API/rR`: load/agentic.js (16 workers) as chat or the same conversations as completions.
* `SCENARIO/r1`: every other docs/results.md scenario (shared_prefix, skewed, multi_turn,
  two_models, long_context), full or --quick sizing.

Per cell and router: hit rate, share of the pooled-LRU bound and holder follow (trace cells),
TTFT p50 / p99, and each router's TTFT p99 and hit rate against smg's in the same cell; the
replay's send lateness p99. `--cells` picks cells by glob patterns (`conversation/*/v1/*/r1`),
`--list` prints them; `--runs N` runs every cell N times per router (interleaved) and adds a
table of medians and ranges; `--held-out` runs `held_out_cells` instead. A router given as
`prefix_router_2t@WASM` runs that filter build: listed after `prefix_router_2t`, the two builds
run interleaved on the same cells and a paired table gives each run's difference (an A/B of a
routing change in one command; near capacity one run's share moves by several points, so judge
on several runs). Results:
`<out>/matrix.md` and `matrix.json`, rewritten after every cell, so an interrupted matrix keeps
what ran.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from load.run_one import run_one
from load.runner import log
from load.scenarios import SCENARIOS
from load.trace_replay import (filter_has_cost_model, trace_scaled_policy, trace_scaled_sim_args, trace_setup,
                               trace_stats)
from prkit import trace as tr
from prkit.build import wasm_path

ROUTERS = ["smg_cache_aware", "prefix_router_2t"]
BASELINE = "smg_cache_aware"
TRACE_REQUESTS = 4000
TRACE_REQUESTS_QUICK = 200
SPEEDS = {"x16": 16.0, "x32": 32.0}
BLOCK_TOKENS = 32
DOC_SCENARIOS = ["shared_prefix", "skewed", "multi_turn", "two_models", "long_context"]


@dataclass(frozen=True)
class Cell:
    name: str
    scenario: str  # a load/scenarios.py key
    replicas: int = 1
    loads: str = "v1"  # v1 | get_load
    api: str = "completions"
    trace: str | None = None
    rate: str | None = None
    workers: int | None = None  # None: the scenario's
    skip: int = 0  # trace cells: requests of the trace before the replayed ones


def trace_grid(trace: str, label: str, skip: int = 0) -> list[Cell]:
    """One trace's cells `LABEL/RATE/LOADS/API/rR`: every rate, load endpoint, prompt form and
    replica count."""
    return [Cell(f"{label}/{rate}/{loads}/{api}/r{r}", "trace", r, loads, api, trace, rate, skip=skip)
            for rate in SPEEDS for loads in ("v1", "get_load") for api in ("completions", "chat") for r in (1, 4)]


def all_cells() -> list[Cell]:
    cells = trace_grid("conversation", "conversation") + trace_grid("synthetic", "synthetic")
    for w in (2, 16):
        cells.append(Cell(f"conversation/x16/v1/completions/r1/w{w}", "trace", 1, "v1", "completions",
                          "conversation", "x16", w))
    for api in ("chat", "completions"):
        cells.append(Cell(f"agentic/{api}/r1", "agentic", 1, "v1", api))
    cells.append(Cell("agentic/chat/r4", "agentic", 4, "v1", "chat"))
    for s in DOC_SCENARIOS:
        cells.append(Cell(f"{s}/r1", s))
    return cells


HELD_OUT_SKIPS = (4000, 8000)


def held_out_cells() -> list[Cell]:
    """The trace cells on stretches of the conversation trace nothing was tuned on (`--held-out`):
    `conversation+S/RATE/LOADS/API/rR` replays the --requests requests after the trace's first S
    (4000: requests 4001-8000, after the matrix's; 8000: 8001-12000 of 12,031), on the grid of
    the matrix's trace cells. The synthetic trace has no more requests than the matrix replays."""
    return [c for skip in HELD_OUT_SKIPS for c in trace_grid("conversation", f"conversation+{skip}", skip)]


def select(cells: list[Cell], patterns: str | None) -> list[Cell]:
    """Cells matching any comma-separated glob pattern (all without patterns), in matrix order."""
    if not patterns:
        return cells
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [c for c in cells if any(fnmatch.fnmatchcase(c.name, p) for p in pats)]


def _setup(cell: Cell, quick: bool, requests: int | None, time_scale: float, policy: dict, workdir: Path) -> dict:
    """The scenario dict, k6 env, simulator flags, policy, trace and sends of one cell."""
    scen = dict(SCENARIOS[cell.scenario])
    if cell.workers:
        scen["models"] = [scen["models"][0]] * cell.workers
    k6_env = dict(scen["quick"] if quick else scen["env"], SEED=1)
    k6_env.setdefault("MODELS", scen["models"][0])
    kv = scen["kv_quick"] if quick else scen["kv"]
    trace = sends = None
    pol = dict(policy)
    if cell.trace:
        n = requests or (TRACE_REQUESTS_QUICK if quick else TRACE_REQUESTS)
        trace = trace_setup(cell.trace, n, SPEEDS[cell.rate], BLOCK_TOKENS, cell.api, len(scen["models"]), workdir,
                            skip=cell.skip)
        kv = trace["kv"]
        sends = tr.plan_sends(json.loads(trace["plan"].read_text()), cell.api, k6_env["MODELS"])
        pol = {**trace_scaled_policy(BLOCK_TOKENS, filter_has_cost_model(wasm_path())), **policy}
    elif cell.scenario == "agentic":
        k6_env["API"] = cell.api
    sim = ["--max-total-tokens", str(kv), "--time-scale", str(time_scale), *scen["sim"]]
    if trace:
        sim += ["--context-length", str(trace["context"]), *trace_scaled_sim_args(BLOCK_TOKENS)]
    if cell.loads == "get_load":
        sim.append("--no-v1-loads")
    return {"scen": scen, "k6_env": k6_env, "sim": sim, "policy": pol, "trace": trace, "sends": sends}


def _summary(cell: Cell, row: dict, trace: dict | None) -> dict:
    t = row["ttft"]
    out = {"cell": cell.name, "router": row["router"], "label": row["label"], "hit_rate": row["hit_rate"],
           "ttft_p50": t.get("med", 0.0), "ttft_p90": t.get("p(90)", 0.0), "ttft_p99": t.get("p(99)", 0.0),
           "errors": row["errors"], "requests": row["requests"], "client": row.get("client"),
           "max_over_mean": row["max_over_mean"]}
    if trace:
        s = trace_stats(row, trace)
        out.update(pooled_lru_bound=s["pooled_lru_bound"], share_of_pooled_lru=s["share_of_pooled_lru"],
                   infinite_bound=s["infinite_bound"], routed_bound=s["routed_bound"],
                   routed_lru_bound=s["routed_lru_bound"], held_lru_bound=s["held_lru_bound"],
                   share_of_held_lru=s["share_of_held_lru"],
                   follow_latest=s["follow_latest"], eligible=s["eligible"],
                   follow_free=s["follow_free"] if s["free_eligible"] else None,
                   follow_under_capacity=s["follow_under_capacity"] if s["under_eligible"] else None,
                   lateness_p99=s["lateness_p99_ms"], speed=trace["speed"], utilisation=trace["utilisation"])
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(results: list[dict]) -> str:
    """One line per cell and router; `vs smg`: TTFT p99 as a multiple of smg's in the same cell,
    hit rate minus smg's in points."""
    base = {r["cell"]: r for r in results if r["router"] == BASELINE}
    lines = ["| cell | router | hit rate | share of pooled LRU | share of it with running KV held "
             "| reuse routed / infinite | routed LRU | holder follow: all / under capacity / free "
             "| TTFT p50 / p99 | p99 / smg's | hit - smg's | lateness p99 | errors |", "|" + "---|" * 13]
    for r in results:
        b = base.get(r["cell"])
        vs_p99 = (f"{r['ttft_p99'] / b['ttft_p99']:.2f}x" if b and b is not r and b["ttft_p99"] > 0 else "")
        vs_hit = (f"{(r['hit_rate'] - b['hit_rate']) * 100:+.1f} pt" if b and b is not r else "")
        share = f"{r['share_of_pooled_lru']:.2f}" if "share_of_pooled_lru" in r else "-"
        held = (f"{r['share_of_held_lru']:.2f} (bound {r['held_lru_bound']:.1%})" if r.get("held_lru_bound")
                else "-")
        routed = (f"{r['routed_bound']:.1%} / {r['infinite_bound']:.1%}" if r.get("infinite_bound") else "-")
        routed_lru = _pct(r.get("routed_lru_bound"))
        free = "-" if r.get("follow_free") is None else f"{r['follow_free']:.0%}"
        under = "-" if r.get("follow_under_capacity") is None else f"{r['follow_under_capacity']:.0%}"
        follow = f"{r['follow_latest']:.0%} / {under} / {free}" if "follow_latest" in r else "-"
        late = f"{r['lateness_p99']:.0f} ms" if "lateness_p99" in r else "-"
        lines.append(f"| {r['cell']} | {r['label']} | {_pct(r['hit_rate'])} | {share} | {held} | {routed} | {routed_lru} | {follow} "
                     f"| {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} ms | {vs_p99} | {vs_hit} | {late} | {r['errors']} |")
    return "\n".join(lines)


def medians_table(results: list[dict]) -> str:
    """Per cell and router over its runs (`--runs`): the median and range of the share of the
    pooled-LRU bound (hit rate for cells without a trace), of the share of the held bound, and of
    TTFT p99. Near capacity one run's share moves by several points (docs/results.md), so a
    target is judged on the median."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["cell"], r["label"]), []).append(r)

    def span(rows: list[dict], key: str, fmt: str) -> str:
        xs = [r[key] for r in rows if r.get(key) is not None]
        if not xs:
            return "-"
        return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"

    lines = ["| cell | router | runs | share of pooled LRU (hit rate), median (range) "
             "| share of it with running KV held | TTFT p99 ms |", "|" + "---|" * 6]
    for (cell, label), rows in groups.items():
        traced = any("share_of_pooled_lru" in r for r in rows)
        share = span(rows, "share_of_pooled_lru", ".3f") if traced else span(rows, "hit_rate", ".1%")
        lines.append(f"| {cell} | {label} | {len(rows)} | {share} | {span(rows, 'share_of_held_lru', '.3f')} "
                     f"| {span(rows, 'ttft_p99', '.0f')} |")
    return "\n".join(lines)


def _measure(r: dict) -> tuple[float, str]:
    """What a paired comparison compares: the share of the pooled-LRU bound where the cell has a
    trace, else the hit rate in points."""
    if "share_of_pooled_lru" in r:
        return r["share_of_pooled_lru"], ".3f"
    return r["hit_rate"] * 100, ".1f"


def paired_table(results: list[dict], routers: list[str]) -> str:
    """Filter builds against the first prefix-router of `routers` (`NAME@WASM` entries, run
    interleaved with it): per cell, each run's difference (share of the pooled-LRU bound, or hit
    rate in points) and TTFT p99 ratio, their mean, and the runs the build was ahead; then the
    totals over the cells. Empty without a second prefix-router."""
    prs = [r for r in routers if r.startswith("prefix_router_")]
    if len(prs) < 2:
        return ""
    ref, others = prs[0], prs[1:]
    by = {(r["cell"], r["router"], r["run"]): r for r in results}
    lines = [f"Paired against `{ref}`, run by run:", "",
             "| cell | router | each run: difference (p99 ratio) | mean difference | runs ahead | mean p99 ratio |",
             "|" + "---|" * 6]
    # Per build, the sign of each cell's mean difference.
    signs: dict[str, list[int]] = {}
    for o in others:
        for cell in dict.fromkeys(r["cell"] for r in results):
            pairs = [(a, b) for run in sorted({r["run"] for r in results})
                     if (a := by.get((cell, ref, run))) and (b := by.get((cell, o, run)))]
            if not pairs:
                continue
            fmt = _measure(pairs[0][0])[1]
            diffs = [_measure(b)[0] - _measure(a)[0] for a, b in pairs]
            # One ratio per run (nan where the reference's p99 is 0), so each stays with its run.
            ratios = [b["ttft_p99"] / a["ttft_p99"] if a["ttft_p99"] > 0 else float("nan") for a, b in pairs]
            each = ", ".join(f"{format(d, '+' + fmt)} ({q:.2f}x)" for d, q in zip(diffs, ratios))
            known = [q for q in ratios if q == q]
            mean = statistics.fmean(diffs)

            # Signs as printed: a difference that rounds to zero is a tie, not a lead.
            def sign(d: float) -> int:
                shown = float(format(d, fmt))
                return (shown > 0) - (shown < 0)
            signs.setdefault(o, []).append(sign(mean))
            lines.append(f"| {cell} | {pairs[0][1]['label']} | {each} | {format(mean, '+' + fmt)} "
                         f"| {sum(sign(d) > 0 for d in diffs)} of {len(diffs)} "
                         f"| {statistics.fmean(known) if known else float('nan'):.2f}x |")
    lines.append("")
    for o, ss in signs.items():
        lines.append(f"- `{o}`: ahead on the mean in {ss.count(1)} of {len(ss)} cells, behind in {ss.count(-1)}.")
    return "\n".join(lines)


def cell_notes(results: list[dict]) -> list[str]:
    """Per trace cell: its speed, estimated prefill utilisation and pooled-LRU bound."""
    seen, out = set(), []
    for r in results:
        if "speed" in r and r["cell"] not in seen:
            seen.add(r["cell"])
            out.append(f"- {r['cell']}: speed {r['speed']:g}, estimated prefill utilisation {r['utilisation']:.0%}, "
                       f"pooled-LRU bound {r['pooled_lru_bound']:.1%}, {r['requests']} requests")
    return out


def run_matrix(cells: list[Cell], routers: list[str], quick: bool, requests: int | None, time_scale: float,
               policy: dict, out: Path, command: str, keep: bool = False,
               runs: int = 1) -> tuple[list[dict], Path]:
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    path = out / "matrix.md"
    t_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for k, cell in enumerate(cells):
        workdir = Path(tempfile.mkdtemp(prefix="compare-matrix-"))
        try:
            c = _setup(cell, quick, requests, time_scale, policy, workdir)
            log(f"matrix {k + 1}/{len(cells)}: {cell.name}"
                + (f" (speed {c['trace']['speed']:g}, estimated prefill utilisation {c['trace']['utilisation']:.0%})"
                   if c["trace"] else ""))
            # Runs interleave the routers, so a slow spell of the shared machine falls on each.
            for run in range(1, runs + 1):
                for router in routers:
                    row = run_one(router, c["scen"], c["k6_env"], c["sim"], c["policy"], cell.replicas, False,
                                  None, c["sends"])
                    results.append({**_summary(cell, row, c["trace"]), "run": run})
                    if not keep and not row["errors"] and row["k6_exit"] == 0:
                        shutil.rmtree(row["workdir"], ignore_errors=True)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        md = [f"# matrix ({t_start})", "", f"Command: `{command}`", "",
              "Shared 2-core machine: simulated workers, routers and the client on it; "
              + ("one run per cell." if runs == 1 else f"{runs} runs per cell and router, each a row; medians below."),
              "", table(results), "", *cell_notes(results), ""]
        if runs > 1:
            md += [medians_table(results), ""]
        paired = paired_table(results, routers)
        if paired:
            md += [paired, ""]
        path.write_text("\n".join(md))
        (out / "matrix.json").write_text(json.dumps(results, indent=2))
    return results, path
