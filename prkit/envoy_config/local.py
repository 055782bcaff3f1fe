"""Configs for local runs (tests, load tools, benchmarks): the demo on local ports, and a
plain Envoy without the filter for baselines."""

from __future__ import annotations

from .options import HostPort, MIB16, Options, Worker, profile
from .plugin import merge
from .yaml import strip_comments
from .sections import access_log, overload_manager, router_filter, socket_address


def local_demo(worker_ports: dict[str, int], *, listen: int, admin: int, wasm: str,
               plugin: dict | None = None) -> Options:
    """The demo config (profile demo: its models, worker names and plugin configuration) with the
    workers on local ports, loopback listeners on the given ports, `wasm`, and `plugin` merged
    into the plugin configuration (tests, load/demo, the memory probe)."""
    demo = profile("demo")
    models = {m: [Worker(w.cluster, "127.0.0.1", worker_ports[w.cluster], w.weight) for w in ws]
              for m, ws in demo.models.items()}
    return profile("demo", models=models, listen=("127.0.0.1", listen), admin=("127.0.0.1", admin), wasm=wasm,
                   plugin=merge(demo.plugin, plugin or {}))


def plain_proxy(listen: HostPort, admin_addr: HostPort, pools: dict[str, list[HostPort]], *,
                lb_policy: str | None = None, header_routes: dict[str, str] | None = None,
                http_filters: list | None = None, log: bool = True) -> dict:
    """An Envoy WITHOUT the filter, for baselines (load/compare's Envoy round_robin/least_request,
    benches/overhead's plain and buffer proxies): one STATIC cluster per pool (all its endpoints,
    `lb_policy`), requests routed to the first pool, or to header_routes[value of x-model] when
    the request names one; `http_filters` before the router. Timeouts, buffer limits, connection
    cap and access log (`log`) as the filter's configs, so only the routing differs. Render with
    dump()."""
    first = next(iter(pools))
    defaults = Options()
    route = {"timeout": "0s", "idle_timeout": "300s"}
    routes = [{"match": {"prefix": "/", "headers": [{"name": "x-model", "string_match": {"exact": model}}]},
               "route": {"cluster": cluster, **route}, "request_body_buffer_limit": MIB16}
              for model, cluster in (header_routes or {}).items()]
    routes.append({"match": {"prefix": "/"}, "route": {"cluster": first, **route}, "request_body_buffer_limit": MIB16})
    clusters = []
    for name, eps in pools.items():
        c: dict = {"name": name, "type": "STATIC", "connect_timeout": "1s",
                   "per_connection_buffer_limit_bytes": MIB16}
        if lb_policy:
            c["lb_policy"] = lb_policy
        c["load_assignment"] = {"cluster_name": name, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": socket_address(hp)}} for hp in eps]}]}
        clusters.append(c)
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress_http", "codec_type": "AUTO", "request_timeout": defaults.request_timeout,
        "request_headers_timeout": defaults.request_headers_timeout,
        "stream_idle_timeout": "300s", "common_http_protocol_options": {"idle_timeout": "3600s"},
        "http2_protocol_options": {"max_concurrent_streams": defaults.max_concurrent_streams},
        **({"access_log": access_log()} if log else {}),
        "route_config": {"name": "plain", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": [*(http_filters or []), router_filter()],
    }
    return strip_comments({
        "admin": {"address": socket_address(admin_addr)},
        "overload_manager": overload_manager(defaults),
        "static_resources": {
            "listeners": [{"name": "ingress", "address": socket_address(listen),
                           "per_connection_buffer_limit_bytes": MIB16,
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": hcm}]}]}],
            "clusters": clusters,
        },
    })


def buffer_filter() -> dict:
    """Envoy's native buffer filter (the whole body before routing, as the Wasm filter needs)."""
    return {"name": "envoy.filters.http.buffer", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer", "max_request_bytes": MIB16}}
