"""Shipped-config hardening, checked on the real Envoy: encoded paths are
normalized before the filter and the worker see them, and the public route can only reach worker
clusters, even with the filter bypassed."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from prkit import envoy_config as ec
from prkit.build import wasm_path
from prkit.envoy import Envoy
from prkit.envoy_config import run_gen
from prkit.paths import REPO_ROOT as REPO
from prkit.ports import free_port
from prkit.wait import wait_until

from .conftest import Worker, get, header_command, yaml_doc

SHIPPED = ["envoy.yaml", "compose.yaml", "ingress.yaml", "scale-out.yaml", "pool.yaml"]


class Live:
    """A real Envoy on a config from prkit.envoy_config (dicts, optionally edited), 2 workers."""

    def __init__(self, tmp_path, edit=None, **opts):
        self.workers = {"llama_0": Worker("A"), "llama_1": Worker("B")}
        self.listen, self.admin, self.stats = free_port(), free_port(), free_port()
        o = ec.profile("ingress", models={"llama": [ec.Worker(n, "127.0.0.1", w.port) for n, w in self.workers.items()]},
                       listen=("127.0.0.1", self.listen), admin=("127.0.0.1", self.admin),
                       stats_listen=("127.0.0.1", self.stats), wasm=str(wasm_path()), debug_header=True,
                       **{"load_poll_ms": 0, **opts})
        cfg = ec.config(o)
        if edit:
            edit(cfg)
        self.envoy = Envoy(ec.dump(cfg), listener_port=self.listen, admin_port=self.admin, workdir=tmp_path,
                           concurrency=1, log_level="warn").start()
        self.log = self.envoy.log_path
        # the metrics listener (a route to the admin's /ready) is up too
        wait_until(lambda: get(self.stats, "/ready")[0] == 200, "the stats listener's /ready", 60, 0.1)

    def post(self, path: str, body: dict, headers: dict | None = None):
        req = urllib.request.Request(f"http://127.0.0.1:{self.listen}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", **(headers or {})},
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()

    def close(self):
        self.envoy.stop()
        for w in self.workers.values():
            w.stop()


@pytest.fixture
def live(tmp_path):
    lv = Live(tmp_path)
    yield lv
    lv.close()


CHAT = {"model": "llama", "messages": [{"role": "user", "content": "normalize me " * 20}], "max_tokens": 4}
COMPLETION = {"model": "llama", "prompt": "normalize me " * 20, "max_tokens": 4}


@pytest.mark.parametrize(
    "sent,seen,body",
    [
        ("/v1/chat/%63ompletions", "/v1/chat/completions", CHAT),
        ("/v1/chat%2Fcompletions", "/v1/chat/completions", CHAT),
        ("/v1/chat%2fcompletions", "/v1/chat/completions", CHAT),
        ("//v1/completions", "/v1/completions", COMPLETION),
        ("/v1//chat/./completions", "/v1/chat/completions", CHAT),
    ],
)
def test_encoded_paths_are_normalized_for_the_filter_and_the_worker(tmp_path, sent, seen, body):
    lv = Live(tmp_path)
    try:
        status, headers, raw = lv.post(sent, body)
        assert status == 200, (status, raw, lv.log.read_text()[-3000:])
        decision = dict(p.strip().split("=", 1) for p in headers["x-prefix-router-decision"].split(";"))
        # classified as inference (charged, indexed), not passthrough
        assert decision["reason"] != "passthrough", decision
        served = json.loads(raw)["worker"]
        (worker,) = [w for w in lv.workers.values() if w.name == served]
        assert worker.requests[-1][0] == seen
    finally:
        lv.close()


def test_every_shipped_config_normalizes_paths(composecheck, tmp_path):
    for name in SHIPPED:
        doc = yaml_doc(composecheck, (REPO / "envoy" / name).read_text(), tmp_path)
        (ingress,) = [li for li in doc["static_resources"]["listeners"] if li["name"] == "ingress"]
        hcm = ingress["filter_chains"][0]["filters"][0]["typed_config"]
        assert hcm["normalize_path"] is True and hcm["merge_slashes"] is True, name
        assert hcm["path_with_escaped_slashes_action"] == "UNESCAPE_AND_FORWARD", name


def test_public_route_reaches_only_worker_clusters(composecheck, tmp_path):
    """Every shipped config: the cluster_header route only matches worker cluster names; the
    fallback route answers itself."""
    for name in SHIPPED:
        text = (REPO / "envoy" / name).read_text()
        doc = yaml_doc(composecheck, text, tmp_path)
        plugin = json.loads(next(f for li in doc["static_resources"]["listeners"] if li["name"] == "ingress"
                                 for f in li["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
                                 if f["name"] == "envoy.filters.http.wasm")["typed_config"]["config"]
                            ["configuration"]["value"])
        workers = {w if isinstance(w, str) else w["cluster"] for m in plugin["models"].values()
                   for w in m.get("workers", [])} | {m["pool"]["cluster"] for m in plugin["models"].values() if "pool" in m}
        others = {c["name"] for c in doc["static_resources"]["clusters"]} - workers
        (ingress,) = [li for li in doc["static_resources"]["listeners"] if li["name"] == "ingress"]
        routes = ingress["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
        dynamic = [r for r in routes if "cluster_header" in r.get("route", {})]
        assert dynamic and all("cluster" not in r.get("route", {}) for r in routes), name
        for r in dynamic:
            method, h = r["match"]["headers"]  # the public route's method, then the worker check
            assert method["name"] == ":method"
            assert h["name"] == plugin["cluster_header"]
            rx = re.compile(h["string_match"]["safe_regex"]["regex"])
            assert all(rx.search(w) for w in workers), name
            assert not any(rx.search(c) for c in others | {"admin", "llama_0_load", "llama_load", "prefix_router_peer_0",
                                                           ""}), name
        assert routes[-1]["direct_response"]["status"] == 503, name
        # no route matches every path: what the public route leaves out gets Envoy's 404
        assert not any(r["match"].get("prefix") is not None for r in routes), name
        assert header_command(text)  # generated


def test_bypassed_filter_cannot_reach_admin_or_poll_clusters(tmp_path):
    """With the Wasm filter removed (what FAIL_OPEN or a misconfiguration would do), a client's own
    x-prefix-router-cluster header reaches a worker at most, never admin or a poll cluster."""

    def drop_wasm(cfg):
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.wasm"]

    lv = Live(tmp_path, edit=drop_wasm, load_poll_ms=100)
    try:
        for cluster in ("admin", "llama_0_load", "llama_0|admin", "nope"):
            status, _, raw = lv.post("/v1/chat/completions", CHAT, {"x-prefix-router-cluster": cluster})
            assert status == 503 and b"no worker was chosen" in raw, (cluster, status, raw)
        assert get(lv.admin, "/ready")[0] == 200  # admin itself is up: it was the route that refused
        status, _, raw = lv.post("/v1/chat/completions", CHAT, {"x-prefix-router-cluster": "llama_1"})
        assert status == 200 and json.loads(raw)["worker"] == "B"
    finally:
        lv.close()


def test_compose_is_private_by_default():
    plugin_text = (REPO / "envoy" / "compose.yaml").read_text()
    assert "--debug-header" not in header_command(plugin_text)
    assert '"debug_header": null' in plugin_text
    assert run_gen(*header_command(plugin_text)) == plugin_text


def _post_from(port: int, source: str, body: dict) -> tuple[int, dict]:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=20, source_address=(source, 0))
    try:
        c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}
    finally:
        c.close()


def test_per_client_rate_limit(tmp_path):
    """--rate-limit-per-client: each client address has its own bucket; one client over its limit
    gets 429 while another is still served."""
    lv = Live(tmp_path, rate_limit=0, rate_limit_per_client=2)
    try:
        for _ in range(40):
            status, headers = _post_from(lv.listen, "127.0.0.1", CHAT)
            if status == 429:
                break
            assert status == 200, status
        assert status == 429 and headers.get("x-local-rate-limit") == "true"
        # another address right away: its bucket is full
        assert _post_from(lv.listen, "127.0.0.2", CHAT)[0] == 200
    finally:
        lv.close()


def test_rate_limit_per_client_option(composecheck, tmp_path):
    text = run_gen("--model", "m=10.0.0.1:8000", "--rate-limit-per-client", "5", "--rate-limit", "0")
    doc = yaml_doc(composecheck, text, tmp_path)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (rl,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.local_ratelimit"]
    assert "token_bucket" not in rl  # --rate-limit 0: no global bucket
    assert rl["rate_limits"] == [{"actions": [{"remote_address": {}}]}]
    assert rl["descriptors"][0]["entries"] == [{"key": "remote_address"}]
    assert rl["descriptors"][0]["token_bucket"]["max_tokens"] == 5
    assert hcm["use_remote_address"] is True  # the peer address, not a client-set X-Forwarded-For
