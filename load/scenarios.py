"""load/compare's workloads: per scenario its k6 script, env (full and --quick), KV capacity per
worker, simulator flags and model per worker; the trace replay's default sizing; the routers it
compares and their labels (a prefix-router with its own filter build: `NAME@WASM`)."""

from __future__ import annotations

import os
from pathlib import Path

from prkit.paths import REPO_ROOT as REPO

LOAD = REPO / "load"
GEN = Path(os.environ.get("ENVOY_GEN", REPO / "envoy" / "gen"))
WORKERS = 8  # per scenario: len(SCENARIOS[s]["models"])


SCENARIOS = {
    "shared_prefix": {
        "script": "shared_prefix.js",
        "env": dict(GROUPS=64, PROMPTS=16, SYS_TOKENS=2048, Q_TOKENS=128, OUT_TOKENS=64, CONCURRENCY=32),
        "quick": dict(GROUPS=8, PROMPTS=4, SYS_TOKENS=512, Q_TOKENS=32, OUT_TOKENS=8, CONCURRENCY=8),
        # 64 prefixes x ~2.1k tokens = ~135k tokens: one worker (40k) holds < 1/3 of them, the fleet
        # (328k) all of them. Quick: 8 x ~0.5k = 4.2k vs 2k per worker.
        "kv": 40960, "kv_quick": 2048,
        "sim": [], "models": ["llama"] * WORKERS,
    },
    "skewed": {
        "script": "skewed.js",
        "env": dict(GROUPS=64, REQUESTS=1024, ZIPF_S=1.1, SYS_TOKENS=2048, Q_TOKENS=128, OUT_TOKENS=64,
                    CONCURRENCY=32),
        "quick": dict(GROUPS=16, REQUESTS=48, ZIPF_S=1.1, SYS_TOKENS=512, Q_TOKENS=32, OUT_TOKENS=8,
                      CONCURRENCY=8),
        "kv": 40960, "kv_quick": 2048,
        "sim": [], "models": ["llama"] * WORKERS,
    },
    "multi_turn": {
        "script": "multi_turn.js",
        "env": dict(USERS=32, CONVERSATIONS=2, TURNS=6, APPS=4, SYS_TOKENS=1024, Q_TOKENS=96, OUT_TOKENS=64),
        "quick": dict(USERS=8, CONVERSATIONS=1, TURNS=3, APPS=2, SYS_TOKENS=256, Q_TOKENS=32, OUT_TOKENS=8),
        # 64 conversations growing to ~2k tokens = ~130k tokens of histories; 24k per worker.
        "kv": 24576, "kv_quick": 2048,
        "sim": [], "models": ["llama"] * WORKERS,
    },
    "two_models": {
        "script": "two_models.js",
        "env": dict(GROUPS=32, PROMPTS=8, SYS_TOKENS=2048, Q_TOKENS=128, OUT_TOKENS=64, CONCURRENCY=32,
                    MODELS="a,b"),
        "quick": dict(GROUPS=8, PROMPTS=4, SYS_TOKENS=512, Q_TOKENS=32, OUT_TOKENS=8, CONCURRENCY=8,
                      MODELS="a,b"),
        # model a on w0..w3, b on w4..w7; 16 prefixes per model (~34k tokens) vs 16k per worker.
        "kv": 16384, "kv_quick": 2048,
        "sim": [], "models": ["a"] * 4 + ["b"] * 4,
    },
    "long_context": {
        "script": "long_context.js",
        "env": dict(GROUPS=8, PROMPTS=6, SYS_TOKENS=32768, Q_TOKENS=256, OUT_TOKENS=32, CONCURRENCY=8),
        "quick": dict(GROUPS=4, PROMPTS=2, SYS_TOKENS=16384, Q_TOKENS=64, OUT_TOKENS=8, CONCURRENCY=4),
        # 8 documents x 32.8k = 262k tokens; one worker (96k) holds at most 2 with room to run.
        "kv": 98304, "kv_quick": 40960,
        "sim": ["--context-length", "65536"], "models": ["llama"] * WORKERS,
    },
    "agentic": {
        "script": "agentic.js",
        "env": dict(CONVERSATIONS=40, MAX_TURNS=12, REQUESTS=360, ZIPF_S=1.0, SYS_TOKENS=3000, TASK_TOKENS=200,
                    TOOL_TOKENS=256, OUT_TOKENS=128, CONCURRENCY=16),
        "quick": dict(CONVERSATIONS=12, MAX_TURNS=4, REQUESTS=36, ZIPF_S=1.0, SYS_TOKENS=1000, TASK_TOKENS=50,
                      TOOL_TOKENS=64, OUT_TOKENS=16, CONCURRENCY=8),
        # 16 workers. One shared 3k-token system prompt; a conversation's own part grows by
        # 128 + 256 = 384 tokens a turn to 200 + 12 x 384 = ~4.8k tokens (its last prompt ~7.6k with
        # the system prompt). 360 turns over 40 conversations (Zipf: the 16 hottest reach 12
        # turns) = ~3k + 40 x 200 + 360 x 384 = ~150k tokens of histories. One worker (16k) holds
        # the system prompt + ~3 full conversations; the fleet (262k) holds all 40, ~2.5 per
        # worker, only if each conversation stays on one worker. Quick: 12 conversations x <= 4
        # turns of 16 + 64 tokens on a 1k system prompt (~2.5k tokens) vs 2k per worker.
        "kv": 16384, "kv_quick": 2048,
        "sim": ["--context-length", "16384"], "models": ["llama"] * 16,
    },
    "trace": {
        "script": "trace.js",
        # Built by trace_setup from --trace / --requests / --speed / --block-tokens / --api: the
        # replay plan, KV capacity (the fleet holds about a fifth of the slice's distinct prompt
        # blocks) and --context-length (the slice's longest request fits).
        "env": {}, "quick": {},
        "kv": None, "kv_quick": None,
        "sim": ["--max-running-requests", "16", "--decode-base-ms", "10"], "models": ["llama"] * WORKERS,
        "records": True, "debug_header": True,
    },
}

# --scenario trace defaults (full / --quick): the first REQUESTS requests of the trace, replayed
# SPEED times faster, 512-token blocks scaled to BLOCK_TOKENS tokens. 32 tokens (1/16) keeps the
# conversation trace's longest prompt (123k tokens) under 8k tokens and its mean (13.3k) at ~830
# tokens, so 4000 requests at speed 16 (~49 requests/s, 81 s) fit 8 simulated workers, Envoy and
# k6 on 2 cores.
TRACE_FULL = dict(requests=4000, speed=16.0, block_tokens=32)
TRACE_QUICK = dict(requests=200, speed=16.0, block_tokens=32)
KV_FLEET_SHARE = 0.2  # fleet KV / the slice's distinct prompt-block tokens

ROUTERS = [
    "round_robin",
    "least_request",
    "smg_cache_aware",
    "smg_power_of_two",
    "prefix_router_1t",
    "prefix_router_2t",
    "prefix_router_standalone",
]
LABELS = {
    "round_robin": "Envoy round_robin",
    "least_request": "Envoy least_request",
    "smg_cache_aware": "smg cache_aware",
    "smg_power_of_two": "smg power_of_two",
    "prefix_router_1t": "prefix-router (1 thread)",
    "prefix_router_2t": "prefix-router (2 threads)",
    "prefix_router_standalone": "prefix-router standalone (2 threads, no peers, no load poll)",
}
# Routers that run one process whatever --replicas says.
SINGLE = ("round_robin", "least_request")


def split_router(spec: str) -> tuple[str, Path | None]:
    """`NAME` or `NAME@WASM`: a prefix-router run with that filter build instead of the default
    one (`PREFIX_ROUTER_WASM`, else built fresh), so two builds can share one interleaved run."""
    name, sep, build = spec.partition("@")
    return name, (Path(build) if sep else None)


def router_error(spec: str) -> str | None:
    """Why `spec` names no router (`split_router`), or None."""
    name, build = split_router(spec)
    if name not in ROUTERS:
        return f"unknown router {name!r}; known: {', '.join(ROUTERS)}"
    if build is not None and not name.startswith("prefix_router_"):
        return f"{spec!r}: only a prefix_router_* router takes a filter build (@WASM)"
    if build is not None and not build.is_file():
        return f"{spec!r}: no filter build at {build}"
    return None
