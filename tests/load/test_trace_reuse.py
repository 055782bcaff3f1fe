"""load/trace_reuse.py: the reuse of the bundled traces split by how many earlier requests reached
each request's deepest reused prefix."""

from load.trace_reuse import BUCKETS, reuse


def test_every_reuse_falls_in_one_bucket_and_a_conversation_reuses_its_own_history():
    for name in ("conversation", "synthetic"):
        rows = reuse(name, 300)
        assert len(rows) == len(BUCKETS)
        assert 0 < sum(reqs for _, reqs, _ in rows) < 300, (name, rows)
        assert 0 < sum(share for _, _, share in rows) < 1, (name, rows)
    # The conversation trace's turns resend the turn before: most reuse has one earlier request.
    span, reqs, _ = reuse("conversation", 300)[0]
    assert span == "1" and reqs > 0
