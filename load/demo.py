"""The local demo: the same shared-prefix workload through round robin and through prefix-router.

Each router gets a fresh fleet of 4 simulated SGLang workers (real-time latency model, KV cache of
16k tokens each, so one worker cannot hold all 16 group prefixes of ~1.7k tokens but a quarter of
them fits), Envoy with the compiled filter, and the k6 scenario `load/shared_prefix.js`.
"""

from __future__ import annotations

import json
import sys

from load.runner import REPO, log, run_router, table

SIM_ARGS = ["--max-total-tokens", "16384", "--time-scale", "1"]
K6_ENV = {
    "MODEL": "llama",
    "GROUPS": 16,
    "PROMPTS": 16,
    "SYS_TOKENS": 1700,  # exact simulator tokens (load/lib.js text(): 4 bytes per token)
    "Q_TOKENS": 80,
    "OUT_TOKENS": 24,
    "CONCURRENCY": 8,
    "SEED": 1,
}
ROUTERS = [
    ("round-robin", {"policy": {"name": "round_robin"}}),
    ("prefix-router", {"policy": {"name": "cost_aware"}}),
]


def main() -> int:
    scenario = REPO / "load" / "shared_prefix.js"
    log(f"shared-prefix workload: {K6_ENV['GROUPS']} groups x {K6_ENV['PROMPTS']} prompts, "
        f"concurrency {K6_ENV['CONCURRENCY']}, 4 simulated workers ({' '.join(SIM_ARGS)})")
    rows = [run_router(label, over, scenario, K6_ENV, 4, SIM_ARGS, "llama") for label, over in ROUTERS]
    print()
    print(table(rows))
    out = REPO / "load" / "results" / "demo.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"\n(raw rows: {out.relative_to(REPO)})")
    bad = [r["router"] for r in rows if r["errors"] or r["k6_exit"] not in (0,)]
    if bad:
        print(f"demo: errors or failed k6 thresholds for: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
