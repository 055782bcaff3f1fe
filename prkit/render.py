"""Rendering the demo config (envoy/envoy.yaml) for a run: ports, the .wasm path and plugin
overrides. (Moved here from tests/integration/harness.py; to be replaced by prkit.envoy_config.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .paths import REPO_ROOT

DEMO_CONFIG = REPO_ROOT / "envoy" / "envoy.yaml"


def _replace_once(text: str, old: str, new: str) -> str:
    n = text.count(old)
    if n != 1:
        raise AssertionError(f"config template: expected exactly one {old!r}, found {n}")
    return text.replace(old, new)


def merge(base: dict, over: dict) -> dict:
    """`over` merged into `base` recursively (dicts merge, anything else replaces)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


PLUGIN_BLOCK = re.compile(
    r"(?P<head>\"@type\": type\.googleapis\.com/google\.protobuf\.StringValue\n(?P<indent>[ ]+)value: \|\n)"
    r"(?P<body>(?:(?P=indent)[ ]+.*\n|[ ]*\n)+)"
)


def plugin_config(text: str) -> dict:
    """The Wasm plugin configuration JSON embedded in a config (the StringValue block)."""
    m = PLUGIN_BLOCK.search(text)
    if not m:
        raise AssertionError("config template: plugin configuration block not found")
    return json.loads(m.group("body"))


def merge_plugin_configs(text: str, overrides: dict) -> str:
    """Merges `overrides` into every prefix-router plugin JSON of a config (the StringValue blocks
    whose JSON has `models`: the client listener's, and the peer listener's where there is one)."""
    out, pos, found = [], 0, 0
    for m in PLUGIN_BLOCK.finditer(text):
        try:
            cfg = json.loads(m.group("body"))
        except ValueError:
            continue
        if not isinstance(cfg, dict) or "models" not in cfg:
            continue
        cfg = merge(cfg, overrides)
        ind = m.group("indent") + "  "
        out += [text[pos: m.start("body")], "".join(ind + line + "\n" for line in json.dumps(cfg, indent=2).splitlines())]
        pos = m.end("body")
        found += 1
    if not found:
        raise AssertionError("prefix-router plugin configuration not found")
    return "".join(out) + text[pos:]


def render_config(template: str, *, listener_port: int, admin_port: int, worker_ports: dict, wasm: Path,
                  plugin_overrides: dict | None = None) -> tuple[str, dict]:
    """Render the demo config for a run. Returns (yaml text, effective plugin config)."""
    text = template
    text = _replace_once(text, "port_value: 9901 }", f"port_value: {admin_port} }}")
    text = _replace_once(text, "port_value: 10000 }", f"port_value: {listener_port} }}")
    text = _replace_once(text, "filename: target/wasm32-wasip1/release/prefix_router.wasm", f"filename: {wasm}")
    for name, port in worker_ports.items():
        marker = f"cluster_name: {name}\n"
        if text.count(marker) != 1:
            raise AssertionError(f"config template: cluster {name} not found exactly once")
        start = text.index(marker)
        m = re.compile(r"port_value: \d+").search(text, start)
        assert m, f"no port_value after cluster {name}"
        text = text[: m.start()] + f"port_value: {port}" + text[m.end():]
    m = PLUGIN_BLOCK.search(text)
    if not m:
        raise AssertionError("config template: plugin configuration block not found")
    cfg = merge(json.loads(m.group("body")), plugin_overrides or {})
    indent = m.group("indent") + "  "
    body = "".join(indent + line + "\n" for line in json.dumps(cfg, indent=2).splitlines())
    text = text[: m.start("body")] + body + text[m.end("body"):]
    return text, cfg


def worker_names(cfg: dict) -> list:
    """The worker cluster names of a plugin config, in order, each once."""
    names = []
    for model in cfg["models"].values():
        for w in model["workers"]:
            n = w if isinstance(w, str) else w["cluster"]
            if n not in names:
                names.append(n)
    return names
