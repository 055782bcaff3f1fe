"""What bounds an Envoy replica's memory, checked in every shipped config and
manifest: the filter holds every inference request until its body ends, so without these a few
hundred clients trickling 16 MiB bodies pin gigabytes and the OOM killer takes the replica with
every generation it carries. The live behaviour is tests/reliability/test_slow_clients.py.
"""

from __future__ import annotations

import re

import pytest

from prkit import envoy_config as ec
from prkit.envoy_config import run_gen
from prkit.paths import REPO_ROOT as REPO

from .conftest import hcm_of, listener, yaml_doc

SHIPPED = ["envoy.yaml", "compose.yaml", "ingress.yaml", "scale-out.yaml", "pool.yaml"]
HEAP = "envoy.resource_monitors.fixed_heap"


def seconds(d: str) -> float:
    assert re.fullmatch(r"[0-9]+(\.[0-9]+)?s", d), d
    return float(d[:-1])


def check_bounds(doc: dict) -> dict:
    """Asserts the bounds are there; returns them."""
    hcm = hcm_of(listener(doc, "ingress"))
    rt, rht = seconds(hcm["request_timeout"]), seconds(hcm["request_headers_timeout"])
    assert 0 < rht <= rt <= 300, (rt, rht)
    streams = hcm["http2_protocol_options"]["max_concurrent_streams"]
    assert 1 <= streams <= 1000, streams
    om = doc["overload_manager"]
    monitors = {m["name"]: m["typed_config"] for m in om["resource_monitors"]}
    heap = int(monitors[HEAP]["max_heap_size_bytes"])
    assert om["buffer_factory_config"]["minimum_account_to_track_power_of_two"] <= 24  # tracks >= 16 MiB streams
    actions = {a["name"]: a["triggers"] for a in om["actions"]}
    (reset,) = actions["envoy.overload_actions.reset_high_memory_stream"]
    (stop,) = actions["envoy.overload_actions.stop_accepting_requests"]
    (shed,) = {p["name"]: p["triggers"] for p in om["loadshed_points"]}["envoy.load_shed_points.http1_server_abort_dispatch"]
    assert reset["name"] == stop["name"] == shed["name"] == HEAP
    assert reset["scaled"]["scaling_threshold"] < reset["scaled"]["saturation_threshold"] <= stop["threshold"]["value"] < 1
    assert shed["threshold"]["value"] == stop["threshold"]["value"]
    return {"request_timeout": rt, "streams": streams, "heap": heap, "shed_at": stop["threshold"]["value"],
            "connections": int(monitors["envoy.resource_monitors.global_downstream_max_connections"]
                               ["max_active_downstream_connections"]),
            "body": int(listener(doc, "ingress")["per_connection_buffer_limit_bytes"])}


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_bounds_slow_requests_and_the_heap(composecheck, tmp_path, name):
    b = check_bounds(yaml_doc(composecheck, (REPO / "envoy" / name).read_text(), tmp_path))
    assert b["body"] == 16 << 20


def _memory_limit(text: str) -> int:
    m = re.fullmatch(r"([0-9]+)(Gi|Mi|g|m)", text)
    assert m, text
    return int(m.group(1)) << (30 if m.group(2) in ("Gi", "g") else 20)


def test_manifests_leave_room_above_the_heap_threshold(composecheck, tmp_path):
    """The StatefulSet (scale-out.yaml) and compose (compose.yaml) memory limits sit >= 256 MiB above
    the heap Envoy sheds at: memory outside tcmalloc's heap (V8's Wasm VMs, the binary) fits, and
    Envoy sheds before the kernel kills."""
    import json
    import subprocess

    r = subprocess.run([str(composecheck), "yaml2json", str(REPO / "envoy" / "k8s" / "statefulset.yaml")],
                       capture_output=True, text=True, timeout=60)
    (sts,) = [d for d in json.loads(r.stdout) if d["kind"] == "StatefulSet"]
    (envoy,) = sts["spec"]["template"]["spec"]["containers"]
    r = subprocess.run([str(composecheck), "check", "-profiles", "sim", str(REPO / "docker-compose.yml")],
                       capture_output=True, text=True, timeout=60)
    compose = json.loads(r.stdout)["project"]["services"]["envoy"]
    for cfg, limit in (("scale-out.yaml", _memory_limit(envoy["resources"]["limits"]["memory"])),
                       ("compose.yaml", int(compose["mem_limit"]))):
        b = check_bounds(yaml_doc(composecheck, (REPO / "envoy" / cfg).read_text(), tmp_path))
        assert b["heap"] * b["shed_at"] + (256 << 20) <= limit <= b["heap"] + (1 << 30), (cfg, b, limit)


def test_gen_options(composecheck, tmp_path):
    text = run_gen("--model", "m=10.0.0.1:8000", "--request-timeout", "2s", "--request-headers-timeout", "0.5s",
                   "--max-concurrent-streams", "8", "--max-heap-mib", "256")
    b = check_bounds(yaml_doc(composecheck, text, tmp_path))
    assert (b["request_timeout"], b["streams"], b["heap"]) == (2.0, 8, 256 << 20)
    hcm = hcm_of(listener(yaml_doc(composecheck, text, tmp_path), "ingress"))
    assert hcm["request_headers_timeout"] == "0.5s"


@pytest.mark.parametrize("over,opt", [
    ({"request_timeout": "0s"}, "--request-timeout"),
    ({"request_headers_timeout": "0s"}, "--request-headers-timeout"),
    ({"request_timeout": "soon"}, "--request-timeout"),
    ({"max_concurrent_streams": 0}, "--max-concurrent-streams"),
    ({"max_heap_mib": 16}, "--max-heap-mib"),
])
def test_bad_bounds_are_refused(over, opt):
    with pytest.raises(ec.ConfigError) as e:
        ec.config(ec.profile("test", models=ec.fleet("m", {"w0": 1}), **over))
    assert e.value.option == opt


def test_baseline_proxies_have_the_same_bounds(composecheck, tmp_path):
    """load/compare's and the benches' plain Envoys (plain_proxy) bound requests and the heap as
    the filter's configs do, so only the routing differs."""
    cfg = ec.plain_proxy(("127.0.0.1", 1), ("127.0.0.1", 2), {"p": [("127.0.0.1", 3)]})
    b = check_bounds(yaml_doc(composecheck, ec.dump(cfg), tmp_path))
    d = ec.Options()
    assert (b["request_timeout"], b["streams"], b["heap"]) == (seconds(d.request_timeout), d.max_concurrent_streams,
                                                               d.max_heap_mib << 20)
