"""Runs a k6 scenario through a router in front of a fresh fleet of simulated SGLang workers.

Used by `scripts/demo` (a short round-robin vs prefix-router comparison). Everything is real: the
`sglang-sim` binaries, the Envoy from `.venv` running the compiled filter with a config rendered
from `envoy/envoy.yaml`, and k6 from `.venv`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from prkit import envoy_config as ec
from prkit.build import k6_binary, wasm_path
from prkit.envoy import Envoy
from prkit.fleet import SimFleet
from prkit.paths import REPO_ROOT as REPO
from prkit.ports import free_port


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start_envoy(fleet: SimFleet, plugin_overrides: dict, workdir: Path) -> Envoy:
    listener, admin = free_port(), free_port()
    opts = ec.local_demo(fleet.ports, listen=listener, admin=admin, wasm=str(wasm_path()), plugin=plugin_overrides)
    return Envoy(ec.render(opts), listener_port=listener, admin_port=admin, workdir=workdir).start()


def run_k6(script: Path, env: dict, summary: Path, workdir: Path, extra_args: list[str] | None = None) -> dict:
    full_env = dict(os.environ, **{k: str(v) for k, v in env.items()}, SUMMARY=str(summary))
    with open(workdir / "k6.log", "wb") as out:
        rc = subprocess.call(
            [str(k6_binary()), "run", "--quiet", "--no-color", *(extra_args or []), str(script)],
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
    fleet = SimFleet(workers, workdir, sim_args, models=model)
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
