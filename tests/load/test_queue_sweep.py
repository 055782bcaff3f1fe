"""load/queue_sweep: the holder-queue table it builds from the decision headers of a replay."""

from __future__ import annotations

from load import queue_sweep


def rec(worker: str, reason: str, holder: str, queued: int, ttft: float) -> dict:
    d = f"worker={worker}; reason={reason}; matched=3; total=9; holder={holder}; holder_load=2/16/{queued}"
    return {"d": d, "ttft": ttft}


def test_waits_splits_followed_and_spilled_requests_by_the_holders_queue():
    records = [
        rec("w0", "prefix_hit", "w0", 0, 10.0),
        rec("w0", "prefix_hit", "w0", 4000, 300.0),
        rec("w0", "prefix_hit", "w0", 5000, 500.0),
        rec("w1", "load_spill", "w0", 4500, 40.0),
        # Not counted: no holder in the header, no TTFT, or sent elsewhere for another reason.
        {"d": "worker=w2; reason=hash_affinity; matched=0; total=9", "ttft": 5.0},
        rec("w1", "load_spill", "w0", 4500, None),
        rec("w2", "prefix_hit", "w0", 4000, 7.0),
    ]
    lines = queue_sweep.waits(records)
    assert lines[2] == "| 0 | followed | 1 | 10 / 10 ms | 0 ms |"
    assert "| 3000-5999 | followed | 2 | 400 / 400 ms | 150 ms |" in lines
    assert "| 3000-5999 | spilled | 1 | 40 / 40 ms | 150 ms |" in lines
    assert len(lines) == 5
