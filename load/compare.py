"""Side-by-side comparison of routers on one k6 scenario (run it through `load/compare`).

For each router: a fresh fleet of `sglang-sim` workers (8, or 16 for `agentic`; KV capacity per
scenario below, chosen so that one worker cannot hold every prefix of the scenario but the fleet
can), the router in front of them, one k6 run of `load/<scenario>.js` (per-request samples with
`--out csv`), then the workers' `/metrics`. Writes `load/results/<scenario>.md` (table +
parameters; `<scenario>-<N>replicas[-pin].md` with --replicas N > 1 / --pin) and two PNGs (TTFT
CDF per router, requests per worker), plus the raw rows as `<scenario>*.json` (git-ignored).

Trace replay (--scenario trace [--trace conversation|synthetic|PATH] [--requests N] [--speed X]
[--block-tokens N] [--api completions|chat]): the first N requests (default 4000) of a Mooncake
FAST'25 trace (load/traces) replayed open-loop by `load/trace.js`: request i is sent (t_i - t_0) / X
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
import csv
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from load.runner import log, run_k6
from prkit import envoy_config as ec
from prkit import trace as tr
from prkit.build import ensure_smg, smg_healthy_workers, wasm_path
from prkit.eds import write_local_eds
from prkit.envoy import METRICS_FLUSH_S, Envoy
from prkit.fleet import SimFleet
from prkit.paths import REPO_ROOT as REPO
from prkit.ports import free_port
from prkit.wait import Timeout, wait_until

LOAD = REPO / "load"
GEN = Path(os.environ.get("ENVOY_GEN", REPO / "envoy" / "gen"))
WORKERS = 8  # per scenario: len(SCENARIOS[s]["models"])

# --------------------------------------------------------------------------------------------
# Scenarios: k6 script, env (full and --quick), simulator flags, model per worker.
# --------------------------------------------------------------------------------------------

SCENARIOS = {
    "shared_prefix": {
        "script": "shared_prefix.js",
        "env": dict(GROUPS=64, PROMPTS=16, SYS_TOKENS=2048, Q_TOKENS=128, OUT_TOKENS=64, CONCURRENCY=32),
        "quick": dict(GROUPS=8, PROMPTS=4, SYS_TOKENS=512, Q_TOKENS=32, OUT_TOKENS=8, CONCURRENCY=8),
        # 64 prefixes x ~2.1k tokens = ~135k tokens: one worker (40k) holds < 1/3 of them, the fleet
        # (328k) all of them. Quick: 8 x ~0.5k = 4.2k vs 2k per worker.
        "kv": 40960, "kv_quick": 2048,
        "sim": [], "models": ["llama"] * WORKERS,
    },
    "skewed": {
        "script": "skewed.js",
        "env": dict(GROUPS=64, REQUESTS=1024, ZIPF_S=1.1, SYS_TOKENS=2048, Q_TOKENS=128, OUT_TOKENS=64,
                    CONCURRENCY=32),
        "quick": dict(GROUPS=16, REQUESTS=48, ZIPF_S=1.1, SYS_TOKENS=512, Q_TOKENS=32, OUT_TOKENS=8,
                      CONCURRENCY=8),
        "kv": 40960, "kv_quick": 2048,
        "sim": [], "models": ["llama"] * WORKERS,
    },
    "multi_turn": {
        "script": "multi_turn.js",
        "env": dict(USERS=32, CONVERSATIONS=2, TURNS=6, APPS=4, SYS_TOKENS=1024, Q_TOKENS=96, OUT_TOKENS=64),
        "quick": dict(USERS=8, CONVERSATIONS=1, TURNS=3, APPS=2, SYS_TOKENS=256, Q_TOKENS=32, OUT_TOKENS=8),
        # 64 conversations growing to ~2k tokens = ~130k tokens of histories; 24k per worker.
        "kv": 24576, "kv_quick": 2048,
        "sim": [], "models": ["llama"] * WORKERS,
    },
    "two_models": {
        "script": "two_models.js",
        "env": dict(GROUPS=32, PROMPTS=8, SYS_TOKENS=2048, Q_TOKENS=128, OUT_TOKENS=64, CONCURRENCY=32,
                    MODELS="a,b"),
        "quick": dict(GROUPS=8, PROMPTS=4, SYS_TOKENS=512, Q_TOKENS=32, OUT_TOKENS=8, CONCURRENCY=8,
                      MODELS="a,b"),
        # model a on w0..w3, b on w4..w7; 16 prefixes per model (~34k tokens) vs 16k per worker.
        "kv": 16384, "kv_quick": 2048,
        "sim": [], "models": ["a"] * 4 + ["b"] * 4,
    },
    "long_context": {
        "script": "long_context.js",
        "env": dict(GROUPS=8, PROMPTS=6, SYS_TOKENS=32768, Q_TOKENS=256, OUT_TOKENS=32, CONCURRENCY=8),
        "quick": dict(GROUPS=4, PROMPTS=2, SYS_TOKENS=16384, Q_TOKENS=64, OUT_TOKENS=8, CONCURRENCY=4),
        # 8 documents x 32.8k = 262k tokens; one worker (96k) holds at most 2 with room to run.
        "kv": 98304, "kv_quick": 40960,
        "sim": ["--context-length", "65536"], "models": ["llama"] * WORKERS,
    },
    "agentic": {
        "script": "agentic.js",
        "env": dict(CONVERSATIONS=40, MAX_TURNS=12, REQUESTS=360, ZIPF_S=1.0, SYS_TOKENS=3000, TASK_TOKENS=200,
                    TOOL_TOKENS=256, OUT_TOKENS=128, CONCURRENCY=16),
        "quick": dict(CONVERSATIONS=12, MAX_TURNS=4, REQUESTS=36, ZIPF_S=1.0, SYS_TOKENS=1000, TASK_TOKENS=50,
                      TOOL_TOKENS=64, OUT_TOKENS=16, CONCURRENCY=8),
        # 16 workers. One shared 3k-token system prompt; a conversation's own part grows by
        # 128 + 256 = 384 tokens a turn to 200 + 12 x 384 = ~4.8k tokens (its last prompt ~7.6k with
        # the system prompt). 360 turns over 40 conversations (Zipf: the 16 hottest reach 12
        # turns) = ~3k + 40 x 200 + 360 x 384 = ~150k tokens of histories. One worker (16k) holds
        # the system prompt + ~3 full conversations; the fleet (262k) holds all 40, ~2.5 per
        # worker, only if each conversation stays on one worker. Quick: 12 conversations x <= 4
        # turns of 16 + 64 tokens on a 1k system prompt (~2.5k tokens) vs 2k per worker.
        "kv": 16384, "kv_quick": 2048,
        "sim": ["--context-length", "16384"], "models": ["llama"] * 16,
    },
    "trace": {
        "script": "trace.js",
        # Built by trace_setup from --trace / --requests / --speed / --block-tokens / --api: the
        # replay plan, KV capacity (the fleet holds about a fifth of the slice's distinct prompt
        # blocks) and --context-length (the slice's longest request fits).
        "env": {}, "quick": {},
        "kv": None, "kv_quick": None,
        "sim": ["--max-running-requests", "16", "--decode-base-ms", "10"], "models": ["llama"] * WORKERS,
        "records": True, "debug_header": True,
    },
}

# --scenario trace defaults (full / --quick): the first REQUESTS requests of the trace, replayed
# SPEED times faster, 512-token blocks scaled to BLOCK_TOKENS tokens. 32 tokens (1/16) keeps the
# conversation trace's longest prompt (123k tokens) under 8k tokens and its mean (13.3k) at ~830
# tokens, so 4000 requests at speed 16 (~49 requests/s, 81 s) fit 8 simulated workers, Envoy and
# k6 on 2 cores.
TRACE_FULL = dict(requests=4000, speed=16.0, block_tokens=32)
TRACE_QUICK = dict(requests=200, speed=16.0, block_tokens=32)
KV_FLEET_SHARE = 0.2  # fleet KV / the slice's distinct prompt-block tokens

ROUTERS = [
    "round_robin",
    "least_request",
    "smg_cache_aware",
    "smg_power_of_two",
    "prefix_router_1t",
    "prefix_router_2t",
    "prefix_router_standalone",
]
LABELS = {
    "round_robin": "Envoy round_robin",
    "least_request": "Envoy least_request",
    "smg_cache_aware": "smg cache_aware",
    "smg_power_of_two": "smg power_of_two",
    "prefix_router_1t": "prefix-router (1 thread)",
    "prefix_router_2t": "prefix-router (2 threads)",
    "prefix_router_standalone": "prefix-router standalone (2 threads, no peers, no load poll)",
}
# Routers that run one process whatever --replicas says.
SINGLE = ("round_robin", "least_request")

# --------------------------------------------------------------------------------------------
# Routers
# --------------------------------------------------------------------------------------------


def _by_model(fleet: SimFleet) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in fleet.names:
        out.setdefault(fleet.models[name], []).append(name)
    return out


def envoy_lb_config(fleet: SimFleet, lb_policy: str, listener: int, admin: int) -> str:
    """Envoy-native load balancing baseline (no Wasm filter): every worker of a model is an endpoint
    of one cluster (`pool`, or `pool_<model>` with several models, routed by the `x-model` header
    the k6 scenarios send: Envoy cannot read the body); timeouts, buffer limits and access log as
    the filter's configs, so only the routing differs (prkit.envoy_config.plain_proxy)."""
    groups = _by_model(fleet)
    pool = (lambda m: "pool") if len(groups) == 1 else (lambda m: f"pool_{m}")
    pools = {pool(m): [("127.0.0.1", fleet.ports[n]) for n in names] for m, names in groups.items()}
    routes = {m: pool(m) for m in groups} if len(groups) > 1 else {}
    return ec.dump(ec.plain_proxy(("127.0.0.1", listener), ("127.0.0.1", admin), pools, lb_policy=lb_policy,
                                  header_routes=routes))


SCALE_OUT_FLAGS = ("--peers", "--peer-listen", "--peer-secret", "--load-poll-ms", "--hash-key")


def gen_flags() -> set[str]:
    """The scale-out flags the config generator knows: all of them, or those ENVOY_GEN's --help
    lists (an older generator for an older filter build)."""
    if not os.environ.get("ENVOY_GEN"):
        return set(SCALE_OUT_FLAGS)
    out = subprocess.run([sys.executable, str(GEN), "--help"], capture_output=True, text=True, timeout=30).stdout
    return {f for f in SCALE_OUT_FLAGS if f in out}


def prefix_router_config(fleet: SimFleet, policy: dict, listener: int, admin: int, extra: list[str],
                         pool: Path | None = None) -> str:
    """envoy/gen's config for the fleet (one cluster per worker, its models), loopback listeners,
    no rate limit, no stats listener, `policy` merged into the plugin's policy. In process
    (prkit.envoy_config); with ENVOY_GEN, that generator's output (no policy overrides). `pool`:
    the fleet's one model is a pool whose hosts the EDS file at that path lists (--membership)."""
    groups = _by_model(fleet)
    args = []
    for model, names in groups.items():
        if pool is not None:
            args += ["--model", f"{model}=eds:{pool}"]
            continue
        args += ["--model", model + "=" + ",".join(f"127.0.0.1:{fleet.ports[n]}" for n in names)]
    args += ["--default-model", next(iter(groups)), "--listen", f"127.0.0.1:{listener}",
             "--admin", f"127.0.0.1:{admin}", "--stats-listen", "none", "--rate-limit", "0",
             "--wasm", str(wasm_path()), *extra]
    if os.environ.get("ENVOY_GEN"):
        if policy:
            raise SystemExit("compare: --policy needs the current generator (unset ENVOY_GEN)")
        r = subprocess.run([sys.executable, str(GEN), *args], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"{GEN} failed ({r.returncode}): {r.stderr.strip()}\n  {' '.join(args)}")
        return r.stdout
    try:
        opts = ec.options_from_args(args)
    except ec.ConfigError as e:
        raise RuntimeError(f"envoy config: {e}\n  envoy/gen {' '.join(args)}") from None
    opts.plugin = ec.merge(opts.plugin, {"policy": policy})
    return ec.render(opts)


class Smg:
    def __init__(self, fleet: SimFleet, policy: str, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.fleet = fleet
        self.policy = policy
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        out = open(self.workdir / "smg.log", "wb")
        self.proc = subprocess.Popen(
            [str(ensure_smg()), "launch", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *[self.fleet.url(n) for n in self.fleet.names],
             "--policy", self.policy, "--log-level", "warn",
             # smg serves Prometheus metrics on 0.0.0.0:29000 by default: loopback, a free port.
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        out.close()
        # Ready = /workers lists every worker as healthy (/health answers before registration ends).
        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}; see {self.workdir / 'smg.log'}")
            return smg_healthy_workers(self.base_url) == len(self.fleet.names)
        try:
            wait_until(ready, "smg ready", timeout_s, 0.2)
        except Timeout:
            raise RuntimeError(f"smg not ready after {timeout_s}s; see {self.workdir / 'smg.log'}") from None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_router(router: str, fleet: SimFleet, policy: dict, workdir: Path, replicas: int = 1,
                 debug_header: bool = False, pool: Path | None = None,
                 membership_ms: int | None = None) -> tuple[list, list[str], str]:
    """Starts the router (`replicas` processes where the router scales out); returns (processes to
    stop, target URLs, a note on how the replicas were configured). `debug_header`: the
    prefix-router answers with its decision header (envoy/gen --debug-header). `pool`: the
    prefix-router's model is a pool read from this EDS file (`--model llama=eds:PATH`), with
    `--membership-ms membership_ms` when given."""
    procs: list = []
    try:
        if router in SINGLE:
            listener, admin = free_port(), free_port()
            cfg = envoy_lb_config(fleet, router.upper(), listener, admin)
            e = Envoy(cfg, listener_port=listener, admin_port=admin, workdir=workdir, concurrency=2)
            e.start()
            return [e], [e.base_url], "one Envoy (2 threads)"
        if router.startswith("smg_"):
            ensure_smg()
            for k in range(replicas):
                s = Smg(fleet, router[len("smg_"):], workdir / f"smg{k}")
                procs.append(s)
                s.start()
            return procs, [p.base_url for p in procs], f"{replicas} smg process(es), each with every worker"
        if router.startswith("prefix_router_"):
            threads = 1 if router == "prefix_router_1t" else 2
            flags = gen_flags()
            per_replica: list[list[str]] = [["--debug-header"] if debug_header else [] for _ in range(replicas)]
            if router == "prefix_router_standalone":
                note = "no --peers"
                if "--load-poll-ms" in flags:
                    for extra in per_replica:
                        extra += ["--load-poll-ms", "0"]
                    note += ", --load-poll-ms 0"
                else:
                    note += " (envoy/gen has no --load-poll-ms)"
            elif replicas > 1 and {"--peers", "--peer-listen", "--peer-secret"} <= flags:
                ports = [free_port() for _ in range(replicas)]
                peers = ",".join(f"http://127.0.0.1:{p}" for p in ports)
                secret = secrets.token_hex(16)
                for extra, port in zip(per_replica, ports):
                    extra += ["--peers", peers, "--peer-listen", f"127.0.0.1:{port}", "--peer-secret", secret]
                note = "--peers (every replica's peer listener), own --peer-listen, shared --peer-secret"
            elif replicas > 1:
                note = "no --peers (envoy/gen has none yet): independent replicas"
            else:
                note = "one replica"
            if "--hash-key" in flags:
                # one key for every replica: replicas agree on rendezvous placement only if their
                # hashes are keyed alike (envoy/gen would generate one per config otherwise)
                key = secrets.token_hex(32)
                for extra in per_replica:
                    extra += ["--hash-key", key]
            if pool is not None:
                note += f", pool model from the EDS file {pool.name} (--model NAME=eds:PATH)"
                if membership_ms is not None:
                    for extra in per_replica:
                        extra += ["--membership-ms", str(membership_ms)]
                    note += f", --membership-ms {membership_ms}"
            if debug_header:
                note += f", --debug-header ({ec.DEBUG_HEADER})"
            for k in range(replicas):
                listener, admin = free_port(), free_port()
                d = workdir / f"envoy{k}"
                d.mkdir()
                e = Envoy(prefix_router_config(fleet, policy, listener, admin, per_replica[k], pool),
                          listener_port=listener, admin_port=admin, workdir=d, concurrency=threads)
                procs.append(e)
                e.start()
            return procs, [e.base_url for e in procs], f"{replicas} Envoy process(es), {threads} threads each, {note}"
    except Exception:
        for p in procs:
            p.stop()
        raise
    raise SystemExit(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------


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
    label = LABELS.get(router, router)
    if router in SINGLE or replicas == 1:
        return label
    return f"{label} x{replicas} replicas" + (" (pinned)" if pin else "")


def run_one(router: str, scen: dict, k6_env: dict, sim_args: list[str], policy: dict, replicas: int = 1,
            pin: bool = False, membership: dict | None = None) -> dict:
    """One router on a fresh fleet. `membership` (--membership): {"phases": worker counts,
    "duration": seconds, "interval_ms": --membership-ms or None}: the prefix-router's model is a
    pool read from an EDS file that MembershipSchedule rewrites at each phase; k6 runs for
    `duration` seconds with per-request records and the decision header on."""
    label = router_label(router, replicas, pin)
    workers = len(scen["models"])
    workdir = Path(tempfile.mkdtemp(prefix=f"compare-{router}-"))
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
        log(f"{label}: {workers} workers up, router at {', '.join(urls)} ({how}); k6 {scen['script']} running")
        env = dict(k6_env, TARGETS=",".join(urls), PIN="1" if pin else "0")
        if membership is not None:
            env.update(DURATION=membership["duration"], RECORDS=1)
        extra = ["--out", f"csv={workdir / 'samples.csv'}"]
        if records_on:  # per-request console lines (load/trace.js, load/multi_turn.js RECORDS=1)
            extra += ["--log-format", "raw", "--console-output", str(workdir / "records.log")]
        t0 = time.monotonic()
        if schedule is not None:
            schedule.start()
        try:
            summary = run_k6(LOAD / scen["script"], env, workdir / "summary.json", workdir, extra_args=extra)
        finally:
            if schedule is not None:
                schedule.finish()
        wall = time.monotonic() - t0
        m = fleet.metrics()
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


# --------------------------------------------------------------------------------------------
# Live membership (--membership A:B:C)
# --------------------------------------------------------------------------------------------

# Seconds of load per --membership run (full / --quick): phases of equal length.
MEMBERSHIP_DURATION = 150
MEMBERSHIP_DURATION_QUICK = 30


def parse_membership(spec: str, workers: int) -> list[int]:
    """`A:B:C...`: the pool's worker count per phase (the fleet's first N workers), 1..workers."""
    try:
        phases = [int(x) for x in spec.split(":")]
    except ValueError:
        raise ValueError(f"--membership: expected worker counts like 4:8:4, got {spec!r}") from None
    if not phases or any(n < 1 or n > workers for n in phases):
        raise ValueError(f"--membership: each phase needs 1 to {workers} workers, got {spec!r}")
    return phases


def membership_label(label: str, phases: list[int]) -> str:
    if len(set(phases)) == 1:
        return f"{label}, static pool of {phases[0]}"
    return f"{label}, pool {':'.join(map(str, phases))}"


class MembershipSchedule:
    """The pool's membership over a run: the EDS file lists the fleet's first phases[0] workers
    from the start; `start()` (when k6 starts) begins phase 0, and phase k begins k/len(phases) of
    `duration` later, when the file is rewritten with the first phases[k] workers (not rewritten
    when the list stays the same: a static pool). The workers' metrics are read at every half
    phase and by `finish()` (after k6), so a phase's hit rate, and its second (stable) half's, are
    differences of the workers' counters. Removed workers keep running (a drain: Envoy sends
    them nothing new, what runs there finishes). Times are Unix ms, as k6's records'."""

    def __init__(self, fleet: SimFleet, eds: Path, phases: list[int], duration: float, cluster: str = "llama"):
        self.fleet, self.eds, self.phases, self.duration, self.cluster = fleet, eds, phases, duration, cluster
        self.changes: list[dict] = []  # {"at", "phase", "added", "removed"}
        self.snapshots: list[tuple[float, dict]] = []  # (Unix ms, fleet.metrics())
        self.members = fleet.names[:phases[0]]
        self.version = 1
        write_local_eds(eds, cluster, [fleet.ports[n] for n in self.members], self.version)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self._thread.start()

    def _snapshot(self) -> None:
        self.snapshots.append((time.time() * 1000, self.fleet.metrics()))

    def _run(self) -> None:
        try:
            t0 = time.monotonic()
            self._snapshot()
            halves = 2 * len(self.phases)
            for j in range(1, halves):
                if self._stop.wait(max(0.0, t0 + self.duration * j / halves - time.monotonic())):
                    return
                if j % 2 == 0:
                    self._change(j // 2)
                self._snapshot()
        except BaseException as e:  # reported by finish()
            self.error = e

    def _change(self, k: int) -> None:
        new = self.fleet.names[:self.phases[k]]
        if new == self.members:
            return
        self.version += 1
        write_local_eds(self.eds, self.cluster, [self.fleet.ports[n] for n in new], self.version)
        at = time.time() * 1000
        self.changes.append({"at": at, "phase": k, "added": [n for n in new if n not in self.members],
                             "removed": [n for n in self.members if n not in new]})
        log(f"membership: phase {k}: EDS file now lists {len(new)} workers "
            f"(+{len(self.changes[-1]['added'])} / -{len(self.changes[-1]['removed'])})")
        self.members = new

    def finish(self) -> None:
        """Stops the schedule (k6 ended) and takes the last snapshot."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"membership schedule failed: {self.error!r}")
        self._snapshot()


POOL_STAT_RE = re.compile(r"^\S*prefix_router\.(membership\.\w+|served_by_fallback|pool\.unplaced): (\d+)$")


def envoy_pool_stats(procs: list) -> dict:
    """The filter's pool counters (membership reads, rebuilds, requests served by another worker,
    pool requests without a worker), summed over the Envoys (saved by envoy_peer_stats' /stats)."""
    out: Counter = Counter()
    for p in procs:
        f = getattr(p, "workdir", None)
        if not isinstance(p, Envoy) or f is None or not (f / "stats.txt").exists():
            continue
        for line in (f / "stats.txt").read_text().splitlines():
            m = POOL_STAT_RE.match(line)
            if m:
                out[m.group(1)] += int(m.group(2))
    return dict(out)


def _decided_worker(header: str | None) -> str | None:
    m = re.search(r"worker=([^;\s]+)", header or "")
    return m.group(1) if m else None


def _hit(snapshots: list, a: int, b: int) -> float | None:
    """The fleet's hit rate between snapshots a and b (cached / prompt token deltas)."""
    if b >= len(snapshots):
        return None
    def tot(k, name):
        return sum(v.get(name, 0) for v in snapshots[k][1].values())
    prompt = tot(b, "sglang:prompt_tokens_total") - tot(a, "sglang:prompt_tokens_total")
    cached = tot(b, "sglang:cached_tokens_total") - tot(a, "sglang:cached_tokens_total")
    return cached / prompt if prompt else None


def membership_stats(records: list[dict], sched: MembershipSchedule, fleet: SimFleet, pool_stats: dict | None) -> dict:
    """What the run's records (load/multi_turn.js RECORDS=1) say about the membership changes:
    failed requests, and those in flight on a worker a change removed (sent before, ended after,
    served by or decided for a removed worker); per added worker the seconds from its change to
    the first request sent that it served; per removed worker the requests it served that were
    sent after its removal; requests served by another worker than the decision named (Envoy's
    fallback); per phase (and its second, stable half) requests, hit rate, TTFT."""
    addr = {f"127.0.0.1:{fleet.ports[n]}": n for n in fleet.names}
    n = len(sched.phases)
    t_start = sched.snapshots[0][0]
    bounds = [sched.snapshots[2 * k][0] if 2 * k < len(sched.snapshots) else math.inf for k in range(n)] + [math.inf]
    failed = [r for r in records if r["s"] != 200]
    on_removed = []
    for r in failed:
        who = {r.get("w"), addr.get(_decided_worker(r.get("d")) or "")}
        if any(c["removed"] and r["t0"] <= c["at"] <= r["t1"] and who & set(c["removed"]) for c in sched.changes):
            on_removed.append(r)
    added, removed = [], []
    for c in sched.changes:
        for w in c["added"]:
            sent = [r["t0"] for r in records if r.get("w") == w and r["s"] == 200 and r["t0"] >= c["at"]]
            added.append({"worker": w, "phase": c["phase"],
                          "first_request_s": (min(sent) - c["at"]) / 1000 if sent else None,
                          "requests": len(sent)})
        for w in c["removed"]:
            after = [r["t0"] for r in records if r.get("w") == w and r["t0"] > c["at"]]
            removed.append({"worker": w, "phase": c["phase"], "requests_sent_after": len(after),
                            "last_sent_after_s": (max(after) - c["at"]) / 1000 if after else None})
    elsewhere = sum(1 for r in records if r["s"] == 200 and r.get("w") and _decided_worker(r.get("d"))
                    and addr.get(_decided_worker(r.get("d"))) != r["w"])
    phases = []
    for k in range(n):
        lo, hi = bounds[k], bounds[k + 1]
        mid = sched.snapshots[2 * k + 1][0] if 2 * k + 1 < len(sched.snapshots) else math.inf
        rs = [r for r in records if lo <= r["t0"] < hi]
        stable = [r for r in rs if r["t0"] >= mid]
        tt = [r["ttft"] for r in stable if r["s"] == 200 and r.get("ttft") is not None]
        tt_all = [r["ttft"] for r in rs if r["s"] == 200 and r.get("ttft") is not None]
        per = Counter(r.get("w") for r in rs if r["s"] == 200)
        phases.append({
            "workers": sched.phases[k], "requests": len(rs), "failed": sum(1 for r in rs if r["s"] != 200),
            "hit_rate": _hit(sched.snapshots, 2 * k, 2 * k + 2),
            "hit_rate_stable": _hit(sched.snapshots, 2 * k + 1, 2 * k + 2),
            "ttft_p50": percentile(tt_all, 50), "ttft_p99": percentile(tt_all, 99),
            "ttft_p50_stable": percentile(tt, 50), "ttft_p99_stable": percentile(tt, 99),
            "worker_requests": [per.get(w, 0) for w in fleet.names],
        })
    return {
        "phases_spec": sched.phases, "duration_s": sched.duration, "start_ms": t_start,
        "changes": [{**c, "at_s": (c["at"] - t_start) / 1000} for c in sched.changes],
        "records": len(records), "failed": len(failed), "failed_on_removed": len(on_removed),
        "failed_elsewhere": len(failed) - len(on_removed),
        "failed_detail": [{k: r.get(k) for k in ("i", "w", "d", "s")} for r in failed[:20]],
        "added": added, "removed": removed, "served_elsewhere": elsewhere, "phases": phases,
        "envoy": pool_stats or {},
    }


def membership_table(rows: list[dict]) -> str:
    """Per run and phase: workers, requests, hit rate (whole phase / second half), TTFT."""
    lines = ["| run | phase | pool workers | requests (failed) | hit rate: phase / stable half "
             "| TTFT p50 / p99: phase | TTFT p50 / p99: stable half | requests per worker |",
             "|---|---|---|---|---|---|---|---|"]
    def pct(x):
        return "-" if x is None else f"{x:.1%}"
    for r in rows:
        for k, ph in enumerate(r["membership"]["phases"]):
            lines.append(
                f"| {r['label']} | {k + 1} | {ph['workers']} | {ph['requests']} ({ph['failed']}) "
                f"| {pct(ph['hit_rate'])} / {pct(ph['hit_rate_stable'])} "
                f"| {ph['ttft_p50']:.0f} / {ph['ttft_p99']:.0f} ms | {ph['ttft_p50_stable']:.0f} / "
                f"{ph['ttft_p99_stable']:.0f} ms | {' / '.join(map(str, ph['worker_requests']))} |")
    return "\n".join(lines)


def membership_notes(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        ms = r["membership"]
        ch = ", ".join(f"{c['at_s']:.1f} s (phase {c['phase'] + 1}: added {','.join(c['added']) or 'none'}, "
                       f"removed {','.join(c['removed']) or 'none'})" for c in ms["changes"]) or "none (static)"
        add = ", ".join(f"{a['worker']} {a['first_request_s']:.1f} s ({a['requests']} requests)"
                        if a["first_request_s"] is not None else f"{a['worker']} never"
                        for a in ms["added"])
        rem = ", ".join(f"{x['worker']} {x['requests_sent_after']}"
                        + (f" (last {x['last_sent_after_s']:.1f} s after)" if x["last_sent_after_s"] is not None else "")
                        for x in ms["removed"])
        env = ", ".join(f"{k} {v}" for k, v in sorted(ms["envoy"].items()))
        out.append(f"- {r['label']}: {ms['records']} requests recorded; EDS changes at {ch}; failed "
                   f"{ms['failed']} ({ms['failed_on_removed']} in flight on a removed worker, "
                   f"{ms['failed_elsewhere']} others)"
                   + (f"; first request of each added worker after its change: {add}" if add else "")
                   + (f"; requests served by each removed worker that were sent after its removal: {rem}" if rem else "")
                   + f"; served by another worker than the decision named: {ms['served_elsewhere']}"
                   + (f"; Envoy: {env}" if env else "") + ".")
    return out


# --------------------------------------------------------------------------------------------
# Trace replay (--scenario trace)
# --------------------------------------------------------------------------------------------


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
FILTER_TOKEN_DEFAULTS = {"request_cost_tokens": 64, "slack_full_tokens": 8192, "prefill_slack_full_tokens": 2048}


def trace_scaled_policy(block_tokens: int) -> dict:
    """prefix-router policy values in the replay's token units: a scaled token stands for
    512 / block_tokens real ones (as in trace_scaled_sim_args), so a request in flight costs, and
    a holder earns its full load slack at, the same real-token amounts as in production. Without
    it a 2-block shared prefix (1024 real tokens, 64 scaled) weighs no more than one request in
    flight (64), and conversations leave idle holders for a replay artefact."""
    f = 512 / block_tokens
    return {k: max(1, round(v / f)) for k, v in FILTER_TOKEN_DEFAULTS.items()}


def trace_setup(name: str, requests: int, speed: float, block_tokens: int, api: str, workers: int,
                workdir: Path) -> dict:
    """The first `requests` requests of trace `name`: writes the replay plan (prkit.trace) to
    `workdir/plan.json` and computes the fleet's sizing and the offline bounds. KV per worker: the
    fleet holds KV_FLEET_SHARE of the slice's distinct prompt-block tokens, but at least twice the
    largest request (prompt + output: the simulator refuses a request its KV cannot hold, and one
    that fills a worker blocks it); --context-length: the largest request fits (at least 8192)."""
    reqs = tr.load_trace(name, requests)
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
    plan = workdir / "plan.json"
    plan.write_text(json.dumps(tr.replay_plan(reqs, block_tokens, speed), separators=(",", ":")))
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000
    return {
        "name": name,
        "stem": Path(name).name.removesuffix(".gz").removesuffix(".jsonl") if name not in tr.TRACES else name,
        "requests": len(reqs),
        "speed": speed,
        "block_tokens": block_tokens,
        "api": api,
        "plan": plan,
        "hash_seqs": [r.hash_ids for r in reqs],
        "prompt_tokens": prompts,
        "out_tokens": outs,
        "infinite": tr.infinite_cache_hits(seqs),
        "pooled_lru": tr.pooled_lru_hits(seqs, kv * workers),
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
    return (f"first {t['requests']} requests of the {t['name']} trace ({t['span_s']:.0f} s of trace) replayed "
            f"open-loop at speed {t['speed']:g} ({t['replay_s']:.0f} s, {t['requests'] / max(t['replay_s'], 1e-9):.1f} "
            f"requests/s), 512-token blocks scaled to {t['block_tokens']} tokens, `/v1/{'chat/' if t['api'] == 'chat' else ''}"
            f"completions` (streaming); prompts mean {sum(pr) / len(pr):.0f} / max {max(pr)} tokens, outputs mean "
            f"{sum(out) / len(out):.1f} / max {max(out)} tokens (ignore_eos); distinct prompt blocks "
            f"{t['distinct_tokens']} tokens; KV {t['kv']} tokens per worker, fleet {fleet} = "
            f"{fleet / t['distinct_tokens']:.0%} of them"
            + (f" (floor: twice the largest request, {t['largest']} tokens)" if t["kv_floor"] else "")
            + f"; --context-length {t['context']}")


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0 for no samples."""
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[max(0, math.ceil(q / 100 * len(ys)) - 1)]


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
    total = sum(t["prompt_tokens"])
    inf = sum(t["infinite"]) / total
    lru = sum(t["pooled_lru"]) / total
    late = [r["late"] for r in recs.values()]
    return {
        "infinite_bound": inf,
        "pooled_lru_bound": lru,
        "share_of_infinite": row["hit_rate"] / inf if inf else 0.0,
        "share_of_pooled_lru": row["hit_rate"] / lru if lru else 0.0,
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
        "lateness_p50_ms": percentile(late, 50),
        "lateness_p99_ms": percentile(late, 99),
        "lateness_max_ms": max(late, default=0.0),
    }


def trace_table(rows: list[dict]) -> str:
    t0 = rows[0]["trace"] if rows else {}
    head = (f"| router | replicas | hit rate | share of infinite ({t0.get('infinite_bound', 0):.1%}) "
            f"| share of pooled LRU ({t0.get('pooled_lru_bound', 0):.1%}) | holder follow latest / earliest / any "
            "| TTFT p50 / p90 / p99 | E2E p50 / p90 / p99 | lateness p50 / p99 / max | errors | max/mean load "
            "| requests per worker |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        s, t, e = r["trace"], r["ttft"], r["e2e"]
        reqs = r["worker_requests"]
        n = r.get("replicas", 1)
        replicas = str(n) if n == 1 else f"{n} {r.get('replica_mode', '')}"
        lines.append(
            f"| {r['label']} | {replicas} | {r['hit_rate']:.1%} | {s['share_of_infinite']:.0%} "
            f"| {s['share_of_pooled_lru']:.0%} "
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
        "outputs and reserve KV for running requests, and LRU is not optimal). Share = hit rate / bound.",
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


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


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
        f"Workload (`load/{scen['script']}`): " + (trace_describe(trace) + "; k6 env " if trace else "")
        + ", ".join(f"{k}={v}" for k, v in k6_env.items() if k != "PLAN") + ".",
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="load/compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="shared_prefix", choices=sorted(SCENARIOS))
    ap.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated subset of: " + ", ".join(ROUTERS))
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
    tg.add_argument("--block-tokens", type=int, default=None,
                    help=f"tokens per 512-token trace block (default {TRACE_FULL['block_tokens']})")
    tg.add_argument("--api", choices=sorted(tr.SHAPES), default=None,
                    help="completions (default: text prompt) or chat (one user message)")
    args = ap.parse_args(argv)
    trace_args = {k: getattr(args, k) for k in ("trace", "requests", "speed", "block_tokens", "api")}
    if args.scenario != "trace" and any(v is not None for v in trace_args.values()):
        ap.error("--trace/--requests/--speed/--block-tokens/--api need --scenario trace")

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
        if r not in ROUTERS:
            ap.error(f"unknown router {r!r}; known: {', '.join(ROUTERS)}")
    policy = json.loads(args.policy)
    k6_env = dict(scen["quick"] if args.quick else scen["env"], SEED=1)
    trace = None
    if args.scenario == "trace":
        d = TRACE_QUICK if args.quick else TRACE_FULL
        requests = args.requests or d["requests"]
        speed = args.speed or d["speed"]
        block_tokens = args.block_tokens or d["block_tokens"]
        if requests < 1 or speed <= 0 or block_tokens < 1:
            ap.error("--requests and --block-tokens must be >= 1, --speed > 0")
        trace_dir = Path(tempfile.mkdtemp(prefix="compare-trace-"))
        try:
            trace = trace_setup(args.trace or "conversation", requests, speed, block_tokens, args.api or "completions",
                                len(scen["models"]), trace_dir)
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
        policy = {**trace_scaled_policy(trace["block_tokens"]), **policy}
    envs = [f"{k}={os.environ[k]}" for k in ("PREFIX_ROUTER_WASM", "SGLANG_SIM_BIN", "ENVOY_GEN") if os.environ.get(k)]
    command = " ".join(envs + ["load/compare"]) + " " + " ".join(a if re.fullmatch(r"[\w.,=/:-]+", a) else repr(a)
                                         for a in (argv if argv is not None else sys.argv[1:]))
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
    for r, mem in runs:
        row = run_one(r, scen, k6_env, sim_args, policy, args.replicas, args.pin, mem)
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


if __name__ == "__main__":
    sys.exit(main())
