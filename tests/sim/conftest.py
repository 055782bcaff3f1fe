"""Fixtures for the simulator tests: locate (or build) the `sglang-sim` binary and run it."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama-3-8b"


def _target_dir() -> Path:
    t = os.environ.get("CARGO_TARGET_DIR")
    if not t:
        return REPO_ROOT / "target"
    p = Path(t)
    return p if p.is_absolute() else REPO_ROOT / p


def sim_binary() -> Path:
    """SGLANG_SIM_BIN, else the newest of target/{release,debug}/sglang-sim, else build release."""
    env = os.environ.get("SGLANG_SIM_BIN")
    if env:
        p = Path(env)
        if not p.is_file():
            raise RuntimeError(f"SGLANG_SIM_BIN={env} does not exist")
        return p
    candidates = [_target_dir() / kind / "sglang-sim" for kind in ("release", "debug")]
    found = [c for c in candidates if c.is_file()]
    if not found:
        r = subprocess.run(
            ["cargo", "build", "-p", "sglang-sim", "--release"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"cargo build -p sglang-sim --release failed:\n{r.stderr[-4000:]}")
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise RuntimeError(f"sglang-sim not found in {candidates} after building")
    return max(found, key=lambda p: p.stat().st_mtime)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sim:
    """A running simulator process."""

    def __init__(self, *args: str, worker_id: str = "sim-test"):
        self.port = free_port()
        self.worker_id = worker_id
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            str(sim_binary()),
            "--port", str(self.port),
            "--model", MODEL,
            "--worker-id", worker_id,
            *args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-sim exited early: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("sglang-sim did not become healthy in 20 s")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def sim():
    s = Sim("--time-scale", "0.01")
    yield s
    s.stop()


@pytest.fixture
def sim_factory():
    started: list[Sim] = []

    def make(*args: str, **kw) -> Sim:
        s = Sim(*args, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
