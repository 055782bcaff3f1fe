"""One load/compare run: a fresh fleet, one router (its replicas), the load (k6, or prkit.replay
for trace replays), the workers' metrics; returns the row the reports read."""

from __future__ import annotations

import csv
import json
import re
import tempfile
import time
from pathlib import Path

from load.membership import MembershipSchedule, envoy_pool_stats, membership_label, membership_stats
from load.routers import start_router
from load.runner import log, run_k6
from load.scenarios import LABELS, LOAD, SINGLE, split_router
from prkit.envoy import METRICS_FLUSH_S, Envoy
from prkit import replay
from prkit.fleet import SimFleet


def k6_samples(path: Path, metric: str) -> list[float]:
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("metric_name") == metric:
                out.append(float(row["metric_value"]))
    return out


def k6_records(path: Path) -> list[dict]:
    """The per-request `TRACE {...}` console lines of load/trace.js, by request index."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        if line.startswith("TRACE "):
            out.append(json.loads(line[len("TRACE "):]))
    return sorted(out, key=lambda r: r["i"])


def k6_requests_per_target(path: Path, urls: list[str]) -> list[int]:
    """http_reqs samples per router replica (by the request URL's scheme://host:port)."""
    counts = dict.fromkeys(urls, 0)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("metric_name") != "http_reqs":
                continue
            m = re.match(r"^(https?://[^/]+)", row.get("url", ""))
            if m and m.group(1) in counts:
                counts[m.group(1)] += int(float(row["metric_value"]))
    return [counts[u] for u in urls]


def envoy_peer_stats(procs: list) -> dict:
    """Saves each Envoy's /stats next to its log (kept with --keep or on failure) and sums the
    upstream requests to its peer clusters (prefix_router_peer_*): index-record batches sent, 2xx;
    and the index self-check's aged-out windows (prefix_router.hit_check.aged_out)."""
    sent = ok = aged = 0
    if any(isinstance(p, Envoy) for p in procs):
        time.sleep(METRICS_FLUSH_S)  # the filter flushes its metrics every 200 ms
    for p in procs:
        if not isinstance(p, Envoy):
            continue
        try:
            status, text = p.admin_get("/stats", timeout=5)
        except OSError:
            continue
        if status != 200:
            continue
        (p.workdir / "stats.txt").write_text(text)
        for line in text.splitlines():
            a = re.match(r"^\S*prefix_router\.hit_check\.aged_out: (\d+)$", line)
            if a:
                aged += int(a.group(1))
            m = re.match(r"^cluster\.prefix_router_peer_\d+\.upstream_rq_(total|2xx): (\d+)$", line)
            if m:
                if m.group(1) == "total":
                    sent += int(m.group(2))
                else:
                    ok += int(m.group(2))
    return {"sent": sent, "ok": ok, "aged_out": aged}


def router_label(router: str, replicas: int, pin: bool) -> str:
    """The router's name in tables; a prefix-router with its own filter build
    (`NAME@WASM`) is named with that build's path."""
    router, wasm = split_router(router)
    label = LABELS.get(router, router) + (f" [{wasm}]" if wasm is not None else "")
    if router in SINGLE or replicas == 1:
        return label
    return f"{label} x{replicas} replicas" + (" (pinned)" if pin else "")


def run_one(router: str, scen: dict, k6_env: dict, sim_args: list[str], policy: dict, replicas: int = 1,
            pin: bool = False, membership: dict | None = None, sends: list | None = None) -> dict:
    """One router on a fresh fleet. `membership` (--membership): {"phases": worker counts,
    "duration": seconds, "interval_ms": --membership-ms or None}: the prefix-router's model is a
    pool read from an EDS file that MembershipSchedule rewrites at each phase; k6 runs for
    `duration` seconds with per-request records and the decision header on. `sends` (a trace
    replay with --client py): prkit.replay sends them open-loop instead of k6, with the same
    per-request records."""
    label = router_label(router, replicas, pin)
    workers = len(scen["models"])
    workdir = Path(tempfile.mkdtemp(prefix=f"compare-{split_router(router)[0]}-"))
    fleet = SimFleet(workers, workdir, sim_args, models=scen["models"])
    procs = []
    records_on = scen.get("records") or membership is not None
    schedule = None
    try:
        fleet.start()
        pool = None
        if membership is not None:
            label = membership_label(label, membership["phases"])
            pool = workdir / "eds" / "pool.json"
            pool.parent.mkdir()
            schedule = MembershipSchedule(fleet, pool, membership["phases"], membership["duration"])
        procs, urls, how = start_router(router, fleet, policy, workdir, replicas,
                                        scen.get("debug_header", False) or membership is not None, pool,
                                        membership and membership.get("interval_ms"))
        client = "prkit.replay" if sends is not None else f"k6 {scen['script']}"
        log(f"{label}: {workers} workers up, router at {', '.join(urls)} ({how}); {client} running")
        env = dict(k6_env, TARGETS=",".join(urls), PIN="1" if pin else "0")
        if membership is not None:
            env.update(DURATION=membership["duration"], RECORDS=1)
        extra = ["--out", f"csv={workdir / 'samples.csv'}"]
        if records_on:  # per-request console lines (load/trace.js, load/multi_turn.js RECORDS=1)
            extra += ["--log-format", "raw", "--console-output", str(workdir / "records.log")]
        t0 = time.monotonic()
        if schedule is not None:
            schedule.start()
        if sends is not None:
            res = replay.run(sends, urls, pin=pin, seed=int(k6_env.get("SEED", 1)))
            summary = res.summary()
            summary["k6_exit"] = 0 if summary["errors"] == 0 else 99  # as k6's failed thresholds
            summary["params"] = {"TOTAL_REQUESTS": len(sends)}
            summary["thresholds_ok"] = summary["errors"] == 0
        else:
            try:
                summary = run_k6(LOAD / scen["script"], env, workdir / "summary.json", workdir, extra_args=extra)
            finally:
                if schedule is not None:
                    schedule.finish()
        wall = time.monotonic() - t0
        m = fleet.metrics()
        if sends is not None:
            ttfts = [r.ttft_ms for r in res.records if r.ok and r.ttft_ms is not None]
            records = [r.as_trace_record() for r in res.records]
            per_target = res.per_target
        else:
            ttfts = k6_samples(workdir / "samples.csv", "ttft")
            records = k6_records(workdir / "records.log") if records_on else None
            per_target = k6_requests_per_target(workdir / "samples.csv", urls)
        peer = envoy_peer_stats(procs)
        pool_stats = envoy_pool_stats(procs) if membership is not None else None
    finally:
        for p in procs:
            p.stop()
        fleet.stop()
    prompt = sum(v.get("sglang:prompt_tokens_total", 0) for v in m.values())
    cached = sum(v.get("sglang:cached_tokens_total", 0) for v in m.values())
    reqs = [m[n].get("sglang:num_requests_total", 0) for n in fleet.names]
    mean = sum(reqs) / len(reqs)
    row = {
        "router": router,
        "label": label,
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft": summary.get("ttft_ms", {}),
        "e2e": summary.get("e2e_ms", {}),
        "tpot": summary.get("tpot_ms", {}),
        "rps": summary.get("rps", 0.0),
        "out_tokens_per_s": summary.get("out_tokens_per_s", 0.0),
        "requests": summary.get("requests", 0),
        "expected_requests": summary.get("params", {}).get("TOTAL_REQUESTS"),
        "errors": summary.get("errors", 0),
        "worker_requests": reqs,
        "worker_prompt_tokens": [m[n].get("sglang:prompt_tokens_total", 0) for n in fleet.names],
        "max_over_mean": (max(reqs) / mean) if mean else 0.0,
        "workers_used": sum(1 for x in reqs if x > 0),
        "replicas": len(urls),
        "replica_requests": per_target,
        "replica_mode": "one" if len(urls) == 1 else ("pinned" if pin else "random"),
        "router_setup": how + (f"; peer record batches sent {peer['sent']}, answered 2xx {peer['ok']}"
                               if peer["sent"] or peer["ok"] else "")
        + (f"; index self-check aged out a worker's entries {peer['aged_out']} times" if peer.get("aged_out") else ""),
        "peer_batches": peer,
        "k6_exit": summary.get("k6_exit"),
        "thresholds_ok": summary.get("thresholds_ok"),
        "wall_s": wall,
        "ttft_samples": ttfts,
        "policy": policy if router.startswith("prefix_router") else None,
        "workdir": str(workdir),
        "client": "prkit.replay" if sends is not None else "k6",
    }
    if records is not None:
        row["records"] = records
    if schedule is not None:
        row["membership"] = membership_stats(records or [], schedule, fleet, pool_stats)
    t = row["ttft"]
    log(f"{label}: {row['requests']} requests in {wall:.0f}s, errors {row['errors']}, hit rate "
        f"{row['hit_rate']:.1%}, TTFT p50/p99 {t.get('med', 0):.0f}/{t.get('p(99)', 0):.0f} ms, "
        f"max/mean load {row['max_over_mean']:.2f}, workers used {row['workers_used']}/{workers}, "
        f"requests per replica {'/'.join(map(str, per_target))}")
    return row
