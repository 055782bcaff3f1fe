"""Prefill/decode disaggregation: prefix-router (Envoy + filter, `envoy/gen --pd-model`) against
smg's PD mode (`smg launch --pd-disaggregation`) on the same simulated PD fleets.

For each fleet size N (N prefill + N decode `sglang-sim` workers, `--disaggregation-mode`) and
each router: a fresh fleet, the router, one k6 run of `load/shared_prefix.js`, then the workers'
`/metrics`. Reports TTFT p50/p99 (k6 time to first byte: the decode worker sends its head with
the first token), the prefill hit rate (cached / prompt tokens over the prefill workers), request
throughput, errors, and decode workers' bootstrap failures.

    load/pd_compare [--sizes 2,4] [--quick] [--routers prefix_router,smg] [--runs N]

With `--runs N` every fleet size and router runs N times, interleaved (run 1 of each router,
then run 2, ...: a slow spell of the machine hits both routers), and the table adds each
router's median per fleet: single runs of the 2+2 fleet, whose caches are tight, vary by several
points of hit rate for both routers.

Writes load/results/pd.md (table + command). Workers: KV 40960 tokens each (shared_prefix's
sizing), decode bootstrap timeout 30 s.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from load.runner import REPO, log, run_k6
from prkit.build import ensure_smg, sim_binary, smg_healthy_workers, wasm_path
from prkit.envoy import Envoy
from prkit.envoy_config import gen_result
from prkit.ports import free_port
from prkit.prom import sum_by_name
from prkit.wait import Timeout, http_ok, wait_until

LOAD = REPO / "load"
MODEL = "llama"
ENV = dict(GROUPS=32, PROMPTS=8, SYS_TOKENS=2048, Q_TOKENS=128, OUT_TOKENS=64, CONCURRENCY=16)
QUICK = dict(GROUPS=8, PROMPTS=4, SYS_TOKENS=512, Q_TOKENS=32, OUT_TOKENS=8, CONCURRENCY=8)
KV, KV_QUICK = 40960, 2048


class PdFleet:
    def __init__(self, n: int, kv: int, workdir: Path):
        self.workdir = workdir
        self.prefill = [(free_port(), free_port()) for _ in range(n)]  # (port, bootstrap port)
        self.decode = [free_port() for _ in range(n)]
        self.procs: list = []
        self.kv = kv

    def _spawn(self, name: str, port: int, extra: list) -> None:
        out = open(self.workdir / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen(
            [str(sim_binary()), "--port", str(port), "--model", MODEL, "--worker-id", name,
             "--max-total-tokens", str(self.kv), "--disaggregation-timeout-s", "30", *extra],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        out.close()

    def start(self) -> None:
        for i, (p, b) in enumerate(self.prefill):
            self._spawn(f"p{i}", p, ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(b)])
        for i, p in enumerate(self.decode):
            self._spawn(f"d{i}", p, ["--disaggregation-mode", "decode"])
        deadline = time.monotonic() + 30
        for port in self.ports():
            url = f"http://127.0.0.1:{port}/health"
            try:
                wait_until(lambda: http_ok(url), url, max(0.0, deadline - time.monotonic()), 0.05)
            except Timeout:
                raise RuntimeError(f"worker on {port} did not become healthy") from None

    def ports(self) -> list:
        return [p for p, _ in self.prefill] + self.decode

    def metrics(self, port: int) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return sum_by_name(r.read().decode())

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


class Proc:
    def __init__(self, cmd: list, log_path: Path):
        out = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


POLICY_PARAMS: list = []  # --policy-param KEY=VALUE, passed to envoy/gen


def start_prefix_router(f: PdFleet, workdir: Path):
    listener, admin = free_port(), free_port()
    args = ["--profile", "test", "--listen", f"127.0.0.1:{listener}",
            "--admin", f"127.0.0.1:{admin}", "--wasm", str(wasm_path()), "--no-debug-header", "--no-access-log",
            "--pd-model", MODEL,
            "--prefill", ",".join(f"127.0.0.1:{p}@{b}" for p, b in f.prefill),
            "--decode", ",".join(f"127.0.0.1:{p}" for p in f.decode)]
    for kv in POLICY_PARAMS:
        args += ["--policy-param", kv]
    r = gen_result(*args)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    e = Envoy(r.stdout, listener_port=listener, admin_port=admin, workdir=workdir, concurrency=2)
    e.start()
    return e, e.base_url, "Envoy 2 threads + filter, envoy/gen --profile test --pd-model"


def start_smg(f: PdFleet, workdir: Path):
    port = free_port()
    cmd = [str(ensure_smg()), "launch", "--host", "127.0.0.1", "--port", str(port), "--pd-disaggregation",
           "--policy", "cache_aware", "--log-level", "warn",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    for p, b in f.prefill:
        cmd += ["--prefill", f"http://127.0.0.1:{p}", str(b)]
    for p in f.decode:
        cmd += ["--decode", f"http://127.0.0.1:{p}"]
    s = Proc(cmd, workdir / "smg.log")
    url = f"http://127.0.0.1:{port}"
    n = len(f.prefill) + len(f.decode)

    def ready():
        if s.proc.poll() is not None:
            raise RuntimeError(f"smg exited; see {workdir / 'smg.log'}")
        return smg_healthy_workers(url) == n
    try:
        wait_until(ready, "smg ready", 60, 0.2)
    except Timeout:
        s.stop()
        raise RuntimeError(f"smg not ready; see {workdir / 'smg.log'}") from None
    return s, url, "smg 1.13 launch --pd-disaggregation --policy cache_aware"


def run(router: str, n: int, quick: bool) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"pd-{router}-{n}-"))
    fleet = PdFleet(n, KV_QUICK if quick else KV, workdir)
    proc = None
    try:
        fleet.start()
        proc, url, how = (start_prefix_router if router == "prefix_router" else start_smg)(fleet, workdir)
        log(f"{router} {n}+{n}: {how}; k6 shared_prefix running")
        env = dict(QUICK if quick else ENV, TARGETS=url, MODEL=MODEL)
        t0 = time.monotonic()
        summary = run_k6(LOAD / "shared_prefix.js", env, workdir / "summary.json", workdir)
        wall = time.monotonic() - t0
        pm = [fleet.metrics(p) for p, _ in fleet.prefill]
        dm = [fleet.metrics(p) for p in fleet.decode]
    finally:
        if proc:
            proc.stop()
        fleet.stop()
    prompt = sum(m.get("sglang:prompt_tokens_total", 0) for m in pm)
    cached = sum(m.get("sglang:cached_tokens_total", 0) for m in pm)
    t = summary.get("ttft_ms", {})
    row = {"router": router, "n": n, "ttft_p50": t.get("med", 0.0), "ttft_p99": t.get("p(99)", 0.0),
           "hit_rate": cached / prompt if prompt else 0.0, "rps": summary.get("rps", 0.0),
           "requests": summary.get("requests", 0), "errors": summary.get("errors", 0),
           "bootstrap_failed": sum(m.get("sglang:num_bootstrap_failed_reqs_total", 0) for m in dm),
           "prefill_requests": [int(m.get("sglang:num_requests_total", 0)) for m in pm],
           "decode_requests": [int(m.get("sglang:num_requests_total", 0)) for m in dm],
           "wall_s": wall, "how": how, "workdir": str(workdir)}
    log(f"{router} {n}+{n}: TTFT p50/p99 {row['ttft_p50']:.0f}/{row['ttft_p99']:.0f} ms, prefill hit rate "
        f"{row['hit_rate']:.1%}, {row['rps']:.1f} req/s, errors {row['errors']}, bootstrap failures "
        f"{row['bootstrap_failed']:.0f}, prefill/decode requests {row['prefill_requests']}/{row['decode_requests']}")
    return row


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,4", help="fleet sizes N (N prefill + N decode)")
    ap.add_argument("--routers", default="prefix_router,smg")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                    help="a prefix-router policy parameter (envoy/gen --policy-param), repeatable")
    ap.add_argument("--runs", type=int, default=1, help="runs per fleet size and router (interleaved)")
    ap.add_argument("--out", default=str(LOAD / "results" / "pd.md"))
    a = ap.parse_args(argv)
    POLICY_PARAMS[:] = a.policy_param
    rows = []
    for n in a.sizes.split(","):
        for k in range(1, a.runs + 1):
            for r in a.routers.split(","):
                rows.append(dict(run(r, int(n), a.quick), run_no=k))
    lines = ["| fleet | router | run | TTFT p50 ms | TTFT p99 ms | prefill hit rate | req/s | requests | errors | decode bootstrap failures |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def line(r: dict, label: str) -> str:
        return (f"| {r['n']}+{r['n']} | {r['how']} | {label} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | "
                f"{r['hit_rate']:.1%} | {r['rps']:.1f} | {r['requests']} | {r['errors']} | {r['bootstrap_failed']:.0f} |")

    for r in rows:
        lines.append(line(r, str(r["run_no"])))
    if a.runs > 1:
        for n in a.sizes.split(","):
            for router in a.routers.split(","):
                mine = [r for r in rows if r["n"] == int(n) and r["router"] == router]
                med = {k: statistics.median(r[k] for r in mine)
                       for k in ("ttft_p50", "ttft_p99", "hit_rate", "rps")}
                med.update(n=int(n), how=mine[0]["how"], requests=sum(r["requests"] for r in mine),
                           errors=sum(r["errors"] for r in mine),
                           bootstrap_failed=sum(r["bootstrap_failed"] for r in mine))
                lines.append(line(med, f"**median of {len(mine)}** (requests, errors: sums)"))
    cmd = "load/pd_compare " + " ".join(argv if argv is not None else sys.argv[1:])
    env = QUICK if a.quick else ENV
    text = (f"# PD disaggregation: prefix-router vs smg PD\n\nCommand: `{cmd}` ({time.strftime('%Y-%m-%d')}, "
            f"2-core machine shared with other jobs). k6 `load/shared_prefix.js` with "
            f"{', '.join(f'{k}={v}' for k, v in env.items())}; sglang-sim workers "
            f"(KV {KV_QUICK if a.quick else KV} tokens each, default latency model).\n\n" + "\n".join(lines) + "\n")
    Path(a.out).write_text(text)
    Path(a.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))  # raw rows (git-ignored)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
