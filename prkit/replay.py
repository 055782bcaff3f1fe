"""Open-loop replay client: sends planned requests at planned times, whether or not earlier ones
have finished, and measures each one's lateness, time to first token and end-to-end time.

Why not k6: on a 2-core machine shared with Envoy and the simulated fleet, k6's per-VU JavaScript
runtimes sent trace requests seconds after their time at ~100 requests/s (issue 35). This client
is one asyncio loop over raw HTTP/1.1 keep-alive connections: a request costs a few parses of a
header block and of chunk-size lines, no JSON decoding of the stream, so the loop stays free to
send on time.

Model:
* `Send`: one request: its send time (ms after the replay starts), path, JSON body (bytes, built
  by the caller before the replay), the `x-model` header, a pin key.
* `replay()`: the scheduler walks the sends in order, sleeps until each one's time
  (`lead_ms` after the start) and starts it as its own task. Lateness = the moment its bytes are
  written (a keep-alive connection taken or a new one opened) minus its planned time: what the
  server sees, client delays included. `Result.lateness` reports it; a replay that keeps up has
  p99 lateness of a few ms.
* Time to first token = from the write to the first body bytes of the response (the first SSE
  frame; a router that sends headers before the first token gets no credit for it); end-to-end =
  to the last byte. A request is good when the status is 200 and the stream ends with
  `data: [DONE]`. Output tokens are read from the usage chunk when present.
* Targets: each request goes to a seeded random target, or with `pin` to the target its key
  hashes to (FNV-1a, as load/lib.js). Connections are per target, reused after a complete
  response; a reused connection that the server had closed is retried once on a new one.

Costs: per request one header parse and one regex over the last 512 bytes of the body.
Invariants: every send gets a record (status 0 and `err` on a transport error or timeout);
records are returned in send order.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Send:
    t_ms: float  # planned send time, ms after the replay's start (before `lead_ms`)
    path: str
    body: bytes
    model: str = ""
    key: str | None = None  # pin key (a conversation id)


@dataclass
class Record:
    i: int
    target: str
    status: int = 0
    worker: str | None = None  # x-worker-id
    decision: str | None = None  # x-prefix-router-decision
    late_ms: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    out_tokens: int = 0
    #: Prompt tokens the worker reported cached (`usage.prompt_tokens_details.cached_tokens`); None: not reported.
    cached_tokens: int | None = None
    sent_unix_ms: float = 0.0
    done_unix_ms: float = 0.0
    err: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.err is None

    def as_trace_record(self) -> dict:
        """The shape load/trace.js prints (`TRACE {...}`), plus send / end times (Unix ms)."""
        return {"i": self.i, "w": self.worker, "d": self.decision, "s": self.status if self.err is None else 0,
                "late": self.late_ms, "ttft": self.ttft_ms, "e2e": self.e2e_ms,
                "t0": self.sent_unix_ms, "t1": self.done_unix_ms, "err": self.err, "c": self.cached_tokens}


@dataclass
class Result:
    records: list[Record]
    wall_s: float
    targets: list[str]
    per_target: list[int] = field(default_factory=list)

    @property
    def lateness(self) -> dict:
        return trend([r.late_ms for r in self.records])

    def summary(self) -> dict:
        """k6-summary-shaped numbers (load/lib.js `summarize`): requests, errors, rates, TTFT /
        E2E / TPOT trends over the good requests, plus the replay's own lateness."""
        good = [r for r in self.records if r.ok]
        out = sum(r.out_tokens for r in good)
        tpot = [(r.e2e_ms - r.ttft_ms) / (r.out_tokens - 1) for r in good
                if r.out_tokens > 1 and r.e2e_ms is not None and r.ttft_ms is not None]
        return {
            "requests": len(self.records),
            "rps": len(self.records) / self.wall_s if self.wall_s > 0 else 0.0,
            "errors": len(self.records) - len(good),
            "out_tokens": out,
            "out_tokens_per_s": out / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_ms": trend([r.ttft_ms for r in good if r.ttft_ms is not None]),
            "e2e_ms": trend([r.e2e_ms for r in good if r.e2e_ms is not None]),
            "tpot_ms": trend(tpot),
            "lateness_ms": self.lateness,
            "duration_s": self.wall_s,
            "targets": len(self.targets),
            "per_target": self.per_target,
        }


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0 for no samples."""
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[max(0, math.ceil(q / 100 * len(ys)) - 1)]


def trend(xs: list[float]) -> dict:
    """k6's trend stats (avg, min, med, p(90), p(99), max) of `xs`; {} for none."""
    if not xs:
        return {}
    return {"avg": sum(xs) / len(xs), "min": min(xs), "med": percentile(xs, 50), "p(90)": percentile(xs, 90),
            "p(99)": percentile(xs, 99), "max": max(xs)}


def fnv1a(s: str) -> int:
    """32-bit FNV-1a over the UTF-16 code units' low bytes, as load/lib.js `fnv1a`."""
    h = 0x811C9DC5
    for ch in s:
        h ^= ord(ch) & 0xFFFF
        h = (h * 0x01000193) & 0xFFFFFFFF
    return h


_USAGE_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_CACHED_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


class _Conns:
    """Idle keep-alive connections to one target."""

    def __init__(self, url: str):
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.hostport = f"{self.host}:{self.port}".encode()
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def get(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        while self.idle:
            r, w = self.idle.pop()
            if not w.is_closing() and not r.at_eof():
                return r, w, True
            w.close()
        r, w = await asyncio.open_connection(self.host, self.port)
        return r, w, False

    def put(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.idle.append((r, w))

    def close(self) -> None:
        for _, w in self.idle:
            w.close()
        self.idle.clear()


class _Stale(Exception):
    """A reused connection was closed by the server before any byte of the response."""


async def _exchange(conns: _Conns, s: Send, rec: Record, due: float, loop) -> None:
    for attempt in range(2):
        r, w, reused = await conns.get()
        head = (b"POST " + s.path.encode() + b" HTTP/1.1\r\nHost: " + conns.hostport
                + b"\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nx-model: "
                + s.model.encode() + b"\r\nContent-Length: " + str(len(s.body)).encode() + b"\r\n\r\n")
        if attempt == 0:
            sent = loop.time()
            rec.late_ms = max(0.0, (sent - due) * 1000)
            rec.sent_unix_ms = time.time() * 1000
        w.write(head + s.body)
        try:
            await w.drain()
            keep = await _read_response(r, rec, sent, loop, reused)
        except _Stale:
            w.close()
            continue
        except BaseException:
            w.close()
            raise
        if keep:
            conns.put(r, w)
        else:
            w.close()
        return
    raise ConnectionError("connection closed before the response, twice")


async def _read_response(r: asyncio.StreamReader, rec: Record, sent: float, loop, reused: bool) -> bool:
    """Reads one response into `rec`; returns whether the connection can be reused."""
    try:
        head = await r.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionResetError) as e:
        if reused and not getattr(e, "partial", b""):
            raise _Stale() from None
        raise
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    rec.status = int(parts[1])
    version = parts[0]
    headers: dict[bytes, bytes] = {}
    for ln in lines[1:]:
        k, sep, v = ln.partition(b":")
        if sep:
            headers[k.strip().lower()] = v.strip()
    if b"x-worker-id" in headers:
        rec.worker = headers[b"x-worker-id"].decode("latin-1")
    if b"x-prefix-router-decision" in headers:
        rec.decision = headers[b"x-prefix-router-decision"].decode("latin-1")
    tail = b""
    first = True

    def got(data: bytes) -> None:
        nonlocal tail, first
        if first and data:
            rec.ttft_ms = (loop.time() - sent) * 1000
            first = False
        tail = (tail + data)[-512:]

    keep = version == b"HTTP/1.1" and headers.get(b"connection", b"").lower() != b"close"
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size_line = await r.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (await r.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                break
            got((await r.readexactly(size + 2))[:-2])
    elif b"content-length" in headers:
        n = int(headers[b"content-length"])
        while n > 0:
            data = await r.read(min(n, 65536))
            if not data:
                raise asyncio.IncompleteReadError(b"", n)
            got(data)
            n -= len(data)
    else:
        keep = False
        while data := await r.read(65536):
            got(data)
    rec.e2e_ms = (loop.time() - sent) * 1000
    rec.done_unix_ms = time.time() * 1000
    if rec.status == 200 and b"data: [DONE]" not in tail:
        rec.err = "stream did not end with data: [DONE]"
    m = None
    for m in _USAGE_RE.finditer(tail):
        pass
    if m is not None:
        rec.out_tokens = int(m.group(1))
    m = None
    for m in _CACHED_RE.finditer(tail):
        pass
    if m is not None:
        rec.cached_tokens = int(m.group(1))
    return keep


async def replay(sends: list[Send], targets: list[str], pin: bool = False, seed: int = 1,
                 lead_ms: float = 500.0, timeout_s: float = 600.0) -> Result:
    """Sends every request of `sends` (ordered by `t_ms`) at its time to one of `targets` (base
    URLs); returns one record per send, in order."""
    if not targets:
        raise ValueError("replay: no targets")
    loop = asyncio.get_running_loop()
    pools = [_Conns(t) for t in targets]
    rng = random.Random(seed * 7777)
    records: list[Record] = []
    tasks: list[asyncio.Task] = []

    async def one(s: Send, rec: Record, pool: _Conns, due: float) -> None:
        try:
            await asyncio.wait_for(_exchange(pool, s, rec, due, loop), timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError, IndexError) as e:
            rec.err = f"{type(e).__name__}: {e}"[:200]
            rec.done_unix_ms = time.time() * 1000

    start = loop.time() + lead_ms / 1000
    t_wall = time.monotonic()
    per_target = [0] * len(targets)
    for i, s in enumerate(sends):
        if len(targets) == 1:
            k = 0
        elif pin and s.key is not None:
            k = fnv1a(s.key) % len(targets)
        else:
            k = rng.randrange(len(targets))
        per_target[k] += 1
        rec = Record(i=i, target=targets[k])
        records.append(rec)
        due = start + s.t_ms / 1000
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(one(s, rec, pools[k], due)))
    if tasks:
        await asyncio.gather(*tasks)
    wall = time.monotonic() - t_wall - lead_ms / 1000
    for p in pools:
        p.close()
    return Result(records, max(wall, 1e-9), list(targets), per_target)


def run(sends: list[Send], targets: list[str], **kw) -> Result:
    """`replay()` on a fresh event loop (blocking)."""
    return asyncio.run(replay(sends, targets, **kw))
