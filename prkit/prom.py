"""Prometheus text exposition: parsing and the few views the tools need.

Envoy's /stats/prometheus writes unlabelled samples as `name{} value`; they parse to `name`.
Labelled samples keep their labels in the key: `name{a="b"}`.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*")


def parse_prometheus(text: str) -> dict[str, float]:
    """{sample key: value}; comments and unparsable values are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key.endswith("{}"):
            key = key[:-2]
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric_name(key: str) -> str:
    """The metric name of a sample key (labels dropped)."""
    return key.split("{", 1)[0]


def metric_names(text: str) -> set[str]:
    """Every metric name with a sample or a # TYPE line in the exposition."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 3:
                names.add(parts[2])
        elif line and not line.startswith("#"):
            m = _NAME.match(line)
            if m:
                names.add(m.group(0))
    return names


def sum_by_name(text: str) -> dict[str, float]:
    """Samples summed over their labels, per metric name."""
    out: dict[str, float] = {}
    for key, v in parse_prometheus(text).items():
        name = metric_name(key)
        out[name] = out.get(name, 0.0) + v
    return out


def with_prefix(stats: dict, prefix: str) -> dict:
    return {k: v for k, v in stats.items() if k.startswith(prefix)}


def delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}


REQUESTS_PREFIX = "prefix_router_requests_"
INFLIGHT_PREFIX = "prefix_router_inflight_"


def reason_counters(stats: dict) -> dict:
    """{reason: value} from the prefix_router_requests_<reason> counters."""
    return {k[len(REQUESTS_PREFIX):]: v for k, v in stats.items() if k.startswith(REQUESTS_PREFIX)}


def inflight_gauges(stats: dict) -> dict:
    return with_prefix(stats, INFLIGHT_PREFIX)


# The in-flight load as Envoy's shared data holds it (the sum of the VMs' live load leases), set
# by every VM's timer from shared data itself. The per-worker `prefix_router_inflight_*` gauges
# are VM-side counts, decremented even if a release never reached shared data: a leak test must
# look at these two as well.
SHARED_LOAD = ("prefix_router_load_requests", "prefix_router_load_tokens")


def inflight_and_shared_load(stats: dict) -> dict:
    """The VM-side per-worker in-flight gauges plus the two shared-data load gauges."""
    return {k: v for k, v in stats.items() if k.startswith(INFLIGHT_PREFIX) or k in SHARED_LOAD}


def inflight_requests(stats: dict) -> float:
    """Sum of the per-worker in-flight request gauges."""
    return sum(v for k, v in stats.items() if k.startswith(INFLIGHT_PREFIX + "requests_"))


def vm_reloads(stats: dict) -> dict:
    """Envoy's Wasm VM reload counters for the filter (a trapped VM under FAIL_RELOAD)."""
    return with_prefix(stats, "envoy_wasm_prefix_router_vm_reload")
