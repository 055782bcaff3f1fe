"""Request-trace replay: loading the Mooncake traces, turning them into prompts, and the offline
numbers a router's replay is judged against (`load/compare --scenario trace`).

A trace (load/traces/README.md) is one JSON object per line: `timestamp` (ms), `input_length` and
`output_length` (tokens), `hash_ids` (one id per 512-token block; equal ids are a reusable prefix,
and an id implies its whole prefix, as the ids are remapped chained hashes; the last block may be
partial). Replaying it needs prompts whose prefix sharing is exactly the trace's:

* `scale()`: the trace's 512-token blocks become `block_tokens`-token blocks (the last, partial
  one in proportion), output lengths scale by the same factor (at least 1 token), so a long trace
  fits a small simulated fleet with the same reuse structure.
* `block_text()`: each id becomes a fixed ASCII text of exactly 4 bytes per token, which is exactly
  one token each for sglang-sim's tokenizer (sim/src/tokenizer.rs: 4-byte chunks). Its first token
  encodes the id, so distinct ids differ from their first token on (no accidental token-level
  sharing across blocks); a partial block is a prefix of the full block's text.
* Bounds, over the same request sequence at block granularity (`infinite_cache_hits`,
  `pooled_lru_hits`): one infinite prefix cache (every earlier prompt kept: the most any router
  can reuse), and one LRU prefix cache as large as the whole fleet's KV ("pooled LRU": a perfect
  router over LRU workers whose caches never duplicate a block). Prompt tokens outside the blocks
  (BOS, the chat template: `Shape`) are counted as the simulator counts them.
  `held_lru_hits` times the same caches: each request holds its prompt and output from its
  start to its end, as a worker's running requests hold their KV, so a run's timing (given by
  its records) takes out of the pooled LRU the room its running requests used.
* `holder_follow()`: given the worker that served each request, how often a request whose prefix
  beyond its first block (in the conversation trace, the first block is a system prompt every
  request shares) was served before went to a worker that served it.

Pure Python, no I/O beyond reading a trace: tests/load/test_trace.py checks it on tiny traces.
"""

from __future__ import annotations

import gzip
import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .paths import REPO_ROOT

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces
TRACES_DIR = REPO_ROOT / "load" / "traces"
TRACES = {
    "conversation": TRACES_DIR / "conversation_trace.jsonl.gz",
    "synthetic": TRACES_DIR / "synthetic_trace.jsonl.gz",
}


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def resolve_trace(name_or_path: str) -> Path:
    """`conversation` / `synthetic` (the bundled Mooncake traces) or a path (.jsonl or .jsonl.gz)."""
    if name_or_path in TRACES:
        return TRACES[name_or_path]
    p = Path(name_or_path)
    if not p.exists():
        raise FileNotFoundError(f"trace {name_or_path!r}: neither {', '.join(TRACES)} nor an existing file")
    return p


def load_trace(name_or_path: str, limit: int | None = None, skip: int = 0) -> list[TraceRequest]:
    """`limit` requests (all with None) after the first `skip`, in file order (the traces are
    time-sorted). A slice that skips some is a later stretch of the same traffic: prefixes its
    requests share with the skipped ones are new to it."""
    path = resolve_trace(name_or_path)
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[TraceRequest] = []
    seen = 0
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            seen += 1
            if seen <= skip:
                continue
            d = json.loads(line)
            ids = tuple(int(x) for x in d["hash_ids"])
            if not ids or not TRACE_BLOCK * (len(ids) - 1) < d["input_length"] <= TRACE_BLOCK * len(ids):
                raise ValueError(f"{path}:{n}: input_length {d['input_length']} does not fit {len(ids)} blocks")
            out.append(TraceRequest(float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]), ids))
    return out


# --------------------------------------------------------------------------------------------
# Scaling and text
# --------------------------------------------------------------------------------------------

Block = tuple[object, int]  # (block key: a hash id, or HEAD / TAIL), tokens


def scale(req: TraceRequest, block_tokens: int) -> tuple[list[Block], int]:
    """(blocks as (hash id, tokens), output tokens) with 512 -> `block_tokens` tokens per block.
    The last block keeps its share: ceil(rest * block_tokens / 512) tokens, at least 1 (a full
    last block stays full); output: ceil(output_length * block_tokens / 512), at least 1."""
    n = len(req.hash_ids)
    rest = req.input_length - TRACE_BLOCK * (n - 1)
    last = max(1, math.ceil(rest * block_tokens / TRACE_BLOCK))
    blocks = [(h, block_tokens) for h in req.hash_ids[:-1]] + [(req.hash_ids[-1], last)]
    out = max(1, math.ceil(req.output_length * block_tokens / TRACE_BLOCK))
    return blocks, out


_TAG = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
          "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def _mix(z: int) -> int:
    """splitmix64 step (the simulator's and the filter's mixer; any fixed one would do)."""
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def block_text(block_id: int, tokens: int) -> str:
    """ASCII text of exactly 4 * `tokens` bytes for hash id `block_id`: a 4-character tag of the id
    (base 64, low digit first: distinct ids below 64**4 differ in the first token), the id in
    decimal, then words chosen by a PRNG seeded with the id. Deterministic; a shorter block is a
    prefix of a longer one of the same id."""
    v = block_id % 64 ** 4
    tag = "".join(_TAG[(v >> (6 * k)) & 63] for k in range(4))
    want = 4 * tokens
    parts = [tag, f" {block_id}"]
    size = len(tag) + len(parts[1])
    z = _mix(block_id & 0xFFFFFFFFFFFFFFFF)
    while size < want:
        z = _mix(z)
        w = " " + _WORDS[z % len(_WORDS)]
        parts.append(w)
        size += len(w)
    return "".join(parts)[:want]


@dataclass(frozen=True)
class Shape:
    """Prompt tokens outside the blocks, as sglang-sim tokenizes the request: `head` before the
    first block (the same for every request, so always reusable), `tail` after the last."""
    api: str
    head: int
    tail: int


# /v1/completions: BOS + the text. Chat with one user message: BOS, <start_header> "user"
# <end_header>, content, <eot> <start_header> "assi" "stan" "t" <end_header>.
SHAPES = {"completions": Shape("completions", 1, 0), "chat": Shape("chat", 4, 6)}
HEAD = ("head",)
TAIL = ("tail",)


def with_shape(blocks: Sequence[Block], shape: Shape) -> list[Block]:
    """The request's token sequence as blocks: the shape's head and tail as pseudo-blocks."""
    out: list[Block] = [(HEAD, shape.head)] if shape.head else []
    out += list(blocks)
    if shape.tail:
        out.append((TAIL, shape.tail))
    return out


def prompt_tokens(blocks: Sequence[Block]) -> int:
    return sum(t for _, t in blocks)


def distinct_block_tokens(seqs: Iterable[Sequence[Block]]) -> int:
    """Tokens of the distinct hash-id blocks (each at its longest), pseudo-blocks left out."""
    size: dict = {}
    for blocks in seqs:
        for key, t in blocks:
            if key is not HEAD and key is not TAIL and t > size.get(key, 0):
                size[key] = t
    return sum(size.values())


# --------------------------------------------------------------------------------------------
# Bounds
# --------------------------------------------------------------------------------------------


class _Node:
    __slots__ = ("children", "tokens", "parent", "key")

    def __init__(self, parent: "_Node | None" = None, key: object = None):
        self.children: dict = {}
        self.tokens = 0  # longest length of this block seen (a partial block may grow later)
        self.parent = parent
        self.key = key


def _match(root: _Node, blocks: Sequence[Block]) -> tuple[int, list[_Node]]:
    """Reusable tokens of `blocks` in the tree and the matched nodes: the longest run of leading
    blocks present, the last one counted up to what is cached; matching goes on past a block only
    when it was cached at this request's length (a cached longer block diverges from a shorter
    request's next tokens). Exact when every id has one length, as in both Mooncake traces."""
    hit, path, node = 0, [], root
    for key, t in blocks:
        child = node.children.get(key)
        if child is None:
            break
        hit += min(t, child.tokens)
        path.append(child)
        if child.tokens != t:
            break
        node = child
    return hit, path


def _insert(root: _Node, blocks: Sequence[Block]) -> list[_Node]:
    """Inserts the blocks (growing a block cached shorter); returns the nodes, root side first."""
    node, path = root, []
    for key, t in blocks:
        child = node.children.get(key)
        if child is None:
            child = node.children[key] = _Node(node, key)
        child.tokens = max(child.tokens, t)
        path.append(child)
        node = child
    return path


def infinite_cache_hits(seqs: Sequence[Sequence[Block]]) -> list[int]:
    """Per request, the tokens one infinite prefix cache holding every earlier prompt would
    serve: the longest prefix of its blocks that an earlier request also started with."""
    root, out = _Node(), []
    for blocks in seqs:
        out.append(_match(root, blocks)[0])
        _insert(root, blocks)
    return out


def routed_cache_hits(seqs: Sequence[Sequence[Block]], workers: Sequence[str | None]) -> list[int]:
    """Per request, the tokens an infinite prefix cache on the worker that served it would serve:
    the longest prefix of its blocks that an earlier request served by the same worker started
    with. Beside `infinite_cache_hits` it separates what a router's choices lose (sending a
    request away from the prefix it shares) from what the workers' finite caches lose (evicting
    a prefix before it is asked again). `workers[i]` None: a failed request (0, not inserted)."""
    roots: dict[str, _Node] = {}
    out = []
    for blocks, w in zip(seqs, workers):
        if w is None:
            out.append(0)
            continue
        root = roots.setdefault(w, _Node())
        out.append(_match(root, blocks)[0])
        _insert(root, blocks)
    return out


def pooled_lru_hits(seqs: Sequence[Sequence[Block]], capacity_tokens: int) -> list[int]:
    """Per request, the tokens one LRU prefix cache of `capacity_tokens` would serve: a request
    matches its longest cached prefix, then its prompt blocks are inserted (outputs are not) and
    touched, and least recently used blocks are evicted, leaves first (a block's prefix is touched
    whenever the block is, so a block is never older than its extensions), until the cache fits.
    A request larger than the capacity keeps only its first blocks."""
    root, out = _Node(), []
    lru: OrderedDict[_Node, int] = OrderedDict()  # node -> its tokens counted in `used`; LRU first
    used = 0
    for blocks in seqs:
        out.append(_match(root, blocks)[0])
        path = _insert(root, blocks)
        for node in reversed(path):  # the request's leaf side first: older than its prefix
            used += node.tokens - lru.pop(node, 0)
            lru[node] = node.tokens
        while used > capacity_tokens and lru:
            victim, tokens = lru.popitem(last=False)
            used -= tokens
            del victim.parent.children[victim.key]
    return out


def held_lru_hits(seqs: Sequence[Sequence[Block]], outs: Sequence[int],
                  spans: Sequence[tuple[float, float] | None], capacity_tokens: int,
                  workers: Sequence[str | None] | None = None) -> list[int]:
    """Per request, the tokens an LRU prefix cache of `capacity_tokens` would serve when, as on a
    worker, each request holds its KV from `spans[i][0]` to `spans[i][1]` (any time unit; None: a
    failed request, 0 and never inserted): at its start it matches its longest cached prefix, its
    prompt blocks and `outs[i]` output tokens (a block of its own) are inserted and locked; at
    its end they are unlocked, most recently used (the output stays cached, as SGLang's
    `cache_finished_req` keeps it), and the least recently used unlocked blocks are evicted,
    leaves first, until the cache fits (locked blocks may overfill it, as running requests do).

    One cache (`workers` None): the pooled-LRU bound of `pooled_lru_hits` with the KV the run's
    running requests held taken out of it while they ran, which no router can give back. Per
    worker (`workers[i]`, each cache fed what it was sent): what the placement's caches deliver
    in the time they were served. With every span of length zero and no outputs it is
    `pooled_lru_hits` / `routed_lru_hits`."""
    groups: dict[object, list[int]] = {}
    for i, span in enumerate(spans):
        w = None if workers is None else workers[i]
        if span is not None and (workers is None or w is not None):
            groups.setdefault(w, []).append(i)
    out = [0] * len(seqs)
    for idx in groups.values():
        _held_lru(seqs, outs, spans, capacity_tokens, idx, out)
    return out


def _held_lru(seqs, outs, spans, capacity_tokens: int, idx: list[int], out: list[int]) -> None:
    """`held_lru_hits` for the requests `idx` through one cache, into `out`."""
    # (time, order, i): at one instant ends free their blocks before starts claim theirs; a
    # request's own end (order 2) always follows its start.
    events = []
    for i in idx:
        start, end = spans[i]
        end = max(end, start)
        events += [(start, 1, i), (end, 0 if end > start else 2, i)]
    events.sort()
    root = _Node()
    counted: dict[_Node, int] = {}  # every cached node -> its tokens counted in `used`
    lru: OrderedDict[_Node, None] = OrderedDict()  # the unlocked ones, LRU first
    locks: dict[_Node, int] = {}
    used = 0
    held: dict[int, list[_Node]] = {}
    for _, order, i in events:
        if order == 1:
            out[i] = _match(root, seqs[i])[0]
            path = _insert(root, seqs[i])
            parent = path[-1] if path else root
            tail = parent.children[("out", i)] = _Node(parent, ("out", i))
            tail.tokens = max(0, outs[i])
            path.append(tail)
            for node in path:
                # a partial block cached shorter may have grown: count its new tokens
                used += node.tokens - counted.get(node, 0)
                counted[node] = node.tokens
                lru.pop(node, None)
                locks[node] = locks.get(node, 0) + 1
            held[i] = path
        else:
            for node in reversed(held.pop(i)):  # leaf side first: older than its prefix
                locks[node] -= 1
                if locks[node] == 0:
                    del locks[node]
                    lru[node] = None
        while used > capacity_tokens and lru:
            victim, _ = lru.popitem(last=False)
            used -= counted.pop(victim)
            if victim.parent is not None and victim.parent.children.get(victim.key) is victim:
                del victim.parent.children[victim.key]


def routed_lru_hits(seqs: Sequence[Sequence[Block]], workers: Sequence[str | None],
                    capacity_tokens: int) -> list[int]:
    """Per request, the tokens an LRU prefix cache of `capacity_tokens` on the worker that served
    it would serve, fed only what that worker was sent (`pooled_lru_hits` per worker). Beside the
    pooled-LRU bound it is what the routing's placement leaves to caches of the workers' size;
    beside the workers' real hit rate, what timing costs them (KV held by running requests,
    prefixes evicted while queued). `workers[i]` None: a failed request (0, not sent)."""
    per: dict[str, list[int]] = {}
    for i, w in enumerate(workers):
        if w is not None:
            per.setdefault(w, []).append(i)
    out = [0] * len(seqs)
    for idx in per.values():
        for i, hit in zip(idx, pooled_lru_hits([seqs[i] for i in idx], capacity_tokens)):
            out[i] = hit
    return out


# --------------------------------------------------------------------------------------------
# Holder follow
# --------------------------------------------------------------------------------------------


@dataclass
class HolderFollow:
    """Requests whose prefix beyond `min_shared - 1` blocks was served before (`eligible`: an
    earlier served request shares at least `min_shared` leading hash ids) and, of those, how many
    went to the worker of the earliest / the latest earlier request sharing the longest prefix, or
    to any worker that served a request sharing it. `followed_latest[i]` per eligible request."""
    requests: int
    served: int
    eligible: list[int]
    followed_latest: list[bool]
    followed_earliest: list[bool]
    followed_any: list[bool]

    def rate(self, which: str) -> float:
        xs = getattr(self, "followed_" + which)
        return sum(xs) / len(xs) if xs else 0.0


class _HNode:
    __slots__ = ("children", "first", "last", "workers")

    def __init__(self):
        self.children: dict = {}
        self.first: str | None = None  # worker of the earliest served request through this node
        self.last: str | None = None
        self.workers: set[str] = set()


def holder_follow(hash_seqs: Sequence[Sequence[int]], workers: Sequence[str | None],
                  min_shared: int = 2) -> HolderFollow:
    """`hash_seqs[i]`: request i's hash ids (arrival order); `workers[i]`: the worker that served
    it, None when it failed (a failed request is neither eligible nor a holder)."""
    root = _HNode()
    eligible, latest, earliest, any_ = [], [], [], []
    for i, (ids, w) in enumerate(zip(hash_seqs, workers)):
        node, best, depth = root, None, 0
        for h in ids:
            node = node.children.get(h)
            if node is None or not node.workers:
                break
            depth += 1
            if depth >= min_shared:
                best = node
        if best is not None and w is not None:
            eligible.append(i)
            latest.append(w == best.last)
            earliest.append(w == best.first)
            any_.append(w in best.workers)
        if w is None:
            continue
        node = root
        for h in ids:
            node = node.children.setdefault(h, _HNode())
            if node.first is None:
                node.first = w
            node.last = w
            node.workers.add(w)
    return HolderFollow(len(hash_seqs), sum(1 for w in workers if w is not None), eligible, latest, earliest,
                        any_)


# --------------------------------------------------------------------------------------------
# Replay plan (what load/trace.js reads)
# --------------------------------------------------------------------------------------------


def replay_plan(reqs: Sequence[TraceRequest], block_tokens: int, speed: float) -> dict:
    """The k6 replay's input: per request its send offset (ms after the first request, divided by
    `speed`), its blocks as (index into `texts`, tokens), its output tokens and its pin key (its
    second hash id, or its only one: what keeps a conversation on one router replica with --pin,
    as the first block is a prompt all conversations share); `texts`: each distinct id's
    full-length block text, once."""
    index: dict[int, int] = {}
    texts: list[str] = []
    requests = []
    t0 = reqs[0].timestamp_ms if reqs else 0.0
    for r in reqs:
        blocks, out = scale(r, block_tokens)
        bs = []
        for h, t in blocks:
            if h not in index:
                index[h] = len(texts)
                texts.append(block_text(h, block_tokens))
            bs.append([index[h], t])
        key = r.hash_ids[1] if len(r.hash_ids) > 1 else r.hash_ids[0]
        requests.append({"t": round((r.timestamp_ms - t0) / speed, 3), "b": bs, "o": out, "k": f"h{key}"})
    return {"block_tokens": block_tokens, "speed": speed, "requests": requests, "texts": texts}


def plan_sends(plan: dict, api: str, model: str) -> list:
    """The replay plan as prkit.replay sends: per request the streaming `/v1/completions` body
    with the text prompt (api `completions`) or `/v1/chat/completions` with one user message
    (`chat`), exactly `o` output tokens (ignore_eos), the usage chunk asked for; the same bodies
    load/trace.js sends. Built before the replay, so building them is not lateness."""
    from .replay import Send

    if api not in SHAPES:
        raise ValueError(f"api must be one of {sorted(SHAPES)}, not {api!r}")
    texts = plan["texts"]
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    out = []
    for r in plan["requests"]:
        text = "".join(texts[k][:4 * t] for k, t in r["b"])
        body: dict = {"model": model}
        if api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        body.update(max_tokens=r["o"], ignore_eos=True, stream=True, stream_options={"include_usage": True})
        out.append(Send(r["t"], path, json.dumps(body, separators=(",", ":")).encode(), model, r.get("k")))
    return out
