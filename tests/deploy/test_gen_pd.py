"""envoy/gen's prefill/decode options: --pd-model, --prefill, --decode, --pd-timeout.

The generated config passes the real `envoy --mode validate` (the filter checks its PD plugin
configuration there); the structure is read from prkit.envoy_config's dicts."""

from __future__ import annotations

import json
import re

import pytest

from prkit import envoy_config as ec
from prkit.build import wasm_path
from prkit.envoy import check_config
from prkit.envoy_config import run_gen

from .conftest import gen_fail

PD = ["--pd-model", "m", "--prefill", "10.0.0.1:30000@8998,p1.llm.svc:30000@9000",
      "--decode", "10.0.0.3:30000,10.0.0.4:30000,10.0.0.5:30000"]


def test_pd_config_validates(tmp_path):
    check_config(run_gen(*PD, "--wasm", str(wasm_path())), tmp_path)
    check_config(run_gen(*PD, "--profile", "test", "--wasm", str(wasm_path())), tmp_path, "test.yaml")


def test_pd_route_mirrors_to_the_prefill_header_and_clusters_have_the_right_fallbacks():
    opts = ec.options_from_args(PD + ["--pd-timeout", "120s"])
    cfg = ec.config(opts)
    (listener,) = [li for li in cfg["static_resources"]["listeners"] if li["name"] == "ingress"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    routes = vhost["routes"]
    # per public path group: the PD route, the worker route, the 503 (tests/deploy/test_public_route.py)
    assert len(routes) == 3 * len(ec.public_routes(opts))
    pd_route, plain, default = routes[:3]
    assert pd_route["match"]["safe_regex"] == plain["match"]["safe_regex"] == default["match"]["safe_regex"]
    # both headers must name workers of the right role (a client's own header never reaches admin)
    (method_h, prefill_h, cluster_h) = pd_route["match"]["headers"]
    assert method_h == {"name": ":method", "string_match": {"exact": "POST"}}
    assert prefill_h["name"] == ec.PREFILL_HEADER and cluster_h["name"] == ec.CLUSTER_HEADER
    prefill_rx = re.compile(prefill_h["string_match"]["safe_regex"]["regex"])
    assert prefill_rx.search("m_prefill_0") and prefill_rx.search("m_prefill_1")
    assert not any(prefill_rx.search(c) for c in ("admin", "m_decode_0", "m_prefill_0_load", ""))
    assert default["direct_response"]["status"] == 503
    assert pd_route["route"]["request_mirror_policies"] == [
        {"cluster_header": ec.PREFILL_HEADER, "disable_shadow_host_suffix_append": True}]
    assert pd_route["route"]["timeout"] == "120s"
    assert pd_route["route"]["cluster_header"] == ec.CLUSTER_HEADER
    assert "retry_policy" not in pd_route["route"] and vhost["retry_policy"]["num_retries"] == 2
    assert "request_mirror_policies" not in plain["route"] and plain["route"]["timeout"] == "0s"

    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    for i in range(2):
        eps = clusters[f"m_prefill_{i}"]["load_assignment"]["endpoints"]
        assert len(eps) == 1, "a prefill cluster has no fallbacks (the body names that worker)"
        assert f"m_prefill_{i}_load" in clusters
    for i in range(3):
        eps = clusters[f"m_decode_{i}"]["load_assignment"]["endpoints"]
        assert len(eps) == 3 and [g.get("priority", 0) for g in eps] == [0, 1, 1]
        assert f"m_decode_{i}_load" in clusters

    wasm = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm"][0]
    plugin = json.loads(wasm["typed_config"]["config"]["configuration"]["value"])
    assert plugin["default_model"] == "m"
    assert plugin["models"]["m"] == {
        "prefill": [{"cluster": "m_prefill_0", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998},
                    {"cluster": "m_prefill_1", "bootstrap_host": "p1.llm.svc", "bootstrap_port": 9000}],
        "decode": ["m_decode_0", "m_decode_1", "m_decode_2"],
    }


def test_pd_and_plain_models_together():
    opts = ec.options_from_args(["--model", "n=10.0.0.9:8000"] + PD)
    plugin = ec.plugin_config(opts)
    assert set(plugin["models"]) == {"n", "m"} and plugin["default_model"] == "n"
    assert "workers" in plugin["models"]["n"] and "prefill" in plugin["models"]["m"]


@pytest.mark.parametrize("args,option", [
    (["--pd-model", "m", "--prefill", "10.0.0.1:30000", "--decode", "10.0.0.3:1"], "--prefill"),
    (["--pd-model", "m", "--prefill", "10.0.0.1:30000@x", "--decode", "10.0.0.3:1"], "--prefill"),
    (["--pd-model", "m", "--prefill", "10.0.0.1:30000@70000", "--decode", "10.0.0.3:1"], "--prefill"),
    (["--pd-model", "m", "--prefill", "10.0.0.1:30000@8998"], "--decode"),
    (["--pd-model", "m", "--decode", "10.0.0.3:1"], "--prefill"),
    (["--prefill", "10.0.0.1:30000@8998", "--decode", "10.0.0.3:1"], "--prefill / --decode"),
    (["--pd-model", "m", "--prefill", "10.0.0.1:30000@8998", "--decode", "10.0.0.1:30000"], "--pd-model m"),
    (PD + ["--pd-timeout", "0s"], "--pd-timeout"),
    (PD + ["--model", "m=10.0.0.9:1"], "--pd-model m"),
])
def test_pd_errors_name_the_option(args, option):
    err = gen_fail(*args)
    assert err.startswith(f"envoy/gen: {option}: "), err
