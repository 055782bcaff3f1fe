"""Fixtures for the real-Envoy integration tests (the stack: prkit.stack, prkit.fake_workers)."""

from __future__ import annotations

import pytest

from prkit.client import Client
from prkit.prom import vm_reloads
from prkit.stack import Stack

_ACTIVE_STACKS: list = []


@pytest.fixture(scope="session")
def stack(request):
    """The demo config (envoy/envoy.yaml) with the debug header forced on, shared by the session.

    State in Envoy (prefix index, counters) persists across tests: tests use their own random
    prefixes and measure metric deltas, so they do not depend on order. The cache-footprint rule
    (`policy.placement_window_ms`) is off here: it remembers where earlier tests put their
    prompts for a minute, which would make rendezvous spreads depend on test order; its own test
    (test_footprint.py) starts a fresh Envoy with the default policy.
    """
    s = Stack(plugin_overrides={"debug_header": "x-prefix-router-decision",
                                "policy": {"placement_window_ms": 0}}).start()
    _ACTIVE_STACKS.append(s)
    yield s
    _ACTIVE_STACKS.remove(s)
    s.close(keep_logs=request.session.testsfailed > 0)  # failed runs keep config + log in /tmp


@pytest.fixture(scope="module")
def fresh():
    """A fresh stack for one test module, with the default policy and the debug header: for tests
    whose outcome depends on what earlier prompts left in the index or in the footprints."""
    s = Stack(plugin_overrides={"debug_header": "x-prefix-router-decision"}).start()
    yield s
    s.close()


@pytest.fixture
def env(stack):
    """Per test: worker counters reset, delays off; the invariant checks run after the test."""
    stack.pool.reset()
    yield stack
    check_upstream_headers(stack)
    check_filter_healthy(stack)


@pytest.fixture
def client(stack):
    c = Client(stack.envoy.listener_port)
    yield c
    c.close()


def check_upstream_headers(stack):
    """Every request a worker saw carried exactly one cluster header naming that worker, and no
    debug header (the filter strips client-sent ones and sets its own)."""
    bad = []
    for name, r in stack.pool.all_requests():
        if r["cluster_header"] != [name] or r["debug_header"]:
            bad.append((name, r))
    assert not bad, f"upstream saw wrong routing headers: {bad[:5]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and _ACTIVE_STACKS:
        for s in _ACTIVE_STACKS:
            rep.sections.append((f"envoy log tail ({s.envoy.log_path})", s.envoy.log_tail(120)))


def check_filter_healthy(stack):
    """The Wasm VM never failed: with failure_policy FAIL_RELOAD a panic would be papered over by a
    reload (only the request in flight fails), so look for it explicitly."""
    reloads = vm_reloads(stack.envoy.stats())
    assert reloads and all(v == 0 for v in reloads.values()), reloads
    bad = stack.envoy.wasm_log_errors()
    assert not bad, "\n".join(bad[:20])
