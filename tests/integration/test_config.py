"""The Envoy configs in envoy/ are valid for the real Envoy 1.40 and render for tests."""

from __future__ import annotations

import json
import re
import secrets

import pytest

from prkit import envoy_config as ec
from prkit.build import wasm_path
from prkit.envoy import check_config
from prkit.paths import REPO_ROOT

DEMO_CONFIG = REPO_ROOT / "envoy" / "envoy.yaml"
CONFIGS = sorted((REPO_ROOT / "envoy").glob("*.yaml")) + sorted((REPO_ROOT / "envoy").glob("*.yml"))


def test_there_is_a_demo_config():
    assert DEMO_CONFIG in CONFIGS


def test_demo_config_validates_as_is(tmp_path):
    # Validation loads the Wasm module (and runs its start/configure): the filter must be built.
    # The demo config names the module relative to the repository root: validate from there.
    wasm_path()  # builds the module (or fails with cargo's output)
    check_config(DEMO_CONFIG.read_text(), tmp_path, DEMO_CONFIG.name, cwd=REPO_ROOT)


_WASM_FILENAME = re.compile(r"(filename:\s*)(\S+\.wasm)")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_envoy_validate(path, tmp_path):
    """Every config in envoy/ is valid for Envoy 1.40. Deployment configs name the module where a
    container or host installs it (e.g. /etc/prefix-router/...) and carry the placeholders a
    deployment replaces with its secrets (the filter refuses each one left in,
    tests/deploy/test_secrets.py): validate with the local build and secrets substituted, as a
    deployment does, nothing else changed."""
    text = path.read_text()
    assert "envoy.filters.http.wasm" in text, f"{path.name}: not a prefix-router Envoy config?"
    subs = _WASM_FILENAME.findall(text)
    assert subs, f"{path.name}: no Wasm module filename"
    rendered = _WASM_FILENAME.sub(lambda m: m.group(1) + str(wasm_path()), text)
    rendered = rendered.replace(ec.HASH_KEY_PLACEHOLDER, secrets.token_hex(16))
    rendered = rendered.replace(ec.PEER_SECRET_PLACEHOLDER, secrets.token_hex(16))
    check_config(rendered, tmp_path, path.name, cwd=REPO_ROOT)


def test_rendered_demo_config_validates(tmp_path):
    """The demo config as the tests run it (prkit.envoy_config.local_demo): local ports, the local
    build, plugin overrides merged."""
    ports = {"w0": 18010, "w1": 18011, "w2": 18012, "w3": 18013}
    opts = ec.local_demo(ports, listen=18000, admin=18001, wasm=str(wasm_path()),
                         plugin={"policy": {"load_eps": 0.5}})
    cfg = ec.plugin_config(opts)
    assert cfg["policy"] == {"name": "cost_aware", "load_eps": 0.5}
    doc = ec.config(opts)
    (listener,) = doc["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (wasm,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm"]
    assert json.loads(wasm["typed_config"]["config"]["configuration"]["value"]) == cfg
    text = ec.render(opts)
    for port in (18000, 18001, 18010, 18011, 18012, 18013):
        assert f"port_value: {port}" in text
    check_config(text, tmp_path, "e.yaml")


def test_demo_plugin_config_matches_the_contract():
    cfg = ec.plugin_config(ec.profile("demo"))
    # local workers are IP literals: each entry carries the worker's address
    assert cfg["models"] == {"llama": {"workers": [
        {"cluster": f"w{i}", "weight": 1.0, "address": f"127.0.0.1:{30000 + i}"} for i in range(4)]}}
    assert cfg.get("cluster_header", "x-prefix-router-cluster") == "x-prefix-router-cluster"
    text = DEMO_CONFIG.read_text()
    for key in (
        "allow_on_headers_stop_iteration: true",
        "failure_policy: FAIL_RELOAD",
        "vm_id: prefix_router",
        "runtime: envoy.wasm.runtime.v8",
        "cluster_header: x-prefix-router-cluster",
        "address: 127.0.0.1, port_value: 9901",
        "address: 127.0.0.1, port_value: 10000",
    ):
        assert key in text, key
