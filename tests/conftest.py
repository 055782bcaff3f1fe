"""Shared by every Python test suite under tests/.

`scripts/test` runs pytest on several processes (pytest-xdist, each test file on one of them),
then the `quiet` tests alone: tests whose assertions depend on timing or on how load spreads
(a slow worker's share, headers before a prefill ends, failover under a closed-loop load, the
k6 comparisons). They are listed here, by file or test, rather than marked in each file, so the
list of what needs a quiet machine is in one place; a plain `pytest` runs everything in one
process as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Node-id prefixes (relative to the repository root) of the tests that run alone.
QUIET = (
    # k6 against several routers: CPU-bound comparisons of hit rates, spreads and timings
    "tests/load/test_compare_smoke.py",
    "tests/load/test_pd_compare_smoke.py",
    "tests/load/test_replay.py::test_replay_against_a_simulated_worker_records_every_request",  # send spacing
    "tests/reliability/test_worker_faults.py",  # detection under load, a slow worker's share
    "tests/reliability/test_config_change.py",  # hot restart under a closed-loop load
    "tests/reliability/test_slow_clients.py",  # timeouts measured against trickled bytes
    "tests/sim/test_sim_sse.py::test_stream_headers_arrive_with_first_token",  # prefill timing
    "tests/sim/test_sim_cost.py::test_follow_up_on_a_long_history_prefills_slower_per_token",  # TTFT ratio
)


def pytest_configure(config):
    config.addinivalue_line("markers", "quiet: depends on timing or load; scripts/test runs it alone")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(QUIET):
            item.add_marker(pytest.mark.quiet)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the directory holding Cargo.toml)."""
    return REPO_ROOT
