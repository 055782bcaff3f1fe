"""`cache_aware` (the default policy until 2026-11-27, still selectable): a conversation stays on
its worker while that worker is busy decoding (many running requests, no prefill queue) and
while it has other prompts' prefill queued, and leaves it only when the worker is at capacity; a
prompt sharing only a system prompt with it leaves the queue: the rules of docs/design.md
("Queued prefill", "Policy `cache_aware`" 3), through the real Envoy with the compiled filter, on
a fresh Envoy whose fake workers report SGLang's `/v1/loads` fields. The default `cost_aware`
prices the same queue in seconds: tests/integration/test_cost_aware.py."""

from __future__ import annotations

import uuid

import pytest

from prkit.client import Client
from prkit.stack import Stack
from prkit.wait import wait_until

from . import workload as wl

MODEL = "llama"
POLLS = "prefix_router_load_poll_answers"


@pytest.fixture(scope="module")
def fresh():
    """A fresh stack for this module with `policy.name: cache_aware` and the debug header."""
    s = Stack(plugin_overrides={"debug_header": "x-prefix-router-decision",
                                "policy": {"name": "cache_aware"}}).start()
    yield s
    s.close()


def fresh_load(stack: Stack):
    """Waits until the poller has answered at least two more rounds (every worker's new state
    reached shared data)."""
    def answers():
        return sum(v for k, v in stack.envoy.stats().items() if k.startswith(POLLS))
    start = answers()
    n = len(stack.names)
    wait_until(lambda: answers() >= start + 2 * n, "two more load-poll rounds")


def test_a_conversation_keeps_its_worker_while_it_is_busy_decoding(fresh):
    r = wl.rng("queued-prefill")
    c = Client(fresh.envoy.listener_port)
    system = {"role": "system", "content": f"{uuid.uuid4().hex} " + wl.text(r, 16000)}
    msgs = [system, {"role": "user", "content": wl.text(r, 400)}]

    def turn(msgs):
        rep = c.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 8})
        assert rep.status == 200, rep.body
        return rep, msgs + [{"role": "assistant", "content": wl.text(r, 200)},
                            {"role": "user", "content": wl.text(r, 300)}]

    try:
        first, msgs = turn(msgs)
        holder = first.worker
        busy = fresh.pool.workers[holder]
        # The holder runs 20 requests that no Envoy routed (decoding: nothing waits for prefill)
        # out of 64 slots; the other workers are idle. The conversation (~4k tokens) costs more to
        # recompute elsewhere than joining the decode batch does (request_cost_tokens per request).
        busy.capacity, busy.extra_load, busy.waiting_tokens = 64, 20, 0
        fresh_load(fresh)
        for _ in range(3):
            rep, msgs = turn(msgs)
            assert (rep.worker, rep.decision["reason"]) == (holder, "prefix_hit"), rep.decision
        # At its capacity the worker queues what it is sent: the next turn goes elsewhere.
        busy.capacity = 20
        fresh_load(fresh)
        rep, msgs = turn(msgs)
        assert rep.worker != holder and rep.decision["reason"] == "load_spill", rep.decision
    finally:
        busy = fresh.pool.workers.get(locals().get("holder", ""), None)
        if busy is not None:
            busy.capacity, busy.extra_load, busy.waiting_tokens = 0, 0, 0
        c.close()


def test_a_conversation_waits_out_its_workers_prefill_queue_a_shared_prompt_does_not(fresh):
    r = wl.rng("queued-prefill-history")
    c = Client(fresh.envoy.listener_port)
    system = {"role": "system", "content": f"{uuid.uuid4().hex} " + wl.text(r, 16000)}

    def post(msgs):
        rep = c.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 8})
        assert rep.status == 200, rep.body
        return rep

    def more(msgs):
        return msgs + [{"role": "assistant", "content": wl.text(r, 200)},
                       {"role": "user", "content": wl.text(r, 300)}]

    holder = None
    try:
        msgs = [system, {"role": "user", "content": wl.text(r, 400)}]
        holder = post(msgs).worker
        msgs = more(msgs)
        assert post(msgs).worker == holder
        busy = fresh.pool.workers[holder]
        # Other prompts' prefill queued on the holder: 50k tokens, far more than the ~4k-token
        # conversation costs to recompute on an idle worker, with a running slot free.
        busy.capacity, busy.extra_load, busy.waiting_tokens = 64, 2, 50_000
        fresh_load(fresh)
        for _ in range(3):
            msgs = more(msgs)
            rep = post(msgs)
            assert (rep.worker, rep.decision["reason"]) == (holder, "prefix_hit"), rep.decision
        # A new conversation on the same system prompt (two messages: nothing of it is this
        # conversation's own history) does not wait behind the queue for a shared prefix.
        rep = post([system, {"role": "user", "content": wl.text(r, 400)}])
        assert rep.worker != holder and rep.decision["reason"] == "load_spill", rep.decision
    finally:
        busy = fresh.pool.workers.get(holder or "", None)
        if busy is not None:
            busy.capacity, busy.extra_load, busy.waiting_tokens = 0, 0, 0
        c.close()


def conversation(c: Client, r, form: str):
    """A new conversation (its own system prompt, ~4k tokens) sent as `form` ("chat", or
    "completions": the same messages rendered into one text); each call sends the conversation so
    far and appends a reply and a new user message (the next call is a follow-up)."""
    msgs = [{"role": "system", "content": f"{uuid.uuid4().hex} " + wl.text(r, 16000)},
            {"role": "user", "content": wl.text(r, 400)}]

    def post():
        if form == "chat":
            rep = c.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 8})
        else:
            prompt = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs)
            rep = c.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8})
        assert rep.status == 200, rep.body
        msgs.extend([{"role": "assistant", "content": wl.text(r, 200)},
                     {"role": "user", "content": wl.text(r, 300)}])
        return rep
    return post


def test_an_older_sglang_holder_is_bound_by_the_capacity_its_server_info_reports(fresh):
    """A worker without `/v1/loads` (its `/get_load` reports no capacity) running 20 requests no
    Envoy routed keeps its conversation: its `/get_server_info` says it runs 64 at once, so it is
    not saturated (the fleet-relative bound alone would spill it at about 13 of 4 workers)."""
    r = wl.rng("old-sglang-capacity")
    c = Client(fresh.envoy.listener_port)
    busy = None
    try:
        post = conversation(c, r, "chat")
        holder = post().worker
        busy = fresh.pool.workers[holder]
        busy.old_api, busy.capacity = True, 64
        # The poller read this worker's server info once already (capacity then unknown); a failed
        # poll (as a restart gives) makes it read it again.
        reads, polls = busy.server_info_reads, busy.stats.polls
        busy.load_status = 503
        wait_until(lambda: busy.stats.polls >= polls + 2, "failed polls")
        busy.load_status = 200
        wait_until(lambda: busy.server_info_reads > reads, "the server info read again")
        busy.extra_load = 20
        fresh_load(fresh)
        for _ in range(3):
            rep = post()
            assert (rep.worker, rep.decision["reason"]) == (holder, "prefix_hit"), rep.decision
            assert "/64/" in rep.decision.get("holder_load", ""), rep.decision
    finally:
        if busy is not None:
            busy.old_api, busy.load_status = False, 200
            busy.capacity, busy.extra_load, busy.waiting_tokens = 0, 0, 0
        c.close()
