"""The native module as a pool cluster's load balancer (`envoy/gen --native --native-lb`,
filter/src/native/lb/) in the real Envoy 1.40, against override_host (the default) on the same
pool: the first attempt goes to the filter's choice, a retry to the next host the filter listed
(skipping the one that failed), and a listed host Envoy holds unhealthy is skipped before any
attempt (override_host tries it: Envoy 1.40 uses a named member whatever its health)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from prkit import envoy_config as ec
from prkit.envoy_config.cli import options_from_args
from prkit.build import cargo_build, envoy_executable
from prkit.eds import write_eds
from prkit.envoy import check_config
from prkit.paths import target_dir
from prkit.native_pool import NativePool, next_turn, opening
from prkit.wait import wait_until


@pytest.fixture
def make_pool():
    made = []
    tmp = Path(tempfile.mkdtemp(prefix="prefix-router-native-lb-"))

    def make(native_lb: bool, **kw) -> NativePool:
        made.append(NativePool(tmp / str(len(made)), native_lb, **kw))
        return made[-1]

    try:
        yield make
    finally:
        for p in made:
            p.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_lb_sends_the_first_attempt_to_the_filters_choice(make_pool):
    pool = make_pool(native_lb=True)
    before = pool.lb_stats()
    assert set(before) == {"listed_fallback", "unlisted", "no_host", "panics"}, before
    for _ in range(6):
        msgs = opening()
        holder, d, attempts = pool.chat(msgs)
        assert d["worker"] == holder and attempts == 1, d
        worker, d, attempts = pool.chat(next_turn(msgs))
        assert worker == holder and d["reason"] == "prefix_hit" and attempts == 1, d
    # Every attempt went to the first listed host: no fallback, no unlisted pick, no panic.
    assert pool.lb_stats() == before, (before, pool.lb_stats())


def test_a_retry_goes_to_the_next_listed_host_and_never_the_one_that_failed(make_pool):
    pool = make_pool(native_lb=True, n=4, fallbacks=2)
    msgs = opening()
    holder, _, _ = pool.chat(msgs)
    pool.worker(holder).close()  # refused; health checks not yet aware
    before = pool.lb_stats()
    msgs = next_turn(msgs)
    worker, d, attempts = pool.chat(msgs, tag="retry")
    listed = pool.listed("retry")
    assert listed[0] == holder and len(listed) == 3, listed
    # The retry went to the filter's next holder, not to the least busy or any other host.
    assert worker == listed[1] and d["worker"] == worker and d.get("chosen") == holder, (d, listed)
    assert attempts == 2, attempts
    after = pool.lb_stats()
    assert after["listed_fallback"] == before["listed_fallback"] + 1, (before, after)
    assert after["unlisted"] == before["unlisted"] and after["panics"] == 0, (before, after)


@pytest.mark.parametrize("native_lb", [True, False], ids=["native_lb", "override_host"])
def test_a_listed_host_envoy_holds_unhealthy(make_pool, native_lb):
    """The filter still names a dead holder (it reads the pool's health every 4 s here, the
    request goes out as soon as Envoy's admin shows the holder unhealthy); Envoy's health checks
    already hold it unhealthy. The native LB skips it before any attempt; override_host tries it
    and the retry serves."""
    pool = make_pool(native_lb=native_lb, membership_ms=4000)
    msgs = opening()
    holder, _, _ = pool.chat(msgs)
    pool.worker(holder).close()
    wait_until(lambda: holder not in pool.healthy(), f"Envoy's health checks failing {holder}", 30, 0.02)
    msgs = next_turn(msgs)
    worker, d, attempts = pool.chat(msgs)
    # the filter named the dead holder first
    assert worker != holder and d.get("chosen") == holder, d
    assert attempts == (1 if native_lb else 2), (attempts, d)


def test_gen_writes_the_native_lb_only_with_the_native_build_and_envoy_accepts_it(tmp_path, monkeypatch):
    """`--native-lb` needs `--native`; with it every pool cluster (EDS or DNS) gets the module as
    its load balancer, static workers keep theirs, and Envoy 1.40 validates the config."""
    common = ["--stats-listen", "none", "--hash-key", "k" * 32]
    r = ec.gen_result("--model", "m=eds:/tmp/m.yaml", "--native-lb", *common)
    assert r.returncode != 0 and "--native-lb" in r.stderr and "--native" in r.stderr, r.stderr
    write_eds(tmp_path / "m.yaml", "m", [("127.0.0.1", 30002)], 1)
    o = options_from_args(["--model", f"m=eds:{tmp_path / 'm.yaml'}", "--model", "d=dns:workers.local:30000",
                           "--model", "s=127.0.0.1:30001", "--native", "--native-lb", *common])
    cfg = ec.config(o)
    lbs = {c["name"]: c.get("load_balancing_policy", {}).get("policies", [{}])[0]
           .get("typed_extension_config", {}).get("name") for c in cfg["static_resources"]["clusters"]}
    assert lbs["m"] == lbs["d"] == "envoy.load_balancing_policies.dynamic_modules", lbs
    assert lbs["m_load"] == "envoy.load_balancing_policies.override_host", lbs  # polls name one host
    assert lbs.get("s") != "envoy.load_balancing_policies.dynamic_modules", lbs
    cargo_build("prefix-router", release=True, features=["dynamic-module"])
    monkeypatch.setenv("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", str(target_dir() / "release"))
    check_config(ec.render(o), tmp_path, "native-lb.yaml")


LB_HOOKS = {f"envoy_dynamic_module_on_lb_{h}" for h in (
    "config_new", "config_destroy", "new", "choose_host", "on_host_membership_update", "destroy")}


def test_the_module_exports_every_lb_hook_and_imports_only_what_envoy_exports():
    """Envoy resolves all six LB hooks when it creates the LB config (a missing one fails it); the
    LB callbacks the module calls must be ones this Envoy exports (else the module fails to load)."""
    cargo_build("prefix-router", release=True, features=["dynamic-module"])
    so = target_dir() / "release" / "libprefix_router.so"

    def symbols(path, flag):
        out = subprocess.run(["nm", "-D", flag, str(path)], check=True, capture_output=True, text=True).stdout
        return {line.split()[-1] for line in out.splitlines() if line.strip()}

    exports = symbols(so, "--defined-only")
    assert LB_HOOKS <= exports, LB_HOOKS - exports
    imports = {s for s in symbols(so, "--undefined-only") if s.startswith("envoy_dynamic_module_callback_lb_")}
    assert imports, "the LB calls back into Envoy: its imports must show"
    missing = imports - symbols(envoy_executable(), "--defined-only")
    assert not missing, missing


def test_a_worker_that_joins_the_pool_is_picked_where_the_filter_names_it(make_pool):
    """A host added to the EDS file: Envoy's membership event reaches every thread's LB instance,
    and once Envoy's first health check of the new worker passed (the LB can answer only with
    hosts Envoy holds healthy; until then a conversation the filter places there goes to its next
    listed host), a conversation the filter places on it goes there on its first attempt."""
    pool = make_pool(native_lb=True, n=3, listed=2)
    pool.listen(["p0", "p1", "p2"])

    def placed_on_p2():
        msgs = opening()
        worker, d, attempts = pool.chat(msgs)
        assert attempts == 1, (d, attempts)
        # "chosen" is there only when another worker than the filter's choice served
        return worker == "p2" and "chosen" not in d and msgs

    msgs = wait_until(placed_on_p2, "a new conversation placed on, and served by, the joined worker p2", 60, 0)
    before = pool.lb_stats()
    worker, d, attempts = pool.chat(next_turn(msgs))
    assert worker == "p2" and d["reason"] == "prefix_hit" and "chosen" not in d and attempts == 1, d
    after = pool.lb_stats()
    assert after["listed_fallback"] == before["listed_fallback"] and after["panics"] == 0, (before, after)
