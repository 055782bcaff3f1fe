"""The native module as a pool cluster's load balancer (`envoy/gen --native --native-lb`,
filter/src/native/lb/) in the real Envoy 1.40, against override_host (the default) on the same
pool: the first attempt goes to the filter's choice, a retry to the next host the filter listed
(skipping the one that failed), and a listed host Envoy holds unhealthy is skipped before any
attempt (override_host tries it: Envoy 1.40 uses a named member whatever its health)."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from prkit import envoy_config as ec
from prkit.build import cargo_build
from prkit.client import Client
from prkit.eds import write_eds
from prkit.envoy import Envoy
from prkit.fake_workers import Worker
from prkit.paths import target_dir
from prkit.ports import free_port
from prkit.wait import wait_until

from . import workload as wl

MODEL = "m"
LB_STAT = "prefix_router.lb."


class NativePool:
    """Three fake workers as one EDS pool behind the native filter, with the pool's load balancer
    the native module (`native_lb`) or override_host. `membership_ms`: how often the filter reads
    the pool's healthy hosts from Envoy's admin."""

    def __init__(self, tmp: Path, native_lb: bool, membership_ms: int = 200):
        cargo_build("prefix-router", release=True, features=["dynamic-module"])
        so = target_dir() / "release" / "libprefix_router.so"
        self.workers = [Worker(f"p{i}") for i in range(3)]
        self.addr = {f"127.0.0.1:{w.port}": w.name for w in self.workers}
        path = tmp / "eds" / "m.yaml"
        path.parent.mkdir()
        write_eds(path, MODEL, [("127.0.0.1", w.port) for w in self.workers], 1)
        listen, admin = free_port(), free_port()
        args = ["--model", f"{MODEL}=eds:{path}", "--listen", f"127.0.0.1:{listen}", "--admin",
                f"127.0.0.1:{admin}", "--stats-listen", "none", "--rate-limit", "0", "--hash-key", "k" * 32,
                "--native", "--membership-ms", str(membership_ms), "--health-interval", "1s",
                "--debug-header", "--fallbacks", "1"]
        text = ec.run_gen(*args, *(["--native-lb"] if native_lb else []))
        assert ("envoy.load_balancing_policies.dynamic_modules" in text) == native_lb
        self.envoy = Envoy(text, listener_port=listen, admin_port=admin, workdir=tmp,
                           env={"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(so.parent)}).start()
        self.client = Client(listen)
        wait_until(lambda: self.healthy() == {"p0", "p1", "p2"}, lambda: f"healthy: {self.healthy()}", 30)
        # The filter names hosts once it has read the pool's membership (Envoy's admin).
        wait_until(lambda: "worker" in self.chat(opening())[1], "the filter naming pool hosts", 30, 0.1)

    def healthy(self) -> set[str]:
        """The pool's hosts Envoy's admin shows healthy."""
        _, body = self.envoy.admin_get("/clusters")
        out = set()
        for line in body.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == MODEL and parts[2] == "health_flags" and parts[3] == "healthy":
                out.add(self.addr.get(parts[1], parts[1]))
        return out

    def lb_stats(self) -> dict[str, int]:
        """The LB's counters (`<namespace>.prefix_router.lb.<name>`) by name."""
        _, body = self.envoy.admin_get("/stats?filter=prefix_router\\.lb\\.")
        out = {}
        for line in body.splitlines():
            name, _, v = line.partition(": ")
            if LB_STAT in name and v.strip().isdigit():
                out[name.split(LB_STAT, 1)[1]] = int(v)
        return out

    def chat(self, msgs: list[dict]):
        rep = self.client.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
        assert rep.status == 200, (rep.status, rep.body[:300])
        d = {k: self.addr.get(v, v) if isinstance(v, str) else v for k, v in rep.decision.items()}
        attempts = int((rep.headers.get("x-envoy-attempt-count") or ["1"])[0])
        return rep.worker, d, attempts

    def close(self):
        self.envoy.stop()
        for w in self.workers:
            w.close()


@pytest.fixture
def make_pool():
    made = []
    tmp = Path(tempfile.mkdtemp(prefix="prefix-router-native-lb-"))

    def make(native_lb: bool, membership_ms: int = 200) -> NativePool:
        d = tmp / str(len(made))
        d.mkdir()
        made.append(NativePool(d, native_lb, membership_ms))
        return made[-1]

    try:
        yield make
    finally:
        for p in made:
            p.close()
        shutil.rmtree(tmp, ignore_errors=True)


def opening() -> list[dict]:
    r = wl.rng(uuid.uuid4().hex)
    return [{"role": "system", "content": f"{uuid.uuid4().hex} " + wl.text(r, 2000)},
            {"role": "user", "content": wl.text(r, 200)}]


def next_turn(msgs: list[dict]) -> list[dict]:
    r = wl.rng(str(len(msgs)))
    return msgs + [{"role": "assistant", "content": wl.text(r, 100)}, {"role": "user", "content": wl.text(r, 100)}]


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
    pool = make_pool(native_lb=True)
    msgs = opening()
    holder, _, _ = pool.chat(msgs)
    next(w for w in pool.workers if w.name == holder).close()  # refused; health checks not yet aware
    before = pool.lb_stats()
    msgs = next_turn(msgs)
    worker, d, attempts = pool.chat(msgs)
    assert worker != holder and d["worker"] == worker and d.get("chosen") == holder, d
    assert attempts == 2, attempts
    after = pool.lb_stats()
    # The retry went to the listed fallback (the filter's next holder), not to the least busy host.
    assert after.get("listed_fallback", 0) == before.get("listed_fallback", 0) + 1, (before, after)
    assert after.get("unlisted", 0) == before.get("unlisted", 0), (before, after)
    assert after.get("panics", 0) == 0


@pytest.mark.parametrize("native_lb", [True, False], ids=["native_lb", "override_host"])
def test_a_listed_host_envoy_holds_unhealthy(make_pool, native_lb):
    """The filter still names a dead holder (it reads the pool's health every 4 s here, the
    request goes out as soon as Envoy's admin shows the holder unhealthy); Envoy's health checks
    already hold it unhealthy. The native LB skips it before any attempt; override_host tries it
    and the retry serves."""
    pool = make_pool(native_lb=native_lb, membership_ms=4000)
    msgs = opening()
    holder, _, _ = pool.chat(msgs)
    next(w for w in pool.workers if w.name == holder).close()
    wait_until(lambda: holder not in pool.healthy(), f"Envoy's health checks failing {holder}", 30, 0.02)
    msgs = next_turn(msgs)
    worker, d, attempts = pool.chat(msgs)
    # the filter named the dead holder first
    assert worker != holder and d.get("chosen") == holder, d
    assert attempts == (1 if native_lb else 2), (attempts, d)
