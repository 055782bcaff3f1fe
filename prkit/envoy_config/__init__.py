"""Envoy configurations for prefix-router: the one source of every Envoy config the repo ships or
runs (envoy/*.yaml, the test and benchmark Envoys, load/compare).

    from prkit import envoy_config as ec
    opts = ec.profile("test", models=ec.fleet("llama", {"w0": 18010, "w1": 18011}),
                      listen=("127.0.0.1", 18000), admin=("127.0.0.1", 18001), wasm="/path/x.wasm",
                      plugin={"policy": {"load_eps": 0.5}})
    text = ec.render(opts)           # YAML text (with comments), what Envoy reads
    cfg = ec.config(opts)            # the same as plain dicts (no comments), to inspect or edit
    ec.plugin_config(opts)           # the filter's configuration JSON, as a dict

`python -m prkit.envoy_config` (or `envoy/gen`) is the command line over the same functions.

Modules: `options` (constants, `Options`, profiles, validation, value parsers), `plugin` (the
filter's configuration), `clusters` (the clusters), `sections` (the other Envoy sections, `config`, `render`), `yaml` (`dump`),
`cli` (`main`, `options_from_args`), `local` (`local_demo`, `plain_proxy`). Every name is
re-exported here: `ec.<name>` is the API.

Profiles (`profile(name, **overrides)`): every option has a default per profile, and a listener
is on loopback unless an address is given.

  demo     envoy/envoy.yaml: 4 local workers w0..w3 on 127.0.0.1:30000-30003, the .wasm from
           target/, debug header on; simple clusters (one endpoint, no health checks or retries).
  test     the demo's shape for tests: workers, ports and .wasm given by the caller.
  bench    the test shape without access log or debug header (overhead benchmarks).
  ingress  production shape: per worker a cluster with fallbacks, health checks, outlier
           detection and retries; local rate limit; stats listener; load polling.
  compose  the ingress shape for docker-compose (envoy/compose.yaml): workers w0..w3:30000 by
           service name, listeners on the container's interfaces.

Production cluster layout (ingress, compose): each worker (HOST:PORT, a DNS name or an IP) gets
one cluster, the name listed in the plugin config (the filter sets it in x-prefix-router-cluster).
It holds that worker at priority 0 and the next `fallbacks` workers of the same model (list order,
wrapping) at priority 1: normal traffic goes to priority 0; a request failing before its response
starts is retried with previous_priorities (moves the retry to priority 1) and previous_hosts
(never a host that already failed); a worker failing health checks or ejected by outlier detection
sends the cluster's traffic to priority 1 at once. (An aggregate cluster of [worker, pool] ignores
retry priorities: retries hit the same dead worker, measured on Envoy 1.40; tests/deploy checks the
retry for real.)

Pools (--model NAME=eds:PATH | NAME=dns:HOST:PORT; Options.pools): a model whose workers are the
hosts of ONE cluster NAME, with live membership from a file-based EDS DiscoveryResponse (the
bootstrap then has a `node`) or a DNS name (STRICT_DNS: a Kubernetes headless Service), and the
override_host load balancing policy: the filter names the chosen worker, then its fallbacks, in
x-gateway-destination-endpoint (IP:PORT,...) and x-prefix-router-cluster: NAME; a retry goes to the
next host named, a request naming none (or past the last) to least request over healthy hosts.
override_host uses a named member whatever its health (Envoy 1.40), so the filter learns the hosts
and their health_flags from the admin's GET /clusters (plugin `membership`, through the loopback
`admin` cluster the client route never names). NAME_load has the same membership and policy and no
health checks or outlier detection (the pool's load polls). Production pools carry the worker
clusters' health checks, outlier detection and timeouts, circuit breakers scaled by
--pool-max-workers, and ignore_health_on_host_removal (membership is authoritative).

Several replicas (peers, peer_listen, peer_secret, load_poll_ms): every replica polls every
worker's load through `<worker>_load` clusters (own host only, no health checks, no outlier
detection, so a failing load endpoint never ejects the worker), and sends the index records it
makes to every peer (cluster prefix_router_peer_<i>); peers receive them on a second listener,
"peers", running the same Wasm filter (same vm_id: the same shared data) with "peer_listener":
true. Each batch carries an HMAC-SHA256 keyed by the shared secret (>= 16 characters; the secret
itself never travels), a sender timestamp (replicas' clocks must agree within peers.window_s, 30 s:
NTP) and a sequence number; the peer listener logs every batch it refuses. A config may list its
own replica as a peer, so one config serves every replica of a StatefulSet.

Representation: sections are plain dicts and lists; a key starting with "#" is a comment emitted
above the next key (or above a list item when it is the item's first key). `dump` writes block
YAML (short scalar-only mappings in flow style); `strip_comments` removes the comment keys.
Output is deterministic: the checked-in configs are compared with it (tests/deploy).
"""

from __future__ import annotations

from .options import (
    ADMIN_CLUSTER, CLUSTER_HEADER, CLUSTER_RE, CONTAINER_WASM, ConfigError, DEBUG_HEADER, DESTINATION_HEADER,
    DURATION_RE, HASH_KEY_PLACEHOLDER, HEAP_RESET_FROM, HEAP_SHED, HEAP_SHRINK, HOST_RE, HostPort, LOCAL_WASM,
    MAX_POOL_WORKERS, MEMBERSHIP_PATH, MEMBERSHIP_TIMEOUT_MS, MIB16, MIB4, MIN_SECRET_LEN, NAME_RE,
    NATIVE_MODULE, NO_WORKER_BODY, NOT_FOUND_BODY, Options, PEER_PATH, PEER_PREFIX, PEER_SECRET_PLACEHOLDER,
    PEER_URL_RE, PLACEHOLDER_RE, POLL_SUFFIX, PUBLIC_PATHS, parse_allow_path, public_routes,
    POOL_MAX_FALLBACKS, PREFILL_HEADER, PROFILES, PdModel, Pool, Worker, check_secret, cluster_id, fleet,
    generate_hash_key, is_ip, is_pool_spec, parse_hostport, parse_model, parse_pd, parse_peers, parse_pool,
    pool_fallbacks, profile, validate,
)
from .plugin import merge, plugin_config, worker_entry
from .yaml import dump, scalar, strip_comments
from .sections import (
    ACCESS_LOG_FIELDS, PEER_LOG_FIELDS, access_log, admin, admin_cluster, clusters, config,
    dynamic_module_filter, endpoints, header, http_connection_manager, ingress_listener,
    local_reply_413, overload_manager, pd_clusters, pd_route, peer_access_log, peer_cluster,
    override_host_policy, peers_listener, public_match, poll_cluster, pool_cluster, pool_load_cluster, rate_limit_filter,
    render, retry_policy, route_config,
    router_filter, simple_cluster, socket_address, stats_listener, wasm_filter, worker_cluster,
)
from .cli import GEN, REDACTED, arg_parser, command_line, gen_result, main, options_from_args, run_gen
from .local import buffer_filter, local_demo, plain_proxy

__all__ = [
    "ADMIN_CLUSTER", "DESTINATION_HEADER", "MAX_POOL_WORKERS", "MEMBERSHIP_PATH", "MEMBERSHIP_TIMEOUT_MS",
    "POOL_MAX_FALLBACKS", "Pool", "is_pool_spec", "parse_pool", "pool_fallbacks", "worker_entry",
    "override_host_policy", "pool_cluster", "pool_load_cluster",
    "NOT_FOUND_BODY", "PEER_SECRET_PLACEHOLDER", "PLACEHOLDER_RE", "PUBLIC_PATHS", "parse_allow_path",
    "public_routes", "public_match", "command_line", "REDACTED",
    "CLUSTER_HEADER", "CLUSTER_RE", "CONTAINER_WASM", "ConfigError", "DEBUG_HEADER", "DURATION_RE",
    "HASH_KEY_PLACEHOLDER", "HEAP_RESET_FROM", "HEAP_SHED", "HEAP_SHRINK", "HOST_RE", "HostPort",
    "LOCAL_WASM", "MIB16", "MIB4", "MIN_SECRET_LEN", "NAME_RE", "NATIVE_MODULE", "NO_WORKER_BODY",
    "Options", "PEER_PATH", "PEER_PREFIX", "PEER_URL_RE", "POLL_SUFFIX", "PREFILL_HEADER",
    "PROFILES", "PdModel", "Worker", "check_secret", "cluster_id", "fleet", "generate_hash_key",
    "is_ip", "parse_hostport", "parse_model", "parse_pd", "parse_peers", "profile", "validate",
    "merge", "plugin_config", "dump", "scalar", "strip_comments", "ACCESS_LOG_FIELDS",
    "PEER_LOG_FIELDS", "access_log", "admin", "admin_cluster", "clusters", "config",
    "dynamic_module_filter", "endpoints", "header", "http_connection_manager", "ingress_listener",
    "local_reply_413", "overload_manager", "pd_clusters", "pd_route", "peer_access_log",
    "peer_cluster", "peers_listener", "poll_cluster", "rate_limit_filter", "render", "retry_policy",
    "route_config", "router_filter", "simple_cluster", "socket_address", "stats_listener",
    "wasm_filter", "worker_cluster", "GEN", "arg_parser", "gen_result", "main", "options_from_args",
    "run_gen", "buffer_filter", "local_demo", "plain_proxy",
]
