"""The command line (`envoy/gen`, `python -m prkit.envoy_config`): options to `Options`, then
the rendered config on stdout."""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
from pathlib import Path

from ..paths import REPO_ROOT
from .options import (
    ConfigError, HASH_KEY_PLACEHOLDER, NATIVE_MODULE, PEER_SECRET_PLACEHOLDER, PUBLIC_PATHS, parse_allow_path, Options, PROFILES, Worker, _PROFILE_DEFAULTS,
    _worker_names, check_secret, is_pool_spec, parse_hostport, parse_model, parse_pd, parse_peers, parse_pool,
    profile,
)
from .plugin import merge
from .sections import render


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


_OPTION_NAME = re.compile(r"--?[A-Za-z][A-Za-z0-9_-]*")


def _unrecognized(extras: list[str]) -> ConfigError:
    """The error for arguments the parser does not know, naming only what looks like an option
    (without any `=VALUE`) and never the word after one: a mistyped secret option
    (`--peer-secrt S`) or a value after a flag (`--hash-key-placeholder K`) must not print S or K."""
    named: list[str] = []
    hidden = 0
    after_option = False
    for x in extras:
        name, eq, _ = x.partition("=")
        if not after_option and _OPTION_NAME.fullmatch(name):
            named.append(name)
            after_option = not eq
        else:
            hidden += 1
            after_option = False
    if not named:
        return ConfigError("<arguments>", f"{hidden} unexpected argument(s) (values are not shown; see --help)")
    more = f", and {hidden} other argument(s) (values are not shown)" if hidden else " (values are not shown)"
    also = f" (also {', '.join(named[1:])})" if len(named) > 1 else ""
    return ConfigError(named[0], f"unrecognized option{also}{more}; see --help")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors never contain a value from the command line: its own messages quote
    them (`unrecognized arguments: --peer-secrt S`, `invalid choice: 'S'`), and the value may be a
    secret typed after a mistyped option. Errors are raised as ConfigError (one line, exit 2)."""

    def parse_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        ns, extras = self.parse_known_args(self._argv, namespace)
        if extras:
            raise _unrecognized(extras)
        return ns

    def error(self, message: str):
        # argparse quotes every value it repeats ('...' or "..."): keep the text before the first
        # quote. "argument --opt: ..." names a defined option, which is safe to repeat.
        option, reason = "<arguments>", message
        head, sep, rest = message.partition(": ")
        if head.startswith("argument ") and sep:
            option, reason = head[len("argument "):], rest
        cut = min((i for i in (reason.find("'"), reason.find('"')) if i >= 0), default=-1)
        if cut >= 0:
            reason = reason[:cut].rstrip(" :") + " (the value is not shown)"
            action = self._option_string_actions.get(option.split("/")[0])
            if action is not None and action.choices:
                reason += f"; choose from {', '.join(map(str, action.choices))}"
        # A last guard for messages that repeat a word of the command line unquoted: any word
        # that is not one of this parser's option names is blanked.
        for x in sorted(getattr(self, "_argv", []), key=len, reverse=True):
            for word in {x, x.partition("=")[2]}:
                if len(word) >= 4 and word not in self._option_string_actions:
                    option, reason = option.replace(word, "..."), reason.replace(word, "...")
        raise ConfigError(option, reason)


def arg_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="envoy/gen",
        # options are spelled out: an abbreviation of a secret's option could escape the header's
        # redaction (command_line)
        allow_abbrev=False,
        description="Generate an Envoy config for prefix-router (profiles and options: "
                    "prkit/envoy_config/, docs/configuration.md). Listeners are on loopback unless "
                    "an address is given.",
    )
    ap.add_argument("--profile", default="ingress", choices=PROFILES,
                    help="defaults for everything below (default: ingress)")
    ap.add_argument("--model", action="append", default=[],
                    metavar="NAME=[CLUSTER=]HOST:PORT[@WEIGHT][,...]|NAME=eds:PATH|NAME=dns:HOST:PORT",
                    help="a model and its workers (repeat for several models): a static list, one cluster per "
                    "worker (clusters default to <model>_<i>); or a pool, one cluster NAME whose hosts are the "
                    "workers, from an EDS file (eds:/abs/path, replaced by rename) or a DNS name resolving to "
                    "one address per worker (dns:HOST:PORT, e.g. a Kubernetes headless Service)")
    ap.add_argument("--pool-max-workers", metavar="N",
                    help="pools: the most workers the filter tracks per pool (64; 1-1024)")
    ap.add_argument("--membership-ms", metavar="MS",
                    help="pools: how often the filter reads their hosts from the admin's GET /clusters (1000; 100-60000, "
                    "or 0 = never: a pool is then used only through Envoy's least request)")
    ap.add_argument("--pd-model", metavar="NAME",
                    help="a prefill/decode-disaggregated model (with --prefill and --decode)")
    ap.add_argument("--prefill", metavar="[CLUSTER=]HOST:PORT@BOOTSTRAP_PORT[,...]",
                    help="--pd-model's prefill workers and their bootstrap ports")
    ap.add_argument("--decode", metavar="[CLUSTER=]HOST:PORT[@WEIGHT][,...]", help="--pd-model's decode workers")
    ap.add_argument("--pd-timeout", metavar="DURATION",
                    help="route timeout of PD requests, which the prefill mirror inherits (600s)")
    ap.add_argument("--default-model", help="model for requests without one (default: the first)")
    ap.add_argument("--listen", metavar="HOST:PORT", help="client listener (default 127.0.0.1:10000)")
    ap.add_argument("--allow-path", action="append", default=[], metavar="[METHOD[,METHOD]:]PATH",
                    help="forward this exact path too (methods default to GET), e.g. /get_model_info or "
                    "POST:/flush_cache (repeatable). Without it the client listener forwards only "
                    + ", ".join(f"{m} {p}" for m, p in PUBLIC_PATHS) + "; anything else gets a local 404")
    ap.add_argument("--admin", metavar="HOST:PORT", help="admin interface (default 127.0.0.1:9901; keep it on loopback)")
    ap.add_argument("--stats-listen", metavar="HOST:PORT|none",
                    help="listener exposing only /stats/prometheus and /ready (default 127.0.0.1:9902 in "
                    "production profiles; 'none' to omit)")
    ap.add_argument("--wasm", help="path of prefix_router.wasm as Envoy sees it")
    ap.add_argument("--native", action="store_true",
                    help="use the experimental native build (libprefix_router.so, an Envoy dynamic module: "
                    "cargo build -p prefix-router --release --features dynamic-module) instead of the .wasm; "
                    "start Envoy with ENVOY_DYNAMIC_MODULES_SEARCH_PATH naming the .so's directory")
    ap.add_argument("--native-lb", action="store_true",
                    help="with --native: the pool clusters' load balancer is the native module too (opt-in; LB modules "
                    "are alpha in Envoy 1.40; docs/performance.md) instead of override_host; each attempt goes to "
                    "the next host the filter listed that is healthy and not yet tried")
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
    ap.add_argument("--hit-check-ms", metavar="MS",
                    help="read every worker's SGLang token counters (/metrics) this often through the same "
                    "clusters, for the index's self-check (the filter's default 2000; 0 = off; needs --load-poll-ms > 0)")
    ap.add_argument("--peers", metavar="URL[,URL...]",
                    help="peer replicas' peer listeners (http://HOST:PORT); a replica may list itself")
    ap.add_argument("--peer-listen", metavar="HOST:PORT", help="listener for peers' index records")
    ap.add_argument("--peer-secret-file", metavar="PATH", help="file holding the shared peer secret (whitespace stripped)")
    ap.add_argument("--peer-secret", metavar="SECRET",
                    help="shared peer secret (>= 16 characters; prefer --peer-secret-file: a command line is "
                    "visible to every process on the host; the header comment never repeats it)")
    ap.add_argument("--peer-secret-placeholder", action="store_true",
                    help=f"write {PEER_SECRET_PLACEHOLDER} as the peer secret, to be replaced at deploy time "
                    "(the filter refuses the placeholder itself)")
    hk = ap.add_mutually_exclusive_group()
    hk.add_argument("--hash-key-file", metavar="PATH",
                    help="file holding the plugin's hash_key (>= 16 printable characters, whitespace stripped; "
                    "the same on every replica). Production profiles without --peers generate a random key "
                    "when no key is given")
    hk.add_argument("--hash-key", metavar="KEY",
                    help="the hash_key itself (prefer --hash-key-file; the header comment never repeats it)")
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


def _secret_file(path: str, option: str, what: str) -> str:
    """A secret read from `path` (whitespace around it dropped), checked as check_secret does.
    Errors name the option, never the path: a secret pasted where the path belongs must not be
    printed back."""
    try:
        with open(path, encoding="utf-8") as f:
            return check_secret(f.read().strip(), option)
    except OSError as e:
        raise ConfigError(option, f"cannot read the {what} file: {e.strerror or type(e).__name__}") from None
    except UnicodeDecodeError:
        raise ConfigError(option, f"cannot read the {what} file: not UTF-8 text") from None


# Options whose value is a secret: the header comment shows REDACTED instead (a config is read by
# more people than hold its secrets, and the values stay in the plugin configuration only).
SECRET_OPTIONS = ("--peer-secret", "--hash-key")
REDACTED = "REDACTED"


def command_line(argv: list[str]) -> str:
    """The envoy/gen command line for a config's header, secret values replaced by REDACTED
    (as `--opt VALUE` or `--opt=VALUE`; the parser takes no abbreviations)."""
    out = ["envoy/gen"]
    redact_next = False
    for x in argv:
        if redact_next:
            out.append(REDACTED)
            redact_next = False
            continue
        name, eq, _ = x.partition("=")
        if name in SECRET_OPTIONS:
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(x)
                redact_next = True
            continue
        out.append(x if re.match(r"^[A-Za-z0-9_./:=,@%+-]+$", x) else repr(x))
    return " ".join(out)


def options_from_args(argv: list[str]) -> Options:
    a = arg_parser().parse_args(argv)
    over: dict = {}
    if a.model:
        models: dict[str, list[Worker]] = {}
        pools: dict = {}
        for spec in a.model:
            name, ws = parse_pool(spec) if is_pool_spec(spec) else parse_model(spec)
            if name in models or name in pools:
                raise ConfigError("--model", f"model {name!r} is given twice")
            if isinstance(ws, list):
                models[name] = ws
            else:
                pools[name] = ws
        over["models"] = models
        if pools:
            over["pools"] = pools
            if a.default_model is None:
                # the first --model, as for static lists (pools are listed after them in Options)
                over["default_model"] = a.model[0].partition("=")[0]
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
                     ("--max-heap-mib", "max_heap_mib"), ("--hit-check-ms", "hit_check_ms"),
                     ("--pool-max-workers", "pool_max_workers"), ("--membership-ms", "membership_ms")):
        v = _int_opt(opt, getattr(a, key))
        if v is not None:
            over[key] = v
    if a.peers is not None:
        over["peers"] = parse_peers(a.peers)
    if a.allow_path:
        over["allow_paths"] = [pair for spec in a.allow_path for pair in parse_allow_path(spec)]
    given = [o for o, v in (("--peer-secret", a.peer_secret), ("--peer-secret-file", a.peer_secret_file),
                            ("--peer-secret-placeholder", a.peer_secret_placeholder or None)) if v is not None]
    if len(given) > 1:
        raise ConfigError(" and ".join(given), "give only one of them")
    if a.peer_secret_placeholder:
        over["peer_secret"] = PEER_SECRET_PLACEHOLDER
    elif a.peer_secret_file is not None:
        over["peer_secret"] = _secret_file(a.peer_secret_file, "--peer-secret-file", "secret")
    elif a.peer_secret is not None:
        over["peer_secret"] = check_secret(a.peer_secret, "--peer-secret")
    if a.hash_key_file is not None:
        over["hash_key"] = _secret_file(a.hash_key_file, "--hash-key-file", "key")
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
    if a.native_lb:
        if not a.native:
            raise ConfigError("--native-lb", "the load balancer is the native module: add --native")
        over["native_lb"] = True
    over["command"] = command_line(argv)
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


# The executable, run as a user runs it (tests, load tools): a fresh process over this package.
GEN = REPO_ROOT / "envoy" / "gen"


def gen_result(*args: str, gen: Path = GEN, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`envoy/gen ARGS` (or another generator `gen`) in a fresh process: exit code, stdout, stderr."""
    return subprocess.run([str(gen), *args], capture_output=True, text=True, timeout=timeout_s)


def run_gen(*args: str, gen: Path = GEN, timeout_s: float = 60) -> str:
    """The config `envoy/gen ARGS` writes; fails with its stderr unless it exits 0."""
    r = gen_result(*args, gen=gen, timeout_s=timeout_s)
    if r.returncode != 0:
        raise AssertionError(f"envoy/gen {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return r.stdout
