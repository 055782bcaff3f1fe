"""Seeded prompt generators (varied, random-but-reproducible long strings and token lists) and
the malformed bodies the robustness tests send."""

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


MALFORMED = {  # name -> (path, body): bodies the filter cannot parse, each must still be served
    "truncated-json": ("/v1/chat/completions", b'{"model": "llama", "messages": [{"role": "user", "content": "hi"'),
    "not-json": ("/v1/chat/completions", b"this is not json at all"),
    "wrong-type-messages": ("/v1/chat/completions", b'{"model": "llama", "messages": 42}'),
    "wrong-type-prompt": ("/v1/completions", b'{"model": "llama", "prompt": {"a": 1}}'),
    "json-array": ("/v1/chat/completions", b"[1, 2, 3]"),
    "invalid-utf8-chat": ("/v1/chat/completions",
                          b'{"model": "llama", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    "invalid-utf8-prompt": ("/v1/completions", b'{"model": "llama", "prompt": "\xff\xfe"}'),
    "bad-input-ids": ("/generate", b'{"input_ids": [1, "two", 3]}'),
}
