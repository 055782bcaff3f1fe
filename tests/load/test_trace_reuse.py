"""load/trace_reuse.py: the reuse of the bundled traces split by how many earlier requests reached
each request's deepest reused prefix."""

from load.trace_reuse import BUCKETS, reuse


def test_every_reuse_falls_in_one_bucket_and_a_conversation_reuses_its_own_history():
    for name in ("conversation", "synthetic"):
        rows = reuse(name, 300)
        assert len(rows) == len(BUCKETS)
        counted = [int(r.split("|")[3].split(" of ")[0]) for r in rows]
        assert all(r.split("|")[3].strip().endswith("of 300") for r in rows)
        assert 0 < sum(counted) < 300, (name, rows)
    # The conversation trace's turns resend the turn before: most reuse has one earlier request.
    conv = reuse("conversation", 300)
    assert int(conv[0].split("|")[3].split(" of ")[0]) > 0
