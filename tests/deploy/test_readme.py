"""The README's shell blocks, run exactly as written (bash, from the repository root, as a user
who has run scripts/setup: `.venv/bin` on PATH for `envoy`, no CARGO_TARGET_DIR and no
CARGO_PROFILE_* override; scripts/test's release-profile override for its test builds would
otherwise rebuild the shipped `.wasm` under the tests that run it).

Which blocks run, by one rule: a ```sh block runs unless one of its commands
- needs a container engine or a cluster (`docker`, `kubectl`), or
- starts something that does not return: `scripts/demo`, `scripts/test` (the whole suite this
  test is part of) or an `envoy` that is not `envoy --mode validate`.
Every other block runs (today: the build + `envoy/gen` + `envoy --mode validate` of "Deploy", and
the secrets + `envoy/gen` of "Several replicas"); a skipped block shows as a skip with its reason.
Files a block writes in the repository root (`ingress.yaml`, `envoy.yaml`, ...) are removed after.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from prkit.build import envoy_binary
from prkit.paths import REPO_ROOT as REPO

NEEDS_OUTSIDE = re.compile(r"(^|[\s;&|(])(docker|kubectl)\s")
DOES_NOT_RETURN = re.compile(r"(^|[\s;&|(])scripts/(demo|test)\b")
ENVOY_RUN = re.compile(r"(^|[\s;&|(/])envoy\s+(?!--mode validate)")


def shell_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, body) of every ```sh block."""
    blocks = []
    for m in re.finditer(r"^```sh\n(.*?)^```$", text, re.M | re.S):
        blocks.append((text[: m.start()].count("\n") + 1, m.group(1)))
    return blocks


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def skip_reason(block: str) -> str | None:
    for cmd in commands(block):
        if NEEDS_OUTSIDE.search(cmd):
            return f"needs Docker or a cluster: {cmd[:60]}"
        if DOES_NOT_RETURN.search(cmd):
            return f"does not return (demo / the whole suite): {cmd[:60]}"
        if ENVOY_RUN.search(cmd):
            return f"starts Envoy as a server: {cmd[:60]}"
    return None


BLOCKS = shell_blocks((REPO / "README.md").read_text())


def test_the_rule_runs_the_deploy_commands():
    run = [b for _, b in BLOCKS if skip_reason(b) is None]
    assert any("envoy --mode validate" in b and "cargo build" in b and "envoy/gen" in b for b in run), (
        "README's Deploy block (build, envoy/gen, envoy --mode validate) is no longer run by this test")


@pytest.mark.parametrize("line,block", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs_as_written(line: int, block: str):
    reason = skip_reason(block)
    if reason:
        pytest.skip(reason)
    outputs = set(re.findall(r">\s*([\w.-]+)", block))
    existing = [o for o in outputs if (REPO / o).exists()]
    if existing:
        pytest.fail(f"README.md:{line} writes {existing} in the repository root, which already exist(s): "
                    "move them away to run this test")
    env = {k: v for k, v in os.environ.items()
           if k != "CARGO_TARGET_DIR" and not k.startswith("CARGO_PROFILE_")}
    env["PATH"] = f"{Path(envoy_binary()).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PWD"] = str(REPO)
    try:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, f"README.md:{line} failed ({r.returncode}):\n{block}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        for o in outputs:
            assert (REPO / o).stat().st_size > 0, f"README.md:{line}: {o} is empty"
        if "envoy --mode validate" in block:
            assert " OK" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    finally:
        for o in outputs:
            (REPO / o).unlink(missing_ok=True)
