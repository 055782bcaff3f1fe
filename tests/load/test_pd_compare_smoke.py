"""CI smoke of the PD comparison: `load/pd_compare --quick --sizes 2` (2 prefill + 2 decode
simulated workers) for prefix-router (Envoy + filter, envoy/gen --pd-model) and smg's PD mode.
Seconds per router; the full run's command is in load/results/pd.md."""

from __future__ import annotations

import json
import subprocess
import sys


def test_pd_compare_quick(repo_root, tmp_path):
    out = tmp_path / "pd.md"
    proc = subprocess.run(
        [str(repo_root / "load" / "pd_compare"), "--quick", "--sizes", "2", "--out", str(out)],
        cwd=repo_root, capture_output=True, text=True, timeout=600,
    )
    sys.stdout.write(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["router"] for r in rows] == ["prefix_router", "smg"]
    md = out.read_text()
    for r in rows:
        assert r["how"] in md
        assert r["errors"] == 0 and r["bootstrap_failed"] == 0, r
        assert r["requests"] > 0, r
        # every request was prefilled once and decoded once (the mirror reached a prefill worker)
        assert sum(r["prefill_requests"]) == sum(r["decode_requests"]) == r["requests"], r
        assert 0.0 <= r["hit_rate"] <= 1.0 and 0 < r["ttft_p50"] <= r["ttft_p99"], r
