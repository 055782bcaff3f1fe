"""prkit.trace on tiny crafted traces: scaling, block text, the infinite-cache and pooled-LRU
bounds, holder follow, the replay plan. Pure Python, milliseconds; the bundled Mooncake traces
only for their published reuse (37% / 65% with one infinite cache)."""

from __future__ import annotations

import gzip
import json

import pytest

from prkit import trace as tr


def req(ids, input_length=None, output_length=100, t=0.0):
    ids = tuple(ids)
    return tr.TraceRequest(t, input_length if input_length is not None else 512 * len(ids), output_length, ids)


def blocks(*spec):
    """blocks(1, 2, (3, 5)) -> [(1, 4), (2, 4), (3, 5)]: 4-token blocks unless given."""
    return [s if isinstance(s, tuple) else (s, 4) for s in spec]


# --- scaling and text --------------------------------------------------------------------------


def test_scale_keeps_the_partial_last_block_in_proportion():
    bs, out = tr.scale(req([7, 8, 9], input_length=512 * 2 + 100, output_length=300), 32)
    assert bs == [(7, 32), (8, 32), (9, 7)]  # ceil(100 * 32 / 512) = 7
    assert out == 19  # ceil(300 / 16)
    # A full last block stays full, a 1-token remainder and a 1-token output keep 1 token.
    assert tr.scale(req([1, 2]), 32)[0] == [(1, 32), (2, 32)]
    bs, out = tr.scale(req([1, 2], input_length=513, output_length=1), 32)
    assert bs == [(1, 32), (2, 1)] and out == 1


def test_block_text_is_exact_deterministic_distinct_and_prefix_closed():
    for bid in (0, 1, 63, 64, 4095, 123456):
        full = tr.block_text(bid, 32)
        assert len(full) == 128 and full.isascii()
        assert tr.block_text(bid, 32) == full
        assert tr.block_text(bid, 5) == full[:20]  # a partial block is a prefix of the full one
    # Distinct ids differ already in their first token (4 bytes), so blocks never share tokens.
    firsts = {tr.block_text(i, 1) for i in range(5000)}
    assert len(firsts) == 5000


def test_load_trace_reads_gzip_and_rejects_bad_lengths(tmp_path):
    p = tmp_path / "t.jsonl.gz"
    lines = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
             {"timestamp": 5, "input_length": 512, "output_length": 9, "hash_ids": [1]}]
    with gzip.open(p, "wt") as f:
        f.write("\n".join(json.dumps(x) for x in lines) + "\n")
    got = tr.load_trace(str(p))
    assert got == [tr.TraceRequest(0, 600, 3, (1, 2)), tr.TraceRequest(5, 512, 9, (1,))]
    assert len(tr.load_trace(str(p), limit=1)) == 1
    assert tr.load_trace(str(p), skip=1) == got[1:]
    assert tr.load_trace(str(p), limit=1, skip=2) == []
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError):
        tr.load_trace(str(bad))


# --- bounds ------------------------------------------------------------------------------------


def test_infinite_cache_counts_the_longest_earlier_prefix_only():
    seqs = [
        blocks(1, 2, 3),
        blocks(1, 2, 4),  # shares 1, 2
        blocks(5, 2, 3),  # id 2 and 3 again, but after another first block: a prefix cache has none
        blocks(1, 2, 3, 6),  # all of request 0
        blocks(1, 2, 3),  # identical to request 0
    ]
    assert tr.infinite_cache_hits(seqs) == [0, 8, 0, 12, 12]


def test_infinite_cache_partial_blocks():
    seqs = [
        blocks(1, (2, 2)),  # block 2 partial (2 tokens)
        blocks(1, 2, 3),  # block 2 full: only the 2 cached tokens of it are reusable, nothing after
        blocks(1, (2, 3)),  # now cached at 4: 3 reusable
        blocks(1, 2, 3),  # 2 and 3 cached in full
    ]
    assert tr.infinite_cache_hits(seqs) == [0, 4 + 2, 4 + 3, 12]


def test_shape_head_is_always_reused_and_tail_only_by_identical_prompts():
    shape = tr.SHAPES["chat"]
    seqs = [tr.with_shape(b, shape) for b in (blocks(1, 2), blocks(1, 3), blocks(1, 2))]
    assert [tr.prompt_tokens(s) for s in seqs] == [4 + 8 + 6] * 3
    assert tr.infinite_cache_hits(seqs) == [0, 4 + 4, 4 + 8 + 6]


def test_routed_cache_counts_only_what_the_same_worker_served_before():
    seqs = [blocks(1, 2, 3), blocks(1, 2, 4), blocks(1, 2, 3), blocks(1, 2, 3, 5), blocks(1, 2)]
    # One worker: the infinite cache. Request 2 sent elsewhere finds nothing; 3 finds 0's blocks.
    assert tr.routed_cache_hits(seqs, ["a"] * 5) == tr.infinite_cache_hits(seqs)
    assert tr.routed_cache_hits(seqs, ["a", "a", "b", "a", None]) == [0, 8, 0, 12, 0]
    # A failed request (None) neither hits nor is inserted.
    assert tr.routed_cache_hits(seqs, [None, "a", "a", "a", "a"]) == [0, 0, 8, 12, 8]


def test_routed_lru_is_each_workers_own_lru_of_what_it_was_sent():
    seqs = [blocks(1, 2, 3), blocks(1, 2, 4), blocks(1, 5), blocks(1, 2, 3), blocks(1, 2, 4)]
    # One worker: the pooled LRU of its size; room enough: the routed (infinite) bound.
    assert tr.routed_lru_hits(seqs, ["a"] * 5, 16) == tr.pooled_lru_hits(seqs, 16)
    workers = ["a", "b", "a", "a", "b"]
    assert tr.routed_lru_hits(seqs, workers, 10**6) == tr.routed_cache_hits(seqs, workers)
    # Room for 3 blocks each: on "a", request 2 (1, 5) evicts 3, so request 3 finds 1, 2 only;
    # "b" was sent 1, 2, 4 alone and keeps it whole for request 4.
    assert tr.routed_lru_hits(seqs, workers, 12) == [0, 0, 4, 8, 12]
    # A failed request neither hits nor is inserted.
    assert tr.routed_lru_hits(seqs, [None, "a", "a", "a", "a"], 10**6) == [0, 0, 4, 8, 12]


def test_pooled_lru_large_enough_equals_infinite_and_zero_reuses_nothing():
    seqs = [blocks(1, 2, 3), blocks(1, 2, 4), blocks(1, 5), blocks(1, 2, 3)]
    assert tr.pooled_lru_hits(seqs, 10**6) == tr.infinite_cache_hits(seqs) == [0, 8, 4, 12]
    assert tr.pooled_lru_hits(seqs, 0) == [0, 0, 0, 0]


def test_pooled_lru_evicts_least_recently_used_leaves_first():
    # Capacity 16 tokens = 4 blocks. After request 1 the cache holds 1, 2, 3 and 4; request 2 (1, 5)
    # adds a fifth block, so the least recently used leaf goes: 3 (request 0's, older than 4). The
    # shared prefix 1, 2 stays although it was inserted first, because requests keep touching it.
    # Request 3 then finds 1, 2 only and re-inserts 3, evicting 4 (5 was touched after it), so
    # request 4 finds 1, 2 only too.
    seqs = [blocks(1, 2, 3), blocks(1, 2, 4), blocks(1, 5), blocks(1, 2, 3), blocks(1, 2, 4)]
    assert tr.pooled_lru_hits(seqs, 16) == [0, 8, 4, 8, 8]
    # With room for 5 blocks nothing is ever evicted.
    assert tr.pooled_lru_hits(seqs, 20) == [0, 8, 4, 12, 12]
    # A block and its prefix are touched together, yet the extension goes first: room for 3 blocks,
    # request 2 evicts 2 (not its prefix 1, which request 3 still finds).
    assert tr.pooled_lru_hits([blocks(1, 2), blocks(3), blocks(4), blocks(1)], 12) == [0, 0, 0, 4]


def test_held_lru_without_running_time_is_the_pooled_and_routed_lru():
    seqs = [blocks(1, 2, 3), blocks(1, 2, 4), blocks(1, 5), blocks(1, 2, 3), blocks(1, 2, 4)]
    instants = [(t, t) for t in range(len(seqs))]
    outs = [0] * len(seqs)
    for cap in (0, 12, 16, 20, 10**6):
        assert tr.held_lru_hits(seqs, outs, instants, cap) == tr.pooled_lru_hits(seqs, cap)
    workers = ["a", "b", "a", "a", "b"]
    assert tr.held_lru_hits(seqs, outs, instants, 12, workers) == tr.routed_lru_hits(seqs, workers, 12)
    # A failed request (no span, or no worker) neither hits nor is inserted.
    assert tr.held_lru_hits(seqs, outs, [None] + instants[1:], 10**6) == [0, 0, 4, 8, 12]
    assert tr.held_lru_hits(seqs, outs, instants, 10**6, [None, "a", "a", "a", "a"]) == [0, 0, 4, 8, 12]


def test_held_lru_keeps_a_running_requests_blocks_and_loses_the_room_they_take():
    # Room for 2 blocks. Request 0 runs from 0 to 10: its block 1 cannot be evicted while it runs,
    # so request 3 (block 1 again, at 5) finds it, although 2 and 3 came after it; the pooled LRU,
    # where nothing runs, evicted it.
    seqs = [blocks(1), blocks(2), blocks(3), blocks(1)]
    spans = [(0, 10), (1, 2), (3, 4), (5, 6)]
    assert tr.held_lru_hits(seqs, [0] * 4, spans, 8) == [0, 0, 0, 4]
    assert tr.pooled_lru_hits(seqs, 8) == [0, 0, 0, 0]
    # Room for 2 blocks: a long request (block 2 and 4 output tokens) running from 2 to 100 fills
    # it, so block 1, cached at 1, is gone when request 2 asks at 3; the pooled LRU keeps it.
    seqs = [blocks(1), blocks(2), blocks(1)]
    spans = [(0, 1), (2, 100), (3, 4)]
    assert tr.held_lru_hits(seqs, [0, 4, 0], spans, 8) == [0, 0, 0]
    assert tr.pooled_lru_hits(seqs, 8) == [0, 0, 4]
    # Its output stays cached once it ends (as SGLang keeps it) and takes room: with 3 blocks of
    # room, block 3 at 4 then evicts block 1, which request 4 no longer finds.
    seqs = [blocks(1), blocks(2), blocks(3), blocks(2), blocks(1)]
    spans = [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
    assert tr.held_lru_hits(seqs, [0, 4, 0, 0, 0], spans, 12) == [0, 0, 0, 4, 0]
    assert tr.held_lru_hits(seqs, [0] * 5, spans, 12) == [0, 0, 0, 4, 4]
    # Ends free their blocks before starts at the same instant claim room.
    seqs = [blocks(1), blocks(2), blocks(1)]
    assert tr.held_lru_hits(seqs, [0, 0, 0], [(0, 1), (1, 3), (3, 4)], 8) == [0, 0, 4]


def test_pooled_lru_never_beats_infinite_on_a_real_slice():
    reqs = tr.load_trace("conversation", 300)
    seqs = [tr.with_shape(tr.scale(r, 16)[0], tr.SHAPES["completions"]) for r in reqs]
    inf = tr.infinite_cache_hits(seqs)
    distinct = tr.distinct_block_tokens(seqs)
    small = tr.pooled_lru_hits(seqs, distinct // 10)
    large = tr.pooled_lru_hits(seqs, distinct // 2)
    assert all(a <= b for a, b in zip(small, inf)) and all(a <= b for a, b in zip(large, inf))
    assert sum(small) < sum(large) < sum(inf)


@pytest.mark.parametrize("name,share", [("conversation", 0.37), ("synthetic", 0.65)])
def test_infinite_bound_of_the_whole_trace_matches_the_published_one(name, share):
    reqs = tr.load_trace(name)
    seqs = [tr.scale(r, tr.TRACE_BLOCK)[0] for r in reqs]
    total = sum(tr.prompt_tokens(s) for s in seqs)
    assert total == sum(r.input_length for r in reqs)
    assert sum(tr.infinite_cache_hits(seqs)) / total == pytest.approx(share, abs=0.005)


def test_distinct_block_tokens_counts_each_id_once_at_its_longest():
    seqs = [tr.with_shape(blocks(1, (2, 1)), tr.SHAPES["chat"]), blocks(1, 2, 3)]
    assert tr.distinct_block_tokens(seqs) == 12


# --- holder follow ------------------------------------------------------------------------------


def test_holder_follow_latest_earliest_any():
    ids = [
        (0, 1, 2),  # w0
        (0, 1, 2, 3),  # shares 3 blocks with request 0 (holder w0) -> sent to w1: no follow
        (0, 1, 2, 3, 4),  # longest: 4 blocks, request 1 only (w1) -> w1: follows
        (0, 9),  # shares only the first block: not eligible
        (0, 1, 7),  # shares 2 blocks with 0, 1, 2: earliest w0, latest w1 (request 2), sent to w2
        (0, 1, 8),  # shares 2 blocks with 0, 1, 2, 4: earliest w0, latest w2 -> sent to w0
    ]
    workers = ["w0", "w1", "w1", "w3", "w2", "w0"]
    hf = tr.holder_follow(ids, workers)
    assert hf.eligible == [1, 2, 4, 5]
    assert hf.followed_latest == [False, True, False, False]
    assert hf.followed_earliest == [False, True, False, True]
    assert hf.followed_any == [False, True, False, True]
    assert hf.rate("any") == 0.5 and hf.served == 6


def test_holder_follow_ignores_failed_requests():
    ids = [(0, 1, 2), (0, 1, 2), (0, 1, 2)]
    # Request 0 failed: request 1 has no served holder; request 2's holder is request 1 (w5).
    hf = tr.holder_follow(ids, [None, "w5", "w5"])
    assert hf.eligible == [2] and hf.followed_latest == [True] and hf.served == 2
    # A failed request is not eligible itself.
    hf = tr.holder_follow(ids, ["w1", None, "w2"])
    assert hf.eligible == [2] and hf.followed_latest == [False]


def test_holder_follow_min_shared():
    ids = [(0, 1), (0, 2)]
    assert tr.holder_follow(ids, ["a", "a"]).eligible == []
    assert tr.holder_follow(ids, ["a", "a"], min_shared=1).followed_latest == [True]


# --- replay plan --------------------------------------------------------------------------------


def test_replay_plan_times_blocks_and_texts():
    reqs = [req([1, 2], t=1000.0, output_length=512), req([1, 3], input_length=600, t=3000.0)]
    plan = tr.replay_plan(reqs, 8, speed=4.0)
    assert [r["t"] for r in plan["requests"]] == [0.0, 500.0]
    assert plan["requests"][0]["b"] == [[0, 8], [1, 8]] and plan["requests"][0]["o"] == 8
    assert plan["requests"][1]["b"] == [[0, 8], [2, 2]]  # ceil(88 * 8 / 512) = 2
    assert plan["texts"] == [tr.block_text(1, 8), tr.block_text(2, 8), tr.block_text(3, 8)]
    # Pin key: the second hash id (the first is the prompt every conversation shares).
    assert [r["k"] for r in plan["requests"]] == ["h2", "h3"]


# --- load/compare's replay report ----------------------------------------------------------------


def test_replay_scales_the_routers_token_constants_like_the_simulator():
    from load import trace_replay

    # 32-token blocks stand for 512 real tokens: every token amount shrinks 16-fold.
    p = trace_replay.trace_scaled_policy(32)
    assert p == {k: round(v / 16) for k, v in trace_replay.FILTER_TOKEN_DEFAULTS.items()}
    assert trace_replay.trace_scaled_policy(512) == trace_replay.FILTER_TOKEN_DEFAULTS
    assert all(v >= 1 for v in trace_replay.trace_scaled_policy(1).values())
    # the cost model's context scale too, for a filter build that reads policy.cost
    assert trace_replay.trace_scaled_policy(32, cost=True)["cost"] == {"context_tokens": 1280}


def test_filter_has_cost_model_reads_the_builds_field_names(tmp_path):
    from load import trace_replay

    new, old = tmp_path / "new.wasm", tmp_path / "old.wasm"
    new.write_bytes(b"\0asm...prefill_tokens_per_secondcontext_tokenscopy_weight...")
    old.write_bytes(b"\0asm...request_cost_tokens...")
    assert trace_replay.filter_has_cost_model(new)
    assert not trace_replay.filter_has_cost_model(old)
    assert not trace_replay.filter_has_cost_model(tmp_path / "missing.wasm")


def test_holder_state_from_the_decision_header():
    from load import trace_replay

    hs = trace_replay._holder_state
    assert hs("worker=w1; reason=load_spill; matched=2; total=8; holder=w3; holder_load=16/16/0") == "saturated"
    assert hs("worker=w1; reason=load_spill; matched=2; total=8; holder=w3; holder_load=3/16/900") == "queued"
    assert hs("worker=w3; reason=prefix_hit; matched=2; total=8; holder=w3; holder_load=3/16/0") == "free"
    assert hs("worker=w3; reason=prefix_hit; matched=2; total=8; holder=w3; holder_load=30/0/0") == "free"
    assert hs("worker=w3; reason=hash_affinity; matched=0; total=8") == "-"
    assert hs(None) == "-"
