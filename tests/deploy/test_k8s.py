"""envoy/k8s manifests: parsed with tools/composecheck yaml2json (gopkg.in/yaml.v3), structure checked."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from prkit import envoy_config as ec
from prkit.envoy import check_config
from prkit.paths import REPO_ROOT as REPO

from .conftest import check_pool_doc, plugin_config, with_local_wasm, yaml_doc


K8S = REPO / "envoy" / "k8s"
PLUGIN_KEYS = {"models", "default_model", "unknown_model", "passthrough_cluster", "cluster_header",
               "debug_header", "text_block_bytes", "token_block_size", "max_prompt_blocks", "index",
               "policy", "load_poll", "peers", "peer_listener", "hash_key", "destination_header", "membership"}


@pytest.fixture(scope="module")
def docs(composecheck) -> dict:
    out = {}
    for f in sorted(K8S.glob("*.yaml")):
        r = subprocess.run([str(composecheck), "yaml2json", str(f)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out[f.name] = json.loads(r.stdout)
    return out


@pytest.fixture(scope="module")
def scale_out(composecheck) -> dict:
    """envoy/scale-out.yaml, the Envoy config the StatefulSet's ConfigMap holds."""
    r = subprocess.run([str(composecheck), "yaml2json", str(REPO / "envoy" / "scale-out.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (cfg,) = json.loads(r.stdout)
    return cfg


def by_kind(docs, name, kind):
    (doc,) = [d for d in docs[name] if d["kind"] == kind]
    return doc


def check_plugin_config(cfg: dict) -> list[str]:
    assert set(cfg) <= PLUGIN_KEYS, set(cfg) - PLUGIN_KEYS
    # keyed hashes: the placeholder, replaced at deploy time (the filter refuses it as it is)
    assert cfg["hash_key"] == "__HASH_KEY__"
    assert cfg["cluster_header"] == "x-prefix-router-cluster"
    assert cfg["default_model"] in cfg["models"]
    assert cfg["policy"]["name"] in ("cost_aware", "cache_aware", "round_robin", "random")
    workers = [w if isinstance(w, str) else w["cluster"] for m in cfg["models"].values() for w in m.get("workers", [])]
    workers += [m["pool"]["cluster"] for m in cfg["models"].values() if "pool" in m]
    assert workers and len(set(workers)) == len(workers)
    return workers


def test_files_and_kinds(docs):
    assert sorted(docs) == ["envoy-gateway.yaml", "istio-wasmplugin.yaml", "pool.yaml", "statefulset.yaml"]
    assert [(d["apiVersion"], d["kind"]) for d in docs["istio-wasmplugin.yaml"]] == [
        ("extensions.istio.io/v1alpha1", "WasmPlugin"),
        ("networking.istio.io/v1alpha3", "EnvoyFilter"),
        ("networking.istio.io/v1", "VirtualService"),
        ("v1", "ConfigMap"),
    ]
    assert [(d["apiVersion"], d["kind"]) for d in docs["envoy-gateway.yaml"]] == [
        ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy"),
        ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"),
        ("gateway.envoyproxy.io/v1alpha1", "EnvoyPatchPolicy"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute"),
        ("gateway.envoyproxy.io/v1alpha1", "EnvoyProxy"),
    ]
    assert [(d["apiVersion"], d["kind"]) for d in docs["statefulset.yaml"]] == [
        ("v1", "Service"),
        ("v1", "Service"),
        ("apps/v1", "StatefulSet"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
    ]
    assert [(d["apiVersion"], d["kind"]) for d in docs["pool.yaml"]] == [
        ("v1", "Service"),
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("apps/v1", "Deployment"),
    ]
    for ds in docs.values():
        for d in ds:
            assert d["metadata"]["name"] and d["metadata"]["namespace"]
    # the examples can run side by side: no two objects of a kind share a name
    names = [(d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]) for ds in docs.values() for d in ds]
    assert len(set(names)) == len(names), names


def test_istio_wasmplugin(docs):
    spec = by_kind(docs, "istio-wasmplugin.yaml", "WasmPlugin")["spec"]
    assert spec["url"].startswith("oci://") and spec["url"].endswith(":0.1.0")
    assert re.fullmatch(r"[0-9a-f]{64}", spec["sha256"])
    # FAIL_RELOAD: a trapped VM is replaced (FAIL_CLOSE left a crashed thread answering 503 for good)
    assert spec["failStrategy"] == "FAIL_RELOAD"
    # after Istio's authentication and authorization filters
    assert spec["phase"] == "STATS"
    assert spec["pluginName"] == "prefix_router"
    assert spec["selector"]["matchLabels"] == {"istio": "ingressgateway"}
    workers = check_plugin_config(spec["pluginConfig"])
    assert all(re.fullmatch(r"outbound\|30000\|\|sglang-llama-\d\.llm\.svc\.cluster\.local", w) for w in workers)

    ef = by_kind(docs, "istio-wasmplugin.yaml", "EnvoyFilter")["spec"]
    patches = {p["applyTo"]: p for p in ef["configPatches"]}
    route = patches["HTTP_ROUTE"]["patch"]["value"]
    assert route["route"]["cluster_header"] == spec["pluginConfig"]["cluster_header"]
    assert route["route"]["timeout"] == "0s"
    assert route["request_body_buffer_limit"] == 16 * 1024 * 1024
    assert patches["LISTENER"]["patch"]["value"]["per_connection_buffer_limit_bytes"] == 16 * 1024 * 1024
    hcm = patches["NETWORK_FILTER"]["patch"]["value"]["typed_config"]
    assert patches["NETWORK_FILTER"]["match"]["listener"]["filterChain"]["filter"]["name"] == \
        "envoy.filters.network.http_connection_manager"
    assert (hcm["normalize_path"], hcm["merge_slashes"], hcm["path_with_escaped_slashes_action"]) == \
        (True, True, "UNESCAPE_AND_FORWARD")
    # the route patch applies to the public route only, by name (never another route of the vhost)
    assert patches["HTTP_ROUTE"]["match"]["routeConfiguration"]["vhost"]["route"] == {"name": "prefix-router"}
    vs = by_kind(docs, "istio-wasmplugin.yaml", "VirtualService")["spec"]
    (public,) = [r for r in vs["http"] if r.get("name") == "prefix-router"]
    assert len(vs["http"]) == 1
    allowed = set()
    for m in public["match"]:
        methods = m["method"].get("exact") or m["method"]["regex"]
        allowed |= {(x, m["uri"]["exact"]) for x in methods.split("|")}
    assert allowed == set(ec.PUBLIC_PATHS)
    # the slow-client limits of envoy/gen's configs
    defaults = ec.Options()
    assert (hcm["request_timeout"], hcm["request_headers_timeout"]) == (defaults.request_timeout,
                                                                        defaults.request_headers_timeout)
    assert hcm["http2_protocol_options"]["max_concurrent_streams"] == defaults.max_concurrent_streams
    cm = by_kind(docs, "istio-wasmplugin.yaml", "ConfigMap")
    assert_heap_overload(json.loads(cm["data"]["custom_bootstrap.json"])["overload_manager"])
    ext = patches["EXTENSION_CONFIG"]["patch"]["value"]
    # Istio names the WasmPlugin's extension config <namespace>.<name>
    assert ext["name"] == "istio-system.prefix-router"
    assert ext["typed_config"]["config"]["allow_on_headers_stop_iteration"] is True


def test_envoy_gateway(docs, composecheck, tmp_path):
    pol = by_kind(docs, "envoy-gateway.yaml", "EnvoyExtensionPolicy")["spec"]
    assert pol["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "llm"}]
    (wasm,) = pol["wasm"]
    assert wasm["rootID"] == "prefix_router" and wasm["failOpen"] is False
    assert wasm["code"]["type"] == "Image"
    assert re.fullmatch(r"[0-9a-f]{64}", wasm["code"]["image"]["sha256"])
    assert not wasm["code"]["image"]["url"].startswith("oci://")  # EG takes a plain image reference
    workers = check_plugin_config(wasm["config"])

    patch = by_kind(docs, "envoy-gateway.yaml", "EnvoyPatchPolicy")["spec"]
    assert patch["type"] == "JSONPatch" and patch["targetRef"]["kind"] == "Gateway"
    ctp = by_kind(docs, "envoy-gateway.yaml", "ClientTrafficPolicy")["spec"]
    assert ctp["path"] == {"escapedSlashesAction": "UnescapeAndForward", "disableMergeSlashes": False}
    assert ctp["targetRefs"][0]["kind"] == "Gateway"
    every = [p for p in patch["jsonPatches"] if p["type"].endswith("envoy.config.cluster.v3.Cluster")]
    # the load-poll clusters: the worker's own host only, nothing that could eject it
    polls = [c for c in every if c["name"].endswith("_load")]
    assert [c["name"] for c in polls] == [w + "_load" for w in workers]
    assert wasm["config"]["load_poll"]["cluster_suffix"] == "_load"
    for c in polls:
        v = c["operation"]["value"]
        assert "health_checks" not in v and "outlier_detection" not in v
        (ep,) = v["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert ep["endpoint"]["address"]["socket_address"]["address"].startswith(
            "sglang-llama-" + c["name"].split("_")[1] + ".")
    clusters = [c for c in every if not c["name"].endswith("_load")]
    # every worker of the plugin config is a cluster added here, STRICT_DNS, health checked on /health
    assert [c["name"] for c in clusters] == workers
    for c in clusters:
        v = c["operation"]["value"]
        assert c["operation"]["op"] == "add" and v["name"] == c["name"] == v["load_assignment"]["cluster_name"]
        assert v["type"] == "STRICT_DNS"
        assert v["health_checks"][0]["http_health_check"]["path"] == "/health"
        (ep,) = v["load_assignment"]["endpoints"][0]["lb_endpoints"]
        i = c["name"].rsplit("_", 1)[1]
        assert ep["endpoint"]["address"]["socket_address"] == {
            "address": f"sglang-llama-{i}.sglang-llama.llm.svc.cluster.local", "port_value": 30000}
    # the route patches select the rules of HTTPRoute llm/llm by name, never a position such as
    # /virtual_hosts/0/routes/0 (which may be another HTTPRoute's route)
    route_ops = [p["operation"] for p in patch["jsonPatches"] if p["type"].endswith("RouteConfiguration")]
    assert route_ops and all(op["jsonPath"] == "..routes[?match(@.name, 'httproute/llm/llm/rule/.*')]"
                             and "virtual_hosts" not in op["path"] for op in route_ops)
    routes = {(op["op"], op["path"]): op.get("value") for op in route_ops}
    assert routes == {("remove", "/route/cluster"): None,
                      ("add", "/route/cluster_header"): wasm["config"]["cluster_header"],
                      ("add", "/request_body_buffer_limit"): 16 * 1024 * 1024, ("add", "/route/timeout"): "0s"}
    httproute = by_kind(docs, "envoy-gateway.yaml", "HTTPRoute")
    assert (httproute["metadata"]["namespace"], httproute["metadata"]["name"]) == ("llm", "llm")
    (rule,) = httproute["spec"]["rules"]
    assert {(m["method"], m["path"]["value"]) for m in rule["matches"]} == set(ec.PUBLIC_PATHS)
    assert all(m["path"]["type"] == "Exact" for m in rule["matches"])
    # the slow-client limits of envoy/gen's configs
    defaults = ec.Options()
    assert ctp["timeout"]["http"]["requestReceivedTimeout"] == defaults.request_timeout
    assert ctp["http2"]["maxConcurrentStreams"] == defaults.max_concurrent_streams
    (hdr,) = [p["operation"] for p in patch["jsonPatches"]
              if p["operation"].get("path") == "/request_headers_timeout"]
    assert hdr["value"] == defaults.request_headers_timeout and "http_connection_manager" in hdr["jsonPath"]
    proxy = by_kind(docs, "envoy-gateway.yaml", "EnvoyProxy")["spec"]["bootstrap"]
    assert proxy["type"] == "Merge"
    assert_heap_overload(yaml_doc(composecheck, proxy["value"], tmp_path)["overload_manager"])


def assert_heap_overload(om: dict) -> None:
    """An example's overload manager has envoy/gen's heap monitor, actions and load shed point."""
    gen = ec.strip_comments(ec.overload_manager(ec.Options()))
    heap = [m for m in gen["resource_monitors"] if m["name"] == "envoy.resource_monitors.fixed_heap"]
    assert om["resource_monitors"] == heap
    assert om["actions"] == gen["actions"] and om["loadshed_points"] == gen["loadshed_points"]
    assert om["buffer_factory_config"] == gen["buffer_factory_config"]


def test_load_poll_in_gateway_examples(docs):
    for cfg in (by_kind(docs, "istio-wasmplugin.yaml", "WasmPlugin")["spec"]["pluginConfig"],
                by_kind(docs, "envoy-gateway.yaml", "EnvoyExtensionPolicy")["spec"]["wasm"][0]["config"]):
        assert cfg["load_poll"]["interval_ms"] == 100
        assert "peers" not in cfg and "peer_listener" not in cfg


def test_statefulset_matches_scale_out_config(docs, scale_out):
    """envoy/k8s/statefulset.yaml runs envoy/scale-out.yaml on N pods: the config's peers are
    exactly the StatefulSet's pods through the headless service, on the pod's peer port."""
    peers_svc, client_svc = [d for d in docs["statefulset.yaml"] if d["kind"] == "Service"]
    sts = by_kind(docs, "statefulset.yaml", "StatefulSet")
    ns, name, spec = sts["metadata"]["namespace"], sts["metadata"]["name"], sts["spec"]
    assert peers_svc["metadata"]["name"] == spec["serviceName"] == "prefix-router-peers"
    assert peers_svc["spec"]["clusterIP"] == "None" and peers_svc["spec"]["publishNotReadyAddresses"] is True
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] == labels
    assert peers_svc["spec"]["selector"] == labels == client_svc["spec"]["selector"]
    pod = spec["template"]["spec"]
    (envoy,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in envoy["ports"]}
    assert ports == {"http": 10000, "metrics": 9902, "peers": 15100}
    assert [(p["port"], p["targetPort"]) for p in peers_svc["spec"]["ports"]] == [(15100, "peers")]
    assert {p["targetPort"] for p in client_svc["spec"]["ports"]} == {"http", "metrics"}
    assert envoy["image"] == "envoyproxy/envoy:v1.40.0"
    assert envoy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}

    text = (REPO / "envoy" / "scale-out.yaml").read_text()
    cfg = scale_out
    # listeners: client 10000, stats 9902, peers 15100 (what the container ports say)
    listeners = {li["name"]: li["address"]["socket_address"] for li in cfg["static_resources"]["listeners"]}
    assert listeners == {n: {"address": "0.0.0.0", "port_value": p}
                         for n, p in (("ingress", 10000), ("stats", 9902), ("peers", 15100))}
    plugin = plugin_config(text)
    check_plugin_config(plugin)
    replicas = spec["replicas"]
    assert plugin["peers"]["clusters"] == [f"prefix_router_peer_{i}" for i in range(replicas)]
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    for i in range(replicas):
        cluster = clusters[f"prefix_router_peer_{i}"]
        assert cluster["type"] == "STRICT_DNS"
        host = f"{name}-{i}.{spec['serviceName']}.{ns}.svc.cluster.local"
        (ep,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert ep["endpoint"]["address"]["socket_address"] == {"address": host, "port_value": 15100}
    # secret: a placeholder in the ConfigMap, replaced from the Secret by the init container
    placeholder = plugin["peers"]["secret"]
    assert placeholder == "__PREFIX_ROUTER_PEER_SECRET__"
    (init,) = pod["initContainers"]
    script = init["command"][-1]
    # every placeholder filled by docker/fill-secrets.awk from the Secrets' files (never argv)
    assert "-v hash_key_file=/hash-key/key -v peer_secret_file=/secret/secret" in script
    assert f"-f {FILL_IN_IMAGE} /config/envoy.yaml > /etc/prefix-router/envoy.yaml" in script
    assert plugin["hash_key"] == "__HASH_KEY__"  # replaced from the Secret prefix-router-hash-key
    assert "cp /wasm/prefix_router.wasm /etc/prefix-router/prefix_router.wasm" in script
    wasm = [f for li in cfg["static_resources"]["listeners"] for f in li["filter_chains"][0]["filters"][0]
            ["typed_config"]["http_filters"] if f["name"] == "envoy.filters.http.wasm"]
    assert {w["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] for w in wasm} == {
        "/etc/prefix-router/prefix_router.wasm"}
    assert envoy["args"][:2] == ["-c", "/etc/prefix-router/envoy.yaml"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["peer-secret"]["secret"]["secretName"] == "prefix-router-peer-secret"
    assert vols["hash-key"]["secret"]["secretName"] == "prefix-router-hash-key"
    assert vols["config"]["configMap"]["name"] == "prefix-router-envoy"
    assert vols["run"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounts == {"config": "/config", "peer-secret": "/secret", "hash-key": "/hash-key", "run": "/etc/prefix-router"}
    assert {m["name"]: m["mountPath"] for m in envoy["volumeMounts"]} == {"run": "/etc/prefix-router"}
    # The kubectl commands the manifest's header gives create exactly the Secrets and the ConfigMap
    # the pod mounts, under the keys the init script reads, from a file that exists.
    header = (REPO / "envoy" / "k8s" / "statefulset.yaml").read_text()
    secrets = dict(re.findall(r"create secret generic (\S+) --from-literal=(\w+)=", header))
    assert secrets == {vols["peer-secret"]["secret"]["secretName"]: "secret",
                       vols["hash-key"]["secret"]["secretName"]: "key"}, secrets
    assert f"{mounts['peer-secret']}/secret " in script and f"{mounts['hash-key']}/key " in script
    ((cm, key, src),) = re.findall(r"create configmap (\S+) --from-file=([\w.]+)=(\S+)", header)
    assert cm == vols["config"]["configMap"]["name"] and f"{mounts['config']}/{key} " in script, (cm, key)
    assert src == "envoy/scale-out.yaml" and (REPO / src).is_file()
    # the peer port is open to prefix-router pods only
    netpol = by_kind(docs, "statefulset.yaml", "NetworkPolicy")["spec"]
    assert netpol["podSelector"]["matchLabels"] == labels
    peer_rule = [r for r in netpol["ingress"] if {"port": 15100} in r["ports"]]
    assert peer_rule == [{"from": [{"podSelector": {"matchLabels": labels}}], "ports": [{"port": 15100}]}]


# Where the export image (docker/filter.Dockerfile) holds docker/fill-secrets.awk.
FILL_IN_IMAGE = "/usr/local/lib/prefix-router/fill-secrets.awk"


def _local_paths(script: str, tmp_path, dirs) -> str:
    """An init script's container paths mapped to tmp_path/<dir>/ (the /etc/prefix-router mount
    to run/) and the image's fill-secrets.awk to docker/'s."""
    script = script.replace(FILL_IN_IMAGE, str(REPO / "docker" / "fill-secrets.awk"))
    for d in dirs:
        path = "/etc/prefix-router/" if d == "run" else f"/{d}/"
        for sep in (" ", "="):
            script = script.replace(sep + path, f"{sep}{tmp_path}/{d}/")
    return script


def _init_script_here(docs, tmp_path, peer_secret: str, hash_key: str):
    """The StatefulSet's init container script, run here with its absolute paths mapped into
    tmp_path (the ConfigMap = envoy/scale-out.yaml with the local .wasm path, the two Secrets)."""
    pod = by_kind(docs, "statefulset.yaml", "StatefulSet")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][:2] == ["sh", "-c"]
    script = init["command"][-1]
    for d in ("wasm", "config", "secret", "hash-key", "run"):
        (tmp_path / d).mkdir()
    (tmp_path / "wasm" / "prefix_router.wasm").write_bytes(b"\0asm")
    (tmp_path / "config" / "envoy.yaml").write_text(
        with_local_wasm((REPO / "envoy" / "scale-out.yaml").read_text(), "/etc/prefix-router/prefix_router.wasm"))
    (tmp_path / "secret" / "secret").write_text(peer_secret + "\n")
    (tmp_path / "hash-key" / "key").write_text(hash_key + "\n")
    script = _local_paths(script, tmp_path, ("run", "wasm", "config", "secret", "hash-key"))
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    out = tmp_path / "run" / "envoy.yaml"
    return r, (out.read_text() if out.exists() else "")


def test_statefulset_init_writes_both_secrets_into_the_config(docs, tmp_path):
    """The init container really replaces both placeholders from the Secrets' files, and the
    result passes `envoy --mode validate` (which runs the filter's config check)."""
    r, text = _init_script_here(docs, tmp_path, "p" * 32, "0123456789abcdef0123456789abcdef")
    assert r.returncode == 0, r.stderr
    assert "__HASH_KEY__" not in text.split("\n\n", 1)[1] and "__PREFIX_ROUTER_PEER_SECRET__" not in text.split("\n\n", 1)[1]
    plugin = plugin_config(text)
    assert plugin["hash_key"] == "0123456789abcdef0123456789abcdef" and plugin["peers"]["secret"] == "p" * 32
    check_config(text, tmp_path)


def test_statefulset_init_refuses_a_short_hash_key(docs, tmp_path):
    r, _ = _init_script_here(docs, tmp_path, "p" * 32, "short")
    assert r.returncode != 0 and "prefix-router-hash-key" in r.stderr


@pytest.mark.parametrize("peer_secret,hash_key,needle", [
    ("__PREFIX_ROUTER_PEER_SECRET__", "k" * 32, "the peer secret in"),
    ("p" * 32, "__SOME_OTHER_KEY_NAME__", "the hash key in"),
    ('p' * 20 + '"x', "k" * 32, "printable ASCII"),
])
def test_statefulset_init_refuses_a_placeholder_or_unsafe_secret(docs, tmp_path, peer_secret, hash_key, needle):
    """A Secret that holds a placeholder (or a character that would break the JSON) stops the pod
    in its init container, naming the file, never echoing the value."""
    r, _ = _init_script_here(docs, tmp_path, peer_secret, hash_key)
    assert r.returncode != 0 and needle in r.stderr, r.stderr
    for v in (peer_secret, hash_key):
        assert v not in r.stderr


def _pool_parts(docs):
    workers_svc, envoy_svc = [d for d in docs["pool.yaml"] if d["kind"] == "Service"]
    sglang, envoy = [d for d in docs["pool.yaml"] if d["kind"] == "Deployment"]
    return workers_svc, sglang, envoy_svc, envoy


def test_pool_example_matches_its_config(docs, composecheck, tmp_path):
    """envoy/k8s/pool.yaml runs envoy/pool.yaml: its one pool cluster resolves the headless Service
    in front of the SGLang Deployment, so `kubectl scale` changes the pool and nothing else."""
    workers_svc, sglang, envoy_svc, envoy = _pool_parts(docs)
    text = (REPO / "envoy" / "pool.yaml").read_text()
    cfg = yaml_doc(composecheck, text, tmp_path)
    plugin = plugin_config(text)
    (pool_cluster,) = check_plugin_config(plugin)
    assert plugin["models"]["llama"]["pool"]["cluster"] == pool_cluster
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    for name in (pool_cluster, plugin["models"]["llama"]["pool"]["load_cluster"]):
        c = clusters[name]
        assert c["type"] == "STRICT_DNS", name
        (ep,) = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
        sa = ep["endpoint"]["address"]["socket_address"]
        # the headless Service's name in its namespace, on the pods' port
        meta = workers_svc["metadata"]
        assert sa["address"] == f"{meta['name']}.{meta['namespace']}.svc.cluster.local", sa
        assert sa["port_value"] in [p["port"] for p in workers_svc["spec"]["ports"]]
    assert workers_svc["spec"]["clusterIP"] == "None"  # one A record per ready pod
    assert not workers_svc["spec"].get("publishNotReadyAddresses", False)  # only ready pods are hosts
    pod = sglang["spec"]["template"]
    assert workers_svc["spec"]["selector"] == pod["metadata"]["labels"] == sglang["spec"]["selector"]["matchLabels"]
    (server,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    (svc_port,) = workers_svc["spec"]["ports"]
    assert ports[svc_port["targetPort"]] == svc_port["port"]
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    assert server["command"][server["command"].index("--port") + 1] == str(svc_port["port"])

    espec = envoy["spec"]["template"]
    assert envoy_svc["spec"]["selector"] == espec["metadata"]["labels"] == envoy["spec"]["selector"]["matchLabels"]
    (proxy,) = espec["spec"]["containers"]
    listeners = {li["name"]: li["address"]["socket_address"]["port_value"] for li in cfg["static_resources"]["listeners"]}
    assert {p["name"]: p["containerPort"] for p in proxy["ports"]} == {"http": listeners["ingress"],
                                                                      "metrics": listeners["stats"]}
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    # the header's commands create the ConfigMap (from envoy/pool.yaml) and the Secret the pod mounts
    header = (REPO / "envoy" / "k8s" / "pool.yaml").read_text()
    vols = {v["name"]: v for v in espec["spec"]["volumes"]}
    ((cm, key, src),) = re.findall(r"create configmap (\S+) --from-file=([\w.]+)=(\S+)", header)
    assert (cm, src) == (vols["config"]["configMap"]["name"], "envoy/pool.yaml")
    assert re.findall(r"create secret generic (\S+) --from-literal=(\w+)=", header) == [
        (vols["hash-key"]["secret"]["secretName"], "key")]
    (scale,) = re.findall(r"kubectl -n (\S+) scale deployment/(\S+) ", header)
    assert scale == (sglang["metadata"]["namespace"], sglang["metadata"]["name"])
    (init,) = espec["spec"]["initContainers"]
    assert f"/config/{key} " in init["command"][-1]


def test_pool_init_writes_the_key_and_the_config_validates(docs, composecheck, tmp_path):
    """The pool Deployment's init container replaces the hash_key placeholder from the Secret's
    file, and the result passes `envoy --mode validate`."""
    _, _, _, envoy = _pool_parts(docs)
    (init,) = envoy["spec"]["template"]["spec"]["initContainers"]
    script = init["command"][-1]
    for d in ("wasm", "config", "hash-key", "run"):
        (tmp_path / d).mkdir()
    (tmp_path / "wasm" / "prefix_router.wasm").write_bytes(b"\0asm")
    (tmp_path / "config" / "envoy.yaml").write_text(
        with_local_wasm((REPO / "envoy" / "pool.yaml").read_text(), "/etc/prefix-router/prefix_router.wasm"))
    (tmp_path / "hash-key" / "key").write_text("0123456789abcdef0123456789abcdef\n")
    script = _local_paths(script, tmp_path, ("run", "wasm", "config", "hash-key"))
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "run" / "envoy.yaml").read_text()
    assert plugin_config(text)["hash_key"] == "0123456789abcdef0123456789abcdef"
    check_pool_doc(yaml_doc(composecheck, text, tmp_path), tmp_path)
    (tmp_path / "hash-key" / "key").write_text("short\n")
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "prefix-router-hash-key" in r.stderr
