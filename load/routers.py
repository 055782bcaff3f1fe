"""The routers load/compare puts in front of a fleet: Envoy's own load balancing, smg processes,
prefix-router Envoys (configs from envoy/gen's code, prkit.envoy_config); `start_router` starts
one (N replicas where it scales out) and says how it was configured."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

from load.scenarios import GEN, ROUTERS, SINGLE, split_router
from prkit import envoy_config as ec
from prkit.build import ensure_smg, smg_healthy_workers, wasm_path
from prkit.envoy import Envoy
from prkit.fleet import SimFleet
from prkit.ports import free_port
from prkit.wait import Timeout, wait_until


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
                         pool: Path | None = None, wasm: Path | None = None) -> str:
    """envoy/gen's config for the fleet (one cluster per worker, its models), loopback listeners,
    no rate limit, no stats listener, `policy` merged into the plugin's policy. In process
    (prkit.envoy_config); with ENVOY_GEN, that generator's output (no policy overrides). `pool`:
    the fleet's one model is a pool whose hosts the EDS file at that path lists (--membership).
    `wasm`: this filter build instead of the default one."""
    groups = _by_model(fleet)
    args = []
    for model, names in groups.items():
        if pool is not None:
            args += ["--model", f"{model}=eds:{pool}"]
            continue
        args += ["--model", model + "=" + ",".join(f"127.0.0.1:{fleet.ports[n]}" for n in names)]
    args += ["--default-model", next(iter(groups)), "--listen", f"127.0.0.1:{listener}",
             "--admin", f"127.0.0.1:{admin}", "--stats-listen", "none", "--rate-limit", "0",
             "--wasm", str(wasm or wasm_path()), *extra]
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
    stop, target URLs, a note on how the replicas were configured). `router` may name a filter
    build (`prefix_router_2t@WASM`, `scenarios.split_router`). `debug_header`: the
    prefix-router answers with its decision header (envoy/gen --debug-header). `pool`: the
    prefix-router's model is a pool read from this EDS file (`--model llama=eds:PATH`), with
    `--membership-ms membership_ms` when given."""
    router, wasm = split_router(router)
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
                e = Envoy(prefix_router_config(fleet, policy, listener, admin, per_replica[k], pool, wasm),
                          listener_port=listener, admin_port=admin, workdir=d, concurrency=threads)
                procs.append(e)
                e.start()
            if wasm is not None:
                note += f", filter build {wasm}"
            return procs, [e.base_url for e in procs], f"{replicas} Envoy process(es), {threads} threads each, {note}"
    except Exception:
        for p in procs:
            p.stop()
        raise
    raise SystemExit(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")
