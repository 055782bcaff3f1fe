"""envoy/gen's pools: --model NAME=eds:PATH and NAME=dns:HOST:PORT make one Envoy cluster
per model whose hosts are the workers (live membership), routed by override_host on the header the
filter sets; --pool-max-workers, --membership-ms; static workers' addresses in the plugin config.

Generated configs pass the real `envoy --mode validate` (conftest.check_pool_config); a real Envoy
(the filter removed, a client setting the headers the filter would set) routes by the header,
follows the EDS file and retries on the next host named."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from prkit import envoy_config as ec
from prkit.build import wasm_path
from prkit.eds import write_local_eds
from prkit.envoy import Envoy
from prkit.ports import free_port
from prkit.wait import wait_until

from .conftest import Worker, check_pool_config, gen_fail, plugin_config


def clusters_of(cfg: dict) -> dict:
    return {c["name"]: c for c in cfg["static_resources"]["clusters"]}


def route_regex(cfg: dict) -> re.Pattern:
    (li,) = [x for x in cfg["static_resources"]["listeners"] if x["name"] == "ingress"]
    routes = li["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    dynamic = [r for r in routes if "cluster_header" in r.get("route", {})]
    # one worker route per public path group, all with the same worker check after the method
    assert len(dynamic) == len(ec.public_routes(ec.Options())) and len({repr(r["match"]["headers"][1:]) for r in dynamic}) == 1
    _method, h = dynamic[0]["match"]["headers"]
    assert h["name"] == ec.CLUSTER_HEADER
    return re.compile(h["string_match"]["safe_regex"]["regex"])


def override_header(cluster: dict) -> str:
    """The header a cluster's override_host policy reads (fails for any other policy)."""
    (policy,) = cluster["load_balancing_policy"]["policies"]
    ext = policy["typed_extension_config"]
    assert ext["name"] == "envoy.load_balancing_policies.override_host", ext["name"]
    (src,) = ext["typed_config"]["override_host_sources"]
    return src["header"]


def membership(cluster: dict):
    """What decides a cluster's hosts: its EDS service and file, or its DNS name."""
    if cluster["type"] == "EDS":
        eds = cluster["eds_cluster_config"]
        return ("eds", eds["service_name"], eds["eds_config"]["path_config_source"]["path"])
    assert cluster["type"] == "STRICT_DNS"
    (ep,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    return ("dns", ep["endpoint"]["address"]["socket_address"]["address"],
            ep["endpoint"]["address"]["socket_address"]["port_value"])


@pytest.fixture
def eds_file(tmp_path) -> Path:
    path = tmp_path / "eds" / "m.yaml"
    path.parent.mkdir()
    write_local_eds(path, "m", [30000, 30001], 1)
    return path


@pytest.mark.parametrize("profile", ["ingress", "test"])
@pytest.mark.parametrize("source", ["eds", "dns"])
def test_pool_configs_validate(source, profile, eds_file, tmp_path):
    """`--model m=eds:PATH` / `m=dns:localhost:30000`, with a static model beside it, in the production
    and the simple shape: Envoy accepts the config (EDS needs the bootstrap's node; override_host
    and the retry policy on a pool cluster)."""
    spec = f"m=eds:{eds_file}" if source == "eds" else "m=dns:localhost:30000"
    check_pool_config(["--profile", profile, "--model", spec, "--model", "s=10.0.0.1:30000,s1.llm.svc:30000",
                       "--wasm", str(wasm_path())], tmp_path, f"{source}-{profile}.yaml")


@pytest.mark.parametrize("source", ["eds", "dns"])
def test_pool_plugin_config_names_the_pool_and_its_load_cluster(source):
    spec = "m=eds:/etc/prefix-router/m.yaml" if source == "eds" else "m=dns:sglang.llm.svc.cluster.local:30000"
    args = ["--model", spec, "--model", "s=10.0.0.1:30000,s1.llm.svc:30000", "--hash-key-placeholder"]
    text = ec.run_gen(*args)
    plugin = plugin_config(text)
    cfg = ec.config(ec.options_from_args(args))
    clusters = clusters_of(cfg)

    pool = plugin["models"]["m"]["pool"]
    assert set(plugin["models"]["m"]) == {"pool"}
    assert pool == {"cluster": "m", "load_cluster": "m_load", "fallbacks": 3, "max_workers": 64}
    assert plugin["default_model"] == "m"  # the first --model, a pool or not
    assert plugin["destination_header"] == ec.DESTINATION_HEADER
    assert plugin["membership"] == {"cluster": "admin", "path": "/clusters", "interval_ms": 1000, "timeout_ms": 1000}
    # the names the plugin gives are clusters of this config, read by the same header
    main, load, admin = clusters[pool["cluster"]], clusters[pool["load_cluster"]], clusters[plugin["membership"]["cluster"]]
    assert override_header(main) == override_header(load) == plugin["destination_header"]
    assert membership(main) == membership(load)
    assert main["health_checks"] and main["outlier_detection"] and main["circuit_breakers"]
    assert "health_checks" not in load and "outlier_detection" not in load
    (ep,) = admin["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert ep["endpoint"]["address"]["socket_address"] == cfg["admin"]["address"]["socket_address"]
    assert ("node" in cfg) == (source == "eds")
    if source == "dns":
        assert main["dns_lookup_family"] in ("V4_PREFERRED", "ALL")
    # the static model is unchanged: one cluster per worker
    assert plugin["models"]["s"]["workers"][1] == "s_1" and "s_0" in clusters and "s_1_load" in clusters


def test_pool_options_reach_the_plugin_config():
    def pool(*extra):
        return ec.plugin_config(ec.options_from_args(["--model", "m=dns:h.svc:1", *extra]))

    assert pool("--fallbacks", "1")["models"]["m"]["pool"]["fallbacks"] == 1
    assert pool("--fallbacks", "100")["models"]["m"]["pool"]["fallbacks"] == ec.POOL_MAX_FALLBACKS
    capped = pool("--pool-max-workers", "2", "--fallbacks", "5")["models"]["m"]["pool"]
    assert (capped["max_workers"], capped["fallbacks"]) == (2, 1)  # fewer fallbacks than workers
    assert pool("--membership-ms", "0")["membership"]["interval_ms"] == 0
    assert pool("--membership-ms", "250")["membership"]["interval_ms"] == 250
    # without pools, none of the pool fields
    static = ec.plugin_config(ec.options_from_args(["--model", "s=10.0.0.1:1"]))
    assert "destination_header" not in static and "membership" not in static


def test_route_admits_pool_clusters_only():
    args = ["--model", "m=dns:h.svc:1", "--model", "o/x.y=eds:/run/eds/o.yaml", "--model", "s=10.0.0.1:1",
            "--peers", "http://10.0.0.9:15100", "--peer-listen", "0.0.0.0:15100", "--peer-secret", "p" * 32,
            "--hash-key", "k" * 32]
    cfg = ec.config(ec.options_from_args(args))
    rx = route_regex(cfg)
    names = set(clusters_of(cfg))
    admitted = {c for c in names if rx.search(c)}
    assert admitted == {"m", "o_x_y", "s_0"}, admitted
    assert not any(rx.search(c) for c in ("admin", "m_load", "o_x_y_load", "prefix_router_peer_0", "m|admin", ""))


def test_static_workers_with_ip_literals_carry_their_address():
    plugin = ec.plugin_config(ec.options_from_args(
        ["--model", "a=10.0.0.1:30000,b.llm.svc:30000,c=10.0.0.3:30001@2,d.llm.svc:1@3"]))
    assert plugin["models"]["a"]["workers"] == [
        {"cluster": "a_0", "weight": 1.0, "address": "10.0.0.1:30000"},
        "a_1",  # a host name: no address the filter could match, names only
        {"cluster": "c", "weight": 2.0, "address": "10.0.0.3:30001"},
        {"cluster": "a_3", "weight": 3.0},
    ]


@pytest.mark.parametrize("args,option,needles", [
    (["--model", "m=eds:"], "--model m", ["path"]),
    (["--model", "m=eds:relative/m.yaml"], "--model m", ["absolute"]),
    (["--model", "m=dns:h.svc"], "--model m", ["HOST:PORT"]),
    (["--model", "m=dns:bad_host:1"], "--model m", ["bad host"]),
    (["--model", "m=dns:h.svc:70000"], "--model m", ["bad port"]),
    (["--model", "m=dns:a:1,b:1"], "--model m", ["one DNS name"]),
    (["--model", "m=dns:h:1", "--model", "m=10.0.0.1:1"], "--model", ["given twice"]),
    (["--model", "a.b=dns:h:1", "--model", "a_b=dns:h:2"], "--model a_b", ["'a_b'", "used twice"]),
    (["--model", "m=dns:h:1", "--model", "n=m=10.0.0.1:1"], "--model m", ["'m'", "used twice"]),
    (["--model", "m=dns:h:1", "--model", "n=m_load=10.0.0.1:1"], "--model", ["'m_load'", "collides"]),
    (["--model", "admin=dns:h:1"], "--model admin", ["'admin'", "collides"]),
    (["--model", "m=dns:h:1", "--pd-model", "m", "--prefill", "10.0.0.1:1@8998", "--decode", "10.0.0.2:1"],
     "--model m", ["--pd-model"]),
    (["--pd-model", "p", "--prefill", "eds:/x.yaml", "--decode", "10.0.0.2:1"], "--prefill", ["--model only"]),
    (["--pd-model", "p", "--prefill", "10.0.0.1:1@8998", "--decode", "dns:h:1"], "--decode", ["--model only"]),
    (["--model", "m=dns:h:1", "--pool-max-workers", "0"], "--pool-max-workers", ["between 1 and 1024"]),
    (["--model", "m=dns:h:1", "--membership-ms", "-1"], "--membership-ms", ["between 0 and"]),
    (["--model", "m=dns:h:1", "--membership-ms", "50"], "--membership-ms", ["at least 100"]),
    (["--model", "m=dns:h:1", "--admin", "127.0.0.1:0"], "--admin", ["/clusters"]),
])
def test_pool_errors_name_the_option(args, option, needles):
    err = gen_fail(*args)
    assert err.startswith(f"envoy/gen: {option}: "), err
    for n in needles:
        assert n in err, (n, err)


def test_a_static_worker_on_a_host_named_dns_is_still_a_static_list():
    plugin = ec.plugin_config(ec.options_from_args(["--model", "m=dns:30000,eds:30001"]))
    assert plugin["models"]["m"] == {"workers": ["m_0", "m_1"]}


class LivePool:
    """A real Envoy on a pool config without the Wasm filter: the client sets the two headers the
    filter would set (x-prefix-router-cluster and the destination header)."""

    def __init__(self, tmp_path: Path, spec: str, **extra: str):
        self.listen, self.admin = free_port(), free_port()
        args = ["--model", spec, "--listen", f"127.0.0.1:{self.listen}", "--admin", f"127.0.0.1:{self.admin}",
                "--stats-listen", "none", "--rate-limit", "0", "--hash-key", "k" * 32, "--wasm", str(wasm_path())]
        for k, v in extra.items():
            args += [f"--{k.replace('_', '-')}", v]
        cfg = ec.config(ec.options_from_args(args))
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.wasm"]
        self.envoy = Envoy(ec.dump(cfg), listener_port=self.listen, admin_port=self.admin, workdir=tmp_path,
                           concurrency=1, log_level="warn").start()

    def post(self, destination: str | None, cluster: str = "m"):
        """(status, the worker that answered or the body, x-envoy-attempt-count)"""
        headers = {"content-type": "application/json", ec.CLUSTER_HEADER: cluster}
        if destination is not None:
            headers[ec.DESTINATION_HEADER] = destination
        req = urllib.request.Request(f"http://127.0.0.1:{self.listen}/v1/chat/completions", data=b"{}",
                                     headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                return r.status, json.loads(r.read())["worker"], r.headers.get("x-envoy-attempt-count")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers.get("x-envoy-attempt-count")

    def members(self, cluster: str = "m") -> set[str]:
        """The hosts the admin's /clusters lists for `cluster` (what the filter's membership reads)."""
        status, body = self.envoy.admin_get("/clusters")
        assert status == 200
        return {line.split("::")[1] for line in body.splitlines() if line.startswith(f"{cluster}::")
                and line.count("::") >= 3 and re.match(r"^[0-9.]+:[0-9]+$", line.split("::")[1])}

    def health(self, host: str, cluster: str = "m") -> str:
        """A host's health_flags as /clusters reports them ("healthy", "/failed_active_hc/...")."""
        _, body = self.envoy.admin_get("/clusters")
        prefix = f"{cluster}::{host}::health_flags::"
        return next((line[len(prefix):] for line in body.splitlines() if line.startswith(prefix)), "")

    def close(self):
        self.envoy.stop()


def test_eds_pool_routes_by_header_follows_the_file_and_retries_on_the_next_host(tmp_path):
    ws = [Worker(f"w{i}") for i in range(3)]
    addr = {w.name: f"127.0.0.1:{w.port}" for w in ws}
    eds = tmp_path / "eds" / "m.yaml"
    eds.parent.mkdir()
    write_local_eds(eds, "m", [ws[0].port, ws[1].port], 1)
    lv = LivePool(tmp_path, f"m=eds:{eds}", health_interval="1s")
    try:
        assert lv.members() == lv.members("m_load") == {addr["w0"], addr["w1"]}
        for w in ("w0", "w1", "w1", "w0"):
            assert lv.post(addr[w])[:2] == (200, w)
        # a host that is not (yet) a member is skipped for the next one named
        assert lv.post(f"{addr['w2']},{addr['w1']}")[:2] == (200, "w1")
        assert lv.post(None)[0] == 200  # no header: Envoy's least request picks
        # the client route never reaches the admin or a load cluster
        for cluster in ("admin", "m_load"):
            status, body, _ = lv.post(addr["w0"], cluster=cluster)
            assert status == 503 and b"no worker was chosen" in body, (cluster, status, body)

        # membership follows the file: w2 joins, w0 leaves
        write_local_eds(eds, "m", [ws[1].port, ws[2].port], 2)
        wait_until(lambda: lv.members() == {addr["w1"], addr["w2"]}, "the EDS update in /clusters", 10, 0.1)
        assert lv.members("m_load") == {addr["w1"], addr["w2"]}
        assert lv.post(addr["w2"])[:2] == (200, "w2")  # named: used at once
        # Envoy's own least request (no header, or past the hosts named) takes a new host only after
        # its first passing health check (/clusters shows failed_active_hc/pending_active_hc until
        # then), and on the worker threads a moment after /clusters says healthy
        wait_until(lambda: lv.health(addr["w2"]) == "healthy", "w2's first health check", 15, 0.1)
        wait_until(lambda: lv.post(None)[1] == "w2", "least request choosing w2", 15, 0.05)

        # w1 stops listening: a request naming w1 then w2 is retried on w2
        ws[1].stop()
        status, worker, attempts = lv.post(f"{addr['w1']},{addr['w2']}")
        assert (status, worker, attempts) == (200, "w2", "2")
        # override_host uses a named member whatever its health: once w1 is ejected (or fails its
        # health checks) it is still tried first (the filter must name healthy hosts only)
        def w1_flagged() -> bool:
            if lv.health(addr["w1"]) != "healthy":
                return True
            lv.post(addr["w1"])  # one more failure on w1 (served by w2) brings its ejection closer
            return False

        wait_until(w1_flagged, "w1 flagged unhealthy in /clusters", 15, 0.1)
        status, worker, attempts = lv.post(f"{addr['w1']},{addr['w2']}")
        assert (status, worker, attempts) == (200, "w2", "2")
        # naming only w1: past the hosts named, least request picks a host that has not failed
        # (previous_hosts re-picks up to host_selection_retry_max_attempts times)
        status, worker, attempts = lv.post(addr["w1"])
        assert (status, worker) == (200, "w2") and attempts in ("2", "3"), (status, worker, attempts)
    finally:
        lv.close()
        for w in ws:
            w.stop()


def test_dns_pool_hosts_are_the_names_addresses(tmp_path):
    w = Worker("w0")
    lv = LivePool(tmp_path, f"m=dns:localhost:{w.port}", profile="test")
    try:
        wait_until(lambda: f"127.0.0.1:{w.port}" in lv.members(), "localhost resolved into the pool", 10, 0.1)
        assert lv.post(f"127.0.0.1:{w.port}")[:2] == (200, "w0")
        assert lv.post(None)[:2] == (200, "w0")
    finally:
        lv.close()
        w.stop()
