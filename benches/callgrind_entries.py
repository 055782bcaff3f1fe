"""Where a kept callgrind dump of Envoy (`benches/overhead --callgrind --keep DIR`) spent its
instructions, per request, without symbols (Envoy's binary is stripped, V8's compiled Wasm has
none): self cost by object, and per exported Wasm function (proxy_on_request_body, ...) its calls
and inclusive cost.

  .venv/bin/python benches/callgrind_entries.py DIR/callgrind-prefix_router.out.1 WASM [REQUESTS]

How an entry is found: Envoy enters the VM through a V8 wrapper and a thunk per export, which
call the export's slot in V8's jump table, one 8-byte slot per function in index order; WASM (the
.wasm the dump ran) gives the exports' order. REQUESTS: the window's requests (400 by default).
"""

from __future__ import annotations

import collections
import re
import sys


def leb(b: bytes, i: int) -> tuple[int, int]:
    r = s = 0
    while True:
        x = b[i]
        i += 1
        r |= (x & 0x7F) << s
        s += 7
        if x < 0x80:
            return r, i


def exports(path: str) -> dict[int, str]:
    """Exported functions of a .wasm: function index -> name."""
    b = open(path, "rb").read()
    i, out = 8, {}
    while i < len(b):
        sid = b[i]
        size, i = leb(b, i + 1)
        if sid == 7:
            n, j = leb(b, i)
            for _ in range(n):
                ln, j = leb(b, j)
                name = b[j:j + ln].decode()
                kind = b[j + ln]
                idx, j = leb(b, j + ln + 1)
                if kind == 0:
                    out[idx] = name
        i += size
    return out


def parse(path: str):
    """(self cost by object, call edges: (caller obj, caller fn, callee obj, callee fn) -> [calls, inclusive])."""
    names: dict[str, dict[str, str]] = {"ob": {}, "fl": {}, "fn": {}}

    def name(kind: str, s: str) -> str:
        m = re.match(r"\((\d+)\)(?:\s+(.*))?", s)
        if not m:
            return s
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
        return names[kind].get(m.group(1), "?" + m.group(1))

    selfc: collections.Counter = collections.Counter()
    edges: dict = collections.defaultdict(lambda: [0, 0])
    ob = fn = cob = cfn = None
    pending = None
    for line in open(path, errors="replace"):
        line = line.rstrip("\n")
        if not line:
            continue
        key, _, rest = line.partition("=")
        if key == "ob":
            ob, cob = name("ob", rest), None
        elif key in ("fl", "fi", "fe"):
            name("fl", rest)
        elif key == "fn":
            fn, cob = name("fn", rest), None
        elif key == "cob":
            cob = name("ob", rest)
        elif key in ("cfi", "cfl"):
            name("fl", rest)
        elif key == "cfn":
            cfn = name("fn", rest)
        elif key == "calls":
            pending = int(rest.split()[0])
        elif line[0].isdigit() or line[0] in "+-*":
            parts = line.split()
            cost = int(parts[1]) if len(parts) > 1 else 0
            if pending is not None:
                e = edges[(ob, fn, cob or ob, cfn)]
                e[0] += pending
                e[1] += cost
                pending, cob = None, None
            else:
                selfc[ob] += cost
    return selfc, edges


def main():
    dump, wasm = sys.argv[1], sys.argv[2]
    n = float(sys.argv[3]) if len(sys.argv) > 3 else 400
    selfc, edges = parse(dump)
    short = lambda o: (o or "?").rsplit("/", 1)[-1]
    print("self cost per request, by object:")
    for o, c in selfc.most_common():
        if c / n >= 1:
            print(f"  {c / n:10,.0f}  {short(o)}")
    # Entries: Envoy calls a V8 wrapper, which calls a thunk, which calls the export's slot.
    jit = lambda o: short(o) == "???"
    callees = collections.defaultdict(list)
    for (ob, fn, cob, cfn), (calls, incl) in edges.items():
        callees[(ob, fn)].append((incl, calls, (cob, cfn)))
    entries = []
    for (ob, fn, cob, cfn), (calls, incl) in edges.items():
        if jit(ob) or not jit(cob):
            continue
        node = (cob, cfn)
        for _ in range(2):
            nxt = [c for c in callees.get(node, []) if jit(c[2][0])]
            if not nxt:
                break
            node = max(nxt)[2]
        else:
            # V8's embedded builtins, which Envoy's code also calls, lie below 4 GiB.
            if int(node[1], 16) >= 1 << 32:
                entries.append((int(node[1], 16), calls, incl))
    exp = exports(wasm)
    # Slots of one VM's table lie together; a window never enters the exports Envoy calls only
    # at start (abi version, vm start, configure), so the offset to the export indices is not
    # read from the dump: each slot is printed as its distance from the table's first slot
    # seen, beside the exports in index order, to match by the per-request counts (1 context
    # create, 1 request headers, 1 or 2 request body, 1 response headers, 1 delete, one
    # allocation per buffer handed in; ticks and call answers a fraction).
    print("exports in function index order:", ", ".join(exp[i] for i in sorted(exp)))
    first: dict[int, int] = {}
    for slot, _, _ in sorted(entries):
        first.setdefault(slot >> 16, slot)
    agg = collections.defaultdict(lambda: [0, 0])
    for slot, calls, incl in entries:
        agg[(slot >> 16, (slot - first[slot >> 16]) // 8)][0] += calls
        agg[(slot >> 16, (slot - first[slot >> 16]) // 8)][1] += incl
    print("VM entries per request (calls, inclusive instructions), by VM table and slot:")
    for (table, k), (calls, incl) in sorted(agg.items()):
        if incl / n >= 1:
            print(f"  table {table:x} slot +{k:<3d} {calls / n:8.3f} {incl / n:10,.0f}")


if __name__ == "__main__":
    main()
