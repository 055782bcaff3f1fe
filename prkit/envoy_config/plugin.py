"""The filter's configuration (the Wasm plugin's / native module's JSON) from `Options`."""

from __future__ import annotations

from .options import (
    ADMIN_CLUSTER, CLUSTER_HEADER, DEBUG_HEADER, DESTINATION_HEADER, MEMBERSHIP_PATH, MEMBERSHIP_TIMEOUT_MS,
    Options, PEER_PREFIX, POLL_SUFFIX, Worker, is_ip, pool_fallbacks,
)


def merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, recursively for dict values."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def worker_entry(w: Worker):
    """A static worker in the plugin's `workers`: its cluster name, or {"cluster", "weight"}, and
    with an IP literal host {"cluster", "weight", "address": "IP:PORT"} (the address the filter
    recognizes when Envoy reports which host served a request, e.g. a fallback of that cluster).
    A host name has no address the filter could match: names only, as before."""
    if is_ip(w.host):
        host = f"[{w.host}]" if ":" in w.host else w.host
        return {"cluster": w.cluster, "weight": 1.0 if w.weight is None else w.weight, "address": f"{host}:{w.port}"}
    return w.cluster if w.weight is None else {"cluster": w.cluster, "weight": w.weight}


def plugin_config(o: Options) -> dict:
    """The filter's configuration (client listener), with Options.plugin merged in."""
    models = {}
    for model, ws in o.models.items():
        models[model] = {"workers": [worker_entry(w) for w in ws]}
    for model, p in o.pools.items():
        models[model] = {"pool": {"cluster": p.cluster, "load_cluster": p.load_cluster,
                                  "fallbacks": pool_fallbacks(o), "max_workers": o.pool_max_workers}}
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
        "policy": {"name": "cost_aware"},  # tuned defaults: filter/src/config.rs
    }
    if o.pools:
        plugin["destination_header"] = DESTINATION_HEADER
        plugin["membership"] = {"cluster": ADMIN_CLUSTER, "path": MEMBERSHIP_PATH,
                                "interval_ms": o.membership_ms, "timeout_ms": MEMBERSHIP_TIMEOUT_MS}
    if o.load_poll_ms is not None:
        if o.load_poll_ms:
            plugin["load_poll"] = {"interval_ms": o.load_poll_ms, "cluster_suffix": POLL_SUFFIX}
            if o.hit_check_ms is not None:
                plugin["load_poll"]["metrics_interval_ms"] = o.hit_check_ms
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
