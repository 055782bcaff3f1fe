"""Routing behaviour through the real Envoy: affinity, bounded load, spread, chat and all APIs."""

from __future__ import annotations

import math
import queue
import re
import threading
from collections import Counter

from prkit.client import Client
from prkit.envoy import wait_inflight_zero
from prkit.prom import delta
from prkit.wait import wait_until

from . import workload as wl
from .test_queued_prefill import fresh_load

MODEL = "llama"


def _text_blocks(stack, n_chars: int) -> int:
    return n_chars // int(stack.plugin.get("text_block_bytes", 64))


def _covers(matched: int, shared_blocks: int) -> bool:
    """The index records prompts at checkpoint depths (1, 2, 3, 4, 6, 8, 12, 16, 24, ... blocks;
    filter/src/blocks.rs), so a shared prefix of `shared_blocks` full blocks is reported as the
    deepest checkpoint within it: never less than 2/3 of it, and at least 1 block."""
    return 3 * matched >= 2 * shared_blocks and (shared_blocks == 0 or matched >= 1)


def connections_per_envoy_worker(stack) -> dict:
    """{envoy worker thread id: downstream connections accepted so far} for the listener."""
    out = {}
    for k, v in stack.envoy.stats().items():
        if k.startswith("envoy_listener_worker_downstream_cx_total{"):
            m = re.search(r'envoy_worker_id="(\d+)"', k)
            if m and f"_{stack.envoy.listener_port}\"" in k:
                out[m.group(1)] = v
    return out


def test_shared_prefix_sequential_stays_on_one_worker(env, client):
    r = wl.rng("seq")
    prefix = wl.text(r, 4096)
    replies = []
    cx_before = connections_per_envoy_worker(env)
    for i in range(200):
        body = {"model": MODEL, "prompt": prefix + f" Question {i}: " + wl.text(r, 120), "max_tokens": 8}
        if i % 2:
            rep = client.post("/v1/completions", body)  # one keep-alive connection
        else:
            fresh = Client(env.envoy.listener_port)  # new connections land on either Envoy thread
            rep = fresh.post("/v1/completions", body)
            fresh.close()
        assert rep.status == 200, rep.body
        replies.append(rep)
    # Both Envoy worker threads (two Wasm VMs) routed some of these: the prefix index and the load
    # vector are shared between them, so the choice must not depend on the thread.
    cx = delta(connections_per_envoy_worker(env), cx_before)
    assert len([v for v in cx.values() if v > 0]) == 2, cx

    workers = Counter(rep.worker for rep in replies)
    assert len(workers) == 1, f"sequential shared-prefix requests split over workers: {workers}"
    assert env.pool.counts()[replies[0].worker] == 200
    # The debug header agrees with the worker that answered, and explains the decision.
    assert all(rep.decision.get("worker") == rep.worker for rep in replies)
    assert replies[0].decision["reason"] == "hash_affinity", replies[0].decision
    shared = _text_blocks(env, len(prefix))
    for rep in replies[1:]:
        d = rep.decision
        assert d["reason"] == "prefix_hit", d
        assert d["matched"] <= d["total"], d
        assert _covers(d["matched"], shared), (shared, d)


def test_a_follow_up_matches_its_previous_prompt_between_checkpoints(env, client):
    """A prompt of 121 blocks is recorded at its checkpoints (deepest 96) and at the
    sub-checkpoints of its top gap (104, 112, 120): a follow-up that extends it by two blocks
    matches 120 of them, where the checkpoints alone would say 96."""
    r = wl.rng("follow-up between checkpoints")
    block = int(env.plugin.get("text_block_bytes", 64))
    first = wl.text(r, 121 * block)
    follow = first + wl.text(r, 2 * block)
    a = client.post("/v1/completions", {"model": MODEL, "prompt": first, "max_tokens": 8})
    assert a.status == 200, a.body
    b = client.post("/v1/completions", {"model": MODEL, "prompt": follow, "max_tokens": 8})
    assert b.status == 200, b.body
    d = b.decision
    assert (d["reason"], b.worker) == ("prefix_hit", a.worker), d
    assert d["total"] >= 123 and 8 * d["matched"] >= 7 * 121 and d["matched"] <= 121, d
    assert d["held"] == d["matched"], d


def test_a_follow_up_sent_while_its_previous_turn_waits_matches_that_turn(env, client):
    """A conversation's second turn extends its first on the worker that answered it, and waits
    there (the worker holds it: its prefill is queued). The third turn, sent meanwhile, matches
    the second turn's prompt on that worker, not only the first's: the second turn's records
    are written at its decision, not at its answer."""
    r = wl.rng("follow-up while queued")
    block = int(env.plugin.get("text_block_bytes", 64))
    t1 = wl.text(r, 40 * block)
    t2 = t1 + wl.text(r, 40 * block)
    t3 = t2 + wl.text(r, 4 * block)
    a = client.post("/v1/completions", {"model": MODEL, "prompt": t1, "max_tokens": 8})
    assert a.status == 200, a.body
    # The holder reports its capacity: under it, only the cost can move a follow-up (with none
    # known the fleet-relative load bound decides, and a busy machine's timing with it).
    holder = env.pool.workers[a.worker]
    holder.capacity = 64
    try:
        fresh_load(env)
        _follow_up_while_queued(env, a, t2, t3)
    finally:
        holder.capacity = 0


def _follow_up_while_queued(env, a, t2: str, t3: str):
    results: dict = {}

    def send(name: str, prompt: str):
        c = Client(env.envoy.listener_port)
        try:
            results[name] = c.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8})
        finally:
            c.close()

    seen = sum(env.pool.counts().values())
    env.pool.hold()
    threads = []
    try:
        for k, (name, prompt) in enumerate((("t2", t2), ("t3", t3)), start=1):
            threads.append(threading.Thread(target=send, args=(name, prompt)))
            threads[-1].start()
            wait_until(lambda k=k: sum(env.pool.counts().values()) >= seen + k, f"{name} at its worker")
    finally:
        env.pool.release()
    for t in threads:
        t.join(timeout=60)
    b, c = results["t2"], results["t3"]
    assert (b.status, c.status) == (200, 200), (b.body, c.body)
    assert b.worker == a.worker == c.worker, (a.worker, b.worker, c.worker)
    d2, d3 = b.decision, c.decision
    assert d3["reason"] == "prefix_hit" and d3["matched"] > d2["matched"], (d2, d3)
    assert _covers(d3["matched"], _text_blocks(env, len(t2))), (d2, d3)


def test_shared_prefix_concurrent_spills_within_load_bound(env):
    r = wl.rng("conc")
    prefix = wl.text(r, 4096)
    bodies = [
        {"model": MODEL, "prompt": prefix + f" Q{i}: " + wl.text(r, 120), "max_tokens": 8} for i in range(201)
    ]
    # Warm-up: establishes the prefix owner.
    warm = Client(env.envoy.listener_port)
    first = warm.post("/v1/completions", bodies[0])
    warm.close()
    assert first.status == 200
    owner = first.worker
    env.pool.reset()

    C = 32
    env.pool.set_delay(0.05)
    jobs: queue.Queue = queue.Queue()
    for b in bodies[1:]:
        jobs.put(b)
    results, errors = [], []
    lock = threading.Lock()
    start = threading.Barrier(C)

    def run():
        c = Client(env.envoy.listener_port)
        try:
            start.wait()
            while True:
                try:
                    b = jobs.get_nowait()
                except queue.Empty:
                    return
                rep = c.post("/v1/completions", b)
                with lock:
                    results.append(rep)
        except Exception as e:  # noqa: BLE001 - surfaced below
            with lock:
                errors.append(repr(e))
        finally:
            c.close()

    threads = [threading.Thread(target=run) for _ in range(C)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    env.pool.set_delay(0.0)
    assert not errors, errors[:5]
    assert len(results) == 200 and all(rep.status == 200 for rep in results)

    n = len(env.names)
    eps = env.load_eps
    # The filter's bound: in-flight + 1 <= (1 + eps) * (R + 1) / n + slack, with R + 1 <= C.
    bound = math.ceil((1 + eps) * C / n + env.load_slack - 1) + 2
    counts, peaks = env.pool.counts(), env.pool.max_inflight()
    reasons = Counter(rep.decision.get("reason") for rep in results)
    info = f"counts={counts} peaks={peaks} reasons={reasons} bound={bound}"
    assert sum(counts.values()) == 200, info
    assert max(peaks.values()) <= bound, info
    assert sum(1 for v in counts.values() if v) > 1, info
    assert counts[owner] == max(counts.values()), info
    assert reasons["load_spill"] > 0, info
    assert set(reasons) <= {"prefix_hit", "load_spill", "hash_affinity"}, info

    gauges = wait_inflight_zero(env.envoy)
    assert gauges and all(v == 0 for v in gauges.values()), gauges


def test_distinct_prefixes_spread_over_all_workers(env, client):
    r = wl.rng("spread")
    seen = Counter()
    for i in range(64):
        rep = client.post("/v1/completions", {"model": MODEL, "prompt": wl.text(r, 2048), "max_tokens": 8})
        assert rep.status == 200
        assert rep.decision["reason"] == "hash_affinity", rep.decision
        seen[rep.worker] += 1
    assert set(seen) == set(env.names), seen
    assert max(seen.values()) <= 2 * min(seen.values()), seen


def test_multi_turn_chat_stays_on_its_worker(env, client):
    r = wl.rng("chat")
    convs = [[{"role": "system", "content": wl.text(r, 1500)}] for _ in range(4)]
    served = [[] for _ in convs]
    for turn in range(5):
        for k, msgs in enumerate(convs):
            msgs.append({"role": "user", "content": f"turn {turn}: " + wl.text(r, 200)})
            c = Client(env.envoy.listener_port)  # a new connection per turn, as chat UIs do
            rep = c.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 16})
            c.close()
            assert rep.status == 200, rep.body
            served[k].append(rep)
            msgs.append({"role": "assistant", "content": wl.text(r, 300)})
    for k, reps in enumerate(served):
        assert len({rep.worker for rep in reps}) == 1, (k, [rep.decision for rep in reps])
        assert reps[0].decision["reason"] == "hash_affinity", reps[0].decision
        for prev, rep in zip(reps, reps[1:]):
            d = rep.decision
            assert d["reason"] == "prefix_hit", d
            # The whole previous turn is a prefix of this one: its full blocks are shared.
            assert _covers(d["matched"], prev.decision["total"] - 1), (prev.decision, d)


def _assert_sticky(reps):
    assert all(rep.status == 200 for rep in reps), [rep.body for rep in reps]
    assert len({rep.worker for rep in reps}) == 1, [rep.decision for rep in reps]
    assert all(rep.decision.get("reason") == "prefix_hit" for rep in reps[1:]), [rep.decision for rep in reps]


def test_completions_string_prompt_is_sticky(env, client):
    r = wl.rng("cmpl-str")
    prefix = wl.text(r, 3000)
    _assert_sticky(
        [client.post("/v1/completions", {"model": MODEL, "prompt": prefix + wl.text(r, 80)}) for _ in range(6)]
    )


def test_completions_token_prompt_is_sticky(env, client):
    r = wl.rng("cmpl-tok")
    prefix = wl.tokens(r, 1024)
    reps = [client.post("/v1/completions", {"model": MODEL, "prompt": prefix + wl.tokens(r, 40)}) for _ in range(6)]
    _assert_sticky(reps)
    tb = int(env.plugin.get("token_block_size", 16))
    assert all(_covers(rep.decision["matched"], 1024 // tb) for rep in reps[1:]), [rep.decision for rep in reps]


def test_generate_text_is_sticky(env, client):
    r = wl.rng("gen-text")
    prefix = wl.text(r, 3000)
    reps = [client.post("/generate", {"text": prefix + wl.text(r, 80), "sampling_params": {"max_new_tokens": 8}})
            for _ in range(4)]
    reps.append(client.request("PUT", "/generate", {"text": prefix + wl.text(r, 80)}))
    _assert_sticky(reps)


def test_generate_input_ids_is_sticky(env, client):
    r = wl.rng("gen-ids")
    prefix = wl.tokens(r, 1024)
    _assert_sticky(
        [client.post("/generate", {"input_ids": prefix + wl.tokens(r, 40)}) for _ in range(6)]
    )


def test_chunked_request_body_routes_like_a_plain_one(env, client):
    """A body arriving in several chunks (several on_http_request_body calls) is routed on the whole."""
    r = wl.rng("chunked")
    prefix = wl.text(r, 3000)
    first = client.post("/v1/completions", {"model": MODEL, "prompt": prefix + "A"})
    assert first.status == 200
    import json as _json

    body = _json.dumps({"model": MODEL, "prompt": prefix + "B"}).encode()
    parts = [body[i : i + 700] for i in range(0, len(body), 700)]
    rep = client.request_chunked("POST", "/v1/completions", parts)
    assert rep.status == 200, rep.body
    assert rep.worker == first.worker, (first.decision, rep.decision)
    assert rep.decision["reason"] == "prefix_hit", rep.decision
    assert rep.json()["body_len"] == len(body)


def test_shuffled_prefix_groups_under_concurrency(env):
    """The bench_serving 'generated-shared-prefix' shape in small: 8 groups x 20 prompts, shuffled,
    16 concurrent clients. A group lands on a worker that does not hold it only by its first
    request (hash_affinity) or by a load spill, so distinct (worker, group) pairs are bounded by
    groups + spills; and the load bound holds throughout."""
    r = wl.rng("groups")
    groups, per_group, C = 8, 20, 16
    prefixes = [wl.text(r, 2000) for _ in range(groups)]
    jobs_list = [(g, {"model": MODEL, "prompt": prefixes[g] + wl.text(r, 100)}) for g in range(groups)
                 for _ in range(per_group)]
    r.shuffle(jobs_list)
    jobs: queue.Queue = queue.Queue()
    for j in jobs_list:
        jobs.put(j)
    env.pool.set_delay(0.03)
    results, errors = [], []
    lock = threading.Lock()

    def run():
        c = Client(env.envoy.listener_port)
        try:
            while True:
                try:
                    g, body = jobs.get_nowait()
                except queue.Empty:
                    return
                rep = c.post("/v1/completions", body)
                with lock:
                    results.append((g, rep))
        except Exception as e:  # noqa: BLE001
            with lock:
                errors.append(repr(e))
        finally:
            c.close()

    threads = [threading.Thread(target=run) for _ in range(C)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    env.pool.set_delay(0.0)
    assert not errors, errors[:5]
    assert len(results) == groups * per_group and all(rep.status == 200 for _, rep in results)

    reasons = Counter(rep.decision["reason"] for _, rep in results)
    pairs = {(rep.worker, g) for g, rep in results}
    info = f"pairs={len(pairs)} reasons={reasons} counts={env.pool.counts()} peaks={env.pool.max_inflight()}"
    assert set(reasons) <= {"prefix_hit", "hash_affinity", "load_spill"}, info
    assert len(pairs) <= groups + reasons["load_spill"], info
    assert reasons["prefix_hit"] >= groups * per_group // 2, info
    bound = math.ceil((1 + env.load_eps) * C / len(env.names) + env.load_slack - 1) + 2
    assert max(env.pool.max_inflight().values()) <= bound, info
    gauges = wait_inflight_zero(env.envoy)
    assert all(v == 0 for v in gauges.values()), gauges


def test_conversations_over_a_fleet_prefix_use_every_worker(env):
    """A system prompt cached on 3 of the 4 workers is a fleet prefix: new conversations on it go to
    the least busy workers (all idle here, so spread by conversation key), not only to its
    holders, and each conversation's later turns stay on its worker."""
    r = wl.rng("fleet")
    system = {"role": "system", "content": wl.text(r, 3000)}
    n = len(env.names)

    def first_turn(i):
        return [system, {"role": "user", "content": f"Task {i}: " + wl.text(r, 100)}]

    def send(msgs):
        c = Client(env.envoy.listener_port)
        try:
            return c.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 8})
        finally:
            c.close()

    # Seed: concurrent first turns (nobody holds the prompt yet: spread by conversation key, and
    # held in flight so the load bound spills them) put the prompt on several workers; a later
    # round, should the first reach too few, seeds again.
    holders: set = set()
    for round_ in range(6):
        env.pool.set_delay(0.3)
        seeds = [first_turn(1000 * round_ + i) for i in range(2 * n)]
        out = [None] * len(seeds)

        def run(k):
            out[k] = send(seeds[k])

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(seeds))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        env.pool.set_delay(0.0)
        assert all(rep is not None and rep.status == 200 for rep in out), out
        holders |= {rep.worker for rep in out}
        wait_inflight_zero(env.envoy)
        if 4 * len(holders) >= 3 * n:
            break

    # New conversations, one at a time, then each one's second turn.
    convs = [first_turn(100 + i) for i in range(6 * n)]
    starts = []
    for msgs in convs:
        rep = send(msgs)
        assert rep.status == 200, rep.body
        starts.append(rep)
        msgs.append({"role": "assistant", "content": wl.text(r, 50)})
        msgs.append({"role": "user", "content": wl.text(r, 50)})
    served = Counter(rep.worker for rep in starts)
    info = f"seed holders={sorted(holders)} starts={dict(served)}"
    assert 4 * len(holders) >= 3 * n, info  # the load bound spilled the seeds (fleet_prefix_share 0.75)
    assert set(served) == set(env.names), info
    for msgs, first in zip(convs, starts):
        rep = send(msgs)
        assert rep.status == 200, rep.body
        assert rep.worker == first.worker, (info, first.decision, rep.decision)
        assert rep.decision["reason"] == "prefix_hit", rep.decision
