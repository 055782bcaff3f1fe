"""envoy/gen's scale-out options: --load-poll-ms, --peers, --peer-listen, --peer-secret(-file).

The generated config passes the real `envoy --mode validate` (which starts the Wasm VMs and makes
the filter check both listeners' plugin configuration); its structure is read back as JSON with
tools/composecheck yaml2json (no YAML library in Python)."""

from __future__ import annotations

import json

import pytest

from prkit.build import wasm_path
from prkit.envoy import check_config
from prkit.envoy_config import run_gen

from .conftest import gen_fail, yaml_doc

SECRET = "s3cr3t-0123456789abcdef"
HASH_KEY = "h4sh-k3y-0123456789abcdef"  # replicas sharing an index need one key (tests/deploy/test_hash_key.py)
PEERS = "http://10.0.0.2:15100,http://envoy-1.prefix-router-peers.default.svc:15100"


def as_json(composecheck, text: str, tmp_path) -> dict:
    return yaml_doc(composecheck, text, tmp_path)


def hcm(listener: dict) -> dict:
    (chain,) = listener["filter_chains"]
    (f,) = chain["filters"]
    assert f["name"] == "envoy.filters.network.http_connection_manager"
    return f["typed_config"]


def wasm_config(listener: dict) -> dict:
    (w,) = [f for f in hcm(listener)["http_filters"] if f["name"] == "envoy.filters.http.wasm"]
    return w["typed_config"]["config"]


def test_peers_config_validates_and_listeners_share_the_vm(composecheck, tmp_path):
    args = ["--model", "m=10.0.0.1:8000,w1.llm.svc:8000", "--peers", PEERS,
            "--peer-listen", "127.0.0.1:0", "--peer-secret", SECRET, "--load-poll-ms", "50", "--hash-key", HASH_KEY]
    text = run_gen(*args, "--wasm", str(wasm_path()))
    check_config(text, tmp_path)
    doc = as_json(composecheck, text, tmp_path)
    listeners = {li["name"]: li for li in doc["static_resources"]["listeners"]}
    assert list(listeners) == ["ingress", "stats", "peers"]
    client, peer = wasm_config(listeners["ingress"]), wasm_config(listeners["peers"])

    # the same filter definition: one VM per thread, one shared-data scope (vm_id)
    assert client["vm_config"] == peer["vm_config"]
    assert client["vm_config"]["vm_id"] == "prefix_router"
    assert {k: v for k, v in client.items() if k != "configuration"} == \
        {k: v for k, v in peer.items() if k != "configuration"}

    cplug = json.loads(client["configuration"]["value"])
    pplug = json.loads(peer["configuration"]["value"])
    assert cplug["load_poll"] == {"interval_ms": 50, "cluster_suffix": "_load"}
    assert cplug["peers"] == {"clusters": ["prefix_router_peer_0", "prefix_router_peer_1"], "secret": SECRET}
    assert "peer_listener" not in cplug
    assert pplug == {**cplug, "peer_listener": True}

    # peer listener: on --peer-listen, everything the filter does not answer is a 404
    assert listeners["peers"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 0}
    pm = hcm(listeners["peers"])
    # one JSON line per refused request (any status but 2xx), with the filter's reason
    (log,) = pm["access_log"]
    assert log["typed_config"]["log_format"]["json_format"]["details"] == "%RESPONSE_CODE_DETAILS%"
    ops = [(f["status_code_filter"]["comparison"]["op"], f["status_code_filter"]["comparison"]["value"]["default_value"])
           for f in log["filter"]["or_filter"]["filters"]]
    assert ops == [("LE", 199), ("GE", 300)]
    assert "x-prefix-router-peer-secret" not in text, "the secret never travels in a header"
    (vhost,) = pm["route_config"]["virtual_hosts"]
    assert vhost["domains"] == ["*"]
    assert vhost["routes"] == [{"match": {"prefix": "/"}, "direct_response": {"status": 404}}]
    assert [f["name"] for f in pm["http_filters"]] == ["envoy.filters.http.wasm", "envoy.filters.http.router"]

    # one cluster per peer: STATIC for an IP, STRICT_DNS for a name; fast connect; HTTP/1.1
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    for name, kind, host in (("prefix_router_peer_0", "STATIC", "10.0.0.2"),
                             ("prefix_router_peer_1", "STRICT_DNS", "envoy-1.prefix-router-peers.default.svc")):
        c = clusters[name]
        assert c["type"] == kind and c["connect_timeout"] == "0.25s"
        opts = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert "http_protocol_options" in opts["explicit_http_config"]
        (ep,) = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert ep["endpoint"]["address"]["socket_address"] == {"address": host, "port_value": 15100}


def test_secret_file_is_stripped_and_receive_only_listener(composecheck, tmp_path):
    f = tmp_path / "secret"
    f.write_text(f"  {SECRET}\n\n")
    text = run_gen("--model", "m=10.0.0.1:8000", "--peer-listen", "127.0.0.1:15100",
                   "--peer-secret-file", str(f), "--load-poll-ms", "0", "--wasm", str(wasm_path()), "--hash-key", HASH_KEY)
    check_config(text, tmp_path)
    doc = as_json(composecheck, text, tmp_path)
    listeners = {li["name"]: li for li in doc["static_resources"]["listeners"]}
    plug = json.loads(wasm_config(listeners["peers"])["configuration"]["value"])
    # no --peers: nothing to send, but the peer listener still needs the secret
    assert plug["peers"] == {"clusters": [], "secret": SECRET}
    assert plug["load_poll"] == {"interval_ms": 0}
    assert not any(c["name"].startswith("prefix_router_peer_") for c in doc["static_resources"]["clusters"])


def test_long_poll_interval_keeps_stale_above_it():
    text = run_gen("--model", "m=10.0.0.1:8000", "--load-poll-ms", "5000")
    assert '"interval_ms": 5000,\n' in text and '"stale_ms": 50000' in text


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--peers", PEERS], ["--peers", "--peer-secret", "--peer-secret-file", "required"]),
        (["--peer-listen", "127.0.0.1:15100"], ["--peer-listen", "secret", "required"]),
        (["--peers", PEERS, "--peer-secret", "too-short"], ["--peer-secret", "too short", "16"]),
        (["--peers", PEERS, "--peer-secret", "0123456789abcde"], ["--peer-secret", "15 characters"]),
        (["--peers", PEERS, "--peer-secret", "0123456789 abcdef"], ["--peer-secret", "printable"]),
        (["--peers", PEERS, "--peer-secret-file", "/nonexistent/secret"], ["--peer-secret-file", "cannot read"]),
        (["--peers", PEERS, "--peer-secret", SECRET, "--peer-secret-file", "/x"], ["--peer-secret-file", "only one"]),
        (["--peer-secret", SECRET], ["--peer-secret", "only used with --peers or --peer-listen"]),
        (["--peers", "https://10.0.0.2:15100", "--peer-secret", SECRET], ["--peers", "http://"]),
        (["--peers", "10.0.0.2:15100", "--peer-secret", SECRET], ["--peers", "expected http://HOST:PORT"]),
        (["--peers", "http://10.0.0.2:15100/x", "--peer-secret", SECRET], ["--peers", "expected"]),
        (["--peers", "http://a:1,http://a:1", "--peer-secret", SECRET], ["--peers", "twice"]),
        (["--peer-listen", "nohost", "--peer-secret", SECRET], ["--peer-listen", "HOST:PORT"]),
        (["--load-poll-ms", "-1"], ["--load-poll-ms", "between 0 and 60000"]),
        (["--load-poll-ms", "60001"], ["--load-poll-ms"]),
    ],
)
def test_bad_scale_out_options_name_the_option_and_reason(args, needles):
    err = gen_fail("--model", "m=10.0.0.1:8000", *args)
    for n in needles:
        assert n in err, (n, err)


def test_secret_file_too_short(tmp_path):
    f = tmp_path / "secret"
    f.write_text("short\n")
    err = gen_fail("--model", "m=10.0.0.1:8000", "--peers", PEERS, "--peer-secret-file", str(f))
    # Names the option, not the path: what was given where a path belongs may be a secret.
    assert "--peer-secret-file" in err and "too short (5 characters" in err
    assert str(f) not in err


def test_native_renders_the_dynamic_module_on_both_listeners(composecheck, tmp_path):
    """`--native`: the dynamic-module filter in place of the Wasm one, on the client listener and
    the peers listener (same module: its shared data is process-wide), the peers listener's with
    `peer_listener`; no .wasm anywhere; `--wasm` with it is an error naming `--native`."""
    args = ["--model", "m=10.0.0.1:8000,w1.llm.svc:8000", "--peers", PEERS,
            "--peer-listen", "127.0.0.1:0", "--peer-secret", SECRET, "--native", "--hash-key", HASH_KEY]
    text = run_gen(*args)
    assert "envoy.filters.http.wasm" not in text and ".wasm" not in text
    assert "ENVOY_DYNAMIC_MODULES_SEARCH_PATH" in text  # the header says how to start it
    doc = as_json(composecheck, text, tmp_path)
    listeners = {li["name"]: li for li in doc["static_resources"]["listeners"]}
    plugins = {}
    for name in ("ingress", "peers"):
        (f,) = [f for f in hcm(listeners[name])["http_filters"]
                if f["name"] == "envoy.filters.http.dynamic_modules"]
        tc = f["typed_config"]
        assert tc["dynamic_module_config"] == {"name": "prefix_router", "do_not_close": True}
        assert tc["filter_name"] == "prefix_router"
        plugins[name] = json.loads(tc["filter_config"]["value"])
    assert plugins["peers"] == {**plugins["ingress"], "peer_listener": True}
    assert plugins["ingress"]["peers"]["secret"] == SECRET
    assert "--native" in gen_fail(*args, "--wasm", "/x/prefix_router.wasm")
