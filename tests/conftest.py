"""Shared by every Python test suite under tests/."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the directory holding Cargo.toml)."""
    return REPO_ROOT
