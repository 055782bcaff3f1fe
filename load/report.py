"""load/compare's report: the markdown tables, TTFT / load plots and `<stem>.md` / `.json`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from load.membership import membership_notes, membership_table
from load.routers import gen_flags
from load.scenarios import GEN, WORKERS
from load.trace_replay import trace_describe, trace_notes, trace_reasons_table, trace_table
from prkit.build import wasm_path
from prkit.paths import REPO_ROOT as REPO


def table(rows: list[dict]) -> str:
    head = ("| router | replicas | hit rate | TTFT p50 | TTFT p90 | TTFT p99 | E2E p50 | E2E p99 | req/s | out tok/s "
            "| errors | workers used | max/mean load | requests per worker |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        t, e = r["ttft"], r["e2e"]
        reqs = r["worker_requests"]
        mean = sum(reqs) / len(reqs)
        n = r.get("replicas", 1)
        replicas = str(n) if n == 1 else f"{n} {r.get('replica_mode', '')} ({' / '.join(map(str, r.get('replica_requests', [])))})"
        lines.append(
            f"| {r['label']} | {replicas} | {r['hit_rate']:.1%} | {t.get('med', 0):.0f} ms | {t.get('p(90)', 0):.0f} ms "
            f"| {t.get('p(99)', 0):.0f} ms | {e.get('med', 0):.0f} ms | {e.get('p(99)', 0):.0f} ms "
            f"| {r['rps']:.1f} | {r['out_tokens_per_s']:.0f} | {r['errors']} "
            f"| {r.get('workers_used', sum(1 for x in reqs if x > 0))}/{len(reqs)} "
            f"| {r['max_over_mean']:.2f} (max {max(reqs):.0f}, mean {mean:.1f}) "
            f"| {' / '.join(str(int(x)) for x in reqs)} |"
        )
    return "\n".join(lines)


def plots(rows: list[dict], scenario: str, stem: str, outdir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        xs = sorted(r["ttft_samples"])
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=r["label"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    workers = len(rows[0]["worker_requests"]) if rows else WORKERS
    ax.set_title(f"{stem}: TTFT CDF ({workers} simulated workers)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = outdir / f"{stem}-ttft-cdf.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    names.append(p.name)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    n = len(rows)
    width = 0.8 / max(n, 1)
    for k, r in enumerate(rows):
        reqs = r["worker_requests"]
        ax.bar([i + k * width - 0.4 + width / 2 for i in range(len(reqs))], reqs, width, label=r["label"])
    ax.set_xticks(range(workers))
    ax.set_xticklabels([f"w{i}" for i in range(workers)])
    ax.set_ylabel("requests served")
    ax.set_title(f"{stem}: requests per worker")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    p = outdir / f"{stem}-worker-load.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    names.append(p.name)
    return names


def git_rev() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    wasm = wasm_path()
    digest = hashlib.sha256(wasm.read_bytes()).hexdigest()[:12]
    if os.environ.get("PREFIX_ROUTER_WASM"):
        return f"the build PREFIX_ROUTER_WASM names (sha256 {digest}; checkout at {git('rev-parse', '--short', 'HEAD')})"
    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "filter", "Cargo.lock")
    return "built from commit " + rev + (" + uncommitted filter changes" if dirty else "") + f" (wasm sha256 {digest})"


def write_report(rows: list[dict], scenario: str, scen: dict, k6_env: dict, sim_args: list[str], kv: int,
                 policy: dict, command: str, outdir: Path, no_plots: bool, stem: str | None = None,
                 replicas: int = 1, pin: bool = False, trace: dict | None = None,
                 membership: dict | None = None) -> Path:
    """`trace`: trace_setup's result (--scenario trace): the workload line describes the replay and
    the trace tables (bounds, holder follow, decision reasons, lateness) replace the usual one.
    `membership` (--membership): the phases table and per-run notes follow the usual table."""
    stem = stem or scenario
    outdir.mkdir(parents=True, exist_ok=True)
    pngs = [] if no_plots else plots(rows, scenario, stem, outdir)
    flags = gen_flags()
    if replicas > 1:
        spread = ("k6 sends every request of a conversation / prompt group to the replica its id hashes to (--pin)"
                  if pin else "k6 sends each request to a random replica")
        replica_line = (f"Router replicas: {replicas} for smg and prefix-router (Envoy round_robin / least_request: one "
                        f"Envoy); {spread}. envoy/gen scale-out flags: "
                        f"{', '.join(sorted(flags)) if flags else 'none (replicas are independent)'}.")
    else:
        replica_line = "Router replicas: 1."
    models = ", ".join(f"{m} x{scen['models'].count(m)}" for m in dict.fromkeys(scen["models"]))
    md = [
        f"# {stem}",
        "",
        f"Command: `{command}`",
        "",
        (f"Workload (sent by prkit.replay): {trace_describe(trace)}."
         if trace and rows and rows[0].get("client") == "prkit.replay" else
         f"Workload (`load/{scen['script']}`): " + (trace_describe(trace) + "; k6 env " if trace else "")
         + ", ".join(f"{k}={v}" for k, v in k6_env.items() if k != "PLAN") + "."),
        f"Fleet per router: {len(scen['models'])} fresh `sglang-sim` workers (models: {models}), "
        f"`{' '.join(sim_args)}`: KV capacity {kv} tokens per worker.",
        replica_line,
        f"prefix-router policy: `{json.dumps(policy)}` (on top of the filter defaults); "
        f"filter: {git_rev()}; configs from "
        f"{'ENVOY_GEN=' + str(GEN) if os.environ.get('ENVOY_GEN') else 'envoy/gen'}.",
        "Measured on a shared 2-core machine (simulated workers, routers and k6 all on it): "
        "noisy, compare within one table only.",
        "",
        "Hit rate = sum of the workers' `sglang:cached_tokens_total` / `sglang:prompt_tokens_total`; "
        "TTFT = k6 time to first byte of a streaming response; load = requests served per worker; "
        "workers used = workers that served at least one request; replicas: how many router processes, "
        "how k6 spread requests over them and how many each got.",
        "",
    ]
    if trace:
        reasons = trace_reasons_table(rows)
        md += [*trace_notes(rows, trace), "", trace_table(rows), ""]
        if reasons:
            md += ["Decision reasons (`x-prefix-router-decision`) by holder-follow group, and the state of the "
                   "deepest holder the decision saw (its `holder_load`): `saturated` = at its "
                   "`max_running_requests`, `queued` = prefill tokens waiting there (polled "
                   "`num_waiting_uncached_tokens` + this Envoy's prompts without a first token), `free` = "
                   "neither, `-` = no holder in the index. \"Follow where the holder was free\": of the "
                   "eligible requests whose holder was free, the share sent to the latest holder.", "",
                   reasons, ""]
    else:
        md += [table(rows), ""]
    if membership:
        ph = membership["phases"]
        md += [f"Live membership (`--membership {':'.join(map(str, ph))}`): the model is a pool (`envoy/gen --model "
               f"llama=eds:PATH`) whose EDS file lists the fleet's first {ph[0]} workers at the start and is replaced "
               f"(by a rename) at each phase change: {len(ph)} phases of {membership['duration'] / len(ph):g} s "
               f"({membership['duration']:g} s of load, k6 `DURATION`; each virtual user starts conversation after "
               f"conversation); pool workers per phase {', '.join(map(str, ph))}. A removed worker keeps running "
               "(Envoy sends it nothing new; what runs there finishes). Each run with a static pool of "
               f"{max(ph)} lists every worker from the start (no change): the baseline of the same load. "
               "Hit rate per phase and per its second half (\"stable\") from the workers' counters read at every "
               "half phase; requests and TTFT per phase by k6 send time (per-request records: the worker from "
               "`x-worker-id`, the decision from `x-prefix-router-decision`).", "",
               membership_table(rows), "", *membership_notes(rows), ""]
    for r in rows:
        md.append(f"- {r['label']}: {r.get('router_setup', '')}")
    md.append("")
    for p in pngs:
        md.append(f"![{p}]({p})")
    path = outdir / f"{stem}.md"
    path.write_text("\n".join(md) + "\n")
    raw = [{k: v for k, v in r.items() if k != "ttft_samples"} for r in rows]
    (outdir / f"{stem}.json").write_text(json.dumps(raw, indent=2))
    return path
