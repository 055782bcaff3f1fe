"""Trace replay (load/compare --scenario trace): sizing a fleet for a slice of a Mooncake trace,
the simulator flags and policy values at the replay's token scale, and the replay's numbers
beside the workers' hit rate (offline bounds, holder follow, decision reasons, lateness)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

from load.scenarios import KV_FLEET_SHARE
from prkit import trace as tr
from prkit.replay import percentile


def _round_up(x: float, step: int) -> int:
    return int(math.ceil(x / step)) * step


# SGLang's per-token figures at production scale (sim/README.md): chunked prefill of 8192 tokens,
# a decode step that reads every running request's KV (0.035 ms per 1k tokens of context), and
# prefill of a new token 5.3% dearer per 1k tokens of context it attends to.
SGLANG_CHUNK_TOKENS = 8192
KV_READ_MS_PER_1K = 0.035
PREFILL_CONTEXT_PER_1K = 0.053  # sglang-sim's default: the H200 table's context term


def trace_scaled_sim_args(block_tokens: int) -> list[str]:
    """Simulator flags that keep the worker's shape at the replay's token scale: a scaled token
    stands for 512 / block_tokens real ones, so a prompt is chunked where a real one would be, a
    decode step reads as much KV as the real context would, and a new token's prefill grows
    with its context as it would at the real context length."""
    f = 512 / block_tokens
    chunk = max(64, round(SGLANG_CHUNK_TOKENS / f))
    return ["--chunked-prefill-size", str(chunk), "--decode-kv-ms-per-1k-tokens", f"{KV_READ_MS_PER_1K * f:g}",
            "--prefill-context-per-1k-tokens", f"{PREFILL_CONTEXT_PER_1K * f:g}"]


# The filter's token-denominated policy defaults (filter/src/config.rs): a replay at another token
# scale scales them as it scales the simulator (trace_scaled_policy).
FILTER_TOKEN_DEFAULTS = {"request_cost_tokens": 64, "slack_full_tokens": 8192, "prefill_slack_full_tokens": 2048,
                         "prefill_chunk_tokens": 8192}


# The cost model's token-denominated default (filter/src/config/cost.rs, `policy.cost`): the
# context at which a new token's prefill costs twice its zero-context cost.
FILTER_COST_TOKEN_DEFAULTS = {"context_tokens": 20480}


def filter_has_cost_model(wasm: Path) -> bool:
    """Whether a filter build reads `policy.cost` (its serde field names are in the binary):
    an older build refuses the unknown field, so its replays leave it out."""
    try:
        return b"context_tokens" in wasm.read_bytes()
    except OSError:
        return False


def trace_scaled_policy(block_tokens: int, cost: bool = False) -> dict:
    """prefix-router policy values in the replay's token units: a scaled token stands for
    512 / block_tokens real ones (as in trace_scaled_sim_args), so a request in flight costs, and
    a holder earns its full load slack at, the same real-token amounts as in production. Without
    it a 2-block shared prefix (1024 real tokens, 64 scaled) weighs no more than one request in
    flight (64), and conversations leave idle holders for a replay artefact. `cost`: also the
    cost model's `policy.cost.context_tokens`, as the simulator's context term is scaled."""
    f = 512 / block_tokens
    out: dict = {k: max(1, round(v / f)) for k, v in FILTER_TOKEN_DEFAULTS.items()}
    if cost:
        out["cost"] = {k: max(1, round(v / f)) for k, v in FILTER_COST_TOKEN_DEFAULTS.items()}
    return out


# sglang-sim's default prefill rate (zero context) and fixed cost per prefill batch.
SIM_PREFILL_TOKENS_PER_S = 30_000.0
SIM_PREFILL_OVERHEAD_MS = 3.0


def prefill_seconds(prompts: list[int], hits: list[int], block_tokens: int) -> float:
    """Simulated prefill seconds of the requests if each reused `hits[i]` cached tokens (the
    pooled-LRU bound's hits: what a perfect router over LRU workers leaves to compute): per
    request one batch's fixed cost plus its uncached tokens, each dearer by the context term at
    its cached prefix (trace_scaled_sim_args' scale)."""
    k = PREFILL_CONTEXT_PER_1K * 512 / block_tokens
    return sum(SIM_PREFILL_OVERHEAD_MS / 1000 + (p - h) * (1 + k * h / 1000) / SIM_PREFILL_TOKENS_PER_S
               for p, h in zip(prompts, hits))


def trace_setup(name: str, requests: int, speed: float | None, block_tokens: int, api: str, workers: int,
                workdir: Path, utilisation: float | None = None, skip: int = 0) -> dict:
    """`requests` requests of trace `name` after its first `skip` (`tr.load_trace`): writes the
    replay plan (prkit.trace) to `workdir/plan.json` and computes the fleet's sizing and the
    offline bounds. KV per worker: the fleet holds KV_FLEET_SHARE of the slice's distinct
    prompt-block tokens, but at least twice the largest request (prompt + output: the simulator
    refuses a request its KV cannot hold, and one that fills a worker blocks it);
    --context-length: the largest request fits (at least 8192).
    Without `speed`, the speed-up at which the fleet's prefill utilisation (prefill_seconds at the
    pooled-LRU hits / (workers x replay seconds)) is `utilisation`."""
    reqs = tr.load_trace(name, requests, skip)
    if not reqs:
        raise SystemExit(f"compare: trace {name!r} has no requests")
    shape = tr.SHAPES[api]
    scaled = [tr.scale(r, block_tokens) for r in reqs]
    seqs = [tr.with_shape(blocks, shape) for blocks, _ in scaled]
    outs = [o for _, o in scaled]
    prompts = [tr.prompt_tokens(b) for b in seqs]
    largest = max(p + o for p, o in zip(prompts, outs))
    distinct = tr.distinct_block_tokens(seqs)
    share_kv = _round_up(distinct * KV_FLEET_SHARE / workers, 256)
    kv = max(share_kv, _round_up(2 * largest, 256))
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000
    pooled = tr.pooled_lru_hits(seqs, kv * workers)
    busy = prefill_seconds(prompts, pooled, block_tokens)
    if speed is None:
        if not utilisation or utilisation <= 0 or span <= 0:
            raise ValueError("trace_setup: give a speed, or a utilisation > 0 of a trace that spans time")
        speed = round(utilisation * workers * span / busy, 2)
    plan = workdir / "plan.json"
    plan.write_text(json.dumps(tr.replay_plan(reqs, block_tokens, speed), separators=(",", ":")))
    return {
        "name": name,
        "stem": Path(name).name.removesuffix(".gz").removesuffix(".jsonl") if name not in tr.TRACES else name,
        "requests": len(reqs),
        "skip": skip,
        "speed": speed,
        "block_tokens": block_tokens,
        "api": api,
        "plan": plan,
        "hash_seqs": [r.hash_ids for r in reqs],
        "seqs": seqs,
        "prompt_tokens": prompts,
        "out_tokens": outs,
        "infinite": tr.infinite_cache_hits(seqs),
        "pooled_lru": pooled,
        "utilisation": busy * speed / (workers * span) if span > 0 else 0.0,
        "kv": kv,
        "kv_floor": share_kv < kv,
        "context": max(8192, _round_up(largest + 1, 1024)),
        "distinct_tokens": distinct,
        "largest": largest,
        "span_s": span,
        "replay_s": span / speed,
        "workers": workers,
    }


def trace_describe(t: dict) -> str:
    pr, out = t["prompt_tokens"], t["out_tokens"]
    fleet = t["kv"] * t["workers"]
    skip = t.get("skip", 0)
    which = f"requests {skip + 1}-{skip + t['requests']}" if skip else f"first {t['requests']} requests"
    return (f"{which} of the {t['name']} trace ({t['span_s']:.0f} s of trace) replayed "
            f"open-loop at speed {t['speed']:g} ({t['replay_s']:.0f} s, {t['requests'] / max(t['replay_s'], 1e-9):.1f} "
            f"requests/s; estimated prefill utilisation {t.get('utilisation', 0):.0%} at the pooled-LRU bound's hits), "
            f"512-token blocks scaled to {t['block_tokens']} tokens, `/v1/{'chat/' if t['api'] == 'chat' else ''}"
            f"completions` (streaming); prompts mean {sum(pr) / len(pr):.0f} / max {max(pr)} tokens, outputs mean "
            f"{sum(out) / len(out):.1f} / max {max(out)} tokens (ignore_eos); distinct prompt blocks "
            f"{t['distinct_tokens']} tokens; KV {t['kv']} tokens per worker, fleet {fleet} = "
            f"{fleet / t['distinct_tokens']:.0%} of them"
            + (f" (floor: twice the largest request, {t['largest']} tokens)" if t["kv_floor"] else "")
            + f"; --context-length {t['context']}")




def _reason(header: str | None) -> str:
    m = re.search(r"reason=([\w-]+)", header or "")
    return m.group(1) if m else "-"


def _holder_state(header: str | None) -> str:
    """The deepest holder's state as the filter's decision saw it (`holder_load=reqs/capacity/
    queued prefill tokens` in the debug header): `saturated` (at its running-request capacity),
    `queued` (prefill tokens waiting), `free` (neither), `-` (no holder, or no header)."""
    m = re.search(r"holder_load=(\d+)/(\d+)/(\d+)", header or "")
    if not m:
        return "-"
    reqs, cap, tokens = (int(x) for x in m.groups())
    if cap and reqs >= cap:
        return "saturated"
    return "queued" if tokens else "free"


def held_bound(recs: dict[int, dict], t: dict) -> int:
    """Tokens the pooled-LRU bound's cache (the fleet's KV) serves when each served request holds
    its prompt and output from its first token to its end, as its record (`recs`, by request
    index) times it (prkit.trace.held_lru_hits): a request's KV is allocated by the prefill that
    ends at its first token, so the hold starts late by its own prefill, in the bound's favour."""
    spans: list[tuple[float, float] | None] = [None] * t["requests"]
    for i in range(t["requests"]):
        r = recs.get(i)
        if r and r["s"] == 200 and None not in (r.get("ttft"), r.get("t0"), r.get("t1")):
            spans[i] = (r["t0"] + r["ttft"], r["t1"])
    return sum(tr.held_lru_hits(t["seqs"], t["out_tokens"], spans, t["kv"] * t["workers"]))


def trace_stats(row: dict, t: dict) -> dict:
    """The replay's numbers beside the workers' hit rate: the offline bounds and the router's share
    of them, holder follow (prkit.trace.holder_follow on the workers the `x-worker-id` headers
    name), decision reasons per holder-follow group, replay lateness."""
    recs = {r["i"]: r for r in row.get("records", [])}
    workers = [recs[i]["w"] if i in recs and recs[i]["s"] == 200 else None for i in range(t["requests"])]
    hf = tr.holder_follow(t["hash_seqs"], workers)
    groups = {"followed": Counter(), "not_followed": Counter(), "not_eligible": Counter()}
    eligible = dict(zip(hf.eligible, hf.followed_latest))
    states = {"followed": Counter(), "not_followed": Counter()}
    for i, r in recs.items():
        g = "not_eligible" if i not in eligible else ("followed" if eligible[i] else "not_followed")
        groups[g][_reason(r.get("d"))] += 1
        if g != "not_eligible":
            states[g][_holder_state(r.get("d"))] += 1
    free_followed, free_not = states["followed"]["free"], states["not_followed"]["free"]
    # Issue 35's target: follow where the holder was under its capacity (free or queued).
    under_followed = free_followed + states["followed"]["queued"]
    under_not = free_not + states["not_followed"]["queued"]
    total = sum(t["prompt_tokens"])
    routed = sum(tr.routed_cache_hits(t["seqs"], workers)) / total if "seqs" in t else 0.0
    routed_lru = sum(tr.routed_lru_hits(t["seqs"], workers, t["kv"])) / total if "seqs" in t and "kv" in t else 0.0
    inf = sum(t["infinite"]) / total
    lru = sum(t["pooled_lru"]) / total
    held = held_bound(recs, t) / total if "seqs" in t and "kv" in t else 0.0
    late = [r["late"] for r in recs.values()]
    return {
        "infinite_bound": inf,
        "pooled_lru_bound": lru,
        "share_of_infinite": row["hit_rate"] / inf if inf else 0.0,
        "share_of_pooled_lru": row["hit_rate"] / lru if lru else 0.0,
        # Reuse the routing left reachable (each worker an infinite cache of what it served),
        # and the share of it the workers' real caches delivered: routing loss vs eviction loss.
        "routed_bound": routed,
        "share_of_routed": row["hit_rate"] / routed if routed else 0.0,
        # The same reuse through an LRU of the worker's KV size, fed what it was sent: the
        # placement's own eviction, without the time it is served in.
        "routed_lru_bound": routed_lru,
        # The pooled LRU with the KV this run's running requests held taken out while they ran
        # (prkit.trace.held_lru_hits): what one cache of the fleet's size delivers in this run's
        # time, which no routing gives back.
        "held_lru_bound": held,
        "share_of_held_lru": row["hit_rate"] / held if held else 0.0,
        "planned_prompt_tokens": total,
        "records": len(recs),
        "served": hf.served,
        "eligible": len(hf.eligible),
        "follow_latest": hf.rate("latest"),
        "follow_earliest": hf.rate("earliest"),
        "follow_any": hf.rate("any"),
        "reasons": {g: dict(c.most_common()) for g, c in groups.items()},
        "holder_states": {g: dict(c.most_common()) for g, c in states.items()},
        "free_eligible": free_followed + free_not,
        "follow_free": free_followed / (free_followed + free_not) if free_followed + free_not else 0.0,
        "under_eligible": under_followed + under_not,
        "follow_under_capacity": under_followed / (under_followed + under_not) if under_followed + under_not else 0.0,
        "lateness_p50_ms": percentile(late, 50),
        "lateness_p99_ms": percentile(late, 99),
        "lateness_max_ms": max(late, default=0.0),
    }


def trace_table(rows: list[dict]) -> str:
    t0 = rows[0]["trace"] if rows else {}
    head = (f"| router | replicas | hit rate | share of infinite ({t0.get('infinite_bound', 0):.1%}) "
            f"| share of pooled LRU ({t0.get('pooled_lru_bound', 0):.1%}) | share of it with running KV held (bound) "
            "| holder follow latest / earliest / any "
            "| TTFT p50 / p90 / p99 | E2E p50 / p90 / p99 | lateness p50 / p99 / max | errors | max/mean load "
            "| requests per worker |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        s, t, e = r["trace"], r["ttft"], r["e2e"]
        reqs = r["worker_requests"]
        n = r.get("replicas", 1)
        replicas = str(n) if n == 1 else f"{n} {r.get('replica_mode', '')}"
        lines.append(
            f"| {r['label']} | {replicas} | {r['hit_rate']:.1%} | {s['share_of_infinite']:.0%} "
            f"| {s['share_of_pooled_lru']:.0%} | {s['share_of_held_lru']:.0%} ({s['held_lru_bound']:.1%}) "
            f"| {s['follow_latest']:.0%} / {s['follow_earliest']:.0%} / {s['follow_any']:.0%} (of {s['eligible']}) "
            f"| {t.get('med', 0):.0f} / {t.get('p(90)', 0):.0f} / {t.get('p(99)', 0):.0f} ms "
            f"| {e.get('med', 0):.0f} / {e.get('p(90)', 0):.0f} / {e.get('p(99)', 0):.0f} ms "
            f"| {s['lateness_p50_ms']:.0f} / {s['lateness_p99_ms']:.0f} / {s['lateness_max_ms']:.0f} ms "
            f"| {r['errors']} | {r['max_over_mean']:.2f} | {' / '.join(str(int(x)) for x in reqs)} |")
    return "\n".join(lines)


def trace_reasons_table(rows: list[dict]) -> str:
    """Decision reasons (x-prefix-router-decision) per holder-follow group; routers without the
    header are left out."""
    def fmt(c: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in c.items()) or "none"

    lines = ["| router | followed the latest holder | eligible, did not follow | not eligible "
             "| holder state: followed / did not follow | follow where the holder was free |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        g = r["trace"]["reasons"]
        if all(set(c) <= {"-"} for c in g.values()):
            continue
        st = r["trace"].get("holder_states", {})
        free = (f"{r['trace']['follow_free']:.0%} (of {r['trace']['free_eligible']})"
                if r["trace"].get("free_eligible") else "-")
        lines.append(f"| {r['label']} | {fmt(g['followed'])} | {fmt(g['not_followed'])} | {fmt(g['not_eligible'])} "
                     f"| {fmt(st.get('followed', {}))} / {fmt(st.get('not_followed', {}))} | {free} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def trace_notes(rows: list[dict], t: dict) -> list[str]:
    out = [
        f"Bounds (same {t['requests']} requests, prompt tokens as the simulator counts them, outputs never "
        f"cached): one infinite prefix cache {rows[0]['trace']['infinite_bound']:.1%} of prompt tokens; one LRU "
        f"prefix cache of the whole fleet's KV ({t['kv'] * t['workers']} tokens, {t['block_tokens']}-token "
        f"blocks) {rows[0]['trace']['pooled_lru_bound']:.1%} (not a strict upper bound: the workers also cache "
        "outputs and reserve KV for running requests, and LRU is not optimal). Share = hit rate / bound. "
        "The same cache with each served request's prompt and output held in it from its first token to its "
        "end, as this router's run timed them (prkit.trace.held_lru_hits), per router: what that run's "
        "running requests left of the bound.",
        "Holder follow: of the requests an earlier served request shares more than the first block with "
        "(`of N`), the share sent to the worker that served the latest / the earliest request sharing the "
        "longest prefix, or to any worker that served one (workers from `x-worker-id`). Lateness: how long "
        "after its trace time k6 sent each request (the replay keeps up when p99 stays near 0).",
    ]
    for r in rows:
        s = r["trace"]
        if r["prompt_tokens"] != s["planned_prompt_tokens"] and not r["errors"]:
            out.append(f"- {r['label']}: the workers counted {r['prompt_tokens']:.0f} prompt tokens, the plan has "
                       f"{s['planned_prompt_tokens']} (the text-to-token mapping is off).")
        if s["records"] != t["requests"]:
            out.append(f"- {r['label']}: {s['records']} of {t['requests']} per-request records.")
    return out
