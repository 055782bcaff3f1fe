"""Fixtures for the simulator tests: `sglang-sim` processes from prkit (built fresh by cargo, or
SGLANG_SIM_BIN)."""

from __future__ import annotations

import pytest

from prkit.fleet import SimWorker

MODEL = "llama-3-8b"


def start_sim(*args: str, worker_id: str = "sim-test") -> SimWorker:
    return SimWorker(worker_id, list(args), model=MODEL).start(timeout_s=30)


@pytest.fixture
def sim():
    s = start_sim("--time-scale", "0.01")
    yield s
    s.stop()


@pytest.fixture
def sim_factory():
    started: list[SimWorker] = []

    def make(*args: str, **kw) -> SimWorker:
        s = start_sim(*args, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
