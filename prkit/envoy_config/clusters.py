"""The clusters of a generated config: worker clusters with their fallbacks and health checks,
load-poll clusters, pool clusters (override_host), peer and admin clusters, and the endpoints
and discovery they share. `sections.py` assembles them with the listeners."""

from __future__ import annotations

import json
import os

from .options import (
    ADMIN_CLUSTER, DESTINATION_HEADER, HostPort, MIB16, Options, PEER_PREFIX, POLL_SUFFIX, Pool, Worker, _pd_workers, _poll_clusters, is_ip,
)


def socket_address(hp: HostPort) -> dict:
    return {"socket_address": {"address": hp[0], "port_value": hp[1]}}


def endpoints(eps: list[HostPort], fallback_from: int = 1) -> list:
    """Locality groups: eps[:fallback_from] at priority 0, the rest at priority 1."""
    groups = [{"lb_endpoints": [{"endpoint": {"address": socket_address(eps[0])}}]}]
    for i, hp in enumerate(eps[1:]):
        g: dict = {"lb_endpoints": [{"endpoint": {"address": socket_address(hp)}}], "priority": 1}
        if i == 0:
            g = {"#": "Fallbacks, only used by retries and when the worker above is down.", **g}
        groups.append(g)
    return groups


def _discovery(hosts: list[str], comment: str | None = None) -> dict:
    if all(is_ip(h) for h in hosts):
        return {"type": "STATIC"}
    d: dict = {"type": "STRICT_DNS", "dns_lookup_family": "V4_PREFERRED", "dns_refresh_rate": "5s"}
    if comment:
        d = {"#": comment, **d}
    return d


def simple_cluster(w: Worker) -> dict:
    """One endpoint, Envoy's defaults otherwise (HTTP/1.1): a cluster name is one worker's cache."""
    return {"name": w.cluster, **_discovery([w.host]), "connect_timeout": "1s",
            "per_connection_buffer_limit_bytes": MIB16,
            "load_assignment": {"cluster_name": w.cluster, "endpoints": endpoints([(w.host, w.port)])}}


def _production_parts(o: Options, hosts: int = 1) -> dict:
    """What every production cluster of workers has (a worker's cluster, a pool): body buffer,
    keepalive, HTTP/1.1 options, circuit breakers, active health checks, outlier detection.
    `hosts`: the workers the cluster may hold; a pool's circuit breakers are the per-worker limits
    times that, and each host has the per-worker connection limit."""
    n = min(o.max_requests * hosts, 10**9)
    thresholds: dict = {"thresholds": [{
        "priority": "DEFAULT", "max_connections": n, "max_pending_requests": n, "max_requests": n,
        "retry_budget": {"budget_percent": {"value": 20.0}, "min_retry_concurrency": 8},
    }]}
    if hosts > 1:
        thresholds["per_host_thresholds"] = [{"priority": "DEFAULT", "max_connections": o.max_requests}]
    return {
        "#b": "Long prompts: a retry needs the whole body buffered (16 MiB, as the listener).",
        "per_connection_buffer_limit_bytes": MIB16,
        "#k": "Streams can run for minutes; TCP keepalive notices a worker host that vanished mid-stream.",
        "upstream_connection_options": {"tcp_keepalive": {"keepalive_time": 30, "keepalive_interval": 10,
                                                          "keepalive_probes": 3}},
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "#": "SGLang serves HTTP/1.1 (uvicorn), which closes idle keep-alive connections after 5 s;\n"
                 "closing ours at 4 s avoids reusing a connection it is closing.",
            "common_http_protocol_options": {"idle_timeout": "4s"},
            "explicit_http_config": {"http_protocol_options": {}},
        }},
        "#cb": "Circuit breakers: a worker queues what it cannot batch itself; Envoy caps what it sends so\n"
               "one slow worker cannot absorb every connection. Retries: a budget (20% of active requests).",
        "circuit_breakers": thresholds,
        "#h": "Active health checks on SGLang's /health (200 when serving; 503 while starting or draining).",
        "health_checks": [{
            "timeout": o.health_timeout, "interval": o.health_interval, "no_traffic_interval": o.health_interval,
            "interval_jitter": "0.5s", "unhealthy_threshold": 2, "healthy_threshold": 1,
            "always_log_health_check_failures": True, "http_health_check": {"path": "/health"},
        }],
        "#o": "Passive health: eject after consecutive connect failures / resets / gateway errors.",
        "outlier_detection": {
            "split_external_local_origin_errors": True, "consecutive_local_origin_failure": 3,
            "consecutive_gateway_failure": 3, "consecutive_5xx": 5, "interval": "5s",
            "base_ejection_time": "30s", "max_ejection_percent": o.max_ejection_percent,
        },
    }


def worker_cluster(o: Options, w: Worker, group: list[HostPort], model: str) -> dict:
    """Production worker cluster: group[0] (the worker) at priority 0, the fallbacks at 1."""
    fb = f", fallbacks {', '.join(f'{h}:{p}' for h, p in group[1:])}" if len(group) > 1 else ""
    return {
        "#": f"Worker {w.cluster} of model {model}: {w.host}:{w.port}{fb}.",
        "name": w.cluster,
        **_discovery([h for h, _ in group],
                     "STRICT_DNS: re-resolves every dns_refresh_rate (Kubernetes headless services: one name per\n"
                     "pod). For about a second after start-up some requests may be served by the priority-1\n"
                     "fallbacks while the endpoints resolve (they succeed, without the cache hit). IP literals\n"
                     "get STATIC clusters, which exist before the listener opens."),
        "#c": "Dead workers fail fast so the retry to another worker starts quickly.",
        "connect_timeout": "1s",
        "#l": "Within the fallback priority: the least busy fallback.",
        "lb_policy": "LEAST_REQUEST",
        **_production_parts(o),
        "load_assignment": {"cluster_name": w.cluster, "endpoints": endpoints(group)},
    }


def poll_cluster(w: Worker) -> dict:
    """The cluster the filter polls a worker's load through: the worker's own host only, no health
    checks, no outlier detection, no fallbacks (a failing load endpoint never ejects the worker,
    and no fallback answers for it)."""
    name = w.cluster + POLL_SUFFIX
    return {"#": f"Load polls of {w.cluster} ({w.host}:{w.port}): the filter's GET /v1/loads (else /get_load).",
            "name": name, **_discovery([w.host]), "connect_timeout": "0.25s",
            "load_assignment": {"cluster_name": name, "endpoints": endpoints([(w.host, w.port)])}}


def override_host_policy(fallback: bool = True) -> dict:
    """Envoy's override_host load balancing policy: the request goes to the first host named in
    DESTINATION_HEADER (IP:PORT[,IP:PORT...]) that is in the cluster, a retry to the next one;
    without the header, or past its last host, to the least busy host (least request), or
    nowhere (`fallback=False`: the request fails, no host answers for another)."""
    oh = {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [{"header": DESTINATION_HEADER}],
    }
    lb = "type.googleapis.com/envoy.extensions.load_balancing_policies."
    least_request = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.least_request",
        "typed_config": {"@type": lb + "least_request.v3.LeastRequest"}}}]}
    # Envoy requires a fallback policy; one that picks no host: a subset policy whose subsets
    # need a metadata key no host has, with NO_FALLBACK (a request matching no subset fails).
    nowhere = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.subset",
        "typed_config": {"@type": lb + "subset.v3.Subset", "fallback_policy": "NO_FALLBACK",
                         "subset_selectors": [{"keys": ["prefix-router-no-fallback"]}],
                         "subset_lb_policy": least_request}}}]}
    oh["fallback_policy"] = least_request if fallback else nowhere
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host", "typed_config": oh}}]}


def native_lb_policy(module: str) -> dict:
    """The native module as the cluster's load balancer (Envoy 1.40
    `envoy.load_balancing_policies.dynamic_modules`, filter/src/native/lb/): every attempt goes
    to the first host named in DESTINATION_HEADER that is healthy and not yet tried by this
    request (previous_hosts), past the last one to the least busy healthy host."""
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.dynamic_modules.v3."
                     "DynamicModulesLoadBalancerConfig",
            "dynamic_module_config": {"name": module, "do_not_close": True},
            "lb_policy_name": "prefix_router",
            "lb_policy_config": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                 "value": json.dumps({"header": DESTINATION_HEADER})}}}}]}


def _pool_membership(p: Pool) -> dict:
    """A pool's membership: the EDS file (Envoy follows it when it is replaced by a rename into
    its directory) or a DNS name re-resolved every 2 s."""
    if p.source == "eds":
        return {
            "type": "EDS",
            "eds_cluster_config": {"service_name": p.cluster, "eds_config": {
                "#": "The file is a DiscoveryResponse of one ClusterLoadAssignment (cluster_name: the service_name\n"
                     "above). Replace it by a rename (write a temporary file in the same directory, then mv):\n"
                     "Envoy watches the directory for moves; a file edited in place is not re-read.",
                "path_config_source": {"path": p.path, "watched_directory": {"path": os.path.dirname(p.path) or "/"}},
                "resource_api_version": "V3"}},
        }
    return {
        "#": "STRICT_DNS: one host per address the name resolves to (a Kubernetes headless Service: one per\n"
             "ready pod), re-resolved every dns_refresh_rate. 2s: a new pod takes traffic and a removed\n"
             "one stops being chosen within ~2 s of its DNS change (health checks and outlier detection\n"
             "cover a dead pod meanwhile), for one lookup per Envoy every 2 s.",
        "type": "STRICT_DNS", "dns_lookup_family": "V4_PREFERRED", "dns_refresh_rate": "2s",
    }


def _pool_endpoints(p: Pool) -> dict:
    if p.source == "eds":
        return {}
    return {"load_assignment": {"cluster_name": p.cluster, "endpoints": endpoints([(p.host, p.port)])}}


def pool_cluster(o: Options, model: str, p: Pool) -> dict:
    """A pool model's cluster: every worker of the model is one of its hosts (EDS or DNS), the
    filter names the chosen worker (then its fallbacks) in DESTINATION_HEADER and override_host
    sends the request there."""
    c: dict = {
        "#": f"Pool of model {model}: its workers are this cluster's hosts ({p.describe()}). The filter\n"
             f"names the chosen worker, then its fallbacks, in {DESTINATION_HEADER} (IP:PORT,...); a retry\n"
             "goes to the next one named, a request naming none to the least busy host.",
        "name": p.cluster,
        **_pool_membership(p),
        "#c": "Dead workers fail fast so the retry to another worker starts quickly.",
        "connect_timeout": "1s",
    }
    if o.shape == "production":
        parts = _production_parts(o, o.pool_max_workers)
        parts["#cb"] = (f"Circuit breakers: a worker's limits ({o.max_requests} requests, connections per host) times the\n"
                        f"{o.pool_max_workers} workers a pool may hold. Retries: a budget (20% of active requests).")
        c.update(parts)
        c["#r"] = ("Membership is authoritative: a host gone from the EDS file or the DNS answer leaves the pool\n"
                   "at once, even while it still passes health checks (Envoy would otherwise keep it).")
        c["ignore_health_on_host_removal"] = True
    else:
        c["per_connection_buffer_limit_bytes"] = MIB16
    if o.native_lb and o.dynamic_module:
        c["#lb"] = (f"The native module picks each attempt: the hosts named in {DESTINATION_HEADER}, in order,\n"
                    "skipping unhealthy ones and those this request tried; else the least busy healthy host.")
        c["load_balancing_policy"] = native_lb_policy(o.dynamic_module)
    else:
        c["#lb"] = (f"override_host: the hosts named in {DESTINATION_HEADER} that are members, in order, whatever\n"
                    "their health (Envoy 1.40: the filter names healthy ones); else least request over healthy hosts.")
        c["load_balancing_policy"] = override_host_policy()
    c.update(_pool_endpoints(p))
    return c


def pool_load_cluster(model: str, p: Pool) -> dict:
    """The cluster the filter polls a pool's workers' loads through: the same membership, the
    worker named in DESTINATION_HEADER, no health checks, no outlier detection (a failing load
    endpoint never ejects a worker)."""
    name = p.load_cluster
    membership = _pool_membership(p)
    membership.pop("#", None)
    if p.source == "eds":
        membership["eds_cluster_config"]["eds_config"].pop("#")
    out: dict = {
        "#": f"Load polls of pool {p.cluster}'s workers (model {model}): the filter's GET /v1/loads (else /get_load)\n"
             f"to the worker it names in {DESTINATION_HEADER}. Same membership, no health checks or outlier\n"
             "detection: a failing load endpoint never ejects a worker. No fallback host: a worker this\n"
             "cluster does not have yet (its own DNS answer lags the pool's) fails its poll instead of\n"
             "another worker answering, whose load would be published as the named one's.",
        "name": name, **membership, "connect_timeout": "0.25s",
        "load_balancing_policy": override_host_policy(fallback=False),
    }
    if p.source == "dns":
        out["load_assignment"] = {"cluster_name": name, "endpoints": endpoints([(p.host, p.port)])}
    return out


def peer_cluster(i: int, hp: HostPort) -> dict:
    name = PEER_PREFIX + str(i)
    return {
        "#": f"Peer {hp[0]}:{hp[1]}: a replica's peer listener; receives this replica's index records.",
        "name": name,
        **_discovery([hp[0]], "A peer that does not resolve (not started, scaled down) has no host: its batches fail at once."),
        "#t": "A down peer costs freshness, never requests: its batches fail fast and are dropped.",
        "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http_protocol_options": {}},
        }},
        "load_assignment": {"cluster_name": name, "endpoints": endpoints([hp])},
    }


def admin_cluster(o: Options) -> dict:
    comment = "Loopback admin, reached only through the stats listener's two read-only paths."
    if o.pools:
        comment = ("Loopback admin, reached only through the stats listener's two read-only paths and the\n"
                   "filter's reads of GET /clusters (pool membership); the client route never names it.")
    return {"#": comment,
            "name": ADMIN_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": ADMIN_CLUSTER, "endpoints": endpoints([o.admin])}}


def clusters(o: Options) -> list:
    out = []
    for model, ws in o.models.items():
        if o.shape == "simple":
            out += [simple_cluster(w) for w in ws]
            continue
        k = min(o.fallbacks, len(ws) - 1)
        for i, w in enumerate(ws):
            group = [(ws[(i + j) % len(ws)].host, ws[(i + j) % len(ws)].port) for j in range(k + 1)]
            out.append(worker_cluster(o, w, group, model))
    out += [pool_cluster(o, model, p) for model, p in o.pools.items()]
    out += pd_clusters(o)
    if _poll_clusters(o):
        out += [poll_cluster(w) for ws in o.models.values() for w in ws]
        out += [poll_cluster(w) for w in _pd_workers(o)]
    # a pool's load cluster always exists: the plugin names it (pool.load_cluster)
    out += [pool_load_cluster(model, p) for model, p in o.pools.items()]
    out += [peer_cluster(i, hp) for i, hp in enumerate(o.peers)]
    if o.stats_listen is not None or o.pools:
        out.append(admin_cluster(o))
    return out


def pd_clusters(o: Options) -> list:
    """PD models' clusters. A prefill cluster has no fallbacks: the body names that worker as the
    bootstrap host, so KV computed elsewhere would never be fetched. A decode cluster falls back
    to the model's other decode workers: a retried request carries the same body and room."""
    out = []
    for model, pd in o.pd_models.items():
        pre = [w for w, _ in pd.prefill]
        dec = list(pd.decode)
        if o.shape == "simple":
            out += [simple_cluster(w) for w in pre + dec]
            continue
        for w in pre:
            c = worker_cluster(o, w, [(w.host, w.port)], model)
            c["#"] = f"Prefill worker {w.cluster} of model {model}: {w.host}:{w.port} (mirror target, no fallbacks)."
            out.append(c)
        k = min(o.fallbacks, len(dec) - 1)
        for i, w in enumerate(dec):
            group = [(dec[(i + j) % len(dec)].host, dec[(i + j) % len(dec)].port) for j in range(k + 1)]
            c = worker_cluster(o, w, group, model)
            c["#"] = "Decode " + c["#"][0].lower() + c["#"][1:]
            out.append(c)
    return out
