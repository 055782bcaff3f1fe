"""The Grafana dashboard (docker/grafana/dashboards/prefix-router.json) and its compose wiring
(profile "monitoring": Prometheus + Grafana).

Every query of the dashboard must name metrics that really exist: a real Envoy (an envoy/gen
config like the compose one, scraped on its stats listener as Prometheus does) running the
compiled filter in front of two real `sglang-sim` workers (scraped on /metrics) after some
traffic. Every metric the filter exports is on the dashboard (a new one fails this test until a
panel shows it), and the Prometheus jobs the queries select on are the ones it scrapes.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request

import pytest

from prkit.build import wasm_path
from prkit.envoy import Envoy
from prkit.envoy_config import run_gen
from prkit.fleet import SimFleet
from prkit.paths import REPO_ROOT as REPO
from prkit.ports import free_port
from prkit.prom import metric_names


DASHBOARD = REPO / "docker" / "grafana" / "dashboards" / "prefix-router.json"
PROMETHEUS = REPO / "docker" / "prometheus" / "prometheus.yml"
PROVISIONING = REPO / "docker" / "grafana" / "provisioning"

# PromQL words that are not metric names (functions, aggregations, keywords) in the expressions.
PROMQL_WORDS = {
    "sum", "avg", "max", "min", "count", "rate", "irate", "increase", "histogram_quantile", "by",
    "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
    "clamp_min", "clamp_max", "abs", "topk", "bottomk", "quantile", "delta", "deriv", "time",
}


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in panels(dash) for t in p.get("targets", [])]


def names_in(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, __name__ regexes) an expression selects."""
    regexes = set(re.findall(r'__name__=~"([^"]+)"', expr))
    e = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    e = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", e)  # grouping labels
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range selectors
    e = re.sub(r'"[^"]*"', " ", e)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e)) - PROMQL_WORDS
    return words, regexes


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """Metric names from a real scrape: {"envoy": names, "workers": names}."""
    workdir = tmp_path_factory.mktemp("dashboard")
    fleet = SimFleet(2, workdir, ["--time-scale", "0"], models="llama")
    fleet.start()
    envoy = None
    try:
        listen, admin, stats = free_port(), free_port(), free_port()
        spec = ",".join(f"127.0.0.1:{p}" for p in fleet.ports.values())
        text = run_gen("--model", f"llama={spec}", "--listen", f"127.0.0.1:{listen}",
                       "--admin", f"127.0.0.1:{admin}", "--stats-listen", f"127.0.0.1:{stats}",
                       "--wasm", str(wasm_path()), "--rate-limit", "0")
        envoy = Envoy(text, listener_port=listen, admin_port=admin, workdir=workdir, log_level="warn").start()
        for i in range(4):
            body = json.dumps({"model": "llama", "stream": i % 2 == 0, "max_tokens": 4,
                               "messages": [{"role": "user", "content": f"dashboard probe {i} " * 40}]}).encode()
            req = urllib.request.Request(f"{envoy.base_url}/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200
                r.read()
        # As Prometheus scrapes them: Envoy's stats listener, the workers' /metrics.
        with urllib.request.urlopen(f"http://127.0.0.1:{stats}/stats/prometheus", timeout=10) as r:
            envoy_names = metric_names(r.read().decode())
        worker_names: set[str] = set()
        for w in fleet.workers.values():
            worker_names |= metric_names(w.metrics_text())
        return {"envoy": envoy_names, "workers": worker_names}
    finally:
        if envoy is not None:
            envoy.stop()
        fleet.stop()


def test_every_query_names_exported_metrics(dashboard, exported):
    names = exported["envoy"] | exported["workers"]
    assert any(n.startswith("prefix_router_") for n in exported["envoy"]), sorted(exported["envoy"])[:20]
    assert any(n.startswith("sglang:") for n in exported["workers"]), sorted(exported["workers"])
    bad = []
    for e in exprs(dashboard):
        words, regexes = names_in(e)
        assert words or regexes, f"no metric in {e!r}"
        bad += [(w, e) for w in words if w not in names]
        bad += [(r, e) for r in regexes if not any(re.fullmatch(r, n) for n in names)]
    assert not bad, "dashboard queries name metrics nobody exports:\n" + "\n".join(f"  {w}: {e}" for w, e in bad)


def test_every_filter_metric_is_on_the_dashboard(dashboard, exported):
    """Decisions by reason, blocks, index, load poll, peers...: each prefix_router_* metric the
    filter exports is shown (the per-worker in-flight gauges through their name regex)."""
    named, regexes = set(), set()
    for e in exprs(dashboard):
        w, r = names_in(e)
        named |= w
        regexes |= r
    filter_metrics = {n for n in exported["envoy"] if n.startswith("prefix_router_")}
    missing = {n for n in filter_metrics if n not in named and not any(re.fullmatch(r, n) for r in regexes)}
    assert not missing, f"add these filter metrics to {DASHBOARD.relative_to(REPO)}: {sorted(missing)}"
    # the four views the operators asked for
    assert any(n.startswith("prefix_router_requests_") for n in named)
    assert {"prefix_router_blocks_matched", "prefix_router_blocks_prompt"} <= named
    assert any(re.fullmatch(r, "prefix_router_inflight_requests_w0") for r in regexes)
    assert any(n.startswith("sglang:") for n in named)


def test_queries_select_the_jobs_prometheus_scrapes(dashboard, composecheck):
    (cfg,) = json.loads(subprocess.run([str(composecheck), "yaml2json", str(PROMETHEUS)], capture_output=True,
                                       text=True, timeout=60, check=True).stdout)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"prefix-router", "workers"}
    assert jobs["prefix-router"]["metrics_path"] == "/stats/prometheus"
    assert jobs["prefix-router"]["static_configs"][0]["targets"] == ["envoy:9902"]
    assert jobs["workers"]["static_configs"][0]["targets"] == [f"w{i}:30000" for i in range(4)]
    # Envoy's stats listener in the compose config is the port Prometheus scrapes.
    assert "socket_address: { address: 0.0.0.0, port_value: 9902 }" in (REPO / "envoy" / "compose.yaml").read_text()
    used = {j for e in exprs(dashboard) for j in re.findall(r'job="([^"]+)"', e)}
    assert used == set(jobs), used
    for e in exprs(dashboard):
        assert "job=" in e, f"query without a job selector: {e}"


def test_grafana_provisioning(dashboard, composecheck):
    (ds,) = json.loads(subprocess.run([str(composecheck), "yaml2json", str(PROVISIONING / "datasources" / "prometheus.yaml")],
                                      capture_output=True, text=True, timeout=60, check=True).stdout)
    (src,) = ds["datasources"]
    assert src["type"] == "prometheus" and src["url"] == "http://prometheus:9090"
    for p in panels(dashboard):
        if p["type"] != "row":
            assert p["datasource"]["uid"] == src["uid"], p["title"]
            assert all(t["datasource"]["uid"] == src["uid"] for t in p["targets"]), p["title"]
    (prov,) = json.loads(subprocess.run([str(composecheck), "yaml2json", str(PROVISIONING / "dashboards" / "prefix-router.yaml")],
                                        capture_output=True, text=True, timeout=60, check=True).stdout)
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "prefix-router"
