"""The default `cost_aware` policy (`policy/cost.rs`: one cost in seconds for every prompt shape)
on the module's fresh stack (tests/integration/conftest.py), through the real Envoy with the
compiled filter: the same follow-up sent as chat and as completions reaches its holder while the
holder's queued prefill costs less than recomputing the conversation elsewhere, and leaves when
it costs more."""

from __future__ import annotations

from prkit.client import Client

from . import workload as wl
from .test_queued_prefill import conversation, fresh_load


def test_a_follow_up_stays_through_a_queue_shorter_than_its_recompute_as_chat_and_completions(fresh):
    """The same follow-up sent as chat and as completions reaches its holder both times while the
    holder's queued prefill costs less than recomputing the conversation elsewhere, and leaves it
    when the queue costs more (policy/cost.rs: the ~4k-token history's recompute and copy are
    ~8k token-equivalents; a quarter of the queue counts)."""
    r = wl.rng("queued-prefill-forms")
    c = Client(fresh.envoy.listener_port)
    busy = None
    try:
        for form in ("chat", "completions"):
            post = conversation(c, r, form)
            holder = post().worker
            assert post().worker == holder, form
            busy = fresh.pool.workers[holder]
            busy.capacity, busy.extra_load, busy.waiting_tokens = 64, 2, 6000
            fresh_load(fresh)
            for _ in range(2):
                rep = post()
                assert (rep.worker, rep.decision["reason"]) == (holder, "prefix_hit"), (form, rep.decision)
            busy.waiting_tokens = 80_000
            fresh_load(fresh)
            rep = post()
            assert rep.worker != holder and rep.decision["reason"] == "load_spill", (form, rep.decision)
            busy.capacity, busy.extra_load, busy.waiting_tokens = 0, 0, 0
            fresh_load(fresh)
    finally:
        if busy is not None:
            busy.capacity, busy.extra_load, busy.waiting_tokens = 0, 0, 0
        c.close()
