"""Options: the constants, the `Options` a config is rendered from (with its per-profile
defaults and its validation), and the parsers of the command line's values (also usable
from Python)."""

from __future__ import annotations

import copy
import ipaddress
import math
import re
import secrets
from dataclasses import dataclass, field, fields


MIB16 = 16 * 1024 * 1024
MIB4 = 4 * 1024 * 1024
MIN_SECRET_LEN = 16  # the filter's peers.secret and hash_key minimum (filter/src/config.rs)
# hash_key of configs whose key is written in at deploy time (k8s init container, compose start-up
# script): shorter than MIN_SECRET_LEN, so the filter refuses a config where it was never replaced
# rather than run with a key everyone can read in this repository.
HASH_KEY_PLACEHOLDER = "__HASH_KEY__"
# peers.secret of configs whose secret is written in at deploy time (envoy/gen
# --peer-secret-placeholder; the StatefulSet's init container). The filter refuses every
# __NAME__ placeholder (filter/src/config.rs), so a config where it was never replaced never runs.
PEER_SECRET_PLACEHOLDER = "__PREFIX_ROUTER_PEER_SECRET__"
PLACEHOLDER_RE = re.compile(r"^__[A-Z0-9_]+__$")
# Heap pressure (fixed_heap: tcmalloc's reserved heap / --max-heap-mib) at which the overload
# manager acts: HTTP/2 streams buffering >= 1 MiB are reset from HEAP_RESET_FROM (largest first,
# all of them at HEAP_SHED); at HEAP_SHED new requests get 503 and HTTP/1 connections that send
# more bytes are closed.
HEAP_RESET_FROM = 0.85
HEAP_SHRINK = 0.90
HEAP_SHED = 0.95
CLUSTER_HEADER = "x-prefix-router-cluster"
# Pools (one cluster per model, hosts from EDS or DNS): the filter names the chosen worker, then its
# fallbacks, in this header (IP:PORT[,IP:PORT...]); the cluster's override_host policy reads it.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# The filter learns a pool's current hosts from Envoy's admin GET /clusters (text), read through the
# loopback cluster ADMIN_CLUSTER, which the client route never names.
ADMIN_CLUSTER = "admin"
MEMBERSHIP_PATH = "/clusters"
MEMBERSHIP_TIMEOUT_MS = 1000
# Most fallbacks a pool request names after its chosen worker: the route retries twice, and
# override_host skips listed hosts that left the pool, so a few more than the retries are enough.
POOL_MAX_FALLBACKS = 8
MAX_POOL_WORKERS = 1024  # the filter's MAX_WORKERS_PER_MODEL (filter/src/config.rs)
DEBUG_HEADER = "x-prefix-router-decision"
PEER_PATH = "/prefix-router/v1/records"
POLL_SUFFIX = "_load"  # load_poll.cluster_suffix of the per-worker poll clusters
PEER_PREFIX = "prefix_router_peer_"
CONTAINER_WASM = "/etc/prefix-router/prefix_router.wasm"
LOCAL_WASM = "target/wasm32-wasip1/release/prefix_router.wasm"
# The native build's module name: Envoy loads lib<name>.so (cargo build -p prefix-router --release
# --features dynamic-module).
NATIVE_MODULE = "prefix_router"
NO_WORKER_BODY = ('{"object":"error","message":"no worker was chosen for this request",'
                  '"type":"ServiceUnavailableError","param":null,"code":503}')
NOT_FOUND_BODY = ('{"object":"error","message":"not found: this path is not served here",'
                  '"type":"NotFoundError","param":null,"code":404}')
# The client API the public listener forwards (METHOD, PATH; docs/configuration.md "Public route"):
# the inference endpoints and the read-only paths an OpenAI or SGLang client needs. Every other
# request gets Envoy's own 404 (no route matches: http.<stat_prefix>.no_route counts it), so a
# client never reaches a worker's admin API (/flush_cache, /update_weights_from_disk, ...).
# Options.allow_paths (envoy/gen --allow-path) adds to it.
PUBLIC_PATHS = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/generate"),
    ("PUT", "/generate"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
)
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
ALLOW_PATH_RE = re.compile(r"^/[A-Za-z0-9._~/-]*$")
PROFILES = ("demo", "test", "bench", "ingress", "compose")

NAME_RE = re.compile(r"^[^=,@\s\"'\\]+$")  # model names may hold / . - (e.g. org/model)
CLUSTER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
DURATION_RE = re.compile(r"^[0-9]+(\.[0-9]+)?s$")
PEER_URL_RE = re.compile(r"^http://([^/:@\s]+):([0-9]+)/?$")


class ConfigError(ValueError):
    """A bad option: `option` names it (as on the command line), `reason` says what is wrong."""

    def __init__(self, option: str, reason: str):
        super().__init__(f"{option}: {reason}")
        self.option = option
        self.reason = reason


@dataclass(frozen=True)
class Worker:
    """One worker: its cluster name (what the plugin config lists), address and optional weight."""

    cluster: str
    host: str
    port: int
    weight: float | None = None


HostPort = tuple[str, int]


@dataclass(frozen=True)
class Pool:
    """A model whose workers are the hosts of ONE Envoy cluster (`cluster`), with live membership:
    a file-based EDS DiscoveryResponse (`source` "eds", `path`) or a DNS name resolving to one
    address per worker (`source` "dns", `host`, `port`; a Kubernetes headless Service). The filter
    picks a host and names it in DESTINATION_HEADER; the cluster's override_host policy sends the
    request there. `cluster + POLL_SUFFIX` is the pool's load-poll cluster (same membership)."""

    cluster: str
    source: str  # "eds" or "dns"
    path: str | None = None
    host: str | None = None
    port: int | None = None

    @property
    def load_cluster(self) -> str:
        return self.cluster + POLL_SUFFIX

    def describe(self) -> str:
        return f"EDS file {self.path}" if self.source == "eds" else f"DNS {self.host}:{self.port}"


@dataclass(frozen=True)
class PdModel:
    """A prefill/decode-disaggregated model (SGLang --disaggregation-mode): prefill workers with
    their bootstrap ports (the decode workers fetch KV from bootstrap_host = the worker's host) and
    decode workers. The filter picks one of each; the route mirrors the request to the prefill
    worker."""

    prefill: tuple  # of (Worker, bootstrap port)
    decode: tuple  # of Worker


PREFILL_HEADER = "x-prefix-router-prefill-cluster"


@dataclass
class Options:
    """Everything a config depends on. Build with `profile()`; check with `validate()`."""

    models: dict[str, list[Worker]] = field(default_factory=dict)
    # models whose workers are one cluster's hosts (EDS or DNS membership), by model name
    pools: dict[str, Pool] = field(default_factory=dict)
    default_model: str | None = None
    # "production" (fallbacks, health checks, retries, rate limit) or "simple" (one endpoint per
    # cluster, nothing else: demo, tests, benchmarks)
    shape: str = "production"
    listen: HostPort = ("127.0.0.1", 10000)
    admin: HostPort = ("127.0.0.1", 9901)
    stats_listen: HostPort | None = ("127.0.0.1", 9902)  # GET /stats/prometheus and /ready only
    wasm: str = CONTAINER_WASM
    # the name of an Envoy dynamic module (lib<name>.so, found through the
    # ENVOY_DYNAMIC_MODULES_SEARCH_PATH of the Envoy process) run in place of the Wasm filter with
    # the same plugin configuration: benches only (benches/dm-floor); prefix-router ships as Wasm
    dynamic_module: str | None = None
    # the pool clusters' load balancer is the same dynamic module (Envoy 1.40's
    # envoy.load_balancing_policies.dynamic_modules) instead of override_host: opt-in, native only
    native_lb: bool = False
    debug_header: bool = False
    access_log: bool = True
    rate_limit: int = 1000  # requests/s per Envoy replica; 0 = no global bucket
    rate_limit_per_client: int = 0  # requests/s per client address; 0 = no per-client buckets
    rate_limit_clients: int = 10000  # per-client buckets kept (least recently used evicted)
    health_interval: str = "5s"
    health_timeout: str = "2s"
    stream_idle_timeout: str = "300s"
    # The whole request (headers and body) must arrive within request_timeout, its headers within
    # request_headers_timeout: the filter holds every inference request until its body ends, so a
    # client trickling a body would otherwise pin up to 16 MiB for as long as it likes. Both stop
    # counting once the request is received (or a response starts): streamed answers are not cut.
    request_timeout: str = "60s"
    request_headers_timeout: str = "10s"
    # HTTP/2 streams per downstream connection (Envoy's default is 2^31 - 1)
    max_concurrent_streams: int = 100
    # the fixed_heap overload monitor's 100% (MiB): keep it ~512 MiB under the container's memory
    # limit (V8's Wasm memory and the binary are outside tcmalloc's heap)
    max_heap_mib: int = 1536
    per_try_idle_timeout: str = "180s"
    fallbacks: int = 3
    max_requests: int = 1024
    max_ejection_percent: int = 50
    max_connections: int = 10000
    # None: no load_poll key (the filter's default, polling through the worker clusters);
    # 0: off; > 0: poll every that many ms through <worker>_load clusters
    load_poll_ms: int | None = 100
    # The index self-check's counter reads (load_poll.metrics_interval_ms); None: the filter's default.
    hit_check_ms: int | None = None
    peers: list[HostPort] = field(default_factory=list)
    peer_listen: HostPort | None = None
    peer_secret: str | None = None
    # plugin hash_key (keyed block hashes and buckets, docs/design.md "Index poisoning"): required in
    # the production shape; profile() generates one for a production config without peers (one
    # replica: the key only has to live as long as the index, which a restart empties anyway)
    hash_key: str | None = None
    hash_key_generated: bool = False
    # merged (recursively) into the generated plugin configuration: policy parameters, index,
    # unknown_model, passthrough_cluster, ... (filter/src/config.rs is the schema)
    plugin: dict = field(default_factory=dict)
    # the command line recorded in the header of rendered configs (None: no command line)
    command: str | None = None
    # prefill/decode-disaggregated models (docs/design.md "Prefill/decode disaggregation")
    pd_models: dict = field(default_factory=dict)
    # route timeout of PD requests: bounds the decode stream and the prefill mirror (which
    # inherits it); a mirror has no timeout of its own
    pd_timeout: str = "600s"
    # pools: the most hosts the filter tracks per pool (plugin pool.max_workers)
    pool_max_workers: int = 64
    # pools: how often the filter reads the admin's /clusters for their hosts; 0 = never (a pool
    # is then used only through its cluster's fallback load balancer)
    membership_ms: int = 1000
    # (METHOD, PATH) pairs the public route forwards besides PUBLIC_PATHS (envoy/gen --allow-path)
    allow_paths: list[tuple[str, str]] = field(default_factory=list)


def fleet(model: str, ports: dict[str, int], host: str = "127.0.0.1") -> dict[str, list[Worker]]:
    """{model: [Worker(name, host, port), ...]} for workers named by their cluster."""
    return {model: [Worker(name, host, port) for name, port in ports.items()]}


def _demo_models() -> dict[str, list[Worker]]:
    return fleet("llama", {f"w{i}": 30000 + i for i in range(4)})


_PROFILE_DEFAULTS: dict[str, dict] = {
    "demo": dict(shape="simple", models=None, wasm=LOCAL_WASM, debug_header=True, rate_limit=0,
                 stats_listen=None, load_poll_ms=None, plugin={"policy": {"load_eps": 1.0}}),
    "test": dict(shape="simple", wasm=LOCAL_WASM, debug_header=True, rate_limit=0, stats_listen=None,
                 load_poll_ms=None, plugin={"policy": {"load_eps": 1.0}}),
    "bench": dict(shape="simple", wasm=LOCAL_WASM, debug_header=False, access_log=False, rate_limit=0,
                  stats_listen=None, load_poll_ms=None),
    "ingress": dict(shape="production"),
    "compose": dict(shape="production", models=None, listen=("0.0.0.0", 10000),
                    stats_listen=("0.0.0.0", 9902)),
}


def profile(name: str, **overrides) -> Options:
    """Options of a profile with `overrides` (Options fields) applied."""
    if name not in _PROFILE_DEFAULTS:
        raise ConfigError("--profile", f"unknown profile {name!r} (one of {', '.join(PROFILES)})")
    defaults = dict(_PROFILE_DEFAULTS[name])
    if defaults.get("models", {}) is None:
        defaults["models"] = _demo_models() if name == "demo" else {
            "llama": [Worker(f"llama_{i}", f"w{i}", 30000) for i in range(4)]}
    known = {f.name for f in fields(Options)}
    for k in overrides:
        if k not in known:
            raise ConfigError(k, "not an option")
    opts = Options(**{**copy.deepcopy(defaults), **overrides})
    if (opts.shape == "production" and opts.hash_key is None and not opts.peers
            and opts.peer_listen is None and opts.peer_secret is None):
        opts.hash_key = generate_hash_key()
        opts.hash_key_generated = True
    return opts


def generate_hash_key() -> str:
    """A fresh random hash_key (64 hex characters, 256 bits)."""
    return secrets.token_hex(32)


def validate(o: Options) -> None:
    """Raises ConfigError naming the option and the reason for the first bad value."""
    if o.shape not in ("production", "simple"):
        raise ConfigError("shape", f"expected production or simple, got {o.shape!r}")
    if not o.models and not o.pd_models and not o.pools:
        raise ConfigError("--model", "at least one model with its workers is required (or --pd-model)")
    seen_clusters: set[str] = set()
    for model, workers in o.models.items():
        if not NAME_RE.match(model):
            raise ConfigError("--model", f"bad model name {model!r}")
        if not workers:
            raise ConfigError(f"--model {model}", "no workers")
        eps = [(w.host, w.port) for w in workers]
        if len(set(eps)) != len(eps):
            raise ConfigError(f"--model {model}", "duplicate worker (the same HOST:PORT twice)")
        for w in workers:
            _check_hostport((w.host, w.port), f"--model {model}")
            if not CLUSTER_RE.match(w.cluster):
                raise ConfigError(f"--model {model}", f"bad cluster name {w.cluster!r}")
            if w.cluster in seen_clusters:
                raise ConfigError(f"--model {model}", f"cluster name {w.cluster!r} is used twice")
            seen_clusters.add(w.cluster)
            if w.weight is not None and not (math.isfinite(w.weight) and w.weight > 0):
                raise ConfigError(f"--model {model}", f"worker {w.host}:{w.port}: weight must be a number > 0, got {w.weight}")
    _validate_pools(o, seen_clusters)
    _validate_pd(o, seen_clusters)
    if o.default_model is not None and o.default_model not in [*o.models, *o.pools, *o.pd_models]:
        raise ConfigError("--default-model", f"{o.default_model!r} is not one of the models "
                          f"({', '.join([*o.models, *o.pools, *o.pd_models])})")
    _check_hostport(o.listen, "--listen", allow_zero=True)
    _check_hostport(o.admin, "--admin", allow_zero=True)
    for m, path in o.allow_paths:
        _check_allow_path(m, path)
    if o.stats_listen is not None:
        _check_hostport(o.stats_listen, "--stats-listen", allow_zero=True)
    for opt, v in (("--health-interval", o.health_interval), ("--health-timeout", o.health_timeout), ("--stream-idle-timeout", o.stream_idle_timeout),
                   ("--per-try-idle-timeout", o.per_try_idle_timeout), ("--request-timeout", o.request_timeout),
                   ("--request-headers-timeout", o.request_headers_timeout)):
        if not isinstance(v, str) or not DURATION_RE.match(v):
            raise ConfigError(opt, f"expected a duration in seconds like 5s or 0.5s, got {v!r}")
    for opt, v in (("--request-timeout", o.request_timeout), ("--request-headers-timeout", o.request_headers_timeout)):
        if float(v[:-1]) <= 0:
            raise ConfigError(opt, f"must be > 0 (0 would let a client hold a request and its buffered body forever), got {v!r}")
    _int_range("--max-concurrent-streams", o.max_concurrent_streams, 1, 2**31 - 1, "HTTP/2 streams per connection")
    _int_range("--max-heap-mib", o.max_heap_mib, 64, 10**7, "the heap size the overload actions are relative to, MiB")
    _int_range("--rate-limit", o.rate_limit, 0, 10**9, "0 = no rate limit")
    _int_range("--rate-limit-per-client", o.rate_limit_per_client, 0, 10**9, "0 = no per-client limit")
    _int_range("--rate-limit-clients", o.rate_limit_clients, 1, 10**7, "per-client buckets kept")
    _int_range("--fallbacks", o.fallbacks, 0, 1000, "workers of the same model a worker cluster falls back to")
    _int_range("--max-requests", o.max_requests, 1, 10**9, "circuit breaker per worker cluster")
    _int_range("--max-ejection-percent", o.max_ejection_percent, 0, 100, "a percentage")
    _int_range("--max-connections", o.max_connections, 1, 10**9, "downstream connection cap")
    if o.load_poll_ms is not None:
        _int_range("--load-poll-ms", o.load_poll_ms, 0, 60000, "0 disables polling")
    if o.hit_check_ms is not None:
        _int_range("--hit-check-ms", o.hit_check_ms, 0, 600000, "0 disables the index self-check")
    _int_range("--pool-max-workers", o.pool_max_workers, 1, MAX_POOL_WORKERS, "hosts the filter tracks per pool")
    _int_range("--membership-ms", o.membership_ms, 0, 60000, "0 = the filter never reads pool membership")
    if 0 < o.membership_ms < 100:
        raise ConfigError("--membership-ms", f"must be 0 (off) or at least 100 (the filter's floor), got {o.membership_ms}")
    if o.pools and o.membership_ms and o.admin[1] == 0:
        raise ConfigError("--admin", "pools read their membership from the admin's /clusters: give the admin a fixed "
                          "port (or --membership-ms 0)")
    if not isinstance(o.plugin, dict):
        raise ConfigError("--plugin", "the plugin overrides must be a JSON object")
    if (o.peers or o.peer_listen) and o.peer_secret is None:
        raise ConfigError(
            "--peers" if o.peers else "--peer-listen",
            "a shared peer secret is required: give --peer-secret SECRET or --peer-secret-file PATH "
            "(at least 16 characters, the same on every replica)")
    if o.peer_secret is not None and o.peer_secret != PEER_SECRET_PLACEHOLDER:
        check_secret(o.peer_secret, "--peer-secret")
    if o.peer_secret is not None and not (o.peers or o.peer_listen):
        raise ConfigError("--peer-secret / --peer-secret-file", "only used with --peers or --peer-listen")
    if o.peer_listen is not None:
        _check_hostport(o.peer_listen, "--peer-listen", allow_zero=True)
    if o.hash_key is not None and o.hash_key != HASH_KEY_PLACEHOLDER:
        check_secret(o.hash_key, "--hash-key")
    if o.shape == "production" and o.hash_key is None:
        raise ConfigError(
            "--hash-key-file",
            "replicas that share an index (--peers / --peer-listen) need the same hash key: give "
            "--hash-key-file PATH (at least 16 characters, the same file on every replica), or "
            f"--hash-key-placeholder to write {HASH_KEY_PLACEHOLDER} and replace it at deploy time")
    clusters = _worker_names(o)
    reserved = {PEER_PREFIX + str(i) for i in range(len(o.peers))} | {ADMIN_CLUSTER}
    if _poll_clusters(o):
        reserved |= {c + POLL_SUFFIX for c in _static_names(o)}
    reserved |= {p.load_cluster for p in o.pools.values()}
    if set(clusters) & reserved:
        pools = {p.cluster: m for m, p in o.pools.items()}
        bad = sorted(set(clusters) & reserved)[0]
        raise ConfigError(f"--model {pools[bad]}" if bad in pools else "--model",
                          f"cluster name {bad!r} collides with the peer clusters (prefix_router_peer_<i>), the "
                          "load-poll clusters (<worker>_load, <pool>_load) or admin: rename it")


def _check_allow_path(method, path) -> None:
    if method not in HTTP_METHODS:
        raise ConfigError("--allow-path", f"unknown method {method!r} (one of {', '.join(HTTP_METHODS)})")
    if not isinstance(path, str) or not ALLOW_PATH_RE.match(path) or "//" in path or "/./" in path + "/" \
            or "/../" in path + "/":
        raise ConfigError("--allow-path", f"expected an exact, normalized path like /get_model_info (letters, digits, "
                          f"._~-/; no query, no dot segments), got {path!r}")


def public_routes(o: Options) -> list[tuple[tuple[str, ...], list[str]]]:
    """PUBLIC_PATHS and o.allow_paths grouped for route matches: [(methods, paths)], each path
    once, the paths that take the same set of methods together, in first-listed order."""
    by_path: dict[str, list[str]] = {}
    for m, path in [*PUBLIC_PATHS, *o.allow_paths]:
        ms = by_path.setdefault(path, [])
        if m not in ms:
            ms.append(m)
    groups: dict[tuple[str, ...], list[str]] = {}
    for path, ms in by_path.items():
        groups.setdefault(tuple(sorted(ms)), []).append(path)
    return list(groups.items())


def parse_allow_path(spec: str) -> list[tuple[str, str]]:
    """--allow-path [METHOD[,METHOD...]:]PATH (methods default to GET): the pairs it allows."""
    methods, sep, path = spec.partition(":") if not spec.startswith("/") else ("", "", spec)
    if not spec.startswith("/") and not sep:
        raise ConfigError("--allow-path", f"expected [METHOD[,METHOD]:]/PATH, e.g. /get_model_info or "
                          f"POST:/flush_cache, got {spec!r}")
    ms = [m.strip().upper() for m in methods.split(",") if m.strip()] or ["GET"]
    out = [(m, path) for m in ms]
    for m, p in out:
        _check_allow_path(m, p)
    return out


def _validate_pools(o: Options, seen_clusters: set) -> None:
    for model, p in o.pools.items():
        opt = f"--model {model}"
        if not NAME_RE.match(model):
            raise ConfigError("--model", f"bad model name {model!r}")
        if model in o.models:
            raise ConfigError(opt, "is given twice (a static worker list and a pool)")
        if model in o.pd_models:
            raise ConfigError(opt, "is also the --pd-model: a PD model's workers are static lists "
                              "(--prefill / --decode HOST:PORT,...), not a pool")
        if not isinstance(p, Pool) or not CLUSTER_RE.match(p.cluster):
            raise ConfigError(opt, f"bad pool cluster name {getattr(p, 'cluster', p)!r}")
        if p.source == "eds":
            _check_eds_path(p.path, opt)
        elif p.source == "dns":
            _check_hostport((p.host, p.port), opt)
        else:
            raise ConfigError(opt, f"a pool's source is eds or dns, got {p.source!r}")
        if p.cluster in seen_clusters:
            raise ConfigError(opt, f"the pool's cluster name {p.cluster!r} is used twice (pools are named after "
                              "their model, non-alphanumerics as _): rename the model or the other cluster")
        seen_clusters.add(p.cluster)


def _check_eds_path(path, opt: str) -> None:
    if not isinstance(path, str) or not path:
        raise ConfigError(opt, "eds: needs the path of the EDS file (eds:/etc/prefix-router/NAME.yaml)")
    if not path.startswith("/"):
        raise ConfigError(opt, f"the EDS file path must be absolute (Envoy resolves a relative one against its "
                          f"working directory), got {path!r}")
    if any(c in path for c in "\n\r\0,"):
        raise ConfigError(opt, f"bad EDS file path {path!r}")


def _validate_pd(o: Options, seen_clusters: set) -> None:
    if not isinstance(o.pd_timeout, str) or not DURATION_RE.match(o.pd_timeout) or o.pd_timeout.strip("0.s") == "":
        raise ConfigError("--pd-timeout", f"expected a duration > 0 like 600s, got {o.pd_timeout!r}")
    for model, pd in o.pd_models.items():
        opt = f"--pd-model {model}"
        if not NAME_RE.match(model):
            raise ConfigError("--pd-model", f"bad model name {model!r}")
        if model in o.models:
            raise ConfigError(opt, "is also a --model")
        if not pd.prefill:
            raise ConfigError("--prefill", f"model {model}: at least one prefill worker HOST:PORT@BOOTSTRAP_PORT")
        if not pd.decode:
            raise ConfigError("--decode", f"model {model}: at least one decode worker HOST:PORT")
        eps = [(w.host, w.port) for w, _ in pd.prefill] + [(w.host, w.port) for w in pd.decode]
        if len(set(eps)) != len(eps):
            raise ConfigError(opt, "duplicate worker (the same HOST:PORT twice, or in both roles)")
        for w, bport in pd.prefill:
            _check_hostport((w.host, w.port), "--prefill")
            _int_range("--prefill", bport, 1, 65535, f"bootstrap port of {w.host}:{w.port}")
        for w in pd.decode:
            _check_hostport((w.host, w.port), "--decode")
        for w in [w for w, _ in pd.prefill] + list(pd.decode):
            if not CLUSTER_RE.match(w.cluster):
                raise ConfigError(opt, f"bad cluster name {w.cluster!r}")
            if w.cluster in seen_clusters:
                raise ConfigError(opt, f"cluster name {w.cluster!r} is used twice")
            seen_clusters.add(w.cluster)


def _pd_workers(o: Options) -> list:
    """Every PD worker (prefill then decode) of every PD model."""
    return [w for pd in o.pd_models.values() for w in [w for w, _ in pd.prefill] + list(pd.decode)]


def _int_range(opt: str, v, lo: int, hi: int, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(opt, f"must be an integer between {lo} and {hi} ({what}), got {v!r}")


def _check_hostport(hp, opt: str, allow_zero: bool = False) -> None:
    host, port = hp
    if not HOST_RE.match(str(host)):
        raise ConfigError(opt, f"bad host {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not (0 if allow_zero else 1) <= port < 65536:
        raise ConfigError(opt, f"bad port {port!r} (1-65535{', or 0 for any' if allow_zero else ''})")


def _static_names(o: Options) -> list[str]:
    """Clusters of one worker each (static models' and PD workers)."""
    return [w.cluster for ws in o.models.values() for w in ws] + [w.cluster for w in _pd_workers(o)]


def _worker_names(o: Options) -> list[str]:
    """Every cluster the client route may be sent to: one per static worker, one per pool."""
    return ([w.cluster for ws in o.models.values() for w in ws] + [p.cluster for p in o.pools.values()]
            + [w.cluster for w in _pd_workers(o)])


def pool_fallbacks(o: Options) -> int:
    """Fallbacks the filter names after a pool request's chosen worker: --fallbacks, at most
    POOL_MAX_FALLBACKS and fewer than the pool's max_workers."""
    return max(0, min(o.fallbacks, POOL_MAX_FALLBACKS, o.pool_max_workers - 1))


def _poll_clusters(o: Options) -> bool:
    return bool(o.load_poll_ms)


# --------------------------------------------------------------------------------------------
# Command-line parsing helpers (also usable from Python)
# --------------------------------------------------------------------------------------------


def parse_hostport(s: str, opt: str, allow_zero: bool = False) -> HostPort:
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(opt, f"expected HOST:PORT, got {s!r}")
    hp = (host, int(port))
    _check_hostport(hp, opt, allow_zero)
    return hp


def parse_model(spec: str, index_from: int = 0) -> tuple[str, list[Worker]]:
    """NAME=WORKER[,WORKER...], WORKER = [CLUSTER=]HOST:PORT[@WEIGHT]; clusters default to
    <model>_<i> (non-alphanumerics of the model name as _)."""
    name, sep, workers = spec.partition("=")
    if not sep or not NAME_RE.match(name):
        raise ConfigError("--model", f"expected NAME=HOST:PORT[,HOST:PORT...], got {spec!r}")
    out = []
    for i, w in enumerate(x.strip() for x in workers.split(",") if x.strip()):
        cluster, sep, rest = w.partition("=")
        if not sep:
            cluster, rest = f"{cluster_id(name)}_{i}", w
        addr, sep, weight = rest.partition("@")
        host, port = parse_hostport(addr, f"--model {name}")
        wt = None
        if sep:
            try:
                wt = float(weight)
            except ValueError:
                raise ConfigError(f"--model {name}", f"worker {addr}: weight must be a number > 0, got {weight!r}") from None
        out.append(Worker(cluster, host, port, wt))
    if not out:
        raise ConfigError(f"--model {name}", "no workers")
    return name, out


_POOL_SPEC = re.compile(r"^(eds|dns):(?![0-9]+(@[^,]*)?(,|$))")


def is_pool_spec(spec: str) -> bool:
    """NAME=eds:PATH or NAME=dns:HOST:PORT (a static worker on a host named eds or dns, e.g.
    NAME=dns:30000, stays a static list)."""
    return bool(_POOL_SPEC.match(spec.partition("=")[2].strip()))


def parse_pool(spec: str) -> tuple[str, Pool]:
    """NAME=eds:PATH (an EDS DiscoveryResponse file, replaced by rename) or NAME=dns:HOST:PORT (a
    name resolving to one address per worker): a pool model, its cluster named after the model
    (cluster_id)."""
    name, _, rest = spec.partition("=")
    if not NAME_RE.match(name):
        raise ConfigError("--model", f"expected NAME=eds:PATH or NAME=dns:HOST:PORT, got {spec!r}")
    opt = f"--model {name}"
    source, _, arg = rest.strip().partition(":")
    if source == "eds":
        _check_eds_path(arg, opt)
        return name, Pool(cluster_id(name), "eds", path=arg)
    if "," in arg:
        raise ConfigError(opt, f"a pool takes one DNS name (dns:HOST:PORT), got {rest!r}")
    host, port = parse_hostport(arg, opt)
    return name, Pool(cluster_id(name), "dns", host=host, port=port)


def parse_pd(name: str | None, prefill: str | None, decode: str | None) -> dict:
    """--pd-model NAME --prefill [CLUSTER=]HOST:PORT@BOOTSTRAP_PORT[,...] --decode
    [CLUSTER=]HOST:PORT[@WEIGHT][,...]; clusters default to NAME_prefill_<i> / NAME_decode_<i>."""
    if name is None:
        raise ConfigError("--prefill / --decode", "need --pd-model NAME")
    if not prefill:
        raise ConfigError("--prefill", f"--pd-model {name} needs --prefill HOST:PORT@BOOTSTRAP_PORT[,...]")
    if not decode:
        raise ConfigError("--decode", f"--pd-model {name} needs --decode HOST:PORT[,...]")
    for opt, items in (("--prefill", prefill), ("--decode", decode)):
        if is_pool_spec(f"{name}={items}"):
            raise ConfigError(opt, f"{items!r}: pools (eds:PATH, dns:HOST:PORT) are for --model only; a PD "
                              "model's workers are static HOST:PORT lists")
    pre = []
    for i, item in enumerate(prefill.split(",")):
        hp, sep, bport = item.rpartition("@")
        if not sep or not bport.isdigit():
            raise ConfigError("--prefill", f"expected [CLUSTER=]HOST:PORT@BOOTSTRAP_PORT, got {item!r}")
        try:
            _, ws = parse_model(f"{name}={hp}")
        except ConfigError as e:
            raise ConfigError("--prefill", e.reason) from None
        w = ws[0]
        if w.weight is not None:
            raise ConfigError("--prefill", f"{item!r}: prefill workers take no weight")
        cluster = w.cluster if "=" in hp else f"{cluster_id(name)}_prefill_{i}"
        pre.append((Worker(cluster, w.host, w.port), int(bport)))
    dec = []
    for i, item in enumerate(decode.split(",")):
        try:
            _, ws = parse_model(f"{name}={item}")
        except ConfigError as e:
            raise ConfigError("--decode", e.reason) from None
        w = ws[0]
        cluster = w.cluster if "=" in item.split("@")[0] else f"{cluster_id(name)}_decode_{i}"
        dec.append(Worker(cluster, w.host, w.port, w.weight))
    return {name: PdModel(prefill=tuple(pre), decode=tuple(dec))}


def parse_peers(spec: str) -> list[HostPort]:
    urls = [u.strip() for u in spec.split(",") if u.strip()]
    if not urls:
        raise ConfigError("--peers", "expected http://HOST:PORT[,http://HOST:PORT...], got an empty list")
    peers: list[HostPort] = []
    for u in urls:
        if u.lower().startswith("https://"):
            raise ConfigError("--peers", f"{u!r}: only http:// is supported (keep the peer port on a private network)")
        m = PEER_URL_RE.match(u)
        if not m:
            raise ConfigError("--peers", f"expected http://HOST:PORT (the peer's --peer-listen address), got {u!r}")
        host, port = m.group(1), int(m.group(2))
        if not HOST_RE.match(host):
            raise ConfigError("--peers", f"bad host {host!r} in {u!r}")
        if not 0 < port < 65536:
            raise ConfigError("--peers", f"bad port {port} in {u!r}")
        if (host, port) in peers:
            raise ConfigError("--peers", f"{u!r} is listed twice")
        peers.append((host, port))
    return peers


def check_secret(secret: str, opt: str) -> str:
    if PLACEHOLDER_RE.match(secret):
        raise ConfigError(opt, "is a placeholder (__NAME__), not a secret: give the real value, or use "
                          "--hash-key-placeholder / --peer-secret-placeholder to write one on purpose")
    if len(secret) < MIN_SECRET_LEN:
        raise ConfigError(opt, f"the secret is too short ({len(secret)} characters; at least {MIN_SECRET_LEN} are required)")
    if any(not 0x21 <= ord(c) < 0x7F for c in secret):
        raise ConfigError(opt, "the secret must be printable ASCII without spaces (it is sent as an HTTP header)")
    return secret


def cluster_id(model: str) -> str:
    """Cluster-name-safe model id (model names may contain dots, slashes in the wild)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", model)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
