"""Where things are: the repository root and cargo's target directory."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV = REPO_ROOT / ".venv"


def target_dir() -> Path:
    """cargo's target directory: $CARGO_TARGET_DIR (relative to the repository root) or target/."""
    t = os.environ.get("CARGO_TARGET_DIR")
    if not t:
        return REPO_ROOT / "target"
    p = Path(t)
    return p if p.is_absolute() else REPO_ROOT / p
