"""scripts/fleet starts N workers on consecutive ports and stops them cleanly."""

from __future__ import annotations

import os
import subprocess

import httpx

from prkit.build import sim_binary
from prkit.paths import REPO_ROOT
from prkit.ports import port_pair


def test_fleet_start_stop(tmp_path):
    base = port_pair()  # two consecutive free ports
    env = dict(os.environ, FLEET_STATE_DIR=str(tmp_path / "fleet"), SGLANG_SIM_BIN=str(sim_binary()))
    fleet = str(REPO_ROOT / "scripts" / "fleet")
    r = subprocess.run([fleet, "start", "2", str(base), "--time-scale", "0.01"], env=env,
                       capture_output=True, text=True, timeout=60)
    try:
        assert r.returncode == 0, r.stderr
        pids = (tmp_path / "fleet" / "pids").read_text().split("\n")
        assert len([p for p in pids if p]) == 2
        for i in range(2):
            resp = httpx.post(f"http://127.0.0.1:{base + i}/v1/completions",
                              json={"prompt": "hi", "max_tokens": 2}, timeout=5)
            assert resp.status_code == 200
            assert resp.headers["x-worker-id"] == f"w{i}"
        st = subprocess.run([fleet, "status"], env=env, capture_output=True, text=True, timeout=30)
        assert st.stdout.count("health=200") == 2
    finally:
        r = subprocess.run([fleet, "stop"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "stopped 2 worker(s)" in r.stdout
    for i in range(2):
        try:
            httpx.get(f"http://127.0.0.1:{base + i}/health", timeout=1)
            raise AssertionError("worker still serving after stop")
        except httpx.HTTPError:
            pass
