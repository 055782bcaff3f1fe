"""envoy/gen and envoy/ingress.yaml: the checked-in config is the generator's output, every variant
passes `envoy --mode validate` (which also loads the .wasm and checks the plugin configuration),
and a generated config really routes and retries on another worker when the chosen one is down."""

from __future__ import annotations

import json
import re

import pytest

from prkit.build import wasm_path
from prkit.envoy import Envoy, check_config
from prkit.envoy_config import gen_result, run_gen
from prkit.paths import REPO_ROOT as REPO
from prkit.ports import free_port
from prkit.wait import wait_until

from .conftest import (Worker, get, hcm_of, header_command, listener, plugin_config, post, with_local_wasm,
                       yaml_doc)

CONTAINER_WASM = "/etc/prefix-router/prefix_router.wasm"

GENERATED = ["compose.yaml", "envoy.yaml", "ingress.yaml", "pool.yaml", "scale-out.yaml"]


def test_every_envoy_config_is_generated():
    """No hand-written Envoy config: every envoy/*.yaml is envoy/gen output (one source)."""
    assert sorted(p.name for p in (REPO / "envoy").glob("*.y*ml")) == GENERATED


@pytest.mark.parametrize("name", GENERATED)
def test_checked_in_config_is_generator_output(name):
    checked_in = (REPO / "envoy" / name).read_text()
    args = header_command(checked_in)
    assert run_gen(*args) == checked_in, (
        f"envoy/{name} is stale: regenerate with envoy/regen (envoy/gen {' '.join(args)} > envoy/{name})"
    )


@pytest.mark.parametrize(
    "name,profile",
    [("envoy.yaml", "demo"), ("compose.yaml", "compose"), ("ingress.yaml", "ingress"), ("scale-out.yaml", "ingress"),
     ("pool.yaml", "ingress")],
)
def test_checked_in_config_profiles(name, profile):
    args = header_command((REPO / "envoy" / name).read_text())
    assert args[:2] == ["--profile", profile], args


def clusters_of(doc: dict) -> dict:
    return {c["name"]: c for c in doc["static_resources"]["clusters"]}


def hosts_of(cluster: dict) -> list[tuple[str, int]]:
    """(address, priority) of every endpoint, in order."""
    return [(ep["endpoint"]["address"]["socket_address"]["address"], g.get("priority", 0))
            for g in cluster["load_assignment"]["endpoints"] for ep in g["lb_endpoints"]]


def test_ingress_structure(composecheck, tmp_path):
    text = (REPO / "envoy" / "ingress.yaml").read_text()
    doc = yaml_doc(composecheck, text, tmp_path)
    # one cluster per worker, one per worker for its load polls (the worker's own host only, no
    # health check, no outlier detection), + the loopback admin cluster behind the stats listener
    clusters = clusters_of(doc)
    workers = ["llama_0", "llama_1", "llama_2", "llama_3", "qwen_0", "qwen_1"]
    assert list(clusters) == workers + [w + "_load" for w in workers] + ["admin"]
    for w in workers:
        c = clusters[w]
        assert c["type"] == "STRICT_DNS"
        assert c["health_checks"][0]["http_health_check"]["path"] == "/health"
        assert "outlier_detection" in c and "circuit_breakers" in c
        assert c["per_connection_buffer_limit_bytes"] == 16777216
        p = clusters[w + "_load"]
        assert p["type"] == "STRICT_DNS" and "health_checks" not in p and "outlier_detection" not in p
        assert hosts_of(p) == hosts_of(c)[:1]
    # worker i at priority 0, the next 3 (llama) / 1 (qwen) workers of its model at priority 1
    assert hosts_of(clusters["llama_1"]) == [(f"sglang-llama-{i}.sglang-llama.llm.svc.cluster.local", p)
                                            for i, p in ((1, 0), (2, 1), (3, 1), (0, 1))]
    assert [h.split(".")[0] for h, _ in hosts_of(clusters["qwen_0"])] == ["sglang-qwen-0", "sglang-qwen-1"]
    assert hosts_of(clusters["admin"]) == [("127.0.0.1", 0)]

    assert doc["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}
    ingress = listener(doc, "ingress")
    assert ingress["per_connection_buffer_limit_bytes"] == 16777216
    hcm = hcm_of(ingress)
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    assert hcm["route_config"]["validate_clusters"] is True
    routes = vhost["routes"]
    assert all(r["request_body_buffer_limit"] == 16777216 for r in routes if "route" in r)
    # one retry policy for every route of the virtual host (none of its own on a route)
    assert not any("retry_policy" in r.get("route", {}) for r in routes)
    retry = vhost["retry_policy"]
    assert retry["retry_on"] == "connect-failure,refused-stream,reset,retriable-status-codes"
    assert retry["per_try_idle_timeout"]
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert retry["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.local_ratelimit", "envoy.filters.http.wasm", "envoy.filters.http.router"]
    wasm = hcm["http_filters"][1]["typed_config"]["config"]
    assert wasm["allow_on_headers_stop_iteration"] is True and wasm["failure_policy"] == "FAIL_RELOAD"
    fmt = hcm["access_log"][0]["typed_config"]["log_format"]["json_format"]
    assert fmt["route_cluster"] == "%REQ(X-PREFIX-ROUTER-CLUSTER)%"
    assert fmt["decision"] == "%RESP(X-PREFIX-ROUTER-DECISION)%"
    stats_routes = hcm_of(listener(doc, "stats"))["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["match"]["path"] for r in stats_routes] == ["/stats/prometheus", "/ready"]

    plugin = plugin_config(text)
    assert plugin == json.loads(wasm["configuration"]["value"])
    assert plugin["models"] == {
        "llama": {"workers": ["llama_0", "llama_1", "llama_2", "llama_3"]},
        "qwen": {"workers": ["qwen_0", "qwen_1"]},
    }
    assert plugin["default_model"] == "llama"
    assert "passthrough_cluster" not in plugin  # round robin over the default model's workers
    assert plugin["debug_header"] is None  # production default: no decision header to clients
    assert plugin["load_poll"] == {"interval_ms": 100, "cluster_suffix": "_load"}  # --load-poll-ms default
    assert "peers" not in plugin and "peer_listener" not in plugin  # standalone: no --peers
    assert [li["name"] for li in doc["static_resources"]["listeners"]] == ["ingress", "stats"]


def test_compose_config_plugin():
    plugin = plugin_config((REPO / "envoy" / "compose.yaml").read_text())
    assert plugin["models"] == {"llama": {"workers": ["llama_0", "llama_1", "llama_2", "llama_3"]}}
    assert plugin["debug_header"] is None  # clients of the demo are not trusted by default


@pytest.mark.parametrize("name", ["ingress.yaml", "compose.yaml", "scale-out.yaml"])
def test_checked_in_config_validates(name, tmp_path):
    text = (REPO / "envoy" / name).read_text()
    # the placeholders are replaced at deploy time (the filter refuses each one left in:
    # test_secrets.py)
    text = text.replace('"hash_key": "__HASH_KEY__"', '"hash_key": "' + "k" * 32 + '"')
    text = text.replace('"secret": "__PREFIX_ROUTER_PEER_SECRET__"', '"secret": "' + "p" * 32 + '"')
    check_config(with_local_wasm(text, CONTAINER_WASM), tmp_path, name)


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "m=10.0.0.1:8000"],  # one worker, IP address
        ["--model", "a.b/c-d=x:1,y:2", "--rate-limit", "0", "--stats-listen", "none", "--debug-header"],
    ],
)
def test_generator_variants_validate(args, tmp_path):
    text = run_gen(*args, "--wasm", str(wasm_path()))
    check_config(text, tmp_path)


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--model", "llama"],
        ["--model", "llama=host"],
        ["--model", "llama=h:99999"],
        ["--model", "llama=h:1", "--model", "llama=h:2"],
        ["--model", "llama=h:1", "--default-model", "qwen"],
        ["--model", "llama=h:1,h:1"],
    ],
)
def test_generator_rejects_bad_input(args):
    r = gen_result(*args)
    assert r.returncode == 2 and "envoy/gen:" in r.stderr and r.stdout == ""


# --------------------------------------------------------------------------------------------
# The generated config, run for real: 2 tiny upstream workers on 127.0.0.1
# --------------------------------------------------------------------------------------------


@pytest.fixture
def live(tmp_path):
    workers = [Worker("A"), Worker("B")]
    listen, admin, stats = free_port(), free_port(), free_port()
    text = run_gen(
        "--model",
        ",".join(f"llama=127.0.0.1:{workers[0].port}" if i == 0 else f"127.0.0.1:{w.port}"
                 for i, w in enumerate(workers)),
        "--listen", f"127.0.0.1:{listen}",
        "--admin", f"127.0.0.1:{admin}",
        "--stats-listen", f"127.0.0.1:{stats}",
        "--wasm", str(wasm_path()),
        "--debug-header",
        # health checks every 2 s with 2 failures to mark a host down: a worker killed right
        # before a request still looks healthy to Envoy for that request (only the retry can save
        # it), and a first check that timed out while the main thread compiled the Wasm module
        # (seconds on a loaded machine) is repaired 2 s later
        "--health-interval", "2s",
        # a first check must not time out while Envoy's main thread compiles the Wasm module
        # (seconds on a loaded machine): after every host of a cluster failed it, Envoy 1.40 was
        # seen sending part of the traffic to the priority-1 fallback even once all were healthy
        "--health-timeout", "10s",
        # no load polls: fewer connections to the workers; this test is about routing and retries
        "--load-poll-ms", "0",
    )
    envoy = Envoy(text, listener_port=listen, admin_port=admin, workdir=tmp_path, name="ingress",
                  concurrency=1, log_level="warn")
    try:
        envoy.start(timeout_s=60)
        # Every worker healthy in every worker cluster before the first request: a first health
        # check that times out (a loaded machine) leaves a host unhealthy until a later one, and the cluster's traffic would go to its fallback.
        def flags():
            return [line.rsplit("::", 1)[1] for line in envoy.admin_get("/clusters")[1].splitlines()
                    if re.match(r"llama_\d::", line) and "::health_flags::" in line]

        wait_until(lambda: len(flags()) == 4 and all(f == "healthy" for f in flags()),
                   lambda: f"workers healthy in Envoy: {flags()}", 60, 0.2)
        yield {"workers": {f"llama_{i}": w for i, w in enumerate(workers)}, "listen": listen,
               "stats": stats, "log": envoy.log_path}
    finally:
        envoy.stop()
        for w in workers:
            try:
                w.stop()
            except Exception:
                pass


def decision(headers: dict) -> dict:
    h = {k.lower(): v for k, v in headers.items()}["x-prefix-router-decision"]
    return dict(part.strip().split("=", 1) for part in h.split(";"))


def test_generated_config_routes_and_retries_on_another_worker(live):
    port, workers = live["listen"], live["workers"]
    body = {
        "model": "llama",
        "messages": [{"role": "system", "content": "You are a test. " * 40},
                     {"role": "user", "content": "retry me"}],
        "max_tokens": 4,
    }
    # 1. routed: the worker the filter chose served it, first attempt
    status, headers, raw = post(port, body)
    assert status == 200, (status, raw)
    d = decision(headers)
    chosen = d["worker"]
    assert chosen in workers and d["reason"] == "hash_affinity", d
    assert json.loads(raw)["worker"] == workers[chosen].name, (headers, live["log"].read_text()[-3000:])
    assert headers.get("x-envoy-attempt-count") == "1"
    assert workers[chosen].requests[-1] == ("/v1/chat/completions", "1")

    # 2. the same prompt again: prefix hit on the same worker
    status, headers, raw = post(port, body)
    assert status == 200 and decision(headers)["worker"] == chosen
    assert decision(headers)["reason"] == "prefix_hit"
    assert json.loads(raw)["worker"] == workers[chosen].name

    # 3. the chosen worker dies (connection refused). Envoy still believes it healthy (next health
    #    check in ~60 s): the filter still prefers it, the connect fails, and the retry policy
    #    (previous_priorities -> the cluster's fallback priority, previous_hosts -> never the dead
    #    worker) serves the request on the other worker, within the same client request.
    workers[chosen].stop()
    other = next(n for n in workers if n != chosen)
    before = len(workers[other].requests)
    status, headers, raw = post(port, body)
    assert status == 200, (status, headers, raw, live["log"].read_text()[-6000:])
    d = decision(headers)
    # The workers are IP literals, so the plugin config carries their addresses: the filter
    # credits the worker that served (its charge, its index records) and the debug header names it.
    assert d["worker"] == other and d["reason"] == "prefix_hit", d
    assert json.loads(raw)["worker"] == workers[other].name
    assert headers.get("x-envoy-attempt-count") == "2"
    assert workers[other].requests[before:] == [("/v1/chat/completions", "2")]

    # the retry is counted on the chosen worker's cluster, and the metrics listener works
    status, text = get(live["stats"], "/stats/prometheus")
    assert status == 200
    m = re.search(rf'envoy_cluster_upstream_rq_retry\{{envoy_cluster_name="{chosen}"\}} (\d+)', text.decode())
    assert m and int(m.group(1)) >= 1, [l for l in text.decode().splitlines() if "rq_retry{" in l]
    assert b"prefix_router_requests_prefix_hit" in text
    # the stats listener exposes nothing else of the admin
    assert get(live["stats"], "/config_dump")[0] == 404


def test_ip_workers_get_static_clusters_names_get_strict_dns():
    """IP literals need no resolver: STATIC clusters exist, health-checked, before the listener
    opens (STRICT_DNS sent some requests to the fallbacks for ~1 s after start-up; a mix of names
    and IPs in one cluster stays STRICT_DNS)."""
    ips = run_gen("--model", "llama=127.0.0.1:30000,10.0.0.2:30001", "--listen", "127.0.0.1:10000")
    assert ips.count("type: STATIC") == 5  # two workers, their two load-poll clusters, admin
    assert "STRICT_DNS" not in ips
    mixed = run_gen("--model", "llama=127.0.0.1:30000,w1:30000", "--listen", "127.0.0.1:10000")
    assert mixed.count("type: STRICT_DNS") == 3  # both worker clusters (w1 is in each) + w1's load-poll cluster
