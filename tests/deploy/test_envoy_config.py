"""prkit.envoy_config: the Python API behind envoy/gen (profiles, sections, YAML output, errors)."""

from __future__ import annotations

import json
import re

import pytest

from prkit import envoy_config as ec
from prkit.build import wasm_path
from prkit.envoy import check_config
from prkit.envoy_config import gen_result

from .conftest import yaml_doc


@pytest.mark.parametrize("profile", ec.PROFILES)
def test_yaml_output_parses_back_to_the_config(profile, composecheck, tmp_path):
    """dump() is a YAML writer of its own (stdlib only): a real YAML parser reads back exactly the
    dicts config() returns, comments dropped."""
    models = None if profile in ("demo", "compose") else ec.fleet("m/x.y", {"a_0": 18010, "a_1": 18011})
    opts = ec.profile(profile, **({"models": models} if models else {}), wasm=str(wasm_path()),
                      plugin={"index": {"capacity": 4096}, "note": "a: b, #c [d] {e} 'f' \"g\"\n  h"})
    text = ec.render(opts)
    assert yaml_doc(composecheck, text, tmp_path) == ec.config(opts)


def test_test_profile_api_validates_with_plugin_overrides(tmp_path):
    opts = ec.profile("test", models=ec.fleet("llama", {"w0": 18010, "w1": 18011}),
                      listen=("127.0.0.1", 18000), admin=("127.0.0.1", 18001), wasm=str(wasm_path()),
                      plugin={"policy": {"load_eps": 0.5}, "debug_header": None})
    plugin = ec.plugin_config(opts)
    assert plugin["policy"] == {"name": "cost_aware", "load_eps": 0.5}
    assert plugin["debug_header"] is None and "load_poll" not in plugin
    cfg = ec.config(opts)
    assert [c["name"] for c in cfg["static_resources"]["clusters"]] == ["w0", "w1"]
    (li,) = cfg["static_resources"]["listeners"]
    assert li["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18000}
    check_config(ec.render(opts), tmp_path)


def test_listeners_default_to_loopback():
    cfg = ec.config(ec.profile("ingress", models=ec.fleet("m", {"m_0": 1}, host="10.0.0.1")))
    addrs = [li["address"]["socket_address"]["address"] for li in cfg["static_resources"]["listeners"]]
    assert addrs == ["127.0.0.1", "127.0.0.1"] and cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_access_log_switch():
    def has_log(**kw):
        cfg = ec.config(ec.profile("test", models=ec.fleet("m", {"w0": 1}), **kw))
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        return "access_log" in hcm
    assert has_log() and not has_log(access_log=False)
    bench = ec.config(ec.profile("bench", models=ec.fleet("m", {"w0": 1})))
    assert "access_log" not in bench["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_plugin_options_reach_the_plugin_config(composecheck, tmp_path):
    r = gen_result("--model", "llama=w0=127.0.0.1:18010@2,w1=127.0.0.1:18011", "--policy-param", "load_eps=0.25",
            "--unknown-model", "reject", "--passthrough-cluster", "w1", "--index-capacity", "8192",
            "--index-ttl", "600", "--plugin", "index.local_cache_ms=200", "--no-access-log",
            "--wasm", str(wasm_path()))
    assert r.returncode == 0, r.stderr
    check_config(r.stdout, tmp_path)  # the filter accepts it
    doc = yaml_doc(composecheck, r.stdout, tmp_path)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (wasm,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm"]
    doc_plugin = json.loads(wasm["typed_config"]["config"]["configuration"]["value"])
    # IP literal workers carry their address (weight 1.0 unless given)
    assert doc_plugin["models"] == {"llama": {"workers": [
        {"cluster": "w0", "weight": 2.0, "address": "127.0.0.1:18010"},
        {"cluster": "w1", "weight": 1.0, "address": "127.0.0.1:18011"}]}}
    assert doc_plugin["policy"] == {"name": "cost_aware", "load_eps": 0.25}
    assert doc_plugin["unknown_model"] == "reject" and doc_plugin["passthrough_cluster"] == "w1"
    assert doc_plugin["index"] == {"capacity": 8192, "ttl_seconds": 600, "local_cache_ms": 200}
    assert "access_log" not in hcm


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--rate-limit", "-1"], ["--rate-limit", "between 0 and", "got -1"]),
        (["--rate-limit", "x"], ["--rate-limit", "integer", "'x'"]),
        (["--fallbacks", "-2"], ["--fallbacks", "got -2"]),
        (["--max-ejection-percent", "101"], ["--max-ejection-percent", "between 0 and 100"]),
        (["--health-interval", "5"], ["--health-interval", "duration"]),
        (["--listen", "0.0.0.0"], ["--listen", "HOST:PORT"]),
        (["--unknown-model", "drop"], ["--unknown-model", "default or reject"]),
        (["--passthrough-cluster", "admin"], ["--passthrough-cluster", "not a worker cluster"]),
        (["--index-capacity", "0"], ["--index-capacity", "at least 1"]),
        (["--plugin", "index."], ["--plugin", "PATH=JSON"]),
        (["--default-model", "other"], ["--default-model", "not one of the models"]),
        (["--model", "n=1.2.3.4:5@-1"], ["--model n", "weight"]),
        (["--hit-check-ms", "-5"], ["--hit-check-ms", "between 0 and 600000", "got -5"]),
    ],
)
def test_errors_name_the_option_and_the_reason(args, needles):
    r = gen_result("--model", "m=10.0.0.1:8000", *args)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout[:200])
    assert r.stderr.startswith("envoy/gen: ")
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


def test_hit_check_interval_reaches_the_load_poll_section():
    r = gen_result("--model", "m=10.0.0.1:8000", "--load-poll-ms", "50", "--hit-check-ms", "0")
    assert r.returncode == 0, r.stderr
    assert '"metrics_interval_ms": 0' in r.stdout
    r = gen_result("--model", "m=10.0.0.1:8000", "--load-poll-ms", "50")
    assert r.returncode == 0 and "metrics_interval_ms" not in r.stdout, "the filter's default otherwise"


def test_api_errors_are_config_errors():
    with pytest.raises(ec.ConfigError) as e:
        ec.config(ec.profile("ingress", models=ec.fleet("m", {"m_0": 1}), rate_limit=-1))
    assert e.value.option == "--rate-limit"
    with pytest.raises(ec.ConfigError):
        ec.profile("nope")


@pytest.mark.parametrize("mode", ["plain", "buffer", "prefix_router", "prefix_router_nopoll"])
@pytest.mark.parametrize("upstream", [18020, [18020, 18021, 18022, 18023]])
def test_overhead_bench_configs_validate(mode, upstream, tmp_path):
    """benches/overhead's proxies come from this module too (no hand-written YAML): each mode, with
    one upstream for all clusters (table mode) or one per worker (stream mode), is a config Envoy
    accepts."""
    from benches.overhead_modes import common as overhead

    text = overhead.envoy_yaml(mode, 18000, 18001, upstream)
    if mode.startswith("prefix_router"):
        text = text.replace(str(overhead.WASM), str(wasm_path()))
        # The filter's default load polls, or none in the `_nopoll` mode.
        assert ('"interval_ms":0' in text.replace(" ", "")) == mode.endswith("_nopoll"), text
    check_config(text, tmp_path, f"overhead-{mode}.yaml")


@pytest.mark.parametrize("mode", ["prefix_router_pool64", "prefix_router_pool64_nomembership"])
def test_overhead_bench_pool_configs_validate(mode, tmp_path):
    """benches/overhead's idle-only pool kinds: one pool model from an EDS file of 64 hosts,
    membership every 1000 ms or off, load polls every 60 s (the filter reads membership only while
    they are on); Envoy accepts the config (EDS file included)."""
    from benches.overhead_modes import common as overhead

    text = overhead.envoy_yaml(mode, 18000, 18001, [18020] * 4, tmp=tmp_path)
    eds = json.loads((tmp_path / f"eds-{mode}" / "llama.json").read_text())
    (cla,) = eds["resources"]
    assert len(cla["endpoints"][0]["lb_endpoints"]) == overhead.POOL_HOSTS == 64
    plugin = text.replace(" ", "")
    assert f'"interval_ms":{overhead.POOL_KINDS[mode]},' in plugin and '"interval_ms":60000' in plugin, text
    check_config(text.replace(str(overhead.WASM), str(wasm_path())), tmp_path, f"overhead-{mode}.yaml")


def test_overhead_bench_no_worker_address(monkeypatch):
    """--no-worker-address: the static workers are cluster names only (what a build from before
    pools accepts); by default they carry their address."""
    from benches.overhead_modes import common as overhead

    assert '"address":"127.0.0.2:18020"' in re.sub(r"\s", "", overhead.envoy_yaml("prefix_router", 18000, 18001, 18020))
    monkeypatch.setattr(overhead, "WORKER_ADDRESS", False)
    text = re.sub(r"\s", "", overhead.envoy_yaml("prefix_router", 18000, 18001, 18020))
    assert '"address":"127.0.0.' not in text and '"workers":["w0","w1","w2","w3"]' in text, text
