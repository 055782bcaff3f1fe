"""Scale-out through real Envoy processes: 3 replicas of one router in front of 6 fake workers.

Each replica is an `envoy/gen` config, built as load/routers.py builds them: loopback listeners, no
rate limit, no stats listener, plus the debug header, its own peer listener, `--peers` naming all
three peer listeners (itself included), one shared `--peer-secret` and `--load-poll-ms 50`. Each
Envoy gets its own `--base-id` (prkit.envoy.Envoy). The fake workers carry the names of gen's worker
clusters (`llama_<i>`), so they answer the filter's load polls (authority = cluster name) with
their in-flight count plus `extra_load`, or with `load_status` when that is not 200.

Two lags matter, and the tests wait for them (with deadlines) instead of sleeping:
  * index records reach a peer within `peers.flush_ms` (100 ms) plus a round trip: before a turn
    goes through another replica, wait until that replica's `records_received` counter has grown
    (its base read *before* the previous turn was sent: the batch is often applied before the
    previous turn's response comes back);
  * a replica's polled load counts a request that has already finished (routed by another
    replica) until its next poll answer (interval + 50 ms tick + answer time). At R = 1 request
    in flight, the load bound `reqs + 1 <= (1 + load_eps)(R + 1)/6 + slack` admits a worker only
    if it is idle, unless it holds more than ~1.4k tokens of the prompt (slack grows with the
    tokens held, policy.slack_full_tokens): such a phantom request moves a short conversation's
    next turn elsewhere. The tests model a client that sends its next turn once the replicas have
    seen the previous one finish (`wait_fresh_load`).

Served-by checks compare the fake worker's `x-worker-id` with the filter's choice (debug header),
except where Envoy itself has marked the chosen worker's host unhealthy (`check_served`).

The replicas keep state across tests (prefix index, counters): every test uses its own random
prompts and measures counter deltas; worker knobs are reset after each test.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import random
import secrets
import shutil
import string
import struct
import threading
import time
import uuid
from collections import Counter

import pytest

from prkit.build import wasm_path
from prkit.client import Client, Reply
from prkit.envoy import Envoy
from prkit.envoy_config import run_gen
from prkit.fake_workers import WorkerPool
from prkit.ports import free_port
from prkit.prom import inflight_gauges
from prkit.wait import wait_until

from . import conftest as it_conftest

MODEL = "llama"
N_WORKERS = 6
REPLICAS = ("A", "B", "C")
POLL_MS = 50
RECORDS_PATH = "/prefix-router/v1/records"
LEGACY_SECRET_HEADER = "x-prefix-router-peer-secret"  # the first protocol's plain secret
FLEET_NAMES = tuple(f"{MODEL}_{i}" for i in range(N_WORKERS))  # gen's worker clusters, in order
FLEET_PORTS: dict = {}  # worker name -> its port (set by the fleet fixture)
# filter/src/peers.rs: "PRr2", sender, sequence, sent_ms (u64 LE each), 16-byte records, then
# HMAC-SHA256 of all that keyed by the shared secret.
BATCH_MAGIC = b"PRr2"
WINDOW_S = 30  # peers.window_s (default)
MAX_BATCH = 4096  # peers.max_batch (default)
BUDGET = 20_000  # peers.max_records_per_s (default)
# Generous: the machine may have 2 cores for 3 Envoys (2 threads each), 6 Python workers and pytest.
DEADLINE_S = 30.0

RX = "prefix_router_peers_records_received"
ANSWERS = "prefix_router_load_poll_answers"
FAILURES = "prefix_router_load_poll_failures"
UNKNOWN = "prefix_router_load_poll_unknown_workers"
SEND_FAILURES = "prefix_router_peers_send_failures"
REJECTED = "prefix_router_peers_requests_rejected"
IGNORED = "prefix_router_peers_records_ignored"
PLACED = "prefix_router_peers_placements_received"
STALE = "prefix_router_peers_batches_stale"
REPLAYED = "prefix_router_peers_batches_replayed"
BAD_MAC = "prefix_router_peers_batches_bad_mac"
OVER_BUDGET = "prefix_router_peers_records_over_budget"


# --------------------------------------------------------------------------------------------
# The fleet: 6 fake workers, 3 gen-configured Envoy replicas that are each other's peers
# --------------------------------------------------------------------------------------------


class Replica:
    def __init__(self, name: str, envoy: Envoy, peer_port: int):
        self.name = name
        self.envoy = envoy
        self.peer_port = peer_port
        self.client = Client(envoy.listener_port)
        self.restarts = 0

    def stat(self, name: str) -> float:
        """One of the filter's metrics now (`envoy.stats_now()`: it reaches Envoy up to 200 ms
        late, its metric flush; callers poll with a deadline, or use `envoy.stats()`)."""
        return self.envoy.stats_now().get(name, 0.0)

    def stop(self):
        self.client.close()
        self.envoy.stop()

    def restart(self):
        """Start the same config again (a fresh base id, the same ports): an empty index."""
        self.restarts += 1
        if self.envoy.log_path.exists():
            shutil.copy(self.envoy.log_path, self.envoy.workdir / f"envoy.log.{self.restarts}")
        self.envoy.start()
        self.client = Client(self.envoy.listener_port)


class Fleet:
    def __init__(self, tmp):
        self.names = list(FLEET_NAMES)
        self.pool = WorkerPool(self.names)
        self.secret = secrets.token_hex(16)
        self.hash_key = secrets.token_hex(32)  # the same on every replica (they exchange hashes)
        self.tmp = tmp
        self.replicas: dict[str, Replica] = {}
        peer_ports = [free_port() for _ in REPLICAS]
        peers = ",".join(f"http://127.0.0.1:{p}" for p in peer_ports)
        workers = ",".join(f"127.0.0.1:{self.pool.ports[n]}" for n in self.names)
        for name, peer_port in zip(REPLICAS, peer_ports):
            listener, admin = free_port(), free_port()
            args = ["--model", f"{MODEL}={workers}",
                    "--listen", f"127.0.0.1:{listener}", "--admin", f"127.0.0.1:{admin}",
                    "--stats-listen", "none", "--rate-limit", "0", "--debug-header",
                    "--wasm", str(wasm_path()), "--load-poll-ms", str(POLL_MS), "--hit-check-ms", "0", "--health-timeout", "10s",
                    "--peers", peers, "--peer-listen", f"127.0.0.1:{peer_port}", "--peer-secret", self.secret,
                    "--hash-key", self.hash_key]
            config = run_gen(*args)
            # gen names the worker clusters <model>_<i> in --model order: the fake workers' names.
            for n in self.names:
                assert f"    - name: {n}\n" in config, n
            assert '"peer_listener": true' in config and '"interval_ms": 50' in config
            d = tmp / f"envoy-{name}"
            d.mkdir()
            envoy = Envoy(config, listener_port=listener, admin_port=admin, workdir=d, concurrency=2)
            self.replicas[name] = Replica(name, envoy, peer_port)

    def start(self):
        FLEET_PORTS.clear()
        FLEET_PORTS.update(self.pool.ports)
        for rep in self.replicas.values():
            rep.envoy.start()
        for rep in self.replicas.values():
            wait_polling(rep)
            # Start-up health checks passed. On a starved machine the first one can time out while
            # the main thread compiles the Wasm module, and Envoy then sends part of a worker's
            # traffic to its fallbacks: hence --health-timeout 10s above.
            for w in self.names:
                wait_until(lambda rep=rep, w=w: primary_health(rep, w) == "healthy",
                         f"replica {rep.name}: {w} healthy in Envoy")
        return self

    def close(self):
        for rep in self.replicas.values():
            rep.stop()
        self.pool.close()

    def reset_workers(self):
        for w in self.pool.workers.values():
            w.extra_load = 0
            w.load_status = 200
            w.load_delay_s = 0.0
            w.delay_s = 0.0

    def live(self) -> list:
        return [r for r in self.replicas.values() if r.envoy.alive()]

    def __getitem__(self, name: str) -> Replica:
        return self.replicas[name]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, request):
    f = Fleet(tmp_path_factory.mktemp("scale-out"))
    try:
        f.start()
    except Exception:
        f.close()
        raise
    # conftest's failure hook appends every registered Envoy's log tail to a failed test's report.
    it_conftest._ACTIVE_STACKS.extend(f.replicas.values())
    yield f
    for rep in f.replicas.values():
        it_conftest._ACTIVE_STACKS.remove(rep)
    f.close()
    if request.session.testsfailed:
        print(f"\nscale-out: Envoy configs and logs kept in {f.tmp}")


@pytest.fixture
def fl(fleet):
    """Per test: worker knobs back to normal (also after a failure); no Wasm VM failed."""
    fleet.reset_workers()
    yield fleet
    fleet.reset_workers()
    for rep in fleet.live():
        check_vm_healthy(rep)


def check_vm_healthy(rep: Replica):
    """With failure_policy FAIL_RELOAD a trapped VM is papered over by a reload: look for it."""
    bad = rep.envoy.wasm_errors()
    assert not bad, f"replica {rep.name}:\n" + "\n".join(bad[:20])


# --------------------------------------------------------------------------------------------
# Waiting for the two lags (module docstring)
# --------------------------------------------------------------------------------------------


def wait_polling(rep: Replica):
    """The replica's elected VM polls: it has had answers from every worker."""
    wait_until(lambda: rep.stat(ANSWERS) >= N_WORKERS, f"replica {rep.name}: first load-poll answers")


def worker_requests(rep: Replica) -> dict:
    """Load polls this Envoy completed to each worker (envoy/gen polls through `<worker>_load`
    clusters, which carry nothing else here: the index self-check's counter reads, which share
    them, are off in these replicas, `--hit-check-ms 0`)."""
    c = rep.envoy.counters(r"cluster\.llama_\d+_load\.upstream_rq_completed")
    return {n: c.get(f"cluster.{n}_load.upstream_rq_completed", 0) for n in FLEET_NAMES}


def wait_fresh_load(reps, polls: int = 3):
    """Until each replica has completed `polls` more load polls of every worker since the call: at least `polls - 1` were sent after the
    call, one interval apart (the no-traffic interval, 500 ms, on a replica without requests), so
    the load the replica publishes (and its VMs read within a 50 ms tick) is newer than
    everything before the call. Envoy's cluster counters have no flush lag, unlike the filter's
    `load_poll.answers` (up to 200 ms late, i.e. several rounds)."""
    reps = list(reps)
    before = {r.name: worker_requests(r) for r in reps}
    for r in reps:
        def fresh(r=r):
            now = worker_requests(r)
            return all(now[n] >= before[r.name][n] + polls for n in now)
        wait_until(fresh, lambda r=r: f"replica {r.name}: {polls} fresh load polls of every worker "
                                    f"(before {before[r.name]}, now {worker_requests(r)})")


def peer_traffic(reps) -> tuple:
    """(batches sent so far, batches in flight) to the peer clusters, over `reps`."""
    total = active = 0
    for r in reps:
        c = r.envoy.counters(r"cluster\.prefix_router_peer_\d+\.upstream_rq_(total|active)")
        total += sum(v for k, v in c.items() if k.endswith("_total"))
        active += sum(v for k, v in c.items() if k.endswith("_active"))
    return total, active


def wait_peers_quiet(reps, quiet_s: float = 0.4):
    """Until no replica has a batch in flight or has started one for `quiet_s` (> flush_ms + tick):
    every record made before the call has reached every live peer."""
    reps = list(reps)
    state = {"last": None, "since": 0.0}

    def quiet():
        now = peer_traffic(reps)
        t = time.monotonic()
        if now != state["last"] or now[1]:
            state["last"], state["since"] = now, t
            return False
        return t - state["since"] >= quiet_s
    wait_until(quiet, lambda: f"peer batches to settle ({state['last']})")


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------

_ALPHABET = string.ascii_letters + string.digits + "     ,.;:-'!?"


def text(n: int) -> str:
    r = random.Random(uuid.uuid4().int)
    return "".join(r.choice(_ALPHABET) for _ in range(n))


def system_prompt(n: int = 2500) -> dict:
    """A fresh system prompt (~40 blocks of 64 bytes) nobody has routed yet."""
    return {"role": "system", "content": f"You are agent {uuid.uuid4().hex}. " + text(n)}


def user(n: int = 1200) -> dict:
    return {"role": "user", "content": f"Task {uuid.uuid4().hex}: " + text(n)}


def chat(messages: list) -> dict:
    return {"model": MODEL, "messages": list(messages), "max_tokens": 16}


def chosen(r: Reply) -> str:
    """The worker the filter chose (debug header)."""
    return r.decision["worker"]


def primary_health(rep: Replica, worker: str) -> str:
    """Envoy's health flags for `worker`'s own host in its cluster ('healthy', '/failed_active_hc',
    '/failed_outlier_check', ...). Other hosts in the cluster are its fallbacks."""
    port = FLEET_PORTS[worker]
    flags = rep.envoy.host_health(worker, f"127.0.0.1:{port}")
    if flags is None:
        raise AssertionError(f"{worker}: its host 127.0.0.1:{port} not in {rep.name}'s /clusters")
    return flags


def check_served(rep: Replica, r: Reply, served: str):
    """The worker that answered (x-worker-id) is the one the filter chose. `served`: 'always';
    'if_healthy' (default): unless Envoy itself has marked the chosen worker's host unhealthy and
    sent the request to one of its cluster's fallbacks (active health checks time out when a
    heavily loaded machine starves the fake workers for seconds: Envoy's business, not the
    filter's); 'never'."""
    if served == "never" or r.worker == chosen(r):
        return
    if served == "if_healthy":
        health = primary_health(rep, chosen(r))
        if health != "healthy":
            print(f"note: {rep.name} chose {chosen(r)} (host {health}), served by fallback {r.worker}")
            return
    raise AssertionError(f"replica {rep.name} chose {chosen(r)} ({r.decision}) but {r.worker} answered")


def send(rep: Replica, messages: list, served: str = "if_healthy") -> Reply:
    """One chat request through `rep`: 200, a decision naming a worker, served by it (check_served)."""
    r = rep.client.post("/v1/chat/completions", chat(messages))
    assert r.status == 200, (rep.name, r.status, r.body[:300])
    assert r.worker in FLEET_NAMES and r.decision.get("worker") in FLEET_NAMES, (rep.name, r.worker, r.decision)
    check_served(rep, r, served)
    return r


def next_turn(messages: list, reply: Reply) -> list:
    """The conversation's next request: everything so far, the assistant's answer, a new question."""
    answer = {"role": "assistant", "content": f"({chosen(reply)}) " + text(400)}
    return [*messages, answer, user(300)]


def send_then_wait_records(src: Replica, messages: list, dst: Replica) -> Reply:
    """Route a turn through `src`, then wait until `dst` has received the records it made."""
    base = dst.stat(RX)  # before sending: the batch often lands before the response comes back
    r = send(src, messages)
    wait_until(lambda: dst.stat(RX) > base, f"replica {dst.name}: records from {src.name} ({r.decision})")
    return r


def records(n: int, model_key: int = 0xFFFF_FFF1) -> bytes:
    """`n` records of a model no replica has (applied as 'ignored')."""
    return b"".join(struct.pack("<IIQ", model_key, 7, random.getrandbits(64)) for _ in range(n))


def batch(secret: str, n: int, *, sender: int | None = None, seq: int = 1, sent_ms: int | None = None) -> bytes:
    """A signed record batch, as a replica sends it: a fresh random sender unless given, the
    sender's sequence number, its wall clock (now unless given), `n` records, the MAC."""
    sender = random.getrandbits(64) if sender is None else sender
    sent_ms = int(time.time() * 1000) if sent_ms is None else sent_ms
    signed = BATCH_MAGIC + struct.pack("<QQQ", sender, seq, sent_ms) + records(n)
    return signed + hmac.new(secret.encode(), signed, hashlib.sha256).digest()


def refusals_logged(rep: Replica, details: str) -> int:
    """Lines of the peer listener's access log (refused requests only) with this reason."""
    n = 0
    for line in rep.envoy.log_text().splitlines():
        if line.startswith("{") and '"details"' in line:
            try:
                n += json.loads(line).get("details") == details
            except ValueError:
                pass
    return n


def post_peer(port: int, body: bytes, headers: dict, method: str = "POST", path: str = RECORDS_PATH) -> Reply:
    c = Client(port)
    try:
        return c.request(method, path, body, {"content-type": "application/octet-stream", **headers})
    finally:
        c.close()


# --------------------------------------------------------------------------------------------
# 1. Shared placement: a conversation keeps its worker whichever replica a turn goes through
# --------------------------------------------------------------------------------------------


def test_conversation_keeps_its_worker_across_replicas(fl):
    A, B, C = fl["A"], fl["B"], fl["C"]
    order = [A, B, C]
    sysm = system_prompt()
    K = 6
    convs = [[sysm, user()] for _ in range(K)]

    # Turn 1 of K conversations sharing one system prompt, at the same time, conversation k through
    # replica k % 3 (conversation 0 through A), each held 0.3 s by its worker. The contrast that
    # makes the rest meaningful: they do not all go to one worker (the load bound spills the
    # system prompt's holder; replicas that have not heard of it yet hash each conversation).
    fl.pool.set_delay(0.3)
    first: list = [None] * K
    errors: list = []
    gate = threading.Barrier(K)

    def turn1(k):
        c = Client(order[k % 3].envoy.listener_port)
        try:
            gate.wait()
            first[k] = c.post("/v1/chat/completions", chat(convs[k]))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
        finally:
            c.close()

    threads = [threading.Thread(target=turn1, args=(k,)) for k in range(K)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    fl.pool.set_delay(0.0)
    assert not errors, errors
    assert all(r is not None and r.status == 200 and r.decision for r in first), first
    for k, r in enumerate(first):
        check_served(order[k % 3], r, "if_healthy")
    placed = Counter(chosen(r) for r in first)
    assert len(placed) >= 2, f"{K} conversations on one system prompt all went to one worker: {placed}"

    # Every turn-1 record has reached every replica; every replica has seen the workers go idle.
    wait_peers_quiet(order)
    wait_fresh_load(order)

    # Turns 2 and 3, one conversation at a time: conversation k's turn 2 through replica k+1, its
    # turn 3 through replica k+2 (conversation 0: A, B, C). None of those replicas routed an earlier
    # turn of it: what they know of it came from peers.
    for k in range(K):
        r1 = first[k]
        src2, src3 = order[(k + 1) % 3], order[(k + 2) % 3]
        msgs2 = next_turn(convs[k], r1)
        r2 = send_then_wait_records(src2, msgs2, src3)
        wait_fresh_load([src3])
        msgs3 = next_turn(msgs2, r2)
        r3 = send(src3, msgs3)
        wait_fresh_load(order)  # before the next conversation's turn 2
        d2, d3 = r2.decision, r3.decision
        info = f"conversation {k}: turn 1 {r1.decision} via {order[k % 3].name}, turn 2 {d2} via {src2.name}, turn 3 {d3} via {src3.name}"
        assert chosen(r1) == chosen(r2) == chosen(r3), info
        # Without peers this replica would have hashed turn 2 to the same worker (reason
        # hash_affinity): prefix_hit says it found the conversation's turn 1 in its index.
        assert d2["reason"] == "prefix_hit" and d3["reason"] == "prefix_hit", info
        assert 0 < d2["matched"] <= d2["total"] and d3["matched"] <= d3["total"], info
        # Turn 3 matched deeper than turn 1 ended: the end of turn 2, which only src2 recorded.
        assert d3["matched"] > d2["matched"], info


# --------------------------------------------------------------------------------------------
# 2. Polled load: a worker with a deep queue (traffic no replica routed) gets no new conversations
# --------------------------------------------------------------------------------------------


def test_worker_with_deep_polled_queue_gets_no_new_conversations(fl):
    reps = [fl["A"], fl["B"], fl["C"]]
    sysm = system_prompt()
    wait_fresh_load(reps)

    # Control: with idle workers, new conversations on this system prompt go to its holder (the
    # worker of the first one): that is the worker we are about to load.
    owner = chosen(send(reps[0], [sysm, user()]))
    wait_peers_quiet(reps)
    for rep in reps:
        wait_fresh_load(reps)
        r = send(rep, [sysm, user()])
        assert chosen(r) == owner and r.decision["reason"] == "prefix_hit", (rep.name, owner, r.decision)
    wait_peers_quiet(reps)

    # 40 requests queued on the owner that no replica routed: only the polls can know of them.
    before = {r.name: r.stat(ANSWERS) for r in reps}
    fl.pool.workers[owner].extra_load = 40
    wait_fresh_load(reps)
    for r in reps:
        wait_until(lambda r=r: r.stat(ANSWERS) > before[r.name], f"replica {r.name}: load_poll.answers grows")

    got = []
    for i in range(21):
        rep = reps[i % 3]
        r = send(rep, [sysm, user()])
        got.append((rep.name, chosen(r), r.decision["reason"]))
    on_owner = [g for g in got if g[1] == owner]
    assert not on_owner, f"{owner} (40 queued) still got new conversations: {got}"

    # Queue drained: the owner gets new conversations again. Fresh system prompts, hashed over
    # all workers: the 21 conversations above may have made up to five other workers holders of
    # `sysm`, and an index entry keeps four (the least recent one, the owner, can be gone).
    fl.pool.workers[owner].extra_load = 0
    wait_fresh_load(reps)
    seen = decided_for(reps, owner)
    assert seen[-1] == owner, f"{owner} got none of {len(seen)} new conversations after its queue drained: {Counter(seen)}"


# --------------------------------------------------------------------------------------------
# 3. Degrades gracefully
# --------------------------------------------------------------------------------------------


def test_dead_peer_costs_no_requests(fl):
    A, B, C = fl["A"], fl["B"], fl["C"]
    wait_peers_quiet([A, B, C])
    base_fail = {r.name: r.stat(SEND_FAILURES) for r in (A, B)}
    base_rx_b = B.stat(RX)
    C.stop()
    try:
        sysm = system_prompt(600)
        for i in range(12):
            rep = (A, B)[i % 2]
            send(rep, [sysm, user(400)])  # 200 and a decision, checked in send()
        # Each replica's batches to C's peer listener fail (connection refused) and are counted;
        # A and B still exchange records.
        for r in (A, B):
            wait_until(lambda r=r: r.stat(SEND_FAILURES) > base_fail[r.name],
                     f"replica {r.name}: peers.send_failures grows while C is down")
        wait_until(lambda: B.stat(RX) > base_rx_b, "B still receives A's records")
        refused = A.envoy.counters(r"cluster\.prefix_router_peer_2\.upstream_cx_connect_fail")
        assert sum(refused.values()) > 0, refused
    finally:
        C.restart()
    wait_polling(C)
    for w in fl.names:
        wait_until(lambda w=w: primary_health(C, w) == "healthy", f"restarted C: {w} healthy in Envoy")
    # Back: C routes, and records reach it again.
    base_rx_c = C.stat(RX)
    send_then_wait_records(A, [system_prompt(600), user(400)], C)
    assert C.stat(RX) > base_rx_c
    send(C, [system_prompt(600), user(400)])


def wait_unknown(fleet: Fleet, reps, worker: str, knob: str, value):
    """Set a load-endpoint knob of `worker`; wait until every replica in `reps` counts poll
    failures and reports an unknown worker."""
    base = {r.name: r.stat(FAILURES) for r in reps}
    setattr(fleet.pool.workers[worker], knob, value)
    for r in reps:
        wait_until(lambda r=r: r.stat(FAILURES) > base[r.name], f"replica {r.name}: load_poll.failures grows")
        wait_until(lambda r=r: r.stat(UNKNOWN) >= 1, f"replica {r.name}: load_poll.unknown_workers > 0")


def decided_for(reps, worker: str, served: str = "if_healthy", messages=None, tries: int = 60) -> list:
    """New requests, round robin over `reps`, until the filter chooses `worker` (at most `tries`);
    returns the choices. Default requests: a fresh system prompt each (hashed over all workers),
    so a worker is missed `tries` times in a row with probability ~(1 - 1/6)^60 = 2e-5."""
    seen: list = []
    make = messages or (lambda: [system_prompt(600), user(400)])

    def routed_there():
        r = send(reps[len(seen) % len(reps)], make(), served)
        seen.append(chosen(r))
        return seen[-1] == worker or len(seen) >= tries
    wait_until(routed_there, f"a new request routed to {worker}", every_s=0.0)
    return seen


def test_slow_load_endpoint_counts_as_unknown_and_the_worker_still_serves(fl):
    reps = [fl["A"], fl["B"], fl["C"]]
    slow = fl.names[0]
    # Answers after the filter's 250 ms poll timeout (a worker too busy to answer in time).
    wait_unknown(fl, reps, slow, "load_delay_s", 0.4)
    for i in range(6):
        send(reps[i % 3], [system_prompt(600), user(400)])
    seen = decided_for(reps, slow)
    assert seen[-1] == slow, f"{slow} (slow load endpoint) got none of {len(seen)} new prompts: {Counter(seen)}"
    fl.pool.workers[slow].load_delay_s = 0.0
    for r in reps:
        wait_until(lambda r=r: r.stat(UNKNOWN) == 0, f"replica {r.name}: load_poll.unknown_workers back to 0")


def test_load_endpoint_answering_500_counts_as_unknown_not_idle(fl):
    reps = [fl["A"], fl["B"], fl["C"]]
    broken = fl.names[-1]
    wait_unknown(fl, reps, broken, "load_status", 500)
    assert fl.pool.workers[broken].stats.polls > 0
    # Requests still route, through every replica. (Not necessarily served by the worker the
    # filter chose: the polls' 500s get that worker's host ejected by outlier detection, see
    # test_load_endpoint_errors_do_not_eject_the_worker.)
    for i in range(9):
        send(reps[i % 3], [system_prompt(600), user(400)], served="never")
    # Unknown counts as the mean of the known workers, not as excluded: new prompts still go there.
    seen = decided_for(reps, broken, served="never")
    assert seen[-1] == broken, f"{broken} (load endpoint 500) chosen for none of {len(seen)} new prompts: {Counter(seen)}"


def test_load_endpoint_errors_do_not_eject_the_worker(fl):
    """Polls go through `<worker>_load` clusters (envoy/gen): a failing load endpoint's 5xx never
    reach the worker cluster's outlier detection."""
    A = fl["A"]
    broken = fl.names[-1]
    wait_unknown(fl, [A], broken, "load_status", 500)
    wait_fresh_load([A])  # a few more failed polls
    ejected = A.envoy.counters(rf"cluster\.{broken}\.outlier_detection\.ejections_enforced_total")
    assert sum(ejected.values()) == 0, ejected
    seen = decided_for([A], broken, served="always")
    assert seen[-1] == broken, Counter(seen)


def test_peer_listener_accepts_only_authenticated_batches(fl):
    A = fl["A"]
    wait_peers_quiet(fl.live())
    s0 = A.envoy.stats()  # one metric flush period later: nothing pending
    rx0, rej0, ign0, mac0 = (s0.get(k, 0) for k in (RX, REJECTED, IGNORED, BAD_MAC))

    body = batch(fl.secret, 3)
    flipped = bytearray(body)
    flipped[40] ^= 0x01  # a record byte: the MAC no longer matches
    wrong = secrets.token_hex(16)  # same length as the real one
    legacy = b"PRr1" + records(3)  # the first protocol: plain secret in a header, no MAC
    refused = [
        post_peer(A.peer_port, bytes(flipped), {}),
        post_peer(A.peer_port, batch(wrong, 3), {}),
        post_peer(A.peer_port, legacy, {LEGACY_SECRET_HEADER: fl.secret}),
        post_peer(A.peer_port, body, {}, method="PUT"),
        post_peer(A.peer_port, body, {}, path="/prefix-router/v1/other"),
        post_peer(A.peer_port, None, {}, method="GET", path="/stats"),
        post_peer(A.peer_port, body[:-1], {}),  # not a batch at all (ragged): 400
    ]
    want = [403] * (len(refused) - 1) + [400]
    assert [r.status for r in refused] == want, [(r.status, r.body[:100]) for r in refused]
    wait_until(lambda: A.stat(REJECTED) >= rej0 + len(refused), "peers.requests_rejected counts the refusals")
    s1 = A.envoy.stats()
    assert s1.get(RX, 0) == rx0, "a refused batch was applied"
    assert s1.get(BAD_MAC, 0) == mac0 + 3, (mac0, s1.get(BAD_MAC))  # the old protocol's too
    # Each refusal is one access log line of the peer listener, with the filter's reason.
    wait_until(lambda: refusals_logged(A, "prefix_router_peer_bad_mac") >= 2
             and refusals_logged(A, "prefix_router_peer_old_protocol") >= 1, "refusals in the access log")

    # The batch itself, untouched, is accepted: 3 records received, ignored (a model this fleet
    # lacks).
    ok = post_peer(A.peer_port, body, {})
    assert ok.status == 204, (ok.status, ok.body[:200])
    wait_until(lambda: A.stat(RX) >= rx0 + 3, "the accepted batch's records")
    s2 = A.envoy.stats()
    assert (s2.get(RX, 0), s2.get(IGNORED, 0)) == (rx0 + 3, ign0 + 3), (rx0, ign0, s2.get(RX), s2.get(IGNORED))

    # Replayed within the window: refused, whichever worker thread of the peer listener gets it.
    for _ in range(3):
        again = post_peer(A.peer_port, body, {})
        assert again.status == 403, (again.status, again.body[:200])
    wait_until(lambda: refusals_logged(A, "prefix_router_peer_replay") >= 3, "replays in the access log")
    assert A.envoy.stats().get(RX, 0) == rx0 + 3, "a replayed batch was applied"

    # On the client listener the records path is outside the public route: Envoy's own 404, no
    # worker sees it, and nothing is applied.
    r = A.client.post(RECORDS_PATH, body, {"content-type": "application/octet-stream"})
    assert r.status == 404 and r.worker is None, (r.status, r.headers)
    assert A.envoy.stats().get(RX, 0) == rx0 + 3, "the client listener applied a record batch"


def test_a_batch_replayed_after_the_window_is_refused(fl):
    """A batch sent 1.5 s before the end of its window is accepted; replayed once the window has
    passed it is refused as stale (and would be as a replay too). B must have been up for the
    whole window: a receiver refuses batches sent before it started (peers.rs, init_table)."""
    B = fl["B"]
    uptime = lambda: B.envoy.counters(r"server\.uptime").get("server.uptime", 0)  # noqa: E731
    wait_until(lambda: uptime() > WINDOW_S, f"replica B up for more than {WINDOW_S} s", WINDOW_S + 30, 0.5)
    s0 = B.envoy.stats()
    rx0, stale0 = s0.get(RX, 0), s0.get(STALE, 0)
    body = batch(fl.secret, 2, sent_ms=int(time.time() * 1000) - (WINDOW_S * 1000 - 1500))
    first = post_peer(B.peer_port, body, {})
    assert first.status == 204, (first.status, first.body[:200])
    time.sleep(2.0)
    late = post_peer(B.peer_port, body, {})
    assert late.status == 403, (late.status, late.body[:200])
    # A batch from too far in the future is refused as well.
    ahead = post_peer(B.peer_port, batch(fl.secret, 2, sent_ms=int(time.time() * 1000) + (WINDOW_S + 5) * 1000), {})
    assert ahead.status == 403, (ahead.status, ahead.body[:200])
    wait_until(lambda: B.stat(STALE) >= stale0 + 2, "peers.batches_stale counts both")
    assert B.envoy.stats().get(RX, 0) == rx0 + 2, "only the first delivery was applied"
    wait_until(lambda: refusals_logged(B, "prefix_router_peer_stale") >= 2, "stale batches in the access log")


def test_a_flood_from_one_sender_is_cut_at_its_budget(fl):
    """One sender posting full batches as fast as it can: what is applied stays within its
    budget (BUDGET records a second, one second deep), the rest is refused with 429 and counted."""
    C = fl["C"]
    wait_peers_quiet(fl.live())
    s0 = C.envoy.stats()
    rx0, over0 = s0.get(RX, 0), s0.get(OVER_BUDGET, 0)
    sender = random.getrandbits(64)
    statuses = []
    sent = 0
    c = Client(C.peer_port)
    t0 = time.monotonic()
    try:
        for seq in range(1, 41):
            r = c.request("POST", RECORDS_PATH, batch(fl.secret, MAX_BATCH, sender=sender, seq=seq),
                          {"content-type": "application/octet-stream"})
            statuses.append(r.status)
            sent += MAX_BATCH
    finally:
        c.close()
    elapsed = time.monotonic() - t0
    assert set(statuses) <= {204, 429}, Counter(statuses)
    assert statuses[0] == 204 and 429 in statuses, Counter(statuses)
    wait_until(lambda: C.stat(RX) + C.stat(OVER_BUDGET) >= rx0 + over0 + sent, "every record applied or cut")
    s1 = C.envoy.stats()
    got, cut = s1.get(RX, 0) - rx0, s1.get(OVER_BUDGET, 0) - over0
    assert got + cut == sent, (got, cut, sent)
    assert got <= BUDGET * (1 + elapsed) + 1, f"{got} records applied in {elapsed:.2f} s"
    wait_until(lambda: refusals_logged(C, "prefix_router_peer_over_budget") >= statuses.count(429),
             "one access log line per batch cut")


# --------------------------------------------------------------------------------------------
# 4. A new prompt's placement reaches the other replicas before its answer is indexed
# --------------------------------------------------------------------------------------------


def test_a_sibling_through_another_replica_follows_a_new_document_still_in_flight(fl):
    """A new document's first question is still being answered through A (nothing indexed
    anywhere yet); a second question on it reaches B. A's placement of the first reached B
    through the peers, so B sends the second where the document is being computed. Without it
    B would place the question by its own conversation key: one of six workers. (Late in the
    module: the documents' tokens stay in A's placement footprint for a while and steer A's new
    prompts away from their workers; the tests that count where new prompts land come before.)"""
    A, B = fl["A"], fl["B"]
    fl.pool.set_delay(1.5)
    try:
        for g in range(4):
            wait_fresh_load([A, B])
            doc = system_prompt(40_000)  # ~10k tokens: a holder's full load slack
            out: dict = {}

            def first(doc=doc, out=out):
                c = Client(A.envoy.listener_port)
                try:
                    out["a"] = c.post("/v1/chat/completions", chat([doc, user()]))
                finally:
                    c.close()

            base = B.stat(PLACED)
            t = threading.Thread(target=first)
            t.start()
            wait_until(lambda: B.stat(PLACED) > base, f"group {g}: B hears of A's placement")
            assert t.is_alive(), "the first question was answered before the second was sent"
            rb = send(B, [doc, user()])
            t.join(timeout=60)
            ra = out.get("a")
            assert ra is not None and ra.status == 200 and ra.decision, ra
            check_served(A, ra, "if_healthy")
            info = f"group {g}: A {ra.decision}, B {rb.decision}"
            assert rb.decision["matched"] == 0, f"B found it indexed: nothing tested ({info})"
            assert chosen(rb) == chosen(ra), info
    finally:
        fl.pool.set_delay(0.0)


# --------------------------------------------------------------------------------------------
# 5. In-flight accounting returns to 0 on every replica
# --------------------------------------------------------------------------------------------


def test_inflight_returns_to_zero_on_every_replica(fl):
    reps = [fl["A"], fl["B"], fl["C"]]
    assert all(r.envoy.alive() for r in reps)
    # A last burst through all replicas at once: overlapping requests, streams, and streams the
    # client abandons half way.
    fl.pool.set_delay(0.05)
    errors: list = []

    def run(k):
        rep = reps[k % 3]
        c = Client(rep.envoy.listener_port)
        try:
            for j in range(4):
                body = chat([system_prompt(300), user(200)])
                if j % 2:
                    body.update(stream=True, x_events=4, x_interval=0.03)
                r = c.post("/v1/chat/completions", body)
                if r.status != 200:
                    errors.append((rep.name, r.status))
            # abandoned stream: headers read, then the connection is closed
            conn = http.client.HTTPConnection("127.0.0.1", rep.envoy.listener_port, timeout=30)
            b = chat([system_prompt(300), user(200)])
            b.update(stream=True, x_events=20, x_interval=0.05)
            conn.request("POST", "/v1/chat/completions", json.dumps(b), {"content-type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                errors.append((rep.name, resp.status))
            resp.read(10)
            conn.close()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
        finally:
            c.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors

    gauges = {}

    def zero():
        for r in reps:
            g = inflight_gauges(r.envoy.stats_now())
            gauges[r.name] = {k: v for k, v in g.items() if v}
            if len(g) != 2 * N_WORKERS or gauges[r.name]:
                return False
        return True
    wait_until(zero, lambda: f"in-flight gauges back to 0 on every replica; non-zero: {gauges}")
