"""Seeded prompt generators: varied, random-but-reproducible long strings and token lists."""

from __future__ import annotations

import random
import string

_ALPHABET = string.ascii_letters + string.digits + "     ,.;:-'!?"


def rng(seed) -> random.Random:
    return random.Random(f"prefix-router-it:{seed}")


def text(r: random.Random, n_chars: int) -> str:
    """Random printable text of exactly n_chars (ASCII, so chars == bytes)."""
    return "".join(r.choice(_ALPHABET) for _ in range(n_chars))


def tokens(r: random.Random, n: int) -> list:
    return [r.randrange(1, 128_000) for _ in range(n)]
