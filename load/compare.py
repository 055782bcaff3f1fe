"""Side-by-side comparison of routers on one k6 scenario (run it through `load/compare`).

For each router: a fresh fleet of `sglang-sim` workers (8, or 16 for `agentic`; KV capacity per
scenario below, chosen so that one worker cannot hold every prefix of the scenario but the fleet
can), the router in front of them, one k6 run of `load/<scenario>.js` (per-request samples with
`--out csv`), then the workers' `/metrics`. Writes `load/results/<scenario>.md` (table +
parameters; `<scenario>-<N>replicas[-pin].md` with --replicas N > 1 / --pin) and two PNGs (TTFT
CDF per router, requests per worker), plus the raw rows as `<scenario>*.json` (git-ignored).

Trace replay (--scenario trace [--trace conversation|synthetic|PATH] [--requests N] [--speed X]
[--block-tokens N] [--api completions|chat] [--client py|k6]): the first N requests (default 4000)
of a Mooncake FAST'25 trace (load/traces) replayed open-loop by prkit.replay (--client py, the
default: one asyncio loop, lateness within milliseconds on 2 cores; TTFT to the first body byte)
or `load/trace.js` (--client k6; TTFT to the response headers): request i is sent (t_i - t_0) / X
seconds after the start (X default 16) whether or not earlier ones finished. Each 512-token hash
block becomes a fixed text of N tokens (default 32; the last, partial block and the output in
proportion), as prkit.trace builds it. Fleet: 8 workers, --max-running-requests 16,
--decode-base-ms 10, chunked prefill and the decode step's KV read scaled to the replay's token
scale (trace_scaled_sim_args: 512 and 0.56 ms per 1k tokens at 32 tokens a block), and so are
prefix-router's token-denominated policy constants (trace_scaled_policy; --policy overrides them),
KV per worker such that the fleet holds about a fifth of the slice's distinct
prompt-block tokens (at least twice the largest request), --context-length to fit the largest
request. prefix-router runs with its decision header. Writes `load/results/trace-<name>.md`: per
router the hit rate and its share of two offline bounds over the same requests (one infinite prefix
cache; one LRU prefix cache of the fleet's KV), holder follow (requests that share more than their
first block with an earlier one: share sent to the worker that served it, from `x-worker-id`),
decision reasons per holder-follow group, TTFT / E2E, replay lateness (k6 send time minus trace
time), requests per worker.

Matrix (--matrix [--cells GLOBS] [--requests N] [--quick] [--list]; load/matrix.py): every cell of
issue 35's matrix (trace x rate x /v1/loads or /get_load workers x completions or chat x 1 or 4
replicas, 2 and 16 workers, agentic as chat and as completions, every docs/results.md scenario)
for smg cache_aware and prefix-router (2 threads), one table of hit rate, share of the pooled-LRU
bound, holder follow and TTFT p50 / p99 against smg's in the same cell: `<out>/matrix.md`.
--held-out runs the trace cells' grid on later stretches of the conversation trace instead
(requests 4001-8000 and 8001-12000): traffic no routing change was measured on. An A/B of two
filter builds: `--routers prefix_router_2t,prefix_router_2t@/path/to/new.wasm --runs 3` (the
first is PREFIX_ROUTER_WASM's build, or the checkout's), interleaved, with a paired table.

Live membership (--scenario multi_turn --membership A:B:C [--duration S] [--membership-ms MS]
[--no-baseline], prefix-router only): the model is a pool (`envoy/gen --model llama=eds:PATH`) whose
EDS file lists the fleet's first A workers, rewritten (by a rename) to the first B, then C, at equal
fractions of S seconds of load (default 150, quick 30; load/multi_turn.js DURATION: each user
starts conversation after conversation), with the decision header and per-request records on;
then (unless --no-baseline) the same load on a static pool of max(A, B, C) workers. Writes
`load/results/multi_turn-membership-A-B-C.md`: failed requests (and those in flight on a removed
worker), per added worker the seconds from its EDS change to the first request it served, per
removed worker the requests it served that were sent after its removal, and per phase (and its
second, stable half) hit rate, requests and TTFT (MembershipSchedule, membership_stats).

Routers (--replicas N: N separate router processes, each a full router of the whole fleet; k6
sends every request to a random replica, or with --pin every request of a conversation / prompt
group to the replica its id hashes to):
  round_robin, least_request   Envoy-native load balancing: one cluster with every worker as an
                               endpoint, a plain `cluster:` route, no Wasm (envoy_lb_config);
                               always ONE Envoy (2 threads), whatever --replicas says
  smg_cache_aware, smg_power_of_two
                               `smg launch --policy ...` (smg==1.13.0 in .venv-smg), defaults;
                               N smg processes, each with the full worker list
  prefix_router_1t, prefix_router_2t
                               N Envoy processes (1 or 2 worker threads each) + the prefix-router
                               filter, configs from prkit.envoy_config (envoy/gen's; loopback
                               listeners, no rate limit, no stats listener; --policy merged into
                               the plugin's policy). When envoy/gen
                               has --peers, N > 1 replicas are one fleet: each gets --peers = every
                               replica's peer listener, its own --peer-listen and a shared
                               --peer-secret (and gen's default --load-poll-ms)
  prefix_router_standalone     N Envoy processes (2 threads) + filter, without --peers and with
                               --load-poll-ms 0 where gen has it: every replica routes on its own
                               index and load view only (the scale-out features off)

Environment: PREFIX_ROUTER_WASM=path runs that filter build (load/compare then builds no filter),
SGLANG_SIM_BIN=path that simulator, ENVOY_GEN=path that config generator (e.g. an older envoy/gen
whose output an older filter build accepts).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from load.membership import (MEMBERSHIP_DURATION, MEMBERSHIP_DURATION_QUICK, membership_notes, membership_table,
                             parse_membership)
from load import matrix
from load.report import table, write_report
from load.run_one import run_one
from load.runner import log
from load.scenarios import LOAD, ROUTERS, SCENARIOS, TRACE_FULL, TRACE_QUICK, router_error
from load.trace_replay import (filter_has_cost_model, trace_describe, trace_reasons_table, trace_scaled_policy,
                               trace_scaled_sim_args, trace_setup, trace_stats, trace_table)
from prkit import trace as tr
from prkit.build import wasm_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="load/compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="shared_prefix", choices=sorted(SCENARIOS))
    ap.add_argument("--routers", default=",".join(ROUTERS),
                    help="comma-separated subset of: " + ", ".join(ROUTERS)
                    + " (a prefix_router_* as NAME@WASM runs that filter build)")
    ap.add_argument("--quick", action="store_true", help="smoke sizing (seconds per router)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="router processes per smg / prefix-router router (Envoy round_robin/least_request: always 1)")
    ap.add_argument("--pin", action="store_true",
                    help="with --replicas > 1: keep each conversation / prompt group on one replica (hash of its id) "
                    "instead of a random replica per request")
    ap.add_argument("--policy", default="{}", help="prefix-router `policy` overrides as JSON, e.g. '{\"load_eps\": 0.5}'")
    ap.add_argument("--time-scale", type=float, default=None, help="sglang-sim --time-scale (default 1, quick 0.2)")
    ap.add_argument("--out", default=str(LOAD / "results"), help="output directory")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep every run's work directory (logs, k6 samples)")
    ap.add_argument("--set", action="append", default=[], metavar="K=V", help="override a k6 env parameter")
    mg = ap.add_argument_group("--membership (live pool membership, --scenario multi_turn, prefix-router only)")
    mg.add_argument("--membership", default=None, metavar="A:B:C",
                    help="the model is an EDS pool of the fleet's first A workers, then B, then C (phases of equal "
                    "length), plus a baseline run with a static pool of max(A, B, C)")
    mg.add_argument("--duration", type=float, default=None,
                    help=f"--membership: seconds of load (default {MEMBERSHIP_DURATION}, quick {MEMBERSHIP_DURATION_QUICK})")
    mg.add_argument("--membership-ms", type=int, default=None, help="envoy/gen --membership-ms (default: gen's, 1000)")
    mg.add_argument("--no-baseline", action="store_true", help="--membership: skip the static-pool baseline run")
    tg = ap.add_argument_group("--scenario trace")
    tg.add_argument("--trace", default=None,
                    help="conversation (default) or synthetic (the Mooncake traces in load/traces) or a .jsonl[.gz] path")
    tg.add_argument("--requests", type=int, default=None,
                    help=f"replay the trace's first N requests (default {TRACE_FULL['requests']}, quick {TRACE_QUICK['requests']})")
    tg.add_argument("--speed", type=float, default=None, help=f"replay speed-up (default {TRACE_FULL['speed']:g})")
    tg.add_argument("--utilisation", type=float, default=None,
                    help="instead of --speed: the speed-up at which the fleet's estimated prefill utilisation is this "
                    "(0-1; trace_replay.prefill_seconds at the pooled-LRU bound's hits)")
    tg.add_argument("--block-tokens", type=int, default=None,
                    help=f"tokens per 512-token trace block (default {TRACE_FULL['block_tokens']})")
    tg.add_argument("--api", choices=sorted(tr.SHAPES), default=None,
                    help="completions (default: text prompt) or chat (one user message)")
    tg.add_argument("--client", choices=["py", "k6"], default=None,
                    help="who sends the replay: py (default: prkit.replay, one asyncio loop) or k6 (load/trace.js)")
    xg = ap.add_argument_group("--matrix (load/matrix.py: every cell, smg against prefix-router)")
    xg.add_argument("--matrix", action="store_true",
                    help="run the matrix's cells (all, or --cells); --requests caps the trace cells "
                    f"(default {matrix.TRACE_REQUESTS}, quick {matrix.TRACE_REQUESTS_QUICK}); --routers, --quick, "
                    "--policy, --time-scale, --out, --keep apply")
    xg.add_argument("--cells", default=None, metavar="GLOBS",
                    help="comma-separated glob patterns of cell names, e.g. 'conversation/x16/*/r1,agentic/*'")
    xg.add_argument("--list", action="store_true", help="print the matrix's cell names (after --cells) and exit")
    xg.add_argument("--held-out", action="store_true",
                    help="the trace cells on later stretches of the conversation trace (requests 4001-8000 and "
                    "8001-12000 with the default --requests) instead of the matrix's cells; with --cells, --list "
                    "and --runs as there")
    xg.add_argument("--runs", type=int, default=1,
                    help="runs per cell and router (interleaved); with more than one, a table of medians follows")
    args = ap.parse_args(argv)
    if args.matrix or args.list or args.cells or args.held_out:
        return matrix_main(ap, args, argv)
    trace_args = {k: getattr(args, k) for k in ("trace", "requests", "speed", "utilisation", "block_tokens", "api",
                                                    "client")}
    if args.scenario != "trace" and any(v is not None for v in trace_args.values()):
        ap.error("--trace/--requests/--speed/--utilisation/--block-tokens/--api/--client need --scenario trace")

    scen = SCENARIOS[args.scenario]
    if args.replicas < 1:
        ap.error("--replicas must be >= 1")
    membership = None
    if args.membership is None and (args.duration is not None or args.membership_ms is not None or args.no_baseline):
        ap.error("--duration/--membership-ms/--no-baseline need --membership")
    if args.membership is not None:
        if args.scenario != "multi_turn":
            ap.error("--membership needs --scenario multi_turn (a time-bound multi-turn load)")
        try:
            phases = parse_membership(args.membership, len(scen["models"]))
        except ValueError as e:
            ap.error(str(e))
        duration = args.duration or (MEMBERSHIP_DURATION_QUICK if args.quick else MEMBERSHIP_DURATION)
        if duration <= 0:
            ap.error("--duration must be > 0")
        membership = {"phases": phases, "duration": duration, "interval_ms": args.membership_ms}
        if args.routers == ",".join(ROUTERS):
            args.routers = "prefix_router_2t"
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    if membership and any(not r.startswith("prefix_router_") for r in routers):
        ap.error("--membership: prefix-router routers only (pools are an envoy/gen feature)")
    for r in routers:
        if (err := router_error(r)) is not None:
            ap.error(err)
    policy = json.loads(args.policy)
    k6_env = dict(scen["quick"] if args.quick else scen["env"], SEED=1)
    trace = None
    if args.scenario == "trace":
        d = TRACE_QUICK if args.quick else TRACE_FULL
        requests = args.requests or d["requests"]
        if args.speed is not None and args.utilisation is not None:
            ap.error("--speed or --utilisation, not both")
        speed = None if args.utilisation is not None else (args.speed or d["speed"])
        block_tokens = args.block_tokens or d["block_tokens"]
        if requests < 1 or (speed is not None and speed <= 0) or block_tokens < 1:
            ap.error("--requests and --block-tokens must be >= 1, --speed > 0")
        if args.utilisation is not None and not 0 < args.utilisation <= 1:
            ap.error("--utilisation must be within (0, 1]")
        trace_dir = Path(tempfile.mkdtemp(prefix="compare-trace-"))
        try:
            trace = trace_setup(args.trace or "conversation", requests, speed, block_tokens, args.api or "completions",
                                len(scen["models"]), trace_dir, args.utilisation)
        except (OSError, ValueError) as e:
            ap.error(str(e))
        k6_env.update(PLAN=str(trace["plan"]), API=trace["api"], VUS=256)
        log(f"trace: {trace_describe(trace)}")
        log(f"trace: bounds: infinite cache {sum(trace['infinite']) / sum(trace['prompt_tokens']):.1%}, pooled LRU "
            f"{sum(trace['pooled_lru']) / sum(trace['prompt_tokens']):.1%} of prompt tokens")
    for kv in args.set:
        k, _, v = kv.partition("=")
        k6_env[k] = v
    k6_env.setdefault("MODELS", scen["models"][0])
    kv = scen["kv_quick"] if args.quick else scen["kv"]
    if trace:
        kv = trace["kv"]
    ts = args.time_scale if args.time_scale is not None else (0.2 if args.quick else 1.0)
    sim_args = ["--max-total-tokens", str(kv), "--time-scale", str(ts), *scen["sim"]]
    if trace:
        sim_args += ["--context-length", str(trace["context"]), *trace_scaled_sim_args(trace["block_tokens"])]
        policy = {**trace_scaled_policy(trace["block_tokens"], filter_has_cost_model(wasm_path())), **policy}
    command = command_line(argv)
    base = f"trace-{trace['stem']}" + ("-chat" if trace["api"] == "chat" else "") if trace else args.scenario
    if membership:
        base += "-membership-" + "-".join(map(str, membership["phases"]))
    stem = base + (f"-{args.replicas}replicas" if args.replicas > 1 else "") + ("-pin" if args.pin else "")
    log(f"scenario {args.scenario}{' (quick)' if args.quick else ''}: routers {', '.join(routers)}"
        f"{f', {args.replicas} replicas' if args.replicas > 1 else ''}{' (pinned)' if args.pin else ''}")
    rows = []
    runs = [(r, None) for r in routers]
    if membership:
        static = dict(membership, phases=[max(membership["phases"])] * len(membership["phases"]))
        runs = [(r, m) for r in routers for m in ([membership] if args.no_baseline else [membership, static])]
    sends = None
    if trace and (args.client or "py") == "py":
        sends = tr.plan_sends(json.loads(trace["plan"].read_text()), trace["api"], k6_env["MODELS"])
    for r, mem in runs:
        row = run_one(r, scen, k6_env, sim_args, policy, args.replicas, args.pin, mem, sends)
        if mem:
            ms = row["membership"]
            log(f"{row['label']}: failed {ms['failed']} ({ms['failed_on_removed']} in flight on a removed worker); "
                "first request of each added worker after its change: "
                + (", ".join(f"{a['worker']} {a['first_request_s']}" for a in ms["added"]) or "-")
                + "; hit rate per phase (stable half): "
                + ", ".join("-" if p["hit_rate_stable"] is None else f"{p['hit_rate_stable']:.1%}" for p in ms["phases"]))
        if trace:
            row["trace"] = s = trace_stats(row, trace)
            log(f"{row['label']}: share of infinite {s['share_of_infinite']:.0%}, of pooled LRU "
                f"{s['share_of_pooled_lru']:.0%}; holder follow {s['follow_latest']:.0%} (latest) of {s['eligible']}; "
                f"lateness p99 {s['lateness_p99_ms']:.0f} ms")
        rows.append(row)
    path = write_report(rows, args.scenario, scen, k6_env, sim_args, kv, policy, command, Path(args.out),
                        args.no_plots, stem, args.replicas, args.pin, trace, membership)
    if trace and not args.keep:
        shutil.rmtree(trace["plan"].parent, ignore_errors=True)
    print()
    if trace:
        print(trace_table(rows))
        reasons = trace_reasons_table(rows)
        if reasons:
            print("\n" + reasons)
    else:
        print(table(rows))
    if membership:
        print("\n" + membership_table(rows) + "\n\n" + "\n".join(membership_notes(rows)))
    print(f"\nwrote {path}")
    bad = [r["label"] for r in rows if r["errors"] or r["k6_exit"] != 0]
    for r in rows:  # keep the logs (Envoy, smg, workers, k6, samples) of failed runs only
        if r["label"] not in bad and not args.keep:
            shutil.rmtree(r["workdir"], ignore_errors=True)
    if bad:
        print(f"compare: errors or failed k6 thresholds for: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def matrix_main(ap: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> int:
    cells = matrix.select(matrix.held_out_cells() if args.held_out else matrix.all_cells(), args.cells)
    if not cells:
        ap.error(f"--cells {args.cells!r} matches no cell; see --list")
    if args.list:
        print("\n".join(c.name for c in cells))
        return 0
    if not args.matrix:
        ap.error("--cells and --held-out need --matrix or --list")
    other = [k for k in ("trace", "speed", "utilisation", "block_tokens", "api", "client", "membership")
             if getattr(args, k) is not None] + (["replicas"] if args.replicas != 1 else [])
    if other:
        ap.error(f"--matrix sets these per cell: {', '.join('--' + k.replace('_', '-') for k in other)}")
    routers = matrix.ROUTERS if args.routers == ",".join(ROUTERS) else [r.strip() for r in args.routers.split(",")]
    for r in routers:
        if (err := router_error(r)) is not None:
            ap.error(err)
    if len(set(routers)) != len(routers):
        ap.error("--routers names a router twice")
    if args.requests is not None and args.requests < 1:
        ap.error("--requests must be >= 1")
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    ts = args.time_scale if args.time_scale is not None else (0.2 if args.quick else 1.0)
    results, path = matrix.run_matrix(cells, routers, args.quick, args.requests, ts, json.loads(args.policy),
                                      Path(args.out), command_line(argv), args.keep, args.runs)
    print("\n" + matrix.table(results) + "\n\n" + "\n".join(matrix.cell_notes(results)))
    if args.runs > 1:
        print("\n" + matrix.medians_table(results))
    print(f"\nwrote {path}")
    bad = sorted({r["cell"] + " " + r["router"] for r in results if r["errors"]})
    if bad:
        print(f"compare: errors in: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def command_line(argv: list[str] | None) -> str:
    envs = [f"{k}={os.environ[k]}" for k in ("PREFIX_ROUTER_WASM", "SGLANG_SIM_BIN", "ENVOY_GEN") if os.environ.get(k)]
    return " ".join(envs + ["load/compare"]) + " " + " ".join(
        a if re.fullmatch(r"[\w.,=/:*-]+", a) else repr(a) for a in (argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
