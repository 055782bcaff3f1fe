"""The Envoy bootstrap's sections (admin, overload manager, filters, routes, listeners; the
clusters are in `clusters.py`) as plain dicts, and the whole config (`config`, `render` with its
header)."""

from __future__ import annotations

import json
import os
import re

from .options import (
    ADMIN_CLUSTER, CLUSTER_HEADER, DESTINATION_HEADER, HASH_KEY_PLACEHOLDER, HEAP_RESET_FROM, HEAP_SHED,
    HEAP_SHRINK, HostPort, LOCAL_WASM, MIB16, NO_WORKER_BODY, NOT_FOUND_BODY, Options, PEER_PATH,
    PEER_SECRET_PLACEHOLDER,
    PEER_PREFIX, POLL_SUFFIX, PREFILL_HEADER, Pool, Worker, _pd_workers, _poll_clusters, _worker_names,
    is_ip, public_routes, validate,
)
from .clusters import (  # noqa: F401 - re-exported through prkit.envoy_config
    socket_address, endpoints, _discovery, simple_cluster, _production_parts, worker_cluster, poll_cluster, override_host_policy, _pool_membership, _pool_endpoints, pool_cluster, pool_load_cluster, peer_cluster, admin_cluster, clusters, pd_clusters,
)
from .plugin import plugin_config
from .yaml import dump, strip_comments


def admin(o: Options) -> dict:
    return {"#": "Admin: loopback only (it can dump config and stop the server).",
            "address": socket_address(o.admin)}


def overload_manager(o: Options) -> dict:
    """Envoy's overload manager: a connection cap, and a heap bound. Bodies are buffered until they
    end (the filter needs them whole), so connections x streams x 16 MiB is far above any memory
    limit; the fixed_heap monitor sheds before the OOM killer would take every stream with it."""
    heap = "envoy.resource_monitors.fixed_heap"
    mib = o.max_heap_mib
    return {
        "#": "Heap pressure is sampled every refresh_interval: what can arrive between two samples is\n"
             "the overshoot past a threshold.",
        "refresh_interval": "0.25s",
        "resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": o.max_connections,
            },
        }, {
            "#": f"Pressure = tcmalloc's reserved heap / {mib} MiB (keep it ~512 MiB under the memory limit:\n"
                 "V8's Wasm memory is outside this heap).",
            "name": heap,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                "max_heap_size_bytes": mib << 20,
            },
        }],
        "#b": "Track streams buffering >= 1 MiB (2^20) so the largest can be reset.",
        "buffer_factory_config": {"minimum_account_to_track_power_of_two": 20},
        "actions": [
            {"#": f"From {HEAP_RESET_FROM:.0%} ({int(mib * HEAP_RESET_FROM)} MiB): reset the HTTP/2 streams buffering the most (>= 128 MiB\n"
                  f"first, every stream >= 1 MiB at {HEAP_SHED:.0%}). Envoy resets HTTP/2 streams only.",
             "name": "envoy.overload_actions.reset_high_memory_stream",
             "triggers": [{"name": heap, "scaled": {"scaling_threshold": HEAP_RESET_FROM,
                                                    "saturation_threshold": HEAP_SHED}}]},
            {"#": "Return freed memory to the system so the pressure reads what is really held.",
             "name": "envoy.overload_actions.shrink_heap",
             "triggers": [{"name": heap, "threshold": {"value": HEAP_SHRINK}}]},
            {"#": f"From {HEAP_SHED:.0%} ({int(mib * HEAP_SHED)} MiB): new requests get 503 (HTTP/2; HTTP/1 ones meet the load\n"
                  "shed point below first).",
             "name": "envoy.overload_actions.stop_accepting_requests",
             "triggers": [{"name": heap, "threshold": {"value": HEAP_SHED}}]},
        ],
        "#l": f"From {HEAP_SHED:.0%}: an HTTP/1 connection that sends more bytes is answered (500) and closed,\n"
              "new requests included (the HTTP/1 counterpart of the stream reset: a held body stops growing).",
        "loadshed_points": [{"name": "envoy.load_shed_points.http1_server_abort_dispatch",
                             "triggers": [{"name": heap, "threshold": {"value": HEAP_SHED}}]}],
    }


def public_match(methods: tuple[str, ...], paths: list[str]) -> dict:
    """A route match for exactly `paths` (no query string, after path normalization) requested
    with one of `methods`."""
    m: dict = ({"path": paths[0]} if len(paths) == 1
               else {"safe_regex": {"regex": "^(" + "|".join(re.escape(p) for p in paths) + ")$"}})
    method = ({"exact": methods[0]} if len(methods) == 1
              else {"safe_regex": {"regex": "^(" + "|".join(methods) + ")$"}})
    m["headers"] = [{"name": ":method", "string_match": method}]
    return m


def pd_route(o: Options, route: dict, match: dict | None = None, comment: bool = True) -> dict:
    """The route of PD requests (the filter set the prefill header): the usual route plus the mirror
    to the prefill worker and a finite timeout, which the mirror inherits."""
    r = {k: v for k, v in route.items() if k != "timeout"}
    r["#pd"] = ("PD: Envoy mirrors the (rewritten) request to the prefill worker the filter named; the\n"
                "answer is discarded and a failed mirror cannot cancel the decode request, which then waits\n"
                "for KV until its bootstrap timeout. The mirror inherits this route's timeout.")
    r["request_mirror_policies"] = [{"cluster_header": PREFILL_HEADER, "disable_shadow_host_suffix_append": True}]
    r["timeout"] = o.pd_timeout
    def only(header: str, names: list[str]) -> dict:
        return {"name": header, "string_match": {"safe_regex": {"regex": "^(" + "|".join(re.escape(n) for n in names) + ")$"}}}

    prefill = [w.cluster for pd in o.pd_models.values() for w, _ in pd.prefill]
    match = match or {"prefix": "/"}
    # both headers must name workers (never admin: a mirror to it would POST the client's path there)
    out = {"match": {**match, "headers": [*match.get("headers", []), only(PREFILL_HEADER, prefill),
                                          only(CLUSTER_HEADER, _worker_names(o))]},
           "#": "Requests of PD models: the filter sets the prefill header (client values are removed).",
           "request_body_buffer_limit": MIB16, "route": r}
    if not comment:
        del out["#"]
    return out


def wasm_filter(o: Options, plugin: dict, comment: str) -> dict:
    """The prefix-router Wasm filter. Every listener uses this same definition (identical
    vm_config: one VM per thread and one shared-data scope); only the plugin config differs."""
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "prefix_router",
                "root_id": "prefix_router",
                "#": "Required: lets the filter pause on headers and set the routing header from the body.",
                "allow_on_headers_stop_iteration": True,
                "#f": "A trapped VM is replaced for new requests; routing state lives in shared data and\n"
                      "survives. FAIL_CLOSED would leave a crashed thread answering 503 until restart;\n"
                      "FAIL_OPEN would skip the filter (no cluster header, client-sent ones kept).",
                "failure_policy": "FAIL_RELOAD",
                "#r": "Reload quickly (a panic is per request), back off if it keeps crashing.",
                "reload_config": {"backoff": {"base_interval": "0.2s", "max_interval": "10s"}},
                "vm_config": {
                    "#": "Shared-data scope of the prefix index and load vectors (one per Envoy process).",
                    "vm_id": "prefix_router",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": o.wasm}},
                },
                "#c": comment,
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": json.dumps(plugin, indent=2) + "\n",
                },
            },
        },
    }


def dynamic_module_filter(name: str, plugin: dict) -> dict:
    """A native HTTP filter from the dynamic module lib<name>.so (Envoy 1.40 dynamic modules), given
    the plugin configuration as a string. `do_not_close`: a config update must not unload the
    module (its statics are its state)."""
    return {
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": name, "do_not_close": True},
            "filter_name": name,
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": json.dumps(plugin, indent=2) + "\n",
            },
        },
    }


def router_filter() -> dict:
    return {"#": "Terminal filter: forwards to the cluster the header names.",
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def rate_limit_filter(o: Options) -> dict:
    comment = []
    cfg: dict = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
        "stat_prefix": "ingress_ratelimit",
    }
    if o.rate_limit:
        comment.append(f"Local rate limit (per Envoy replica, shared by its worker threads): a token bucket of\n"
                       f"{o.rate_limit} requests refilled every second.")
        cfg["token_bucket"] = {"max_tokens": o.rate_limit, "tokens_per_fill": o.rate_limit, "fill_interval": "1s"}
    if o.rate_limit_per_client:
        comment.append(f"Per client address (the peer address; use_remote_address): {o.rate_limit_per_client} requests\n"
                       f"a second each, one bucket per address (a descriptor without a value is a wildcard),\n"
                       f"the {o.rate_limit_clients} most recent addresses kept.")
        cfg["rate_limits"] = [{"actions": [{"remote_address": {}}]}]
        cfg["descriptors"] = [{"entries": [{"key": "remote_address"}],
                               "token_bucket": {"max_tokens": o.rate_limit_per_client,
                                                "tokens_per_fill": o.rate_limit_per_client, "fill_interval": "1s"}}]
        cfg["max_dynamic_descriptors"] = o.rate_limit_clients
    comment.append("Over a limit: 429 with x-local-rate-limit: true. Runs before the Wasm filter, so rejected\n"
                   "requests cost no body parsing.")
    cfg.update({
        "filter_enabled": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
        "filter_enforced": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
        "response_headers_to_add": [{"append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                                     "header": {"key": "x-local-rate-limit", "value": "true"}}],
    })
    return {"#": "\n".join(comment), "name": "envoy.filters.http.local_ratelimit", "typed_config": cfg}


ACCESS_LOG_FIELDS = {
    "start": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "route_cluster": "%REQ(X-PREFIX-ROUTER-CLUSTER)%",
    "decision": "%RESP(X-PREFIX-ROUTER-DECISION)%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "upstream_host": "%UPSTREAM_HOST%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "bytes_in": "%BYTES_RECEIVED%",
    "bytes_out": "%BYTES_SENT%",
    "ttfb_ms": "%RESPONSE_DURATION%",
    "duration_ms": "%DURATION%",
    "request_id": "%REQ(X-REQUEST-ID)%",
}


def access_log(pools: bool = False) -> list:
    """One JSON line per request; with pools also the hosts the filter named (`destination`),
    which `upstream_host` (the host that served) can be compared with."""
    fields = dict(ACCESS_LOG_FIELDS)
    if pools:
        fields["destination"] = "%REQ(" + DESTINATION_HEADER.upper() + ")%"
    return [{"name": "envoy.access_loggers.stdout", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
        "log_format": {"json_format": fields}}}]


PEER_LOG_FIELDS = {
    "time": "%START_TIME%",
    "status": "%RESPONSE_CODE%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "peer": "%DOWNSTREAM_REMOTE_ADDRESS%",
    "bytes_in": "%BYTES_RECEIVED%",
    "duration_ms": "%DURATION%",
}


def peer_access_log() -> list:
    """One JSON line per request the peer listener refuses (any status but 2xx); accepted batches
    are not logged. `details` is the filter's reason (prefix_router_peer_bad_mac, _stale, _replay,
    _over_budget, ...; docs/reliability.md)."""
    return [{"name": "envoy.access_loggers.stdout",
             "filter": {"or_filter": {"filters": [
                 {"status_code_filter": {"comparison": {"op": "LE", "value": {
                     "default_value": 199, "runtime_key": "prefix_router.peer_log_below"}}}},
                 {"status_code_filter": {"comparison": {"op": "GE", "value": {
                     "default_value": 300, "runtime_key": "prefix_router.peer_log_from"}}}}]}},
             "typed_config": {
                 "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                 "log_format": {"json_format": dict(PEER_LOG_FIELDS)}}}]


def local_reply_413() -> dict:
    """Envoy's own replies rewritten as OpenAI-style JSON errors: 413 (body over the buffer limit)
    and 404 for a request no route matches (response flag NR: a path outside the public route).
    Only these: the filter's own replies keep their body."""
    not_found = json.loads(NOT_FOUND_BODY)
    return {"mappers": [{
        "filter": {"status_code_filter": {"comparison": {
            "op": "EQ", "value": {"default_value": 413, "runtime_key": "prefix_router.local_reply_413"}}}},
        "body_format_override": {"content_type": "application/json", "json_format": {
            "object": "error", "message": f"Request body too large: the limit is {MIB16 >> 20} MiB",
            "type": "BadRequestError", "param": None, "code": 413}},
    }, {
        "filter": {"response_flag_filter": {"flags": ["NR"]}},
        "body_format_override": {"content_type": "application/json", "json_format": not_found},
    }]}


def retry_policy(o: Options) -> dict:
    return {
        "retry_on": "connect-failure,refused-stream,reset,retriable-status-codes",
        "retriable_status_codes": [503],
        "num_retries": 2,
        "#": "A worker that accepts but sends nothing for this long (hung) is abandoned for another attempt.",
        "per_try_idle_timeout": o.per_try_idle_timeout,
        "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},
        "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
        "host_selection_retry_max_attempts": 5,
        "retry_priority": {"name": "envoy.retry_priorities.previous_priorities", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",
            "update_frequency": 1}},
    }


def route_config(o: Options) -> dict:
    route: dict = {
        "#": "The filter always sets this header (client values are removed).",
        "cluster_header": CLUSTER_HEADER,
        "#t": "No deadline on streams (generations run for minutes); a stream idle this long is dropped.",
        "timeout": "0s",
        "idle_timeout": o.stream_idle_timeout,
    }
    vhost: dict = {"name": "llm", "domains": ["*"]}
    if o.shape == "production":
        vhost["#"] = "x-envoy-attempt-count on the upstream request and the response: retries are visible."
        vhost["include_request_attempt_count"] = True
        vhost["include_attempt_count_in_response"] = True
        vhost["#r"] = (
            "Every route below: retry on another worker when the chosen one cannot take the request: connect\n"
            "failure, refused stream, reset before any response byte, or a 503 (SGLang starting/draining).\n"
            "previous_priorities moves the retry to the cluster's fallbacks; previous_hosts never picks\n"
            "a host that already failed this request.")
        if o.pools:
            vhost["#r"] += (f"\nA pool's retry goes to the next worker the filter named in {DESTINATION_HEADER}\n"
                            "(override_host), past the last one to the least busy host that has not failed.")
        vhost["retry_policy"] = retry_policy(o)
    names = "|".join(re.escape(c) for c in _worker_names(o))
    only_workers = {"name": CLUSTER_HEADER, "string_match": {"safe_regex": {"regex": f"^({names})$"}}}
    groups = public_routes(o)
    vhost["#routes"] = (
        "Public route: only these methods and paths reach a worker ("
        + "; ".join(f"{'|'.join(ms)} {' '.join(paths)}" for ms, paths in groups) + ").\n"
        "Anything else matches no route: Envoy answers 404 itself (http.ingress_http.no_route counts it),\n"
        "so a client never reaches a worker's admin API (/flush_cache, /update_weights_from_disk, ...).\n"
        "More paths: envoy/gen --allow-path [METHOD[,METHOD]:]PATH (docs/configuration.md).")
    routes: list = []
    for i, (methods, paths) in enumerate(groups):
        match = public_match(methods, paths)
        worker = {"match": {**match, "headers": [*match.get("headers", []), only_workers]},
                  "request_body_buffer_limit": MIB16, "route": route if i == 0 else strip_comments(route)}
        refuse = {"match": match,
                  "direct_response": {"status": 503, "body": {"inline_string": NO_WORKER_BODY}}}
        if i == 0:
            worker = {"#": "Only a worker cluster: the header must name one of them (never admin, a peer or a\n"
                           "<worker>_load poll cluster), even if the filter were bypassed.",
                      **worker}
            worker["#b"] = "Route-level body buffer limit (16 MiB, as the listener's)."
            worker = {k: worker[k] for k in ("#", "match", "#b", "request_body_buffer_limit", "route")}
            refuse = {"#": "No worker named (the filter did not run): refuse rather than guess.", **refuse}
        if o.pd_models:
            routes.append(pd_route(o, route, match, comment=i == 0))
        routes += [worker, refuse]
    vhost["routes"] = routes
    return {"name": "prefix_router",
            "#": "Every cluster named statically must exist (names set through cluster_header are not checked).",
            "validate_clusters": True, "virtual_hosts": [vhost]}


def _plugin_comment(o: Options, plugin: dict) -> str:
    dbg = ("on: every response names its worker and reason" if plugin.get("debug_header")
           else "off (null): turn on only where clients are trusted")
    lines = ["Plugin configuration (docs/configuration.md): workers are cluster names below;",
             f"debug_header {dbg}."]
    lp = plugin.get("load_poll", {}).get("interval_ms", None)
    if lp == 0:
        lines.append("load_poll off (interval_ms 0): this replica sees only its own requests.")
    elif lp:
        lines.append(f"load_poll: every worker's load is polled every {lp} ms (one VM per Envoy).")
    if o.pools:
        ms = o.membership_ms
        lines.append(f"pools: the filter reads their hosts from the admin's /clusters every {ms} ms (membership)."
                     if ms else "membership off (interval_ms 0): pools are used only through Envoy's least request.")
    if "peers" in plugin:
        n = len(o.peers)
        lines.append(f"peers: the index records this replica makes go to {n} peer(s)." if n
                     else "peers: nothing to send to; peers' records arrive on the peers listener.")
    return "\n".join(lines)


def http_connection_manager(o: Options, filters: list) -> dict:
    hcm: dict = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress_http",
        "codec_type": "AUTO",
    }
    if o.shape == "production":
        hcm["#"] = "Edge proxy: the client address is the peer address (no trusted X-Forwarded-For hops)."
        hcm["use_remote_address"] = True
    hcm.update({
        "#p": "One path for the filter, the route and the worker: RFC 3986 normalization (%63 -> c, dot\n"
              "segments), // -> /, and %2F / %5C unescaped and forwarded as / and \\. SGLang decodes such\n"
              "paths as inference; without this the filter would classify /v1/chat%2Fcompletions as\n"
              "passthrough. UNESCAPE_AND_FORWARD, not _REDIRECT: OpenAI clients do not replay a POST body\n"
              "on a redirect.",
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
        "#t": f"The filter holds a request until its body ends: the whole request must arrive within\n"
              f"{o.request_timeout} (headers within {o.request_headers_timeout}), else 408 and the buffered body is freed.\n"
              "Neither counts once the request is received, so generations still stream for minutes;\n"
              f"a stream with no bytes either way for {o.stream_idle_timeout} is dropped.",
        "request_timeout": o.request_timeout,
        "request_headers_timeout": o.request_headers_timeout,
        "stream_idle_timeout": o.stream_idle_timeout,
        "common_http_protocol_options": {"idle_timeout": "3600s"},
        "#h": f"HTTP/2: at most {o.max_concurrent_streams} streams per connection (each may buffer a 16 MiB body).",
        "http2_protocol_options": {"max_concurrent_streams": o.max_concurrent_streams},
        "#l": f"A body over the {MIB16 >> 20} MiB buffer limit (413) and a path outside the public route (404)\n"
              "are answered by Envoy itself, as text; OpenAI clients expect a JSON error body. Only these:\n"
              "the filter's own replies keep their body.",
        "local_reply_config": local_reply_413(),
    })
    if o.access_log:
        hcm["#a"] = ("One JSON line per request: the cluster the filter chose, the decision header (when on),\n"
                     "where it went (a retry can move it), attempts, time to first byte and duration.")
        hcm["access_log"] = access_log(pools=bool(o.pools))
    hcm["route_config"] = route_config(o)
    hcm["http_filters"] = filters
    return hcm


def ingress_listener(o: Options, plugin: dict) -> dict:
    filters = []
    if o.rate_limit or o.rate_limit_per_client:
        filters.append(rate_limit_filter(o))
    routing = (dynamic_module_filter(o.dynamic_module, plugin) if o.dynamic_module
               else wasm_filter(o, plugin, _plugin_comment(o, plugin)))
    filters.append({"#": "prefix-router: reads the body, chooses a worker, sets x-prefix-router-cluster.",
                    **routing})
    filters.append(router_filter())
    return {
        "#": "Client traffic (OpenAI / SGLang API).",
        "name": "ingress",
        "address": socket_address(o.listen),
        "#b": "The filter needs the whole body before it can route: 16 MiB (a 128k-token prompt is\n"
              "~0.5-0.9 MiB of JSON) instead of Envoy's 1 MiB default (which answers 413).",
        "per_connection_buffer_limit_bytes": MIB16,
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": http_connection_manager(o, filters),
        }]}],
    }


def stats_listener(o: Options) -> dict:
    get = [{"name": ":method", "string_match": {"exact": "GET"}}]
    assert o.stats_listen is not None
    return {
        "#": "Metrics listener: only GET /stats/prometheus and /ready of the (loopback) admin, for\n"
             "Prometheus scrapes and readiness probes. Never expose the admin itself.",
        "name": "stats",
        "address": socket_address(o.stats_listen),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "stats",
                "route_config": {"virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": [
                    {"match": {"path": "/stats/prometheus", "headers": get}, "route": {"cluster": "admin"}},
                    {"match": {"path": "/ready", "headers": get}, "route": {"cluster": "admin"}},
                ]}]},
                "http_filters": [router_filter()],
            },
        }]}],
    }


# The filter's peers.max_batch default (filter/src/config.rs), and the HTTP/2 streams a peer
# may have open on one connection (a replica keeps at most 4 batches per peer in flight).
PEER_MAX_BATCH = 4096
PEER_MAX_STREAMS = 16


def peers_listener(o: Options, plugin: dict) -> dict:
    assert o.peer_listen is not None
    peer_plugin = {**plugin, "peer_listener": True}
    if o.dynamic_module:
        wasm = {"#": f"The same native module (its shared data is process-wide: the client listener's\n"
                     f"prefix index) with peer_listener: it answers POST {PEER_PATH} batches (HMAC of\n"
                     f"the shared secret, fresh, not seen before, within budget) itself and refuses the rest.",
                **dynamic_module_filter(o.dynamic_module, peer_plugin)}
    else:
        wasm = wasm_filter(o, peer_plugin, "Plugin configuration: the client listener's, plus peer_listener.")
        wasm = {"#": f"The same filter (same vm_config and vm_id: the client listener's prefix index) with\n"
                     f"peer_listener: it answers POST {PEER_PATH} batches (HMAC of the shared secret,\n"
                     f"fresh, not seen before, within budget) itself and refuses the rest.",
                **wasm}
    # The largest batch (filter/src/peers.rs): 28-byte header, 16 bytes per record, 32-byte MAC;
    # the body buffer holds one and a little, so nothing bigger is buffered before the MAC check.
    max_batch = int((plugin.get("peers") or {}).get("max_batch", PEER_MAX_BATCH))
    batch_limit = max(64 * 1024, -(-(28 + 16 * max_batch + 32) // 4096) * 4096)
    return {
        "#": "Peer listener: other replicas POST the index records they make here (keep this port on a\n"
             "private network; batches without a valid HMAC of the shared secret are refused).",
        "name": "peers",
        "address": socket_address(o.peer_listen),
        "#b": f"The body buffer holds the largest batch ({max_batch} records, peers.max_batch): a bigger body gets\n"
              "413 from Envoy before anything of it reaches the filter's MAC check.",
        "per_connection_buffer_limit_bytes": batch_limit,
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "peers",
                "codec_type": "AUTO",
                "#a": "One JSON line per refused request, with the filter's reason (details); accepted\n"
                      "batches are not logged.",
                "access_log": peer_access_log(),
                "#": "Batches are small and quick: slow or idle peers are cut off, trickled headers too; a\n"
                     "replica sends a few batches at a time (HTTP/2: at most 16 streams per connection).",
                "request_timeout": "10s",
                "request_headers_timeout": o.request_headers_timeout,
                "stream_idle_timeout": "10s",
                "http2_protocol_options": {"max_concurrent_streams": PEER_MAX_STREAMS},
                "route_config": {"name": "prefix_router_peers", "virtual_hosts": [{
                    "name": "peers", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 404}}]}]},
                "http_filters": [wasm, router_filter()],
            },
        }]}],
    }


def config(o: Options, comments: bool = False) -> dict:
    """The whole Envoy bootstrap as dicts (comment keys only with comments=True)."""
    validate(o)
    plugin = plugin_config(o)
    listeners = [ingress_listener(o, plugin)]
    if o.stats_listen is not None:
        listeners.append(stats_listener(o))
    if o.peer_listen is not None:
        listeners.append(peers_listener(o, plugin))
    doc: dict = {}
    if any(p.source == "eds" for p in o.pools.values()):
        doc["#n"] = ("A node identity: Envoy requires one for EDS (here read from files; no management server).")
        doc["node"] = {"id": "prefix-router", "cluster": "prefix-router"}
    doc.update({
        "admin": admin(o),
        "#o": "Cap downstream connections (each streaming generation holds one) and the heap.",
        "overload_manager": overload_manager(o),
        "static_resources": {"listeners": listeners, "clusters": clusters(o)},
    })
    return doc if comments else strip_comments(doc)


def header(o: Options) -> str:
    models = ", ".join([f"{m} ({len(ws)} workers)" for m, ws in o.models.items()]
                       + [f"{m} (pool: {p.describe()})" for m, p in o.pools.items()]
                       + [f"{m} (PD: {len(pd.prefill)} prefill + {len(pd.decode)} decode)"
                          for m, pd in o.pd_models.items()])
    lines = []
    if o.command is not None:
        lines += ["GENERATED by envoy/gen -- do not edit; change prkit/envoy_config/ and regenerate:",
                  f"  {o.command}", ""]
    if o.dynamic_module:
        lines += [f"prefix-router: Envoy 1.40 + the prefix-router native module, EXPERIMENTAL ({o.shape} shape).",
                  f"Envoy loads lib{o.dynamic_module}.so from ENVOY_DYNAMIC_MODULES_SEARCH_PATH:",
                  "  cargo build -p prefix-router --release --features dynamic-module",
                  "  ENVOY_DYNAMIC_MODULES_SEARCH_PATH=target/release .venv/bin/envoy -c <this file>",
                  "Its stats are named dynamicmodulescustom.prefix_router.* (the Wasm filter's: prefix_router.*)."]
    else:
        lines.append(f"prefix-router: Envoy 1.40 + the prefix-router Wasm filter ({o.shape} shape).")
    if o.wasm == LOCAL_WASM and not o.dynamic_module:
        lines += ["Run from the repository root (the .wasm path is relative to it):",
                  "  cargo build -p prefix-router --target wasm32-wasip1 --release",
                  "  .venv/bin/envoy -c <this file> --concurrency 2"]
    lines.append(f"Models: {models}; default model: {o.default_model or next(iter([*o.models, *o.pools, *o.pd_models]))}.")
    if o.peer_secret is not None:
        lines.append(f"Scale-out: index records sent to {len(o.peers)} peer(s); "
                     + (f"peer listener on {o.peer_listen[0]}:{o.peer_listen[1]}" if o.peer_listen else "no peer listener")
                     + ".")
        if o.peer_secret == PEER_SECRET_PLACEHOLDER:
            lines.append(f"peers.secret is the placeholder {PEER_SECRET_PLACEHOLDER}: replace it with the shared secret\n"
                         "(16+ printable characters, the same on every replica) when deploying; the filter refuses the placeholder.")
        else:
            lines.append("The plugin configuration holds the shared peer secret: protect this file.")
    if o.hash_key == HASH_KEY_PLACEHOLDER:
        lines.append(f"hash_key is the placeholder {HASH_KEY_PLACEHOLDER}: replace it with the secret key (16+ printable\n"
                     "characters, the same on every replica) when deploying; the filter refuses the placeholder.")
    elif o.hash_key_generated:
        lines.append("hash_key: a random key generated for this file (one replica; every run of envoy/gen makes a new one).")
    if o.hash_key is not None and o.hash_key != HASH_KEY_PLACEHOLDER:
        lines.append("The plugin configuration holds the secret hash_key: protect this file.")
    lines.append("Layout and rationale: prkit/envoy_config/__init__.py; options: envoy/gen --help.")
    lines = [part for line in lines for part in (line.split("\n") if line else [line])]
    return "".join(f"# {line}\n" if line else "#\n" for line in lines)


def render(o: Options) -> str:
    """The config as YAML text: a header comment, then the sections with their comments."""
    return header(o) + "\n" + dump(config(o, comments=True))
