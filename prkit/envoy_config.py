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

import argparse
import copy
import ipaddress
import json
import math
import re
import secrets
import sys
from dataclasses import dataclass, field, fields, replace

MIB16 = 16 * 1024 * 1024
MIB4 = 4 * 1024 * 1024
MIN_SECRET_LEN = 16  # the filter's peers.secret and hash_key minimum (filter/src/config.rs)
# hash_key of configs whose key is written in at deploy time (k8s init container, compose start-up
# script): shorter than MIN_SECRET_LEN, so the filter refuses a config where it was never replaced
# rather than run with a key everyone can read in this repository.
HASH_KEY_PLACEHOLDER = "__HASH_KEY__"
# Heap pressure (fixed_heap: tcmalloc's reserved heap / --max-heap-mib) at which the overload
# manager acts: HTTP/2 streams buffering >= 1 MiB are reset from HEAP_RESET_FROM (largest first,
# all of them at HEAP_SHED); at HEAP_SHED new requests get 503 and HTTP/1 connections that send
# more bytes are closed.
HEAP_RESET_FROM = 0.85
HEAP_SHRINK = 0.90
HEAP_SHED = 0.95
CLUSTER_HEADER = "x-prefix-router-cluster"
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


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Worker:
    """One worker: its cluster name (what the plugin config lists), address and optional weight."""

    cluster: str
    host: str
    port: int
    weight: float | None = None


HostPort = tuple[str, int]


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
    if not o.models and not o.pd_models:
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
    _validate_pd(o, seen_clusters)
    if o.default_model is not None and o.default_model not in o.models and o.default_model not in o.pd_models:
        raise ConfigError("--default-model", f"{o.default_model!r} is not one of the models ({', '.join(o.models)})")
    _check_hostport(o.listen, "--listen", allow_zero=True)
    _check_hostport(o.admin, "--admin", allow_zero=True)
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
    if not isinstance(o.plugin, dict):
        raise ConfigError("--plugin", "the plugin overrides must be a JSON object")
    if (o.peers or o.peer_listen) and o.peer_secret is None:
        raise ConfigError(
            "--peers" if o.peers else "--peer-listen",
            "a shared peer secret is required: give --peer-secret SECRET or --peer-secret-file PATH "
            "(at least 16 characters, the same on every replica)")
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
    reserved = {PEER_PREFIX + str(i) for i in range(len(o.peers))} | {"admin"}
    if _poll_clusters(o):
        reserved |= {c + POLL_SUFFIX for c in clusters}
    if set(clusters) & reserved:
        raise ConfigError("--model", "a worker's cluster name collides with the peer clusters "
                          "(prefix_router_peer_<i>), the load-poll clusters (<worker>_load) or admin: rename it")


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


def parse_pd(name: str | None, prefill: str | None, decode: str | None) -> dict:
    """--pd-model NAME --prefill [CLUSTER=]HOST:PORT@BOOTSTRAP_PORT[,...] --decode
    [CLUSTER=]HOST:PORT[@WEIGHT][,...]; clusters default to NAME_prefill_<i> / NAME_decode_<i>."""
    if name is None:
        raise ConfigError("--prefill / --decode", "need --pd-model NAME")
    if not prefill:
        raise ConfigError("--prefill", f"--pd-model {name} needs --prefill HOST:PORT@BOOTSTRAP_PORT[,...]")
    if not decode:
        raise ConfigError("--decode", f"--pd-model {name} needs --decode HOST:PORT[,...]")
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


# --------------------------------------------------------------------------------------------
# The plugin configuration
# --------------------------------------------------------------------------------------------


def merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, recursively for dict values."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _worker_names(o: Options) -> list[str]:
    return [w.cluster for ws in o.models.values() for w in ws] + [w.cluster for w in _pd_workers(o)]


def _poll_clusters(o: Options) -> bool:
    return bool(o.load_poll_ms)


def plugin_config(o: Options) -> dict:
    """The filter's configuration (client listener), with Options.plugin merged in."""
    models = {}
    for model, ws in o.models.items():
        models[model] = {"workers": [w.cluster if w.weight is None else {"cluster": w.cluster, "weight": w.weight}
                                     for w in ws]}
    for model, pd in o.pd_models.items():
        models[model] = {
            "prefill": [{"cluster": w.cluster, "bootstrap_host": w.host, "bootstrap_port": bport}
                        for w, bport in pd.prefill],
            "decode": [w.cluster if w.weight is None else {"cluster": w.cluster, "weight": w.weight}
                       for w in pd.decode],
        }
    plugin: dict = {
        "models": models,
        "default_model": o.default_model or next(iter(models)),
        "unknown_model": "default",
        "cluster_header": CLUSTER_HEADER,
        "debug_header": DEBUG_HEADER if o.debug_header else None,
        "policy": {"name": "cache_aware"},  # tuned defaults: filter/src/config.rs
    }
    if o.load_poll_ms is not None:
        if o.load_poll_ms:
            plugin["load_poll"] = {"interval_ms": o.load_poll_ms, "cluster_suffix": POLL_SUFFIX}
            if o.load_poll_ms > 1000:
                # the filter's default stale_ms (1000) must not be below the interval
                plugin["load_poll"]["stale_ms"] = min(10 * o.load_poll_ms, 600000)
        else:
            plugin["load_poll"] = {"interval_ms": 0}
    if o.peer_secret is not None:
        plugin["peers"] = {"clusters": [PEER_PREFIX + str(i) for i in range(len(o.peers))], "secret": o.peer_secret}
    if o.hash_key is not None:
        plugin["hash_key"] = o.hash_key
    return merge(plugin, o.plugin)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


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


def simple_cluster(w: Worker) -> dict:
    """One endpoint, Envoy's defaults otherwise (HTTP/1.1): a cluster name is one worker's cache."""
    return {"name": w.cluster, **_discovery([w.host]), "connect_timeout": "1s",
            "per_connection_buffer_limit_bytes": MIB16,
            "load_assignment": {"cluster_name": w.cluster, "endpoints": endpoints([(w.host, w.port)])}}


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
        "circuit_breakers": {"thresholds": [{
            "priority": "DEFAULT", "max_connections": o.max_requests, "max_pending_requests": o.max_requests,
            "max_requests": o.max_requests,
            "retry_budget": {"budget_percent": {"value": 20.0}, "min_retry_concurrency": 8},
        }]},
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
    return {"#": "Loopback admin, reached only through the stats listener's two read-only paths.",
            "name": "admin", "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "admin", "endpoints": endpoints([o.admin])}}


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
    out += pd_clusters(o)
    if _poll_clusters(o):
        out += [poll_cluster(w) for ws in o.models.values() for w in ws]
        out += [poll_cluster(w) for w in _pd_workers(o)]
    out += [peer_cluster(i, hp) for i, hp in enumerate(o.peers)]
    if o.stats_listen is not None:
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


def pd_route(o: Options, route: dict) -> dict:
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
    # both headers must name workers (never admin: a mirror to it would POST the client's path there)
    return {"match": {"prefix": "/", "headers": [only(PREFILL_HEADER, prefill),
                                                 only(CLUSTER_HEADER, _worker_names(o))]},
            "#": "Requests of PD models: the filter sets the prefill header (client values are removed).",
            "request_body_buffer_limit": MIB16, "route": r}


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


def access_log() -> list:
    return [{"name": "envoy.access_loggers.stdout", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
        "log_format": {"json_format": dict(ACCESS_LOG_FIELDS)}}}]


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
    return {"mappers": [{
        "filter": {"status_code_filter": {"comparison": {
            "op": "EQ", "value": {"default_value": 413, "runtime_key": "prefix_router.local_reply_413"}}}},
        "body_format_override": {"content_type": "application/json", "json_format": {
            "object": "error", "message": f"Request body too large: the limit is {MIB16 >> 20} MiB",
            "type": "BadRequestError", "param": None, "code": 413}},
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
    if o.shape == "production":
        route["#r"] = (
            "Retry on another worker when the chosen one cannot take the request: connect failure,\n"
            "refused stream, reset before any response byte, or a 503 (SGLang starting/draining).\n"
            "previous_priorities moves the retry to the cluster's fallbacks; previous_hosts never picks\n"
            "a host that already failed this request.")
        route["retry_policy"] = retry_policy(o)
    vhost: dict = {"name": "llm", "domains": ["*"]}
    if o.shape == "production":
        vhost["#"] = "x-envoy-attempt-count on the upstream request and the response: retries are visible."
        vhost["include_request_attempt_count"] = True
        vhost["include_attempt_count_in_response"] = True
    names = "|".join(re.escape(c) for c in _worker_names(o))
    vhost["routes"] = [
        {"#": "Only a worker cluster: the header must name one of them (never admin, a peer or a\n"
              "<worker>_load poll cluster), even if the filter were bypassed.",
         "match": {"prefix": "/", "headers": [{"name": CLUSTER_HEADER,
                                               "string_match": {"safe_regex": {"regex": f"^({names})$"}}}]},
         "#b": "Route-level body buffer limit (16 MiB, as the listener's).",
         "request_body_buffer_limit": MIB16, "route": route},
        {"#": "No worker named (the filter did not run): refuse rather than guess.",
         "match": {"prefix": "/"},
         "direct_response": {"status": 503, "body": {"inline_string": NO_WORKER_BODY}}},
    ]
    if o.pd_models:
        vhost["routes"].insert(0, pd_route(o, route))
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
        "#l": f"A body over the {MIB16 >> 20} MiB buffer limit is answered by Envoy itself (413, text); OpenAI\n"
              "clients expect a JSON error body. Only 413: the filter's own replies keep their body.",
        "local_reply_config": local_reply_413(),
    })
    if o.access_log:
        hcm["#a"] = ("One JSON line per request: the cluster the filter chose, the decision header (when on),\n"
                     "where it went (a retry can move it), attempts, time to first byte and duration.")
        hcm["access_log"] = access_log()
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
    return {
        "#": "Peer listener: other replicas POST the index records they make here (keep this port on a\n"
             "private network; batches without a valid HMAC of the shared secret are refused).",
        "name": "peers",
        "address": socket_address(o.peer_listen),
        "#b": "A batch holds at most a few thousand records: 4 MiB is ample.",
        "per_connection_buffer_limit_bytes": MIB4,
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "peers",
                "codec_type": "AUTO",
                "#a": "One JSON line per refused request, with the filter's reason (details); accepted\n"
                      "batches are not logged.",
                "access_log": peer_access_log(),
                "#": "Batches are small and quick: slow or idle peers are cut off.",
                "request_timeout": "10s",
                "stream_idle_timeout": "10s",
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
    doc = {
        "admin": admin(o),
        "#o": "Cap downstream connections (each streaming generation holds one) and the heap.",
        "overload_manager": overload_manager(o),
        "static_resources": {"listeners": listeners, "clusters": clusters(o)},
    }
    return doc if comments else strip_comments(doc)


def header(o: Options) -> str:
    models = ", ".join([f"{m} ({len(ws)} workers)" for m, ws in o.models.items()]
                       + [f"{m} (PD: {len(pd.prefill)} prefill + {len(pd.decode)} decode)"
                          for m, pd in o.pd_models.items()])
    lines = []
    if o.command is not None:
        lines += ["GENERATED by envoy/gen -- do not edit; change prkit/envoy_config.py and regenerate:",
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
    lines.append(f"Models: {models}; default model: {o.default_model or next(iter([*o.models, *o.pd_models]))}.")
    if o.peer_secret is not None:
        lines.append(f"Scale-out: index records sent to {len(o.peers)} peer(s); "
                     + (f"peer listener on {o.peer_listen[0]}:{o.peer_listen[1]}" if o.peer_listen else "no peer listener")
                     + ". The plugin configuration holds the shared peer secret: protect this file.")
    if o.hash_key == HASH_KEY_PLACEHOLDER:
        lines.append(f"hash_key is the placeholder {HASH_KEY_PLACEHOLDER}: replace it with the secret key (16+ printable\n"
                     "characters, the same on every replica) when deploying; the filter refuses the placeholder.")
    elif o.hash_key_generated:
        lines.append("hash_key: a random key generated for this file (one replica; every run of envoy/gen makes a new one).")
    if o.hash_key is not None and o.hash_key != HASH_KEY_PLACEHOLDER:
        lines.append("The plugin configuration holds the secret hash_key: protect this file.")
    lines.append("Layout and rationale: prkit/envoy_config.py; options: envoy/gen --help.")
    lines = [part for line in lines for part in (line.split("\n") if line else [line])]
    return "".join(f"# {line}\n" if line else "#\n" for line in lines)


def render(o: Options) -> str:
    """The config as YAML text: a header comment, then the sections with their comments."""
    return header(o) + "\n" + dump(config(o, comments=True))


# --------------------------------------------------------------------------------------------
# YAML output (no YAML library: the stdlib only)
# --------------------------------------------------------------------------------------------

_PLAIN = re.compile(r"^[A-Za-z0-9_./][A-Za-z0-9_./-]*$")
_RESERVED = {"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~", ".inf", ".nan", "-.inf"}
_FLOW_WIDTH = 100


def strip_comments(obj):
    if isinstance(obj, dict):
        return {k: strip_comments(v) for k, v in obj.items() if not k.startswith("#")}
    if isinstance(obj, list):
        return [strip_comments(v) for v in obj]
    return obj


def _is_num(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        pass
    try:
        int(s, 0)
        return True
    except ValueError:
        return False


def scalar(v) -> str:
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    s = str(v)
    if _PLAIN.match(s) and s.lower() not in _RESERVED and not _is_num(s) and not s.replace("_", "").isdigit():
        return s
    return json.dumps(s)


def _is_scalar(v) -> bool:
    return not isinstance(v, (dict, list))


def _flow(v) -> str | None:
    """Flow style for a mapping or list of scalars only (no comments)."""
    if isinstance(v, dict):
        if not v:
            return "{}"
        if any(k.startswith("#") for k in v) or not all(_is_scalar(x) and not (isinstance(x, str) and "\n" in x)
                                                         for x in v.values()):
            return None
        return "{ " + ", ".join(f"{scalar(k)}: {scalar(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        if not v:
            return "[]"
        if not all(_is_scalar(x) for x in v):
            return None
        return "[" + ", ".join(scalar(x) for x in v) + "]"
    return None


def _comment(text: str, pad: str, out: list) -> None:
    for line in str(text).splitlines():
        out.append(f"{pad}# {line}".rstrip())


def _value(key: str, v, pad: str, ind: int, out: list) -> None:
    if isinstance(v, str) and "\n" in v:
        out.append(f"{pad}{key}: |" + ("" if v.endswith("\n") else "-"))
        out += [f"{pad}  {line}" if line else "" for line in v.splitlines()]
        return
    if _is_scalar(v):
        out.append(f"{pad}{key}: {scalar(v)}")
        return
    f = _flow(v)
    if f is not None and len(pad) + len(key) + 2 + len(f) <= _FLOW_WIDTH:
        out.append(f"{pad}{key}: {f}")
        return
    out.append(f"{pad}{key}:")
    _block(v, ind + 2, out)


def _block(obj, ind: int, out: list) -> None:
    pad = " " * ind
    if isinstance(obj, dict):
        for i, (k, v) in enumerate(obj.items()):
            if ind == 0 and i and not list(obj)[i - 1].startswith("#"):
                out.append("")  # a blank line between top-level sections
            if k.startswith("#"):
                _comment(v, pad, out)
            else:
                _value(scalar(k), v, pad, ind, out)
        return
    for item in obj:
        if isinstance(item, dict):
            # comments before the item's first key go above its "- "
            keys = list(item)
            n = next((i for i, k in enumerate(keys) if not k.startswith("#")), len(keys))
            for k in keys[:n]:
                _comment(item[k], pad, out)
            item = {k: item[k] for k in keys[n:]}
        f = None if _is_scalar(item) else _flow(item)
        if _is_scalar(item):
            out.append(f"{pad}- {scalar(item)}")
        elif f is not None and len(pad) + 2 + len(f) <= _FLOW_WIDTH:
            out.append(f"{pad}- {f}")
        else:
            sub: list = []
            _block(item, ind + 2, sub)
            first = next(i for i, line in enumerate(sub) if not line.lstrip().startswith("#"))
            sub[first] = pad + "- " + sub[first][ind + 2:]
            out += sub


def dump(obj) -> str:
    """Block YAML for dicts/lists/scalars; "#..." keys become comments."""
    out: list[str] = []
    _block(obj, 0, out)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _set_path(d: dict, path: str, value) -> None:
    keys = path.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ConfigError("--plugin", f"{path}: {k} is not an object")
    d[keys[-1]] = value


def _json_value(opt: str, text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # a bare word is a string


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="envoy/gen",
        description="Generate an Envoy config for prefix-router (profiles and options: "
                    "prkit/envoy_config.py, docs/configuration.md). Listeners are on loopback unless "
                    "an address is given.",
    )
    ap.add_argument("--profile", default="ingress", choices=PROFILES,
                    help="defaults for everything below (default: ingress)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=[CLUSTER=]HOST:PORT[@WEIGHT][,...]",
                    help="a model and its workers (repeat for several models); clusters default to <model>_<i>")
    ap.add_argument("--pd-model", metavar="NAME",
                    help="a prefill/decode-disaggregated model (with --prefill and --decode)")
    ap.add_argument("--prefill", metavar="[CLUSTER=]HOST:PORT@BOOTSTRAP_PORT[,...]",
                    help="--pd-model's prefill workers and their bootstrap ports")
    ap.add_argument("--decode", metavar="[CLUSTER=]HOST:PORT[@WEIGHT][,...]", help="--pd-model's decode workers")
    ap.add_argument("--pd-timeout", metavar="DURATION",
                    help="route timeout of PD requests, which the prefill mirror inherits (600s)")
    ap.add_argument("--default-model", help="model for requests without one (default: the first)")
    ap.add_argument("--listen", metavar="HOST:PORT", help="client listener (default 127.0.0.1:10000)")
    ap.add_argument("--admin", metavar="HOST:PORT", help="admin interface (default 127.0.0.1:9901; keep it on loopback)")
    ap.add_argument("--stats-listen", metavar="HOST:PORT|none",
                    help="listener exposing only /stats/prometheus and /ready (default 127.0.0.1:9902 in "
                    "production profiles; 'none' to omit)")
    ap.add_argument("--wasm", help="path of prefix_router.wasm as Envoy sees it")
    ap.add_argument("--native", action="store_true",
                    help="use the experimental native build (libprefix_router.so, an Envoy dynamic module: "
                    "cargo build -p prefix-router --release --features dynamic-module) instead of the .wasm; "
                    "start Envoy with ENVOY_DYNAMIC_MODULES_SEARCH_PATH naming the .so's directory")
    dbg = ap.add_mutually_exclusive_group()
    dbg.add_argument("--debug-header", dest="debug_header", action="store_const", const=True,
                     help="enable the x-prefix-router-decision response header")
    dbg.add_argument("--no-debug-header", dest="debug_header", action="store_const", const=False)
    log = ap.add_mutually_exclusive_group()
    log.add_argument("--access-log", dest="access_log", action="store_const", const=True,
                     help="one JSON line per request on stdout (default on, off in bench)")
    log.add_argument("--no-access-log", dest="access_log", action="store_const", const=False)
    ap.add_argument("--rate-limit", metavar="N", help="local rate limit, requests/s per Envoy replica (0 = none)")
    ap.add_argument("--rate-limit-per-client", metavar="N",
                    help="local rate limit per client address, requests/s (0 = none, the default)")
    ap.add_argument("--rate-limit-clients", metavar="N", help="per-client buckets kept (10000)")
    ap.add_argument("--health-interval", metavar="DURATION", help="active health check interval (5s)")
    ap.add_argument("--health-timeout", metavar="DURATION",
                    help="active health check timeout (2s; a check still running when the main thread "
                    "was busy, e.g. compiling the Wasm module, fails when it resumes)")
    ap.add_argument("--stream-idle-timeout", metavar="DURATION", help="(300s)")
    ap.add_argument("--per-try-idle-timeout", metavar="DURATION", help="(180s)")
    ap.add_argument("--request-timeout", metavar="DURATION",
                    help="the whole request (headers and body) must arrive within this, else 408; stops "
                    "counting once it has (60s; > 0)")
    ap.add_argument("--request-headers-timeout", metavar="DURATION",
                    help="the request headers must arrive within this (10s; > 0)")
    ap.add_argument("--max-concurrent-streams", metavar="N", help="HTTP/2 streams per downstream connection (100)")
    ap.add_argument("--max-heap-mib", metavar="MIB",
                    help="heap size of the overload manager's fixed_heap monitor (1536): from 85%% HTTP/2 "
                    "streams buffering >= 1 MiB are reset, from 95%% new requests get 503 and HTTP/1 "
                    "connections sending more are closed; keep it ~512 MiB under the memory limit")
    ap.add_argument("--fallbacks", metavar="N",
                    help="workers of the same model each worker cluster falls back to (3)")
    ap.add_argument("--max-requests", metavar="N", help="circuit breaker per worker cluster (1024)")
    ap.add_argument("--max-ejection-percent", metavar="N", help="outlier detection (50)")
    ap.add_argument("--max-connections", metavar="N", help="downstream connection cap (10000)")
    ap.add_argument("--load-poll-ms", metavar="MS",
                    help="poll every worker's load this often through <worker>_load clusters "
                    "(0 = off: each replica sees only its own requests; default 100 in production profiles)")
    ap.add_argument("--peers", metavar="URL[,URL...]",
                    help="peer replicas' peer listeners (http://HOST:PORT); a replica may list itself")
    ap.add_argument("--peer-listen", metavar="HOST:PORT", help="listener for peers' index records")
    ap.add_argument("--peer-secret", metavar="SECRET", help="shared peer secret (>= 16 characters; prefer --peer-secret-file)")
    ap.add_argument("--peer-secret-file", metavar="PATH", help="file holding the shared peer secret (whitespace stripped)")
    hk = ap.add_mutually_exclusive_group()
    hk.add_argument("--hash-key-file", metavar="PATH",
                    help="file holding the plugin's hash_key (>= 16 printable characters, whitespace stripped; "
                    "the same on every replica). Production profiles without --peers generate a random key "
                    "when no key is given")
    hk.add_argument("--hash-key", metavar="KEY", help="the hash_key itself (prefer --hash-key-file)")
    hk.add_argument("--hash-key-placeholder", action="store_true",
                    help=f"write {HASH_KEY_PLACEHOLDER} as hash_key, to be replaced at deploy time (the filter "
                    "refuses the placeholder itself)")
    # the plugin configuration (filter/src/config.rs; docs/configuration.md)
    ap.add_argument("--policy", metavar="NAME", help="policy.name (cache_aware, round_robin, ...)")
    ap.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                    help="a policy parameter, e.g. load_eps=0.5 (repeatable)")
    ap.add_argument("--unknown-model", metavar="default|reject", help="unknown_model")
    ap.add_argument("--passthrough-cluster", metavar="CLUSTER",
                    help="passthrough_cluster: where non-inference requests go (must be a worker cluster)")
    ap.add_argument("--index-capacity", metavar="N", help="index.capacity")
    ap.add_argument("--index-ttl", metavar="SECONDS", help="index.ttl_seconds")
    ap.add_argument("--plugin", action="append", default=[], metavar="PATH=JSON",
                    help="any plugin configuration field, e.g. index.local_cache_ms=200 or "
                    "peers.flush_ms=50 (value JSON, or a bare string; repeatable)")
    ap.add_argument("--plugin-json", metavar="FILE", help="a JSON object merged into the plugin configuration")
    return ap


def _int_opt(opt: str, v: str | None):
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise ConfigError(opt, f"expected an integer, got {v!r}") from None


def options_from_args(argv: list[str]) -> Options:
    a = arg_parser().parse_args(argv)
    over: dict = {}
    if a.model:
        models: dict[str, list[Worker]] = {}
        for spec in a.model:
            name, ws = parse_model(spec)
            if name in models:
                raise ConfigError("--model", f"model {name!r} is given twice")
            models[name] = ws
        over["models"] = models
    elif a.profile in ("ingress", "test", "bench") and a.pd_model is None and a.prefill is None and a.decode is None:
        raise ConfigError("--model", f"at least one model is required (profile {a.profile})")
    if a.pd_model is not None or a.prefill is not None or a.decode is not None:
        over["pd_models"] = parse_pd(a.pd_model, a.prefill, a.decode)
        if not a.model:
            over["models"] = {}
    if a.pd_timeout is not None:
        over["pd_timeout"] = a.pd_timeout
    if a.default_model is not None:
        over["default_model"] = a.default_model
    for opt, key, allow_none in (("--listen", "listen", False), ("--admin", "admin", False),
                                 ("--stats-listen", "stats_listen", True), ("--peer-listen", "peer_listen", False)):
        v = getattr(a, key)
        if v is not None:
            over[key] = None if allow_none and v == "none" else parse_hostport(v, opt, allow_zero=True)
    for key in ("wasm", "debug_header", "access_log", "health_interval", "health_timeout", "stream_idle_timeout",
                "per_try_idle_timeout", "request_timeout", "request_headers_timeout"):
        if getattr(a, key) is not None:
            over[key] = getattr(a, key)
    for opt, key in (("--rate-limit", "rate_limit"), ("--rate-limit-per-client", "rate_limit_per_client"),
                     ("--rate-limit-clients", "rate_limit_clients"), ("--fallbacks", "fallbacks"), ("--max-requests", "max_requests"),
                     ("--max-ejection-percent", "max_ejection_percent"), ("--max-connections", "max_connections"),
                     ("--load-poll-ms", "load_poll_ms"), ("--max-concurrent-streams", "max_concurrent_streams"),
                     ("--max-heap-mib", "max_heap_mib")):
        v = _int_opt(opt, getattr(a, key))
        if v is not None:
            over[key] = v
    if a.peers is not None:
        over["peers"] = parse_peers(a.peers)
    if a.peer_secret is not None and a.peer_secret_file is not None:
        raise ConfigError("--peer-secret and --peer-secret-file", "give only one of them")
    if a.peer_secret_file is not None:
        opt = f"--peer-secret-file {a.peer_secret_file}"
        try:
            with open(a.peer_secret_file, encoding="utf-8") as f:
                over["peer_secret"] = check_secret(f.read().strip(), opt)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(opt, f"cannot read the secret: {e}") from None
    elif a.peer_secret is not None:
        over["peer_secret"] = check_secret(a.peer_secret, "--peer-secret")
    if a.hash_key_file is not None:
        opt = f"--hash-key-file {a.hash_key_file}"
        try:
            with open(a.hash_key_file, encoding="utf-8") as f:
                over["hash_key"] = check_secret(f.read().strip(), opt)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(opt, f"cannot read the key: {e}") from None
    elif a.hash_key is not None:
        over["hash_key"] = check_secret(a.hash_key, "--hash-key")
    elif a.hash_key_placeholder:
        over["hash_key"] = HASH_KEY_PLACEHOLDER

    plugin: dict = copy.deepcopy(_PROFILE_DEFAULTS[a.profile].get("plugin", {}))
    if a.plugin_json is not None:
        try:
            with open(a.plugin_json, encoding="utf-8") as f:
                extra = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--plugin-json {a.plugin_json}", f"cannot read a JSON object: {e}") from None
        if not isinstance(extra, dict):
            raise ConfigError(f"--plugin-json {a.plugin_json}", "expected a JSON object")
        plugin = merge(plugin, extra)
    if a.policy is not None:
        _set_path(plugin, "policy.name", a.policy)
    for kv in a.policy_param:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ConfigError("--policy-param", f"expected KEY=VALUE, got {kv!r}")
        _set_path(plugin, "policy." + k, _json_value("--policy-param", v))
    if a.unknown_model is not None:
        if a.unknown_model not in ("default", "reject"):
            raise ConfigError("--unknown-model", f"expected default or reject, got {a.unknown_model!r}")
        plugin["unknown_model"] = a.unknown_model
    if a.passthrough_cluster is not None:
        plugin["passthrough_cluster"] = a.passthrough_cluster
    for opt, path, v, lo in (("--index-capacity", "index.capacity", a.index_capacity, 1),
                             ("--index-ttl", "index.ttl_seconds", a.index_ttl, 1)):
        n = _int_opt(opt, v)
        if n is not None:
            if n < lo:
                raise ConfigError(opt, f"must be at least {lo}, got {n}")
            _set_path(plugin, path, n)
    for kv in a.plugin:
        k, sep, v = kv.partition("=")
        if not sep or not k or any(not p for p in k.split(".")):
            raise ConfigError("--plugin", f"expected PATH=JSON (e.g. index.capacity=4096), got {kv!r}")
        _set_path(plugin, k, _json_value("--plugin", v))
    over["plugin"] = plugin
    if a.native:
        if a.wasm is not None:
            raise ConfigError("--native", "the native build loads no .wasm: drop --wasm")
        over["dynamic_module"] = NATIVE_MODULE
    over["command"] = " ".join(["envoy/gen"] + [x if re.match(r"^[A-Za-z0-9_./:=,@%+-]+$", x) else repr(x)
                                                for x in argv])
    opts = profile(a.profile, **over)
    pc = plugin.get("passthrough_cluster")
    if pc is not None and pc not in _worker_names(opts):
        raise ConfigError("--passthrough-cluster", f"{pc!r} is not a worker cluster ({', '.join(_worker_names(opts))})")
    return opts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts = options_from_args(argv)
        text = render(opts)
    except ConfigError as e:
        print(f"envoy/gen: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# --------------------------------------------------------------------------------------------
# Local runs (tests, load tools, benchmarks)
# --------------------------------------------------------------------------------------------


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
