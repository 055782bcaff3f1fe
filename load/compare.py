"""Side-by-side comparison of routers on one k6 scenario (run it through `load/compare`).

For each router: a fresh fleet of 8 `sglang-sim` workers (KV capacity per scenario below, chosen so
that one worker cannot hold every prefix of the scenario but the fleet can), the router in front of
them, one k6 run of `load/<scenario>.js` (per-request samples with `--out csv`), then the workers'
`/metrics`. Writes `load/results/<scenario>.md` (table + parameters) and two PNGs (TTFT CDF per
router, requests per worker), plus the raw rows as `<scenario>.json` (git-ignored).

Routers:
  round_robin, least_request   Envoy-native load balancing: one cluster with every worker as an
                               endpoint, a plain `cluster:` route, no Wasm (load/envoy-lb.yaml)
  smg_cache_aware, smg_power_of_two
                               `smg launch --policy ...` (smg==1.13.0 in .venv-smg), defaults
  prefix_router_1t, prefix_router_2t
                               Envoy (1 or 2 worker threads) + the prefix-router filter, config
                               rendered from envoy/envoy.yaml
  prefix_router_2replicas      two separate Envoy processes (1 thread each) + filter; k6 VUs split
                               evenly between them (each replica has its own index and load view)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runner import REPO, Fleet, log, run_k6  # noqa: E402

from tests.integration.harness import DEMO_CONFIG, Envoy, free_port, render_config, wasm_path  # noqa: E402

LOAD = REPO / "load"
SMG = REPO / ".venv-smg" / "bin" / "smg"
WORKERS = 8

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
}

ROUTERS = [
    "round_robin",
    "least_request",
    "smg_cache_aware",
    "smg_power_of_two",
    "prefix_router_1t",
    "prefix_router_2t",
    "prefix_router_2replicas",
]
LABELS = {
    "round_robin": "Envoy round_robin",
    "least_request": "Envoy least_request",
    "smg_cache_aware": "smg cache_aware",
    "smg_power_of_two": "smg power_of_two",
    "prefix_router_1t": "prefix-router (1 thread)",
    "prefix_router_2t": "prefix-router (2 threads)",
    "prefix_router_2replicas": "prefix-router (2 replicas)",
}

# --------------------------------------------------------------------------------------------
# Routers
# --------------------------------------------------------------------------------------------


def _cluster_yaml(name: str, ports: list[int], lb_policy: str | None = None) -> str:
    lines = [
        f"    - name: {name}",
        "      type: STATIC",
        "      connect_timeout: 1s",
        "      per_connection_buffer_limit_bytes: 16777216",
    ]
    if lb_policy:
        lines.append(f"      lb_policy: {lb_policy}")
    # Default circuit breakers (1024 requests per cluster) are far above the scenarios' concurrency.
    lines += [
        "      load_assignment:",
        f"        cluster_name: {name}",
        "        endpoints:",
        "          - lb_endpoints:",
    ]
    for p in ports:
        lines.append(f"              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}")
    return "\n".join(lines)


def _by_model(fleet: Fleet) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in fleet.names:
        out.setdefault(fleet.models[name], []).append(name)
    return out


def envoy_lb_config(fleet: Fleet, lb_policy: str, listener: int, admin: int) -> str:
    groups = _by_model(fleet)
    models = list(groups)
    pool = (lambda m: "pool") if len(models) == 1 else (lambda m: f"pool_{m}")
    ind = " " * 24
    routes = []
    if len(models) > 1:
        for m in models:
            routes.append(
                f'{ind}- match: {{ prefix: "/", headers: [{{ name: x-model, string_match: {{ exact: "{m}" }} }}] }}\n'
                f"{ind}  route: {{ cluster: {pool(m)}, timeout: 0s, idle_timeout: 300s }}\n"
                f"{ind}  request_body_buffer_limit: 16777216"
            )
    routes.append(
        f'{ind}- match: {{ prefix: "/" }}\n'
        f"{ind}  route: {{ cluster: {pool(models[0])}, timeout: 0s, idle_timeout: 300s }}\n"
        f"{ind}  request_body_buffer_limit: 16777216"
    )
    clusters = [_cluster_yaml(pool(m), [fleet.ports[n] for n in groups[m]], lb_policy) for m in models]
    return string.Template((LOAD / "envoy-lb.yaml").read_text()).substitute(
        listener_port=listener, admin_port=admin, routes="\n".join(routes), clusters="\n".join(clusters)
    )


def prefix_router_config(fleet: Fleet, policy: dict, listener: int, admin: int) -> str:
    """envoy/envoy.yaml with one cluster per worker (w0..w7) and the fleet's models."""
    template = DEMO_CONFIG.read_text()
    head, sep, _ = template.partition("\n  clusters:\n")
    assert sep, "envoy/envoy.yaml: clusters section not found"
    clusters = "\n".join(_cluster_yaml(n, [30000 + i]) for i, n in enumerate(fleet.names))
    template = head + sep + clusters + "\n"
    groups = _by_model(fleet)
    models_json = json.dumps({m: {"workers": ws} for m, ws in groups.items()})
    old_models = '"llama": { "workers": ["w0", "w1", "w2", "w3"] }'
    assert template.count(old_models) == 1, "envoy/envoy.yaml: plugin models line changed"
    template = template.replace(old_models, models_json[1:-1])
    template = template.replace('"default_model": "llama"', f'"default_model": "{next(iter(groups))}"', 1)
    text, _ = render_config(
        template,
        listener_port=listener,
        admin_port=admin,
        worker_ports=fleet.ports,
        wasm=wasm_path(),
        plugin_overrides={"policy": policy},
    )
    return text


class Smg:
    def __init__(self, fleet: Fleet, policy: str, workdir: Path):
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
            [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *[self.fleet.url(n) for n in self.fleet.names],
             "--policy", self.policy, "--log-level", "warn",
             # smg serves Prometheus metrics on 0.0.0.0:29000 by default: loopback, a free port.
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + timeout_s
        # Ready = /workers lists every worker as healthy (/health answers before registration ends).
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}; see {self.workdir / 'smg.log'}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/workers", timeout=1) as r:
                    ws = json.loads(r.read()).get("workers", [])
                if sum(1 for w in ws if w.get("is_healthy")) == len(self.fleet.names):
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"smg not ready after {timeout_s}s; see {self.workdir / 'smg.log'}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_router(router: str, fleet: Fleet, policy: dict, workdir: Path) -> tuple[list, list[str]]:
    """Starts the router; returns (processes to stop, target URLs)."""
    if router in ("round_robin", "least_request"):
        listener, admin = free_port(), free_port()
        cfg = envoy_lb_config(fleet, router.upper(), listener, admin)
        e = Envoy(cfg, listener_port=listener, admin_port=admin, workdir=workdir, concurrency=2)
        e.start()
        return [e], [e.base_url]
    if router.startswith("smg_"):
        ensure_smg()
        s = Smg(fleet, router[len("smg_"):], workdir)
        s.start()
        return [s], [s.base_url]
    if router.startswith("prefix_router_"):
        replicas, threads = (2, 1) if router.endswith("2replicas") else (1, int(router[-2]))
        procs, urls = [], []
        try:
            for k in range(replicas):
                listener, admin = free_port(), free_port()
                d = workdir / f"envoy{k}"
                d.mkdir()
                e = Envoy(prefix_router_config(fleet, policy, listener, admin), listener_port=listener,
                          admin_port=admin, workdir=d, concurrency=threads)
                e.start()
                procs.append(e)
                urls.append(e.base_url)
        except Exception:
            for p in procs:
                p.stop()
            raise
        return procs, urls
    raise SystemExit(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")


def ensure_smg() -> None:
    if SMG.exists():
        return
    log("installing smg==1.13.0 into .venv-smg (once)")
    py = os.environ.get("PYTHON", "python3")
    subprocess.check_call([py, "-m", "venv", str(REPO / ".venv-smg")])
    subprocess.check_call([str(REPO / ".venv-smg" / "bin" / "pip"), "install", "-q",
                           "--disable-pip-version-check", "smg==1.13.0"])


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


def run_one(router: str, scen: dict, k6_env: dict, sim_args: list[str], policy: dict) -> dict:
    label = LABELS.get(router, router)
    workdir = Path(tempfile.mkdtemp(prefix=f"compare-{router}-"))
    fleet = Fleet(WORKERS, sim_args, scen["models"], workdir)
    procs = []
    try:
        fleet.start()
        procs, urls = start_router(router, fleet, policy, workdir)
        log(f"{label}: 8 workers up, router at {', '.join(urls)}; k6 {scen['script']} running")
        t0 = time.monotonic()
        summary = run_k6(LOAD / scen["script"], dict(k6_env, TARGETS=",".join(urls)), workdir / "summary.json",
                         workdir, extra_args=["--out", f"csv={workdir / 'samples.csv'}"])
        wall = time.monotonic() - t0
        m = fleet.metrics()
        ttfts = k6_samples(workdir / "samples.csv", "ttft")
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
        "k6_exit": summary.get("k6_exit"),
        "thresholds_ok": summary.get("thresholds_ok"),
        "wall_s": wall,
        "ttft_samples": ttfts,
        "policy": policy if router.startswith("prefix_router") else None,
        "workdir": str(workdir),
    }
    t = row["ttft"]
    log(f"{label}: {row['requests']} requests in {wall:.0f}s, errors {row['errors']}, hit rate "
        f"{row['hit_rate']:.1%}, TTFT p50/p99 {t.get('med', 0):.0f}/{t.get('p(99)', 0):.0f} ms, "
        f"max/mean load {row['max_over_mean']:.2f}")
    return row


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    head = ("| router | hit rate | TTFT p50 | TTFT p90 | TTFT p99 | E2E p50 | E2E p99 | req/s | out tok/s "
            "| errors | max/mean load | requests per worker |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        t, e = r["ttft"], r["e2e"]
        mean = sum(r["worker_requests"]) / len(r["worker_requests"])
        lines.append(
            f"| {r['label']} | {r['hit_rate']:.1%} | {t.get('med', 0):.0f} ms | {t.get('p(90)', 0):.0f} ms "
            f"| {t.get('p(99)', 0):.0f} ms | {e.get('med', 0):.0f} ms | {e.get('p(99)', 0):.0f} ms "
            f"| {r['rps']:.1f} | {r['out_tokens_per_s']:.0f} | {r['errors']} "
            f"| {r['max_over_mean']:.2f} (max {max(r['worker_requests']):.0f}, mean {mean:.0f}) "
            f"| {' / '.join(str(int(x)) for x in r['worker_requests'])} |"
        )
    return "\n".join(lines)


def plots(rows: list[dict], scenario: str, outdir: Path) -> list[str]:
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
    ax.set_title(f"{scenario}: TTFT CDF (8 simulated workers)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = outdir / f"{scenario}-ttft-cdf.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    names.append(p.name)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    n = len(rows)
    width = 0.8 / max(n, 1)
    for k, r in enumerate(rows):
        reqs = r["worker_requests"]
        ax.bar([i + k * width - 0.4 + width / 2 for i in range(len(reqs))], reqs, width, label=r["label"])
    ax.set_xticks(range(WORKERS))
    ax.set_xticklabels([f"w{i}" for i in range(WORKERS)])
    ax.set_ylabel("requests served")
    ax.set_title(f"{scenario}: requests per worker")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    p = outdir / f"{scenario}-worker-load.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    names.append(p.name)
    return names


def git_rev() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "filter", "Cargo.lock")
    return rev + (" + uncommitted filter changes" if dirty else "")


def write_report(rows: list[dict], scenario: str, scen: dict, k6_env: dict, sim_args: list[str], kv: int,
                 policy: dict, command: str, outdir: Path, no_plots: bool) -> Path:
    outdir.mkdir(parents=True, exist_ok=True)
    pngs = [] if no_plots else plots(rows, scenario, outdir)
    md = [
        f"# {scenario}",
        "",
        f"Command: `{command}`",
        "",
        f"Workload (`load/{scen['script']}`): " + ", ".join(f"{k}={v}" for k, v in k6_env.items()) + ".",
        f"Fleet per router: {WORKERS} fresh `sglang-sim` workers (model per worker: {' '.join(scen['models'])}), "
        f"`{' '.join(sim_args)}`: KV capacity {kv} tokens per worker.",
        f"prefix-router policy: `{json.dumps(policy)}` (on top of the filter defaults); "
        f"filter built from commit {git_rev()}.",
        "Measured on a shared 2-core machine (simulated workers, routers and k6 all on it): "
        "noisy, compare within one table only.",
        "",
        "Hit rate = sum of the workers' `sglang:cached_tokens_total` / `sglang:prompt_tokens_total`; "
        "TTFT = k6 time to first byte of a streaming chat response; load = requests served per worker.",
        "",
        table(rows),
        "",
    ]
    for p in pngs:
        md.append(f"![{p}]({p})")
    path = outdir / f"{scenario}.md"
    path.write_text("\n".join(md) + "\n")
    raw = [{k: v for k, v in r.items() if k != "ttft_samples"} for r in rows]
    (outdir / f"{scenario}.json").write_text(json.dumps(raw, indent=2))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="load/compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="shared_prefix", choices=sorted(SCENARIOS))
    ap.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated subset of: " + ", ".join(ROUTERS))
    ap.add_argument("--quick", action="store_true", help="smoke sizing (seconds per router)")
    ap.add_argument("--policy", default="{}", help="prefix-router `policy` overrides as JSON, e.g. '{\"load_eps\": 0.5}'")
    ap.add_argument("--time-scale", type=float, default=None, help="sglang-sim --time-scale (default 1, quick 0.2)")
    ap.add_argument("--out", default=str(LOAD / "results"), help="output directory")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep every run's work directory (logs, k6 samples)")
    ap.add_argument("--set", action="append", default=[], metavar="K=V", help="override a k6 env parameter")
    args = ap.parse_args(argv)

    scen = SCENARIOS[args.scenario]
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    for r in routers:
        if r not in ROUTERS:
            ap.error(f"unknown router {r!r}; known: {', '.join(ROUTERS)}")
    policy = json.loads(args.policy)
    k6_env = dict(scen["quick"] if args.quick else scen["env"], SEED=1)
    for kv in args.set:
        k, _, v = kv.partition("=")
        k6_env[k] = v
    k6_env.setdefault("MODELS", scen["models"][0])
    kv = scen["kv_quick"] if args.quick else scen["kv"]
    ts = args.time_scale if args.time_scale is not None else (0.2 if args.quick else 1.0)
    sim_args = ["--max-total-tokens", str(kv), "--time-scale", str(ts), *scen["sim"]]
    command = "load/compare " + " ".join(a if re.fullmatch(r"[\w.,=/:-]+", a) else repr(a)
                                         for a in (argv if argv is not None else sys.argv[1:]))
    log(f"scenario {args.scenario}{' (quick)' if args.quick else ''}: routers {', '.join(routers)}")
    rows = []
    for r in routers:
        rows.append(run_one(r, scen, k6_env, sim_args, policy))
    path = write_report(rows, args.scenario, scen, k6_env, sim_args, kv, policy, command, Path(args.out),
                        args.no_plots)
    print()
    print(table(rows))
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
