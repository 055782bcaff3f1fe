"""Keyed hashes in every production config: with hash_key unset (0) anyone can
grind prompts offline that evict a victim's index buckets, or compute the rendezvous key and worker
ids that pin new conversations to a chosen worker.

envoy/gen: a production profile always writes a hash_key: --hash-key-file (the same file on every
replica), a random key generated for a single replica, or --hash-key-placeholder (__HASH_KEY__,
replaced at deploy time; the filter refuses the placeholder itself, so a config that skipped the
replacement cannot start unkeyed). Replicas that share an index (--peers) must be given the key.
"""

from __future__ import annotations

import json
import re

import pytest

from prkit import envoy_config as ec
from prkit.build import wasm_path
from prkit.envoy import validate_config
from prkit.envoy_config import gen_result, run_gen
from prkit.paths import REPO_ROOT as REPO

from .conftest import header_command, plugin_config

PRODUCTION = ["compose.yaml", "ingress.yaml", "scale-out.yaml", "pool.yaml"]
PEERS = "http://10.0.0.2:15100,http://10.0.0.3:15100"
SECRET = "0123456789abcdef-peer"


def gen_fail(*args: str) -> str:
    """envoy/gen exits 2 on `args` (its own refusals and argparse's usage errors alike: no stderr
    prefix is required, unlike tests/deploy/conftest.gen_fail); returns stderr."""
    r = gen_result(*args)
    assert r.returncode == 2, (r.returncode, r.stdout[:300])
    return r.stderr


@pytest.mark.parametrize("name", PRODUCTION)
def test_every_shipped_production_config_is_keyed(name):
    """Shipped production configs carry the placeholder (never a committed key), in every filter
    instance (client and peer listeners)."""
    text = (REPO / "envoy" / name).read_text()
    assert "--hash-key-placeholder" in header_command(text)
    keys = re.findall(r'"hash_key": "([^"]*)"', text)
    assert keys and set(keys) == {ec.HASH_KEY_PLACEHOLDER}, keys
    assert plugin_config(text)["hash_key"] == ec.HASH_KEY_PLACEHOLDER


@pytest.mark.parametrize("profile,args", [
    ("ingress", ["--model", "m=10.0.0.1:8000,10.0.0.2:8000"]),
    ("compose", []),
])
def test_every_generated_production_config_carries_a_key(profile, args):
    """No key given, no peers: a random key per config (one replica)."""
    keys = []
    for _ in range(2):
        text = run_gen("--profile", profile, *args)
        plugin = plugin_config(text)
        assert re.fullmatch(r"[0-9a-f]{64}", plugin["hash_key"]), plugin.get("hash_key")
        assert "hash_key: a random key generated" in text.split("\n\n", 1)[0]
        keys.append(plugin["hash_key"])
    assert keys[0] != keys[1]


def test_replicas_must_share_a_given_key(tmp_path):
    err = gen_fail("--model", "m=10.0.0.1:8000", "--peers", PEERS, "--peer-secret", SECRET)
    assert "--hash-key-file" in err and "same" in err
    err = gen_fail("--model", "m=10.0.0.1:8000", "--peer-listen", "0.0.0.0:15100", "--peer-secret", SECRET)
    assert "--hash-key-file" in err
    f = tmp_path / "key"
    f.write_text("k3y-0123456789abcdef\n")
    texts = [run_gen("--model", "m=10.0.0.1:8000", "--peers", PEERS, "--peer-listen", f"0.0.0.0:{15100 + i}",
                     "--peer-secret", SECRET, "--hash-key-file", str(f)) for i in range(2)]
    for text in texts:
        # the client and the peer listener's filter both hold it
        assert re.findall(r'"hash_key": "([^"]*)"', text) == ["k3y-0123456789abcdef"] * 2
        assert "k3y-0123456789abcdef" not in text.split("\n\n", 1)[0]  # the header names the file, not the key


@pytest.mark.parametrize("args,needles", [
    (["--hash-key", "short"], ["--hash-key", "too short"]),
    (["--hash-key", "0123456789 abcdef"], ["--hash-key", "printable"]),
    (["--hash-key-file", "/nonexistent/key"], ["--hash-key-file", "cannot read"]),
    (["--hash-key", "0123456789abcdef", "--hash-key-placeholder"], ["not allowed with"]),
])
def test_bad_keys_are_refused(args, needles):
    err = gen_fail("--model", "m=10.0.0.1:8000", *args)
    for n in needles:
        assert n in err, (n, err)


def test_demo_and_test_profiles_stay_unkeyed_unless_asked():
    """Local profiles (loopback, debug header on) keep deterministic hashes; a key is one option away."""
    assert "hash_key" not in plugin_config((REPO / "envoy" / "envoy.yaml").read_text())
    text = run_gen("--profile", "test", "--model", "m=127.0.0.1:8000", "--hash-key", "0123456789abcdef")
    assert plugin_config(text)["hash_key"] == "0123456789abcdef"


def test_the_filter_refuses_an_unreplaced_placeholder(tmp_path):
    """Fail closed: a config whose placeholder was never replaced does not load (the real filter's
    config check, run by envoy --mode validate); the same config with a key does."""
    text = run_gen("--model", "m=10.0.0.1:8000", "--wasm", str(wasm_path()), "--hash-key-placeholder")
    r = validate_config(text, tmp_path)
    assert r.returncode != 0, r.stdout
    assert "hash_key" in r.stdout + r.stderr
    keyed = text.replace(f'"hash_key": "{ec.HASH_KEY_PLACEHOLDER}"', '"hash_key": "' + "a" * 64 + '"')
    r = validate_config(keyed, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_python_api_production_profiles_are_keyed():
    o = ec.profile("ingress", models=ec.fleet("m", {"m_0": 1}, host="10.0.0.1"))
    assert re.fullmatch(r"[0-9a-f]{64}", ec.plugin_config(o)["hash_key"])
    with pytest.raises(ec.ConfigError, match="hash-key-file"):
        ec.config(ec.profile("ingress", models=ec.fleet("m", {"m_0": 1}, host="10.0.0.1"),
                             peers=[("10.0.0.2", 15100)], peer_secret=SECRET))
    assert json.dumps(ec.plugin_config(ec.profile("ingress", models=ec.fleet("m", {"m_0": 1}, host="10.0.0.1"),
                                                  peers=[("10.0.0.2", 15100)], peer_secret=SECRET,
                                                  hash_key="x" * 16)))
