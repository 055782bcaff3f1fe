"""Prefill/decode disaggregation through a real Envoy: the filter picks a prefill worker (prefix
cache + load) and a decode worker (load), rewrites the body with SGLang's bootstrap fields,
routes the request to the decode worker and Envoy mirrors the same body to the prefill worker
(`request_mirror_policies[].cluster_header`). Configs come from `envoy/gen --pd-model`.

Two fleets:
  * fake recording workers (prkit.fake_workers.Worker): what each worker received, byte for byte, and
    decode failover (production shape: retries move a request to a decode fallback);
  * simulated SGLang PD workers (sglang-sim --disaggregation-mode prefill|decode): the decode
    worker waits for the room's KV from the prefill worker named in the body, then streams; a
    dead prefill worker makes the decode worker give up after its bootstrap timeout (500,
    counted in `sglang:num_bootstrap_failed_reqs_total`).
"""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
import uuid

import pytest

from prkit.build import cargo_build, sim_binary, wasm_path
from prkit.client import Client
from prkit.envoy import Envoy, wait_inflight_zero
from prkit.envoy_config import run_gen
from prkit.fake_workers import WorkerPool
from prkit.paths import target_dir
from prkit.ports import free_port
from prkit.prom import parse_prometheus
from prkit.wait import wait_until

from . import conftest as it_conftest

MODEL = "m"
PREFILL_HEADER = "x-prefix-router-prefill-cluster"
BOOTSTRAP_PORT = 8998  # the fake fleet's: nobody connects to it
DEADLINE_S = 30.0
# sglang-sim decode workers give up on a room after this long (the bound a dead prefill costs).
SIM_BOOTSTRAP_TIMEOUT_S = 2.0


def base_args(listener: int, admin: int) -> list:
    return ["--listen", f"127.0.0.1:{listener}", "--admin", f"127.0.0.1:{admin}",
            "--stats-listen", "none", "--rate-limit", "0", "--debug-header",
            "--wasm", str(wasm_path()), "--health-interval", "0.5s"]


def all_hosts_healthy(envoy: Envoy, clusters: list) -> bool:
    """Every host of these clusters (their own and their fallbacks) passed its health check: on a
    starved machine a first check can time out, and a retry cannot move to an unhealthy fallback."""
    status, text = envoy.admin_get("/clusters")
    assert status == 200
    flags = [line.rsplit("::", 1)[1] for line in text.splitlines()
             if "::health_flags::" in line and line.split("::", 1)[0] in clusters]
    return bool(flags) and all(f == "healthy" for f in flags)


def assert_inflight_zero(envoy: Envoy) -> dict:
    """Waits until every in-flight gauge reads 0; fails showing them otherwise."""
    g = wait_inflight_zero(envoy, DEADLINE_S)
    assert g and all(v == 0 for v in g.values()), f"in-flight gauges not back to 0: {g}"
    return g


# --------------------------------------------------------------------------------------------
# Fleet 1: recording fake workers, production shape (fallbacks + retries for decode)
# --------------------------------------------------------------------------------------------

PREFILLS = [f"{MODEL}_prefill_{i}" for i in range(2)]
DECODES = [f"{MODEL}_decode_{i}" for i in range(2)]


class FakeFleet:
    def __init__(self, tmp, native: bool = False):
        """`native`: the experimental native build (`envoy/gen --native`, libprefix_router.so)."""
        self.pool = WorkerPool(PREFILLS + DECODES)
        p = self.pool.ports
        listener, admin = free_port(), free_port()
        args = base_args(listener, admin)
        env = None
        if native:
            cargo_build("prefix-router", release=True, features=["dynamic-module"])
            args = [a for i, a in enumerate(args) if a != "--wasm" and args[i - 1] != "--wasm"] + ["--native"]
            env = {"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(target_dir() / "release")}
        text = run_gen(
            *args, "--pd-model", MODEL,
            "--prefill", ",".join(f"127.0.0.1:{p[n]}@{BOOTSTRAP_PORT}" for n in PREFILLS),
            "--decode", ",".join(f"127.0.0.1:{p[n]}" for n in DECODES),
        )
        for n in PREFILLS + DECODES:
            assert f"- name: {n}\n" in text, n
        self.envoy = Envoy(text, listener_port=listener, admin_port=admin, workdir=tmp, env=env)
        self.client = Client(listener)

    def start(self):
        self.envoy.start()
        wait_until(lambda: all_hosts_healthy(self.envoy, PREFILLS + DECODES), "every worker host healthy")
        # Envoy's worker threads see a host turn healthy some time after /clusters does (until
        # then a cluster sends its traffic to its fallback): wait until each decode cluster
        # answers from its own worker.
        own = set()

        def warmed():
            r = self.client.post("/v1/completions", {"model": MODEL, "prompt": f"warm-up {uuid.uuid4().hex}"})
            if r.status == 200 and r.decision.get("decode") == r.worker:
                own.add(r.worker)
            return own == set(DECODES)
        wait_until(warmed, "each decode cluster served by its own worker")
        return self

    def close(self):
        self.client.close()
        self.envoy.stop()
        self.pool.close()

    def requests(self, name: str) -> list:
        w = self.pool.workers[name]
        with w.lock:
            return [r for r in w.stats.requests if r["method"] == "POST"]


def _running(f: FakeFleet):
    """Starts `f` (closed again if that fails), yields it, closes it."""
    try:
        f.start()
    except Exception:
        f.close()
        raise
    it_conftest._ACTIVE_STACKS.append(f)
    yield f
    it_conftest._ACTIVE_STACKS.remove(f)
    f.close()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    yield from _running(FakeFleet(tmp_path_factory.mktemp("pd-fake")))


@pytest.fixture(scope="module")
def fake_native(tmp_path_factory):
    yield from _running(FakeFleet(tmp_path_factory.mktemp("pd-fake-native"), native=True))


@pytest.fixture
def ff(fake):
    fake.pool.reset()
    yield fake
    for name in PREFILLS + DECODES:
        if fake.pool.workers[name].server is None:
            fake.pool.restart(name)


def posts_by_worker(f: FakeFleet, n_expected: int, tag: str) -> dict:
    """Wait until n_expected POSTs whose body holds `tag` arrived in all (mirrors are asynchronous,
    and may still arrive from an earlier test); {worker: [requests]}."""
    def seen():
        got = {n: [q for q in f.requests(n) if tag.encode() in q["body"]] for n in PREFILLS + DECODES}
        return got if sum(len(v) for v in got.values()) >= n_expected else None
    return wait_until(seen, f"{n_expected} worker requests")


PD_BODIES = [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": MODEL, "prompt": "once upon a time"}),
    ("/generate", {"text": "once upon a time", "sampling_params": {"max_new_tokens": 4}}),
]


@pytest.mark.parametrize("path,body", PD_BODIES)
def test_prefill_gets_the_same_body_and_room_as_decode(ff, path, body):
    check_prefill_and_decode_bodies(ff, path, body)


@pytest.mark.parametrize("path,body", PD_BODIES)
def test_native_build_rewrites_the_body_for_prefill_and_decode(fake_native, path, body):
    """The same through the native build: its body rewrite drains Envoy's request body and
    appends the new one (`drain_body` / `append_body`), which the mirror carries too; a body in
    several chunks (the buffered body) and one in a single chunk alike."""
    fake_native.pool.reset()
    check_prefill_and_decode_bodies(fake_native, path, body)
    check_prefill_and_decode_bodies(fake_native, path, dict(body, padding="x" * 300_000))


def check_prefill_and_decode_bodies(ff, path, body):
    tag = uuid.uuid4().hex
    body = dict(body, user=tag, bootstrap_room=7, bootstrap_host="attacker.example")
    r = ff.client.post(path, body, headers={PREFILL_HEADER: DECODES[0], "x-prefix-router-cluster": PREFILLS[0]})
    assert r.status == 200, r.body
    d = r.decision
    assert r.worker in DECODES and d["decode"] == r.worker, (r.worker, d)
    got = posts_by_worker(ff, 2, tag)
    on_prefill = [(n, q) for n in PREFILLS for q in got[n]]
    on_decode = [(n, q) for n in DECODES for q in got[n]]
    assert len(on_prefill) == 1 and len(on_decode) == 1, got
    (pn, pq), (dn, dq) = on_prefill[0], on_decode[0]
    assert pn == d["worker"] and dn == r.worker
    assert pq["body"] == dq["body"], "the mirror carries the rewritten body byte for byte"
    sent = json.loads(dq["body"])
    assert sent["bootstrap_host"] == "127.0.0.1"
    assert sent["bootstrap_port"] == BOOTSTRAP_PORT
    assert isinstance(sent["bootstrap_room"], int) and 0 <= sent["bootstrap_room"] < 2**63
    assert sent["bootstrap_room"] != 7, "the client's room never reaches a worker"
    assert sent["user"] == tag
    assert dq["body"].count(b'"bootstrap_') == 3, dq["body"]
    # the decode worker saw the cluster header naming it; the client's values were dropped
    assert dq["cluster_header"] == [dn]


def test_rooms_differ_per_request(ff):
    tag = uuid.uuid4().hex
    for i in range(4):
        r = ff.client.post("/v1/completions", {"model": MODEL, "prompt": f"room {tag} {i}"})
        assert r.status == 200
    got = posts_by_worker(ff, 8, tag)
    rooms = [json.loads(q["body"])["bootstrap_room"] for n in DECODES for q in got[n]]
    assert len(rooms) == 4 and len(set(rooms)) == 4, rooms


def test_inflight_returns_to_zero_for_both_roles(ff):
    for i in range(3):
        r = ff.client.post("/v1/chat/completions",
                           {"model": MODEL, "stream": True, "x_events": 3, "x_interval": 0.01,
                            "messages": [{"role": "user", "content": uuid.uuid4().hex}]})
        assert r.status == 200
    g = assert_inflight_zero(ff.envoy)
    for n in PREFILLS + DECODES:
        assert f"prefix_router_inflight_requests_{n}" in g, sorted(g)


def test_body_that_is_not_an_object_is_refused_and_counted(ff):
    before = ff.envoy.stats().get("prefix_router_pd_bad_body", 0)
    r = ff.client.post("/v1/completions", "[1, 2, 3]")
    assert r.status == 400
    assert r.json()["object"] == "error"
    assert ff.envoy.stats().get("prefix_router_pd_bad_body", 0) == before + 1
    assert not any(b"[1, 2, 3]" in q["body"] for n in PREFILLS + DECODES for q in ff.requests(n))


def test_decode_worker_down_fails_over(ff):
    """(Last of this fleet: it leaves a worker ejected.) A dead decode worker: connect failure, Envoy retries on the cluster's fallback (another
    decode worker, same body and room), as for any model's workers."""
    ff.pool.workers[DECODES[0]].close()
    chose_dead = 0
    for i in range(60):
        r = ff.client.post("/v1/completions", {"model": MODEL, "prompt": f"failover {i} {uuid.uuid4().hex}"})
        assert r.status == 200, r.body
        assert r.worker == DECODES[1]
        chose_dead += r.decision["decode"] == DECODES[0]
        if chose_dead >= 2:
            break
    assert chose_dead >= 2, "the filter never chose the dead decode worker: nothing failed over"


# --------------------------------------------------------------------------------------------
# Fleet 2: simulated SGLang PD workers (2 prefill + 2 decode), test shape
# --------------------------------------------------------------------------------------------


class SimWorker:
    def __init__(self, name: str, mode: str, *extra: str):
        self.name = name
        self.port = free_port()
        self.bootstrap_port = free_port() if mode == "prefill" else None
        args = [str(sim_binary()), "--port", str(self.port), "--model", MODEL, "--worker-id", name,
                "--time-scale", "0.05", "--disaggregation-mode", mode,
                "--disaggregation-timeout-s", str(SIM_BOOTSTRAP_TIMEOUT_S), *extra]
        if self.bootstrap_port:
            args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.healthy, f"{name} up")

    def get(self, path: str) -> tuple[int, str]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read().decode()
        finally:
            c.close()

    def healthy(self) -> bool:
        try:
            return self.get("/health")[0] == 200
        except OSError:
            return False

    def metric(self, name: str) -> float:
        return parse_prometheus(self.get("/metrics")[1]).get(f'{name}{{model_name="{MODEL}"}}', 0.0)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class SimFleet:
    def __init__(self, tmp, *extra_gen: str, prefill_args: tuple = ()):
        self.prefill = [SimWorker(f"p{i}", "prefill", *prefill_args) for i in range(2)]
        self.decode = [SimWorker(f"d{i}", "decode") for i in range(2)]
        listener, admin = free_port(), free_port()
        text = run_gen(
            *base_args(listener, admin), "--profile", "test",
            "--pd-model", MODEL,
            "--prefill", ",".join(f"127.0.0.1:{w.port}@{w.bootstrap_port}" for w in self.prefill),
            "--decode", ",".join(f"127.0.0.1:{w.port}" for w in self.decode),
            *extra_gen,
        )
        self.envoy = Envoy(text, listener_port=listener, admin_port=admin, workdir=tmp)
        self.client = Client(listener)

    def close(self):
        self.client.close()
        self.envoy.stop()
        for w in self.prefill + self.decode:
            w.stop()


def _sim_fleet(tmp, *extra_gen: str, prefill_args: tuple = ()):
    """Starts a SimFleet, yields it (its Envoy log goes into failure reports), closes it."""
    f = None
    try:
        f = SimFleet(tmp, *extra_gen, prefill_args=prefill_args)
        f.envoy.start()
    except Exception:
        if f:
            f.close()
        raise
    it_conftest._ACTIVE_STACKS.append(f)
    yield f
    it_conftest._ACTIVE_STACKS.remove(f)
    f.close()


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    yield from _sim_fleet(tmp_path_factory.mktemp("pd-sim"))


def sse_events(body: bytes) -> list:
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_decode_streams_after_the_prefill_worker_hands_over_the_kv(sims):
    system = "You are a careful assistant. " * 60 + uuid.uuid4().hex
    cached = []
    for q in ("first question", "second question"):
        body = {"model": MODEL, "stream": True, "max_tokens": 8, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
        r = sims.client.post("/v1/chat/completions", body)
        assert r.status == 200, r.body
        assert r.worker in ("d0", "d1"), r.worker
        assert r.body.endswith(b"data: [DONE]\n\n")
        ev = sse_events(r.body)
        usage = ev[-1]["usage"]
        assert usage["completion_tokens"] == 8
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev if e["choices"])
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        assert r.decision["decode"] == f"{MODEL}_decode_{r.worker[1:]}", r.decision
    # the second turn went to the prefill worker holding the system prompt: a cache hit there
    assert cached[0] == 0 and cached[1] > 0, cached
    assert_inflight_zero(sims.envoy)
    transfers = sum(w.metric("sglang:kv_transfer_total") for w in sims.prefill)
    assert transfers >= 2


def test_prefill_worker_down_gives_a_counted_error_within_the_bootstrap_timeout(sims):
    """Mirroring cannot cancel the decode request: it waits for KV until its bootstrap timeout,
    then answers 500; the decode worker counts it."""
    for w in sims.prefill:
        w.stop()
    before = sum(w.metric("sglang:num_bootstrap_failed_reqs_total") for w in sims.decode)
    r = sims.client.post("/v1/completions", {"model": MODEL, "prompt": uuid.uuid4().hex, "max_tokens": 2})
    assert r.status == 500, r.body
    msg = r.json()["message"]
    assert "Decode bootstrap failed" in msg and f"timed out after {SIM_BOOTSTRAP_TIMEOUT_S:.1f}s" in msg, msg
    after = sum(w.metric("sglang:num_bootstrap_failed_reqs_total") for w in sims.decode)
    assert after == before + 1
    assert_inflight_zero(sims.envoy)


@pytest.fixture
def polled_sims(tmp_path_factory):
    """A fresh 2+2 simulated PD fleet whose Envoy polls every worker's load (gen --load-poll-ms)."""
    yield from _sim_fleet(tmp_path_factory.mktemp("pd-sim-polled"), "--load-poll-ms", "100")


def test_a_prefill_worker_that_stops_answering_load_polls_gets_no_prefills(polled_sims):
    """With load polling on, a prefill worker whose polls fail is skipped: requests, including
    those whose prefix it held, are prefilled by the live one instead of waiting out the decode
    worker's bootstrap timeout."""
    s = polled_sims
    prompt = "shared document " + uuid.uuid4().hex * 40
    first = s.client.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert first.status == 200, first.body
    holder = first.decision["worker"]
    dead = next(w for w in s.prefill if holder.endswith(w.name[-1]))
    failures = lambda: s.envoy.stats().get("prefix_router_load_poll_failures", 0)  # noqa: E731
    before = failures()
    dead.stop()
    # Several failed rounds (100 ms apart): every VM has re-read the published failure by then
    # (each does once per 50 ms tick).
    wait_until(lambda: failures() >= before + 4, "the poller sees the prefill worker gone")
    for i in range(6):
        p = prompt if i % 2 == 0 else uuid.uuid4().hex * 20
        r = s.client.post("/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2})
        assert r.status == 200, (i, r.body)
        assert r.decision["worker"] != holder, r.decision
    assert_inflight_zero(s.envoy)



@pytest.fixture
def slow_prefill_sims(tmp_path_factory):
    # 50 prompt tokens per simulated second at time scale 0.05: a 1k-token prompt prefills in
    # about 1 s, long enough for its siblings to arrive before its answer is indexed.
    yield from _sim_fleet(tmp_path_factory.mktemp("pd-slow"), prefill_args=("--prefill-tokens-per-sec", "50"))


def test_siblings_that_arrive_before_the_first_answer_follow_its_prefill_worker(slow_prefill_sims):
    """Prompts of one new group (one system prompt, different questions: different conversation
    keys) sent while the first one is still prefilling, on their own connections (so on both
    Envoy threads): the placement shared by the threads (filter/src/placements.rs) sends every
    one to the first one's prefill worker. Without it each picks its own rendezvous worker (all
    nine on one of two workers by chance: 1 in 256)."""
    s = slow_prefill_sims
    system = "You answer questions about this handbook. " + uuid.uuid4().hex * 120
    replies: dict = {}

    def ask(i: int):
        c = Client(s.envoy.listener_port)
        try:
            body = {"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": f"question {i}?"}]}
            replies[i] = c.post("/v1/chat/completions", body)
        finally:
            c.close()

    first = threading.Thread(target=ask, args=(0,))
    first.start()
    time.sleep(0.3)
    siblings = [threading.Thread(target=ask, args=(i,)) for i in range(1, 9)]
    for t in siblings:
        t.start()
    for t in [first] + siblings:
        t.join(timeout=60)
    assert sorted(replies) == list(range(9)), replies
    workers = {i: r.decision["worker"] for i, r in replies.items()}
    assert set(workers.values()) == {workers[0]}, workers
    for i, r in replies.items():
        assert r.status == 200, (i, r.body)
    # Nothing was indexed when they were routed: they followed the placement, not a prefix hit.
    assert replies[0].decision["reason"] == "hash_affinity", replies[0].decision
    assert_inflight_zero(s.envoy)
