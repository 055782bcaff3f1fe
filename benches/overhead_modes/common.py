"""What every mode shares: the binaries and artifacts (built or installed by `ensure_tools`), the
proxies under test (`KINDS`, their Envoy configs from prkit.envoy_config, `start_proxy`,
`all_proxies`, pinned to the proxy core), the load generator (`wrk`, on the load core), and the
meters (Envoy CPU seconds from /proc, or its instructions under callgrind)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from time import time_ns

from prkit import envoy_config as ec
from prkit.build import ensure_smg, envoy_executable
from prkit.eds import write_eds
from prkit.paths import REPO_ROOT
from prkit.ports import free_port
from prkit.procfs import cpu_seconds, rss_kib
from prkit.wait import Timeout, wait_http, wait_until

ENVOY = REPO_ROOT / ".venv" / "bin" / "envoy"
WASM = Path(os.environ.get("PREFIX_ROUTER_WASM", REPO_ROOT / "target/wasm32-wasip1/release/prefix_router.wasm"))
# benches/wasm-floor: reads the body and sets the cluster header, nothing else (the Wasm floor),
# on the lean ABI layer (the callbacks prefix-router exports) and on the proxy-wasm SDK (every one).
FLOOR_WASM = REPO_ROOT / "target/wasm32-wasip1/release/wasm_floor.wasm"
FLOOR_SDK_WASM = REPO_ROOT / "target/wasm32-wasip1/release/wasm_floor_sdk.wasm"
# benches/dm-floor: the same floor as a native dynamic module (lib<name>.so in this directory).
DM_DIR = REPO_ROOT / "target/release"
DM_FLOOR = "dm_floor"
DM_ROUTER = "prefix_router"
# Static workers carry their `address` in the plugin config (envoy/gen's default for IP hosts);
# benches/overhead --no-worker-address turns it off.
WORKER_ADDRESS = True
SIM = Path(os.environ.get("SGLANG_SIM_BIN", REPO_ROOT / "target/release/sglang-sim"))
PROXY_CPU, LOAD_CPU = "0", "1"
WORKERS = 4


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def ensure_tools(kinds: list[str] | None = None, sim: bool = True):
    """What the bench needs, built or installed only for the proxies of `kinds` (all when None):
    nginx and wrk (apt-get), Envoy (scripts/setup), smg, the filter (unless PREFIX_ROUTER_WASM
    names a build), the floors, the dynamic modules; the simulator when `sim` (stream mode) and
    SGLANG_SIM_BIN is unset."""
    want = set(kinds if kinds is not None else [k for k, _ in KINDS])
    missing = [p for p, b in (("nginx", "/usr/sbin/nginx"), ("wrk", "wrk")) if not shutil.which(b)]
    if missing:
        print(f"installing {missing} with apt-get", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        sh(["apt-get", "install", "-y", *missing], env=env, stdout=subprocess.DEVNULL)
    if "smg" in want:
        ensure_smg()
    if not ENVOY.exists():
        sh([str(REPO_ROOT / "scripts" / "setup")])
    uses_wasm = any(WASM_OF.get(k) is WASM for k in want) or any(k.startswith("prefix_router_dm") for k in want)
    if "PREFIX_ROUTER_WASM" not in os.environ and uses_wasm:  # cargo decides whether it is fresh
        sh(["cargo", "build", "-p", "prefix-router", "--target", "wasm32-wasip1", "--release"], cwd=REPO_ROOT)
    if want & {"wasm_floor", "wasm_floor_sdk"}:
        build_floor = ["cargo", "build", "-p", "wasm-floor", "--target", "wasm32-wasip1", "--release"]
        sh([*build_floor, "--features", "sdk"], cwd=REPO_ROOT)
        shutil.copyfile(FLOOR_WASM, FLOOR_SDK_WASM)
        sh(build_floor, cwd=REPO_ROOT)
    if "dm_floor" in want:
        sh(["cargo", "build", "-p", "dm-floor", "--release"], cwd=REPO_ROOT)
    if want & {"prefix_router_dm", "prefix_router_dm_nopoll", *DM_POOL_KINDS}:
        sh(["cargo", "build", "-p", "prefix-router", "--release", "--features", "dynamic-module"], cwd=REPO_ROOT)
    if sim and "SGLANG_SIM_BIN" not in os.environ:
        sh(["cargo", "build", "-p", "sglang-sim", "--release"], cwd=REPO_ROOT)


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
        return rss_kib(self.p.pid)


# What SGLang answers a load poll (`GET /v1/loads`) and a counter read (`GET /metrics`),
# captured from sglang-sim (sim/, 482 and 7,129 bytes). `--sglang-answers` serves them, so the
# filter's polls succeed and keep their 100 ms interval as against real workers; without it
# nginx answers both with the chat completion, which the filter backs off from (poll.rs).
SGLANG_ANSWERS = Path(__file__).resolve().parent.parent / "sglang_answers"


def nginx_conf(port: int, tmp: Path, sglang_answers: bool = False) -> Path:
    answers = f"""
    location = /v1/loads {{
      default_type application/json;
      alias {SGLANG_ANSWERS / "loads.json"};
    }}
    location = /metrics {{
      default_type text/plain;
      alias {SGLANG_ANSWERS / "metrics.txt"};
    }}""" if sglang_answers else ""
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
    }}{answers}
    location / {{
      default_type application/json;
      return 200 '{{"id":"x","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}]}}';
    }}
  }}
}}
""")
    return conf


def envoy_yaml(mode: str, port: int, admin: int, upstream: int | list[int], plugin: dict | None = None,
               tmp: Path | None = None) -> str:
    """`upstream`: one port (every cluster's endpoint) or one per worker (plain Envoy: one cluster
    over all of them, round robin; Wasm modes: cluster w<i> on port i). From prkit.envoy_config:
    the Wasm modes are the `bench` profile (one endpoint per worker cluster, no access log, no rate
    limit; load polls at the filter's default, every 100 ms per worker, except in the `_nopoll`
    modes); plain and buffer are its filter-less baseline. Static workers carry their `address`
    unless WORKER_ADDRESS is off (`--no-worker-address`: the config a filter from before pools
    accepts). The `prefix_router_pool64*` modes (idle only, see POOL_KINDS) write their EDS file
    into `tmp`."""
    ups = upstream if isinstance(upstream, list) else [upstream] * WORKERS
    listen, admin_addr = ("127.0.0.1", port), ("127.0.0.1", admin)
    if mode in ("plain", "buffer"):
        filters = [ec.buffer_filter()] if mode == "buffer" else []
        pools = {"up": [("127.0.0.1", u) for u in sorted(set(ups))]}
        return ec.dump(ec.plain_proxy(listen, admin_addr, pools, http_filters=filters, log=False))
    if mode in POOL_KINDS:
        return pool_yaml(mode, listen, admin_addr, tmp)
    if mode in DM_POOL_KINDS:
        return dm_pool_yaml(mode, listen, admin_addr, ups, tmp)
    wasm = WASM_OF[mode]
    if mode.endswith("_nopoll"):
        # The same filter without its load polls (a per-second cost, not a per-request one).
        plugin = {**(plugin or {}), "load_poll": {"interval_ms": 0}}
        mode = mode.removesuffix("_nopoll")
    module = {"dm_floor": DM_FLOOR, "prefix_router_dm": DM_ROUTER}.get(mode)
    # One nginx for all clusters (table mode): worker i dials it on loopback address 127.0.0.<i+1>
    # (nginx listens on all four), so the generator sees four distinct workers.
    hosts = ["127.0.0.1"] * WORKERS if len(set(ups)) == WORKERS else [f"127.0.0.{i + 1}" for i in range(WORKERS)]
    models = {"llama": [ec.Worker(f"w{i}", hosts[i], ups[i]) for i in range(WORKERS)]}
    if not WORKER_ADDRESS:
        # cluster names only: the filter never reads `upstream.address` at the response
        plugin = ec.merge(plugin or {}, {"models": {"llama": {"workers": [w.cluster for w in models["llama"]]}}})
    o = ec.profile("bench", models=models, listen=listen, admin=admin_addr, wasm=str(wasm),
                   dynamic_module=module, plugin=plugin or {})
    return ec.render(o)


# Idle-only kinds: prefix-router with ONE pool model of POOL_HOSTS hosts (a file-based EDS
# DiscoveryResponse; the hosts are addresses nothing listens on: no request may go through),
# reading the pool's membership from the admin's /clusters every 1000 ms (envoy/gen's default
# --membership-ms) or never (0): their idle difference is the membership refresh's cost. Load
# polls every 60 s (the longest the filter accepts; the index self-check off): the filter reads
# membership only from its load-poll tick, which returns early when load_poll.interval_ms is 0
# (filter/src/poller.rs `tick`), so polls cannot be switched off; the stream mode prints the
# polls and membership reads each idle window held.
POOL_HOSTS = 64
POOL_KINDS = {"prefix_router_pool64": 1000, "prefix_router_pool64_nomembership": 0}


def pool_yaml(mode: str, listen, admin_addr, tmp: Path | None) -> str:
    if tmp is None:
        raise ValueError(f"{mode}: needs a directory for its EDS file")
    d = tmp / f"eds-{mode}"
    d.mkdir(exist_ok=True)
    eds = d / "llama.json"
    # 127.0.1.x: no listener there (and none of the sims' ports on 127.0.0.1)
    write_eds(eds, "llama", [(f"127.0.1.{i + 1}", 30000) for i in range(POOL_HOSTS)], time_ns())
    o = ec.profile("bench", models={}, pools={"llama": ec.Pool("llama", "eds", path=str(eds))}, listen=listen,
                   admin=admin_addr, wasm=str(WASM), membership_ms=POOL_KINDS[mode], pool_max_workers=POOL_HOSTS,
                   default_model="llama", load_poll_ms=60000, hit_check_ms=0,
                   plugin={"load_poll": {"no_traffic_interval_ms": 60000}})
    return ec.render(o)


# The native build with ONE pool model of the WORKERS upstreams (a file-based EDS file; the filter
# reads membership every 1 s), its pool cluster's load balancer override_host (envoy/gen's default)
# or the native module (`--native-lb`, filter/src/native/lb/): their difference is the LB's cost.
# Load polls every 60 s (the filter reads membership only while polls are on; the per-second
# polls of four workers would otherwise dwarf the difference and vary with the request rate).
DM_POOL_KINDS = {"prefix_router_dm_pool": False, "prefix_router_dm_pool_lb": True}


def dm_pool_yaml(mode: str, listen, admin_addr, ups: list[int], tmp: Path | None) -> str:
    if tmp is None:
        raise ValueError(f"{mode}: needs a directory for its EDS file")
    d = tmp / f"eds-{mode}"
    d.mkdir(exist_ok=True)
    eds = d / "llama.json"
    hosts = ["127.0.0.1"] * WORKERS if len(set(ups)) == WORKERS else [f"127.0.0.{i + 1}" for i in range(WORKERS)]
    write_eds(eds, "llama", list(zip(hosts, ups)), time_ns())
    o = ec.profile("bench", models={}, pools={"llama": ec.Pool("llama", "eds", path=str(eds))}, listen=listen,
                   admin=admin_addr, dynamic_module=DM_ROUTER, native_lb=DM_POOL_KINDS[mode],
                   default_model="llama", pool_max_workers=WORKERS, load_poll_ms=60000, hit_check_ms=0,
                   plugin={"load_poll": {"no_traffic_interval_ms": 60000}})
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
        mode = {"envoy": "plain", "envoy_buffer": "buffer"}.get(kind, kind)
        cfg = tmp / f"envoy-{kind}.yaml"
        cfg.write_text(envoy_yaml(mode, port, admin, upstream, tmp=tmp))
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
    p.admin = admin
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        if kind in POOL_KINDS:  # no host answers: ready when Envoy is
            wait_http(f"http://127.0.0.1:{admin}/ready", 900 if callgrind else 60)
        else:
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
         ("prefix_router_dm_nopoll", "(vii) without load polls"),
         ("prefix_router_pool64", f"(iii) pool of {POOL_HOSTS}, membership every 1 s"),
         ("prefix_router_pool64_nomembership", f"(iii) pool of {POOL_HOSTS}, membership off"),
         ("prefix_router_dm_pool", f"(vii) pool of {WORKERS}, override_host"),
         ("prefix_router_dm_pool_lb", f"(vii) pool of {WORKERS}, the native LB")]
# Measured only when named in --kinds: the filter without its per-second load polls, the pools.
OPTIONAL = ("prefix_router_nopoll", "prefix_router_dm_nopoll", *POOL_KINDS, *DM_POOL_KINDS)
# The .wasm each Wasm mode loads.
WASM_OF = {"prefix_router": WASM, "wasm_floor": FLOOR_WASM, "wasm_floor_sdk": FLOOR_SDK_WASM,
           "dm_floor": WASM, "prefix_router_dm": WASM, "prefix_router_nopoll": WASM,
           "prefix_router_dm_nopoll": WASM, **{k: WASM for k in POOL_KINDS}, **{k: WASM for k in DM_POOL_KINDS}}


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


@contextlib.contextmanager
def workdir(keep: str | None, prefix: str):
    """A fresh temporary directory, or `keep` (created, never removed)."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep).resolve()
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as t:
        yield Path(t)
