"""End-to-end proxy overhead: the same static upstream (nginx answering 200 with a small JSON)
behind (i) Envoy with a plain cluster route, (ii) Envoy + the native buffer filter, (iii) Envoy +
prefix-router, (iv) smg 1.13 --policy cache_aware, (v) Envoy + benches/wasm-floor (a proxy-wasm
filter that only reads the body and sets the cluster header: the floor for any such filter), (vi) Envoy
+ benches/dm-floor (the same floor as a native Envoy dynamic module: the floor without the Wasm VM),
(vii) Envoy + prefix-router built as a dynamic module (filter/src/dynamic_module.rs: the same core
and config). The proxy is pinned to core 0 (taskset), wrk
and nginx to core 1. Bodies: OpenAI chat JSON of 1/4/16/64 KB (one fixed body per run: in (iii)
every request after the first is a prefix hit, the steady state).

  benches/overhead                 # the table (rps at -c16, p50/p99 at -c1) and the ratios
  benches/overhead --sizes 4       # only the 4 KB prompt
  benches/overhead --rss 1000000   # Envoy RSS after indexing N distinct prefixes (default capacity)
  benches/overhead --stream        # streamed responses: Envoy CPU per response (see run_stream)
  benches/overhead --stream --tokens 256 1024 --secs 6 --rounds 5   # more rounds: medians, paired ratios
  benches/overhead --callgrind --sizes 4 --rounds 2                  # Envoy instructions per request
  benches/overhead --callgrind --stream --streams 4 --step-ms 10 --tokens 256 1024 --rounds 2
  benches/overhead --callgrind --stream --idle 5 --rounds 0   # per-second cost without traffic

--callgrind runs every Envoy under valgrind's callgrind and reports the instructions Envoy executed
(all its threads) per request or streamed response instead of CPU time: a count that does not move
with the machine's load, so ratios of a few percent are resolved where CPU time spreads by ±20%.
Instructions are not time (cache misses and IPC differ), and under valgrind Envoy runs ~30x
slower, so the table mode sends `--requests` requests one after another instead of wrk's load,
and the stream mode wants few streams and a slow decode step so that Envoy under valgrind keeps up
(the chunks-per-response column shows whether SSE events coalesced). smg is not Envoy: not counted.

Installs what it needs: nginx and wrk with apt-get when missing, smg==1.13.0 into .venv-smg.
Envoy is .venv/bin/envoy (scripts/setup); the filter is target/wasm32-wasip1/release/prefix_router.wasm
(built here when missing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prkit import envoy_config as ec
from prkit.build import ensure_smg, envoy_executable
from prkit.ports import free_port
from prkit.wait import Timeout, wait_http, wait_until

ROOT = Path(__file__).resolve().parents[1]
ENVOY = ROOT / ".venv" / "bin" / "envoy"
WASM = Path(os.environ.get("PREFIX_ROUTER_WASM", ROOT / "target/wasm32-wasip1/release/prefix_router.wasm"))
# benches/wasm-floor: reads the body and sets the cluster header, nothing else (the Wasm floor),
# on the lean ABI layer (the callbacks prefix-router exports) and on the proxy-wasm SDK (every one).
FLOOR_WASM = ROOT / "target/wasm32-wasip1/release/wasm_floor.wasm"
FLOOR_SDK_WASM = ROOT / "target/wasm32-wasip1/release/wasm_floor_sdk.wasm"
# benches/dm-floor: the same floor as a native dynamic module (lib<name>.so in this directory).
DM_DIR = ROOT / "target/release"
DM_FLOOR = "dm_floor"
DM_ROUTER = "prefix_router"
SIM = Path(os.environ.get("SGLANG_SIM_BIN", ROOT / "target/release/sglang-sim"))
PROXY_CPU, LOAD_CPU = "0", "1"
WORKERS = 4


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def ensure_tools():
    missing = [p for p, b in (("nginx", "/usr/sbin/nginx"), ("wrk", "wrk")) if not shutil.which(b)]
    if missing:
        print(f"installing {missing} with apt-get", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        sh(["apt-get", "install", "-y", *missing], env=env, stdout=subprocess.DEVNULL)
    ensure_smg()
    if not ENVOY.exists():
        sh([str(ROOT / "scripts" / "setup")])
    if "PREFIX_ROUTER_WASM" not in os.environ:  # cargo decides whether it is fresh
        sh(["cargo", "build", "-p", "prefix-router", "--target", "wasm32-wasip1", "--release"], cwd=ROOT)
    build_floor = ["cargo", "build", "-p", "wasm-floor", "--target", "wasm32-wasip1", "--release"]
    sh([*build_floor, "--features", "sdk"], cwd=ROOT)
    shutil.copyfile(FLOOR_WASM, FLOOR_SDK_WASM)
    sh(build_floor, cwd=ROOT)
    sh(["cargo", "build", "-p", "dm-floor", "--release"], cwd=ROOT)
    sh(["cargo", "build", "-p", "prefix-router", "--release", "--features", "dynamic-module"], cwd=ROOT)
    if "SGLANG_SIM_BIN" not in os.environ:
        sh(["cargo", "build", "-p", "sglang-sim", "--release"], cwd=ROOT)


class Proc:
    def __init__(self, cmd, cpu, log: Path, env: dict | None = None):
        self.log = open(log, "w")
        self.p = subprocess.Popen(["taskset", "-c", cpu, *cmd], stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env={**os.environ, **(env or {})})

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self.log.close()

    def rss_kib(self) -> int:
        # The envoy process itself (taskset execs it, so the pid is envoy's).
        for line in Path(f"/proc/{self.p.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0


def nginx_conf(port: int, tmp: Path) -> Path:
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_buffer_size 128k;
  client_max_body_size 16m;
  client_body_temp_path {tmp}/nginx-body;
  keepalive_requests 1000000;
  server {{
    listen 127.0.0.1:{port} reuseport;
    listen 127.0.0.2:{port} reuseport;
    listen 127.0.0.3:{port} reuseport;
    listen 127.0.0.4:{port} reuseport;
    # What smg asks a worker at registration (it learns the served model from /v1/models).
    location = /v1/models {{
      default_type application/json;
      return 200 '{{"object":"list","data":[{{"id":"llama","object":"model","owned_by":"bench"}}]}}';
    }}
    location = /server_info {{
      default_type application/json;
      return 200 '{{"model_path":"llama","served_model_name":"llama"}}';
    }}
    location / {{
      default_type application/json;
      return 200 '{{"id":"x","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}]}}';
    }}
  }}
}}
""")
    return conf


def envoy_yaml(mode: str, port: int, admin: int, upstream: int | list[int], plugin: dict | None = None) -> str:
    """`upstream`: one port (every cluster's endpoint) or one per worker (plain Envoy: one cluster
    over all of them, round robin; Wasm modes: cluster w<i> on port i). From prkit.envoy_config:
    the Wasm modes are the `bench` profile (one endpoint per worker cluster, no access log, no rate
    limit; load polls at the filter's default, every 100 ms per worker, except in the `_nopoll`
    modes); plain and buffer are its filter-less baseline."""
    ups = upstream if isinstance(upstream, list) else [upstream] * WORKERS
    listen, admin_addr = ("127.0.0.1", port), ("127.0.0.1", admin)
    if mode in ("plain", "buffer"):
        filters = [ec.buffer_filter()] if mode == "buffer" else []
        pools = {"up": [("127.0.0.1", u) for u in sorted(set(ups))]}
        return ec.dump(ec.plain_proxy(listen, admin_addr, pools, http_filters=filters, log=False))
    wasm = {"prefix_router": WASM, "wasm_floor": FLOOR_WASM, "wasm_floor_sdk": FLOOR_SDK_WASM,
            "dm_floor": WASM, "prefix_router_dm": WASM, "prefix_router_nopoll": WASM,
            "prefix_router_dm_nopoll": WASM}[mode]
    if mode.endswith("_nopoll"):
        # The same filter without its load polls (a per-second cost, not a per-request one).
        plugin = {**(plugin or {}), "load_poll": {"interval_ms": 0}}
        mode = mode.removesuffix("_nopoll")
    module = {"dm_floor": DM_FLOOR, "prefix_router_dm": DM_ROUTER}.get(mode)
    # One nginx for all clusters (table mode): worker i dials it on loopback address 127.0.0.<i+1>
    # (nginx listens on all four), so the generator sees four distinct workers.
    hosts = ["127.0.0.1"] * WORKERS if len(set(ups)) == WORKERS else [f"127.0.0.{i + 1}" for i in range(WORKERS)]
    models = {"llama": [ec.Worker(f"w{i}", hosts[i], ups[i]) for i in range(WORKERS)]}
    o = ec.profile("bench", models=models, listen=listen, admin=admin_addr, wasm=str(wasm),
                   dynamic_module=module, plugin=plugin or {})
    return ec.render(o)


def body_of_size(kb: int) -> bytes:
    words = ["the", "model", "cache", "prefix", "routing", "worker", "token", "prompt", "system"]
    head = '{"model":"llama","messages":[{"role":"system","content":"'
    tail = '"},{"role":"user","content":"What is the answer?"}],"max_tokens":64}'
    n = kb * 1024 - len(head) - len(tail)
    text, i = [], 0
    while sum(len(w) + 1 for w in text) < n:
        text.append(words[(i * 7 + i // 3) % len(words)])
        i += 1
    return (head + " ".join(text)[:n] + tail).encode()


WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("{body}", "rb"); wrk.body = f:read("*a"); f:close()
"""

WRK_DISTINCT_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, "/v1/completions", nil,
    '{{"model":"llama","prompt":"' .. n .. ' {pad}"}}')
end
"""


def wrk(url: str, lua: Path, conns: int, secs: int) -> dict:
    out = subprocess.run(["taskset", "-c", LOAD_CPU, "wrk", "-t1", f"-c{conns}", f"-d{secs}s", "--latency",
                          "-s", str(lua), url], check=True, capture_output=True, text=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))

    def lat(p):
        m = re.search(rf"\s{p}%\s+([\d.]+)(us|ms|s)\b", out)
        v, u = float(m.group(1)), m.group(2)
        return v * {"us": 1, "ms": 1e3, "s": 1e6}[u]

    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    done = re.search(r"(\d+) requests in", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": rps, "p50": lat(50), "p99": lat(99), "non2xx": int(non2xx.group(1)) if non2xx else 0,
            "requests": int(done.group(1)) if done else 0,
            "errors": errors.group(1) if errors else "", "raw": out}


def start_proxy(kind: str, tmp: Path, upstream: int | list[int], callgrind: bool = False) -> tuple[Proc, str]:
    port, admin = free_port(), free_port()
    if kind == "smg":
        urls = [f"http://127.0.0.1:{upstream}"] * 1
        cmd = [str(ensure_smg()), "launch", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "warn"]
        p = Proc(cmd, PROXY_CPU, tmp / "smg.log")
    else:
        mode = {"envoy": "plain", "envoy_buffer": "buffer", "prefix_router": "prefix_router",
                "wasm_floor": "wasm_floor", "wasm_floor_sdk": "wasm_floor_sdk", "dm_floor": "dm_floor",
                "prefix_router_dm": "prefix_router_dm", "prefix_router_nopoll": "prefix_router_nopoll",
                "prefix_router_dm_nopoll": "prefix_router_dm_nopoll"}[kind]
        cfg = tmp / f"envoy-{kind}.yaml"
        cfg.write_text(envoy_yaml(mode, port, admin, upstream))
        cmd = [str(ENVOY), "-c", str(cfg), "--concurrency", "1", "--log-level", "warn",
               "--use-dynamic-base-id"]
        if callgrind:
            # The binary itself (the .venv entry point is a Python launcher); V8 writes code into
            # heap pages, which valgrind must re-translate (--smc-check).
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/callgrind-{kind}.out",
                   "--smc-check=all-non-file", "--dump-instr=no", envoy_executable(), *cmd[1:]]
        p = Proc(cmd, PROXY_CPU, tmp / f"envoy-{kind}.log",
                 env={"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(DM_DIR)} if mode.startswith("dm_")
                 or "_dm" in mode else None)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        wait_http(url, 900 if callgrind else 60, "POST", body_of_size(1))
    except Exception:
        p.stop()
        print((tmp / (p.log.name)).read_text()[-3000:], file=sys.stderr)
        raise
    return p, url


KINDS = [("envoy", "(i) Envoy, plain route"), ("envoy_buffer", "(ii) Envoy + buffer filter"),
         ("prefix_router", "(iii) Envoy + prefix-router"), ("smg", "(iv) smg 1.13 cache_aware"),
         ("wasm_floor", "(v) Envoy + no-op body-reading Wasm"),
         ("dm_floor", "(vi) Envoy + no-op body-reading dynamic module"),
         ("prefix_router_dm", "(vii) Envoy + prefix-router, dynamic module"),
         ("prefix_router_nopoll", "(iii) without load polls"),
         ("prefix_router_dm_nopoll", "(vii) without load polls")]
# Measured only when named in --kinds: the filter without its per-second load polls.
OPTIONAL = ("prefix_router_nopoll", "prefix_router_dm_nopoll")
# The ratio columns of the table, (numerator, denominator), where both kinds ran.
RATIOS = [("prefix_router", "envoy_buffer"), ("wasm_floor", "envoy_buffer"), ("dm_floor", "envoy_buffer"),
          ("prefix_router_dm", "envoy_buffer"), ("prefix_router", "wasm_floor"), ("prefix_router_dm", "dm_floor"),
          ("prefix_router", "smg"), ("prefix_router_dm", "smg")]


@contextlib.contextmanager
def all_proxies(kinds: list, tmp: Path, upstream, callgrind: bool = False):
    """Every proxy of `kinds` up for the whole bench ({kind: (proc, url)}), all stopped after.
    With [`rotated`], each round measures every kind once in a shifted order, so a slow drift of
    the machine hits all kinds alike."""
    proxies: dict = {}
    try:
        for k in kinds:
            proxies[k] = start_proxy(k, tmp, upstream, callgrind)
        yield proxies
    finally:
        for p, _ in proxies.values():
            p.stop()


def rotated(kinds: list, r: int) -> list:
    """Round `r`'s measuring order: `kinds` shifted by `r`."""
    return kinds[r % len(kinds):] + kinds[:r % len(kinds)]


def run_table(args, tmp: Path, upstream: int):
    """Every proxy runs for the whole bench; each round measures every kind once per size in a
    rotated order. Cells are medians over rounds; the ratio columns are medians of each round's
    ratio (both sides measured in the same round), with their range when there are rounds."""
    kinds = [k for k, _ in KINDS if k in args.kinds]
    labels = dict(KINDS)
    runs: dict = {}
    with all_proxies(kinds, tmp, upstream) as proxies:
        for r in range(args.rounds):
            for kb in args.sizes:
                bf = tmp / f"body-{kb}.json"
                bf.write_bytes(body_of_size(kb))
                lua = tmp / f"wrk-{kb}.lua"
                lua.write_text(WRK_LUA.format(body=bf))
                for kind in rotated(kinds, r):
                    proc, url = proxies[kind]
                    wrk(url, lua, 4, 1)  # warm-up (index the prompt, JIT, pools)
                    c0 = cpu_seconds(proc.p.pid)
                    thr = wrk(url, lua, args.conns, args.secs)
                    # The proxy's own CPU per request over the throughput run: steadier than rps on
                    # a shared machine (another tenant's load slows every proxy's wall clock).
                    cpu_us = (cpu_seconds(proc.p.pid) - c0) / max(thr["requests"], 1) * 1e6
                    lat = wrk(url, lua, 1, args.secs)
                    res = {"rps": thr["rps"], "p50": lat["p50"], "p99": lat["p99"], "rps_c1": lat["rps"],
                           "p99_cN": thr["p99"], "bad": thr["non2xx"] + lat["non2xx"], "cpu_us": cpu_us}
                    runs.setdefault((kind, kb), []).append(res)
                    print(f"round {r + 1} {labels[kind]:32s} {kb:3d} KB  rps(-c{args.conns}) {res['rps']:9.0f}  "
                          f"CPU {cpu_us:6.1f} us/req  "
                          f"p50(-c1) {res['p50']:7.0f} us  p99(-c1) {res['p99']:7.0f} us  non-2xx {res['bad']}",
                          flush=True)
    med = statistics.median

    def m(k, kb, f):
        return med(x[f] for x in runs[(k, kb)])

    def ratio(a, b, kb, f="rps"):
        rs = [x[f] / y[f] for x, y in zip(runs[(a, kb)], runs[(b, kb)])]
        return f"{med(rs):.2f}" + (f" ({min(rs):.2f}-{max(rs):.2f})" if len(rs) > 1 else "")

    print()
    print(f"Medians over {args.rounds} round(s):")
    print(f"| prompt | proxy | rps (-c{args.conns}) | CPU us/request (-c{args.conns}) | p50 (-c1) us | p99 (-c1) us |")
    print("|---|---|---|---|---|---|")
    for kb in args.sizes:
        for k in kinds:
            print(f"| {kb} KB | {labels[k]} | {m(k, kb, 'rps'):.0f} | {m(k, kb, 'cpu_us'):.1f} | "
                  f"{m(k, kb, 'p50'):.0f} | {m(k, kb, 'p99'):.0f} |")
    print()
    print("Ratios: medians of each round's ratio (both sides measured in the same round), with their range;"
          " added p50: median of each round's p50 difference to plain Envoy:")
    pairs = [(a, b) for a, b in RATIOS if a in kinds and b in kinds]
    added = [k for k in ("prefix_router", "prefix_router_dm") if k in kinds and "envoy" in kinds]
    short = {k: label.split(" ", 1)[0] for k, label in KINDS}
    print("| prompt | " + " | ".join(f"{short[a]}/{short[b]} rps" for a, b in pairs)
          + "".join(f" | {short[a]}/{short[b]} CPU per request" for a, b in pairs)
          + "".join(f" | added p50 {short[k]} us" for k in added) + " |")
    print("|---|" + "---|" * (2 * len(pairs) + len(added)))
    for kb in args.sizes:
        cells = [ratio(a, b, kb) for a, b in pairs] + [ratio(a, b, kb, "cpu_us") for a, b in pairs]
        cells += [f"{med(c['p50'] - e['p50'] for e, c in zip(runs[('envoy', kb)], runs[(k, kb)])):.0f}"
                  for k in added]
        print(f"| {kb} KB | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k}/{kb}": v for (k, kb), v in runs.items()}, indent=1))


def run_count_table(args, tmp: Path, upstream: int):
    """`--callgrind`: Envoy's instructions per request (all its threads, so the main thread's
    timers and load polls count too), `--requests` requests sent one after another after 50
    warm-up requests; each round counts every kind once, in a rotated order."""
    kinds = [k for k, _ in KINDS if k in args.kinds]
    labels = dict(KINDS)
    runs: dict = {}
    with all_proxies(kinds, tmp, upstream, callgrind=True) as proxies:
        meters = {k: meter(p, k, tmp, True) for k, (p, _) in proxies.items()}
        for r in range(args.rounds):
            for kb in args.sizes:
                body = body_of_size(kb)
                for kind in rotated(kinds, r):
                    _, url = proxies[kind]
                    start, stop = meters[kind]
                    sequential(url, body, 50)
                    start()
                    sequential(url, body, args.requests)
                    per = stop() / args.requests
                    runs.setdefault((kind, kb), []).append(per)
                    print(f"round {r + 1} {labels[kind]:52s} {kb:3d} KB  {per:10,.0f} instructions/request", flush=True)
    med = statistics.median
    print()
    print(f"Envoy instructions per request, medians over {args.rounds} round(s); (x): median of each round's "
          "ratio to (ii) Envoy + buffer filter [range]:")
    print("| prompt | proxy | instructions / request | vs (ii) |")
    print("|---|---|---|---|")
    for kb in args.sizes:
        base = runs.get(("envoy_buffer", kb))
        for k in kinds:
            v = med(runs[(k, kb)])
            rs = [a / b for a, b in zip(runs[(k, kb)], base)] if base else []
            ratio = f"{med(rs):.3f}x [{min(rs):.3f}-{max(rs):.3f}]" if rs else ""
            print(f"| {kb} KB | {labels[k]} | {v:,.0f} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k}/{kb}": v for (k, kb), v in runs.items()}, indent=1))


def run_rss(args, tmp: Path, upstream: int):
    p, url = start_proxy("prefix_router", tmp, upstream)
    try:
        base = p.rss_kib()
        lua = tmp / "distinct.lua"
        lua.write_text(WRK_DISTINCT_LUA.format(pad="x" * 200))
        done, t0 = 0, time.time()
        while done < args.rss:
            before = done
            r = wrk(url.replace("/v1/chat/completions", "/v1/completions"), lua, 16, 10)
            done += int(r["rps"] * 10)
            print(f"  ~{done} distinct prefixes indexed, RSS {p.rss_kib() / 1024:.1f} MiB "
                  f"({r['rps']:.0f} rps)", flush=True)
            if done == before:
                break
        rss = p.rss_kib()
        print(f"\nEnvoy + prefix-router RSS: {base / 1024:.1f} MiB at start, {rss / 1024:.1f} MiB after "
              f"~{done} distinct prefixes ({time.time() - t0:.0f} s), index capacity 262144 entries (default)")
    finally:
        p.stop()


STREAM_KINDS = [("envoy", "plain Envoy (router only)"), ("wasm_floor_sdk", "+ floor on the SDK (all exports)"),
                ("wasm_floor", "+ floor, lean exports"), ("dm_floor", "+ floor, dynamic module"),
                ("prefix_router", "+ prefix-router"), ("prefix_router_dm", "+ prefix-router, dynamic module"),
                ("prefix_router_nopoll", "+ prefix-router, no load polls"),
                ("prefix_router_dm_nopoll", "+ prefix-router, dynamic module, no load polls")]


class Instructions:
    """Instructions a process under callgrind has executed (all threads) since `zero()`.
    `read()` asks callgrind for a dump (`callgrind_control`, through valgrind's gdbserver) and
    reads its `summary:` line."""

    def __init__(self, proc: "Proc", out: Path):
        self.pid, self.out, self.dumps = proc.p.pid, out, 0

    def _ctl(self, *args):
        sh(["callgrind_control", *args, str(self.pid)], stdout=subprocess.DEVNULL)

    def zero(self):
        self._ctl("--zero")

    def read(self) -> int:
        self._ctl("--dump=measured")
        self.dumps += 1
        dump = self.out.with_name(f"{self.out.name}.{self.dumps}")

        def summary():
            return dump.exists() and re.search(r"^summary: (\d+)$", dump.read_text(errors="replace"), re.M)
        try:
            return int(wait_until(summary, f"callgrind dump {dump}", 120, 0.2).group(1))
        except Timeout:
            raise RuntimeError(f"no callgrind dump at {dump}") from None


def meter(proc: "Proc", kind: str, tmp: Path, callgrind: bool):
    """(start, stop) for one measured window: Envoy CPU seconds from /proc, or its instruction
    count under callgrind."""
    if callgrind:
        counter = Instructions(proc, tmp / f"callgrind-{kind}.out")
        return counter.zero, counter.read
    c0 = [0.0]

    def start():
        c0[0] = cpu_seconds(proc.p.pid)

    return start, lambda: cpu_seconds(proc.p.pid) - c0[0]


def sequential(url: str, body: bytes, n: int):
    """n POSTs one after another on one keep-alive connection; raises on anything but 200."""
    import http.client
    from urllib.parse import urlparse
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        for _ in range(n):
            c.request("POST", u.path, body, {"content-type": "application/json"})
            r = c.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"status {r.status}")
    finally:
        c.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def _stream_client(host: str, port: int, body: bytes, n: int) -> int:
    """n streamed requests one after another on one keep-alive connection; returns the number
    of chunks read. Raises on anything but a complete 200 chunked response."""
    import asyncio
    r, w = await asyncio.open_connection(host, port)
    req = (f"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
           f"content-length: {len(body)}\r\n\r\n").encode() + body
    chunks = 0
    try:
        for _ in range(n):
            w.write(req)
            status = await r.readline()
            if b" 200 " not in status:
                raise RuntimeError(f"bad status {status!r}")
            chunked = False
            while (line := await r.readline()) not in (b"\r\n", b""):
                chunked |= line.lower().startswith(b"transfer-encoding: chunked")
            if not chunked:
                raise RuntimeError("response is not chunked (not streamed)")
            while True:
                size = int((await r.readline()).split(b";")[0], 16)
                await r.readexactly(size + 2)
                if size == 0:
                    break
                chunks += 1
    finally:
        w.close()
    return chunks


def stream_round(url: str, body: bytes, streams: int, per_stream: int) -> int:
    import asyncio
    from urllib.parse import urlparse
    u = urlparse(url)

    async def go():
        return await asyncio.gather(*(_stream_client(u.hostname, u.port, body, per_stream) for _ in range(streams)))

    return sum(asyncio.run(go()))


def run_stream(args, tmp: Path):
    """Streamed responses: 4 sglang-sim workers (fixed decode step, one SSE chunk per token) on
    the load core; `--streams` clients each run a fixed number of streamed /v1/completions
    requests (max_tokens = N, ignore_eos) through the proxy on its own core; the figure is
    Envoy's CPU seconds (utime + stime from /proc) over the measured requests divided by their
    number, so requests still in flight never blur it."""
    sims, ports = [], []
    try:
        for i in range(WORKERS):
            port = free_port()
            sims.append(Proc([str(SIM), "--port", str(port), "--model", "llama", "--decode-base-ms",
                              str(args.step_ms), "--decode-batch-factor", "0", "--prefill-overhead-ms", "0",
                              "--context-length", "65536"], LOAD_CPU, tmp / f"sim{i}.log"))
            ports.append(port)
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health", 30)
        kinds = [k for k, _ in STREAM_KINDS if k in args.kinds]
        labels = dict(STREAM_KINDS)
        # Idle proxies cost nothing measured (the figure is the measured Envoy's own CPU); the
        # table gives medians over rounds and the median of each round's ratio to plain Envoy
        # measured in that same round.
        runs: dict = {}
        unit, scale = ("instructions", 1) if args.callgrind else ("us", 1e6)
        with all_proxies(kinds, tmp, ports, args.callgrind) as proxies:
            meters = {k: meter(p, k, tmp, args.callgrind) for k, (p, _) in proxies.items()}
            idle = {}
            for k in kinds if args.idle else []:
                # No traffic: what the proxy spends per second on timers and load polls.
                start, stop = meters[k]
                start()
                time.sleep(args.idle)
                idle[k] = stop() * scale / args.idle
                print(f"idle {labels[k]:36s} Envoy {idle[k]:12,.0f} {unit}/s", flush=True)
            for r in range(args.rounds):
                for n in args.tokens:
                    body = json.dumps({"model": "llama", "prompt": "Stream me the answer, token by token. " * 8,
                                       "max_tokens": n, "ignore_eos": True, "stream": True}).encode()
                    per = max(2, round(args.secs * 1000 / (n * args.step_ms)))
                    for k in rotated(kinds, r):
                        p, url = proxies[k]
                        stream_round(url, body, args.streams, 1)  # warm-up
                        start, stop = meters[k]
                        start()
                        t0 = time.time()
                        chunks = stream_round(url, body, args.streams, per)
                        wall = time.time() - t0
                        cpu = stop() * scale
                        done = args.streams * per
                        runs.setdefault((k, n), []).append((cpu / done, cpu / chunks, chunks / done))
                        print(f"round {r + 1} {labels[k]:36s} {n:5d} tokens  {done:5d} responses "
                              f"({chunks / done:.0f} chunks each) in {wall:5.1f} s  Envoy "
                              f"{cpu / done:10,.0f} {unit}/response", flush=True)
        med = statistics.median
        results = {key: med(v[0] for v in vs) for key, vs in runs.items()}
        per_chunk = {key: (med(v[1] for v in vs), med(v[2] for v in vs)) for key, vs in runs.items()}
        if runs:
            print()
            print(f"Medians over {args.rounds} round(s); (x) = median of each round's ratio to plain Envoy "
                  "in the same round, [min-max] of those ratios:")
            print("| response | " + " | ".join(labels[k] for k in kinds) + " |")
            print("|---|" + "---|" * len(kinds))
            for n in args.tokens:
                base = runs.get(("envoy", n))
                cells = []
                for k in kinds:
                    v = results[(k, n)]
                    if k == "envoy" or not base:
                        cells.append(f"{v:,.0f} {unit}")
                        continue
                    ratios = [a[0] / b[0] for a, b in zip(runs[(k, n)], base)]
                    cells.append(f"{v:,.0f} {unit} ({med(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}])")
                print(f"| {n} tokens | " + " | ".join(cells) + " |")
            print()
            print(f"Envoy {unit} per HTTP chunk the client read (chunks per response: SSE events coalesce when a "
                  "proxy or worker falls behind, which changes the work per response):")
            print("| response | " + " | ".join(labels[k] for k in kinds) + " |")
            print("|---|" + "---|" * len(kinds))
            for n in args.tokens:
                print(f"| {n} tokens | " + " | ".join(f"{per_chunk[(k, n)][0]:,.1f} {unit} ({per_chunk[(k, n)][1]:.0f} chunks)"
                                                      for k in kinds) + " |")
        if idle:
            print()
            print(f"Idle (no traffic, {args.idle} s): Envoy {unit} per second")
            print("| " + " | ".join(labels[k] for k in kinds) + " |")
            print("|" + "---|" * len(kinds))
            print("| " + " | ".join(f"{idle[k]:,.0f}" for k in kinds) + " |")
        if args.json:
            Path(args.json).write_text(json.dumps({f"{k}/{n}": vs for (k, n), vs in runs.items()}, indent=1))
    finally:
        for s in sims:
            s.stop()


@contextlib.contextmanager
def workdir(keep: str | None, prefix: str):
    """A fresh temporary directory, or `keep` (created, never removed)."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep).resolve()
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as t:
        yield Path(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="prompt sizes in KB")
    ap.add_argument("--secs", type=int, default=5, help="seconds per wrk run")
    ap.add_argument("--conns", type=int, default=16, help="connections for the throughput run")
    ap.add_argument("--rss", type=int, default=0, metavar="N", help="RSS mode: index N distinct prefixes")
    ap.add_argument("--kinds", nargs="+", default=[k for k, _ in KINDS if k not in OPTIONAL], help="which proxies")
    ap.add_argument("--json", help="also write raw results here")
    ap.add_argument("--stream", action="store_true", help="streamed responses: Envoy CPU per response")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 1024], help="--stream: tokens per response")
    ap.add_argument("--step-ms", type=float, default=2.0, help="--stream: the workers' decode step")
    ap.add_argument("--streams", type=int, default=16, help="--stream: concurrent streaming clients")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (every kind measured once per round)")
    ap.add_argument("--callgrind", action="store_true",
                    help="count Envoy's instructions under valgrind's callgrind instead of its CPU time")
    ap.add_argument("--requests", type=int, default=400, help="--callgrind table: requests per measurement")
    ap.add_argument("--idle", type=float, default=0, metavar="SECS",
                    help="--stream: first measure each proxy for SECS seconds without traffic (timers, load polls)")
    ap.add_argument("--keep", metavar="DIR",
                    help="work in DIR and keep it: Envoy configs and logs, callgrind dumps for callgrind_annotate")
    args = ap.parse_args()
    if (os.cpu_count() or 1) < 2:
        sys.exit("needs 2 cores (proxy on core 0, load on core 1)")
    ensure_tools()
    if args.stream and args.kinds == [k for k, _ in KINDS if k not in OPTIONAL]:
        args.kinds = [k for k, _ in STREAM_KINDS if k not in OPTIONAL]
    if args.callgrind:
        if not shutil.which("valgrind"):
            sys.exit("--callgrind needs valgrind (apt-get install valgrind)")
        args.kinds = [k for k in args.kinds if k != "smg"]  # not Envoy: nothing to count
    if args.stream:
        with workdir(args.keep, "pr-stream-") as tmp:
            run_stream(args, tmp)
        return
    with workdir(args.keep, "pr-overhead-") as tmp:
        (tmp / "nginx-body").mkdir(exist_ok=True)
        up = free_port()
        nginx = Proc(["/usr/sbin/nginx", "-c", str(nginx_conf(up, tmp)), "-p", str(tmp)], LOAD_CPU, tmp / "nginx.log")
        try:
            wait_http(f"http://127.0.0.1:{up}/health", 20)
            if args.rss:
                run_rss(args, tmp, up)
            elif args.callgrind:
                run_count_table(args, tmp, up)
            else:
                run_table(args, tmp, up)
        finally:
            nginx.stop()


if __name__ == "__main__":
    main()
