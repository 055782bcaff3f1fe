"""load/placement_loss: which requests placement lost prefix blocks on, and when the other worker
had been sent them."""

from __future__ import annotations

from load.placement_loss import placement_losses


def rec(i, w, t0, ttft, reason="prefix_hit", s=200):
    return {"i": i, "w": w, "s": s, "t0": t0, "ttft": ttft, "t1": t0 + ttft + 50,
            "d": f"worker={w}; reason={reason}; matched=0; total=9"}


def test_losses_are_classified_by_when_the_other_worker_had_the_prefix():
    seqs = [
        [1, 2, 3, 4],        # 0 -> a, answered at 100
        [1, 2, 3, 4, 5],     # 1 -> a: follows, no loss
        [1, 2, 9],           # 2 -> b at 1000: loses 2 blocks a was sent long before
        [7, 8, 9, 10],       # 3 -> c at 1000, answered at 1500
        [7, 8, 9, 11],       # 4 -> d at 1200: loses 3 blocks still in flight on c
        [7, 8, 9, 10, 12],   # 5 -> b at 1600: loses 4 blocks c answered 100 ms before
        [1, 2, 3, 4, 5, 6],  # 6: failed, neither counted nor a holder
        [20, 21],            # 7 -> a: new prefix, no loss
    ]
    records = [rec(0, "a", 0, 100), rec(1, "a", 200, 50), rec(2, "b", 1000, 40, "load_spill"),
               rec(3, "c", 1000, 500), rec(4, "d", 1200, 40, "hash_affinity"),
               rec(5, "b", 1600, 40, "load_spill"), rec(6, "e", 1700, 10, s=503), rec(7, "a", 1800, 10)]
    out = placement_losses(seqs, records)
    assert out["blocks"] == 4 + 5 + 3 + 4 + 4 + 5 + 2
    assert dict(out["lost"]) == {"answered": 2, "in flight": 3, "answered <300 ms": 4}
    assert dict(out["requests"]) == {"answered": 1, "in flight": 1, "answered <300 ms": 1}
    assert out["by_reason"][("in flight", "hash_affinity")] == 3
    assert out["by_reason"][("answered", "load_spill")] == 2


def test_a_worker_holding_part_of_the_prefix_loses_only_the_rest():
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2], [1, 2, 3, 4, 5, 6, 7]]
    records = [rec(0, "a", 0, 10), rec(1, "b", 1000, 10), rec(2, "b", 1500, 10)]
    out = placement_losses(seqs, records)
    # 2 blocks the first time; then b holds 2 of a's 6 and loses the other 4.
    assert dict(out["lost"]) == {"answered": 6} and dict(out["requests"]) == {"answered": 2}
