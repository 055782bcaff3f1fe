"""Runs a k6 scenario through a router in front of a fresh fleet of simulated SGLang workers.

Used by `scripts/demo` (a short round-robin vs prefix-router comparison). Everything is real: the
`sglang-sim` binaries, the Envoy from `.venv` running the compiled filter with a config rendered
from `envoy/envoy.yaml`, and k6 from `.venv`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.harness import (  # noqa: E402  (shared renderer and Envoy process)
    DEMO_CONFIG,
    Envoy,
    free_port,
    render_config,
    wasm_path,
)

SIM_BIN = Path(os.environ.get("SGLANG_SIM_BIN", REPO / "target" / "release" / "sglang-sim"))
K6 = REPO / ".venv" / "bin" / "k6"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Fleet:
    """N `sglang-sim` processes w0..w(N-1) on free loopback ports."""

    def __init__(self, n: int, args: list[str], model: str | list[str], workdir: Path):
        self.names = [f"w{i}" for i in range(n)]
        self.ports = {name: free_port() for name in self.names}
        self.procs: dict[str, subprocess.Popen] = {}
        self.args = args
        # One model for all, or one per worker (disjoint worker sets for several models).
        self.models = {name: (model if isinstance(model, str) else model[i]) for i, name in enumerate(self.names)}
        self.model = model
        self.workdir = workdir

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(self, timeout_s: float = 30.0) -> None:
        for name, port in self.ports.items():
            out = open(self.workdir / f"{name}.log", "wb")
            self.procs[name] = subprocess.Popen(
                [str(SIM_BIN), "--port", str(port), "--model", self.models[name], "--worker-id", name, *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            out.close()
        deadline = time.monotonic() + timeout_s
        for name, port in self.ports.items():
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline or self.procs[name].poll() is not None:
                    raise RuntimeError(f"simulated worker {name} did not become healthy")
                time.sleep(0.05)

    def metrics(self) -> dict[str, dict[str, float]]:
        """Per worker: sglang:* samples summed over labels (histogram series excluded)."""
        out = {}
        for name, port in self.ports.items():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            vals: dict[str, float] = {}
            for line in text.splitlines():
                if not line or line.startswith("#"):
                    continue
                key, _, value = line.rpartition(" ")
                metric = key.split("{", 1)[0]
                try:
                    vals[metric] = vals.get(metric, 0.0) + float(value)
                except ValueError:
                    continue
            out[name] = vals
        return out

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_envoy(fleet: Fleet, plugin_overrides: dict, workdir: Path) -> Envoy:
    listener, admin = free_port(), free_port()
    text, _ = render_config(
        DEMO_CONFIG.read_text(),
        listener_port=listener,
        admin_port=admin,
        worker_ports=fleet.ports,
        wasm=wasm_path(),
        plugin_overrides=plugin_overrides,
    )
    envoy = Envoy(text, listener_port=listener, admin_port=admin, workdir=workdir)
    envoy.start()
    return envoy


def run_k6(script: Path, env: dict, summary: Path, workdir: Path, extra_args: list[str] | None = None) -> dict:
    full_env = dict(os.environ, **{k: str(v) for k, v in env.items()}, SUMMARY=str(summary))
    with open(workdir / "k6.log", "wb") as out:
        rc = subprocess.call(
            [str(K6), "run", "--quiet", "--no-color", *(extra_args or []), str(script)],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if not summary.exists():
        raise RuntimeError(f"k6 wrote no summary (exit {rc}); see {workdir / 'k6.log'}")
    data = json.loads(summary.read_text())
    data["k6_exit"] = rc  # 99 = thresholds crossed
    return data


def run_router(label: str, plugin_overrides: dict, scenario: Path, k6_env: dict, workers: int,
               sim_args: list[str], model: str) -> dict:
    """A fresh fleet, Envoy with the given plugin overrides, one k6 run; returns the row."""
    workdir = Path(tempfile.mkdtemp(prefix=f"prefix-router-{label}-"))
    fleet = Fleet(workers, sim_args, model, workdir)
    envoy = None
    try:
        fleet.start()
        envoy = start_envoy(fleet, plugin_overrides, workdir)
        log(f"{label}: fleet of {workers} on ports {min(fleet.ports.values())}.., Envoy on :{envoy.listener_port}")
        summary = run_k6(scenario, dict(k6_env, TARGET=envoy.base_url), workdir / "summary.json", workdir)
        m = fleet.metrics()
        prompt = sum(v.get("sglang:prompt_tokens_total", 0) for v in m.values())
        cached = sum(v.get("sglang:cached_tokens_total", 0) for v in m.values())
        reqs = [m[n].get("sglang:num_requests_total", 0) for n in fleet.names]
        mean = sum(reqs) / len(reqs) if reqs else 0
        row = {
            "router": label,
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft": summary.get("ttft_ms", {}),
            "e2e": summary.get("e2e_ms", {}),
            "rps": summary.get("rps", 0.0),
            "requests": summary.get("requests", 0),
            "errors": summary.get("errors", 0),
            "worker_requests": reqs,
            "max_over_mean": (max(reqs) / mean) if mean else 0.0,
            "k6_exit": summary.get("k6_exit"),
            "workdir": str(workdir),
        }
        log(f"{label}: {row['requests']} requests, hit rate {row['hit_rate']:.1%}, "
            f"TTFT p50 {row['ttft'].get('med', 0):.0f} ms, errors {row['errors']}")
        return row
    finally:
        if envoy is not None:
            envoy.stop()
        fleet.stop()


def table(rows: list[dict]) -> str:
    head = ("| router | hit rate | TTFT p50 | TTFT p90 | TTFT p99 | E2E p50 | E2E p99 | req/s "
            "| errors | requests per worker | max/mean |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        t, e = r["ttft"], r["e2e"]
        lines.append(
            f"| {r['router']} | {r['hit_rate']:.1%} | {t.get('med', 0):.0f} ms | {t.get('p(90)', 0):.0f} ms "
            f"| {t.get('p(99)', 0):.0f} ms | {e.get('med', 0):.0f} ms | {e.get('p(99)', 0):.0f} ms "
            f"| {r['rps']:.1f} | {r['errors']} | {' / '.join(str(int(x)) for x in r['worker_requests'])} "
            f"| {r['max_over_mean']:.2f} |"
        )
    return "\n".join(lines)
