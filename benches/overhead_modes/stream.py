"""The stream mode (`benches/overhead --stream`, with `--idle`): Envoy's CPU (or instructions)
per streamed response and per idle second."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from prkit.ports import free_port
from prkit.wait import wait_http, wait_until

from .common import LOAD_CPU, POOL_HOSTS, POOL_KINDS, Proc, SIM, WORKERS, all_proxies, meter, rotated


STREAM_KINDS = [("envoy", "plain Envoy (router only)"), ("wasm_floor_sdk", "+ floor on the SDK (all exports)"),
                ("wasm_floor", "+ floor, lean exports"), ("dm_floor", "+ floor, dynamic module"),
                ("prefix_router", "+ prefix-router"), ("prefix_router_dm", "+ prefix-router, dynamic module"),
                ("prefix_router_nopoll", "+ prefix-router, no load polls"),
                ("prefix_router_dm_nopoll", "+ prefix-router, dynamic module, no load polls"),
                ("prefix_router_pool64", f"+ prefix-router, pool of {POOL_HOSTS}, membership 1 s"),
                ("prefix_router_pool64_nomembership", f"+ prefix-router, pool of {POOL_HOSTS}, membership off")]


POLLS = "prefix_router\\.load_poll\\.(answers|failures)"


def filter_stats(proc: Proc, prefix: str) -> dict:
    """The Envoy's counters whose names contain `prefix` (admin /stats), by name."""
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.admin}/stats?filter={prefix}", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, v = line.rpartition(": ")
        if v.isdigit():
            out[name] = int(v)
    return out


async def _stream_client(host: str, port: int, body: bytes, n: int) -> int:
    """n streamed requests one after another on one keep-alive connection; returns the number
    of chunks read. Raises on anything but a complete 200 chunked response."""
    import asyncio
    r, w = await asyncio.open_connection(host, port)
    req = (f"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
           f"content-length: {len(body)}\r\n\r\n").encode() + body
    chunks = 0
    try:
        for _ in range(n):
            w.write(req)
            status = await r.readline()
            if b" 200 " not in status:
                raise RuntimeError(f"bad status {status!r}")
            chunked = False
            while (line := await r.readline()) not in (b"\r\n", b""):
                chunked |= line.lower().startswith(b"transfer-encoding: chunked")
            if not chunked:
                raise RuntimeError("response is not chunked (not streamed)")
            while True:
                size = int((await r.readline()).split(b";")[0], 16)
                await r.readexactly(size + 2)
                if size == 0:
                    break
                chunks += 1
    finally:
        w.close()
    return chunks


def stream_round(url: str, body: bytes, streams: int, per_stream: int) -> int:
    import asyncio
    from urllib.parse import urlparse
    u = urlparse(url)

    async def go():
        return await asyncio.gather(*(_stream_client(u.hostname, u.port, body, per_stream) for _ in range(streams)))

    return sum(asyncio.run(go()))


def run_stream(args, tmp: Path):
    """Streamed responses: 4 sglang-sim workers (fixed decode step, one SSE chunk per token) on
    the load core; `--streams` clients each run a fixed number of streamed /v1/completions
    requests (max_tokens = N, ignore_eos) through the proxy on its own core; the figure is
    Envoy's CPU seconds (utime + stime from /proc) over the measured requests divided by their
    number, so requests still in flight never blur it."""
    sims, ports = [], []
    try:
        for i in range(WORKERS):
            port = free_port()
            sims.append(Proc([str(SIM), "--port", str(port), "--model", "llama", "--decode-base-ms",
                              str(args.step_ms), "--decode-batch-factor", "0", "--prefill-overhead-ms", "0",
                              "--context-length", "65536"], LOAD_CPU, tmp / f"sim{i}.log"))
            ports.append(port)
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health", 30)
        kinds = [k for k, _ in STREAM_KINDS if k in args.kinds]
        labels = dict(STREAM_KINDS)
        # Idle proxies cost nothing measured (the figure is the measured Envoy's own CPU); the
        # table gives medians over rounds and the median of each round's ratio to plain Envoy
        # measured in that same round.
        runs: dict = {}
        unit, scale = ("instructions", 1) if args.callgrind else ("us", 1e6)
        with all_proxies(kinds, tmp, ports, args.callgrind) as proxies:
            meters = {k: meter(p, k, tmp, args.callgrind) for k, (p, _) in proxies.items()}
            idle = {}
            for k in kinds if args.idle else []:
                # No traffic: what the proxy spends per second on timers and load polls.
                start, stop = meters[k]
                if POOL_KINDS.get(k):
                    # The window starts right after a load-poll round (one poll per host, every
                    # 60 s), so it holds none: the stream mode prints the polls it held.
                    def polls(p=proxies[k][0]):
                        return sum(filter_stats(p, POLLS).values())
                    before_round = polls()
                    wait_until(lambda: polls() >= before_round + POOL_HOSTS, f"{k}: a load-poll round", 300, 0.2)
                before = filter_stats(proxies[k][0], "prefix_router\\.(membership|load_poll)") if k in POOL_KINDS else {}
                start()
                time.sleep(args.idle)
                idle[k] = stop() * scale / args.idle
                print(f"idle {labels[k]:36s} Envoy {idle[k]:12,.0f} {unit}/s", flush=True)
                if k in POOL_KINDS:  # the reads the window held (and that the pool was whole)
                    after = filter_stats(proxies[k][0], "prefix_router\\.(membership|load_poll)")
                    delta = {n.split("prefix_router.", 1)[-1]: v - before.get(n, 0) for n, v in after.items()
                             if "age_ms" not in n}
                    print(f"  membership during the window: {delta}; pool of {POOL_HOSTS} hosts", flush=True)
            for r in range(args.rounds):
                for n in args.tokens:
                    body = json.dumps({"model": "llama", "prompt": "Stream me the answer, token by token. " * 8,
                                       "max_tokens": n, "ignore_eos": True, "stream": True}).encode()
                    per = max(2, round(args.secs * 1000 / (n * args.step_ms)))
                    for k in rotated(kinds, r):
                        p, url = proxies[k]
                        stream_round(url, body, args.streams, 1)  # warm-up
                        start, stop = meters[k]
                        start()
                        t0 = time.time()
                        chunks = stream_round(url, body, args.streams, per)
                        wall = time.time() - t0
                        cpu = stop() * scale
                        done = args.streams * per
                        runs.setdefault((k, n), []).append((cpu / done, cpu / chunks, chunks / done))
                        print(f"round {r + 1} {labels[k]:36s} {n:5d} tokens  {done:5d} responses "
                              f"({chunks / done:.0f} chunks each) in {wall:5.1f} s  Envoy "
                              f"{cpu / done:10,.0f} {unit}/response", flush=True)
        med = statistics.median
        results = {key: med(v[0] for v in vs) for key, vs in runs.items()}
        per_chunk = {key: (med(v[1] for v in vs), med(v[2] for v in vs)) for key, vs in runs.items()}
        if runs:
            print()
            print(f"Medians over {args.rounds} round(s); (x) = median of each round's ratio to plain Envoy "
                  "in the same round, [min-max] of those ratios:")
            print("| response | " + " | ".join(labels[k] for k in kinds) + " |")
            print("|---|" + "---|" * len(kinds))
            for n in args.tokens:
                base = runs.get(("envoy", n))
                cells = []
                for k in kinds:
                    v = results[(k, n)]
                    if k == "envoy" or not base:
                        cells.append(f"{v:,.0f} {unit}")
                        continue
                    ratios = [a[0] / b[0] for a, b in zip(runs[(k, n)], base)]
                    cells.append(f"{v:,.0f} {unit} ({med(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}])")
                print(f"| {n} tokens | " + " | ".join(cells) + " |")
            print()
            print(f"Envoy {unit} per HTTP chunk the client read (chunks per response: SSE events coalesce when a "
                  "proxy or worker falls behind, which changes the work per response):")
            print("| response | " + " | ".join(labels[k] for k in kinds) + " |")
            print("|---|" + "---|" * len(kinds))
            for n in args.tokens:
                print(f"| {n} tokens | " + " | ".join(f"{per_chunk[(k, n)][0]:,.1f} {unit} ({per_chunk[(k, n)][1]:.0f} chunks)"
                                                      for k in kinds) + " |")
        if idle:
            print()
            print(f"Idle (no traffic, {args.idle} s): Envoy {unit} per second")
            print("| " + " | ".join(labels[k] for k in kinds) + " |")
            print("|" + "---|" * len(kinds))
            print("| " + " | ".join(f"{idle[k]:,.0f}" for k in kinds) + " |")
        if args.json:
            Path(args.json).write_text(json.dumps({f"{k}/{n}": vs for (k, n), vs in runs.items()}, indent=1))
    finally:
        for s in sims:
            s.stop()
