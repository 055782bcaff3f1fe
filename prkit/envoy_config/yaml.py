"""YAML output (no YAML library: the stdlib only): `dump` writes block YAML, short scalar-only
mappings in flow style, a "#" key as a comment above the next key; `strip_comments` removes
the comment keys. Deterministic: the checked-in configs are compared with it."""

from __future__ import annotations

import json
import re


_PLAIN = re.compile(r"^[A-Za-z0-9_./][A-Za-z0-9_./-]*$")
_RESERVED = {"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~", ".inf", ".nan", "-.inf"}
_FLOW_WIDTH = 100


def strip_comments(obj):
    if isinstance(obj, dict):
        return {k: strip_comments(v) for k, v in obj.items() if not k.startswith("#")}
    if isinstance(obj, list):
        return [strip_comments(v) for v in obj]
    return obj


def _is_num(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        pass
    try:
        int(s, 0)
        return True
    except ValueError:
        return False


def scalar(v) -> str:
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    s = str(v)
    if _PLAIN.match(s) and s.lower() not in _RESERVED and not _is_num(s) and not s.replace("_", "").isdigit():
        return s
    return json.dumps(s)


def _is_scalar(v) -> bool:
    return not isinstance(v, (dict, list))


def _flow(v) -> str | None:
    """Flow style for a mapping or list of scalars only (no comments)."""
    if isinstance(v, dict):
        if not v:
            return "{}"
        if any(k.startswith("#") for k in v) or not all(_is_scalar(x) and not (isinstance(x, str) and "\n" in x)
                                                         for x in v.values()):
            return None
        return "{ " + ", ".join(f"{scalar(k)}: {scalar(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        if not v:
            return "[]"
        if not all(_is_scalar(x) for x in v):
            return None
        return "[" + ", ".join(scalar(x) for x in v) + "]"
    return None


def _comment(text: str, pad: str, out: list) -> None:
    for line in str(text).splitlines():
        out.append(f"{pad}# {line}".rstrip())


def _value(key: str, v, pad: str, ind: int, out: list) -> None:
    if isinstance(v, str) and "\n" in v:
        out.append(f"{pad}{key}: |" + ("" if v.endswith("\n") else "-"))
        out += [f"{pad}  {line}" if line else "" for line in v.splitlines()]
        return
    if _is_scalar(v):
        out.append(f"{pad}{key}: {scalar(v)}")
        return
    f = _flow(v)
    if f is not None and len(pad) + len(key) + 2 + len(f) <= _FLOW_WIDTH:
        out.append(f"{pad}{key}: {f}")
        return
    out.append(f"{pad}{key}:")
    _block(v, ind + 2, out)


def _block(obj, ind: int, out: list) -> None:
    pad = " " * ind
    if isinstance(obj, dict):
        for i, (k, v) in enumerate(obj.items()):
            if ind == 0 and i and not list(obj)[i - 1].startswith("#"):
                out.append("")  # a blank line between top-level sections
            if k.startswith("#"):
                _comment(v, pad, out)
            else:
                _value(scalar(k), v, pad, ind, out)
        return
    for item in obj:
        if isinstance(item, dict):
            # comments before the item's first key go above its "- "
            keys = list(item)
            n = next((i for i, k in enumerate(keys) if not k.startswith("#")), len(keys))
            for k in keys[:n]:
                _comment(item[k], pad, out)
            item = {k: item[k] for k in keys[n:]}
        f = None if _is_scalar(item) else _flow(item)
        if _is_scalar(item):
            out.append(f"{pad}- {scalar(item)}")
        elif f is not None and len(pad) + 2 + len(f) <= _FLOW_WIDTH:
            out.append(f"{pad}- {f}")
        else:
            sub: list = []
            _block(item, ind + 2, sub)
            first = next(i for i, line in enumerate(sub) if not line.lstrip().startswith("#"))
            sub[first] = pad + "- " + sub[first][ind + 2:]
            out += sub


def dump(obj) -> str:
    """Block YAML for dicts/lists/scalars; "#..." keys become comments."""
    out: list[str] = []
    _block(obj, 0, out)
    return "\n".join(out) + "\n"
