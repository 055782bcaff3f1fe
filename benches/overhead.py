"""End-to-end proxy overhead: the same static upstream (nginx answering 200 with a small JSON)
behind (i) Envoy with a plain cluster route, (ii) Envoy + the native buffer filter, (iii) Envoy +
prefix-router, (iv) smg 1.13 --policy cache_aware, (v) Envoy + benches/wasm-floor (a proxy-wasm
filter that only reads the body and sets the cluster header: the floor for any such filter), (vi) Envoy
+ benches/dm-floor (the same floor as a native Envoy dynamic module: the floor without the Wasm VM),
(vii) Envoy + prefix-router built as a dynamic module (filter/src/dynamic_module.rs: the same core
and config). The proxy is pinned to core 0 (taskset), wrk
and nginx to core 1. Bodies: OpenAI chat JSON of 1/4/16/64 KB (one fixed body per run: in (iii)
every request after the first is a prefix hit, the steady state).

  benches/overhead                 # the table (rps at -c16, p50/p99 at -c1) and the ratios
  benches/overhead --sizes 4       # only the 4 KB prompt
  benches/overhead --rss 1000000   # Envoy RSS after indexing N distinct prefixes (default capacity)
  benches/overhead --stream        # streamed responses: Envoy CPU per response (see run_stream)
  benches/overhead --stream --tokens 256 1024 --secs 6 --rounds 5   # more rounds: medians, paired ratios
  benches/overhead --callgrind --sizes 4 --rounds 2                  # Envoy instructions per request
  benches/overhead --callgrind --sizes 4 --rounds 1 --sglang-answers # ... polls answered as SGLang does
  benches/overhead --callgrind --stream --streams 4 --step-ms 10 --tokens 256 1024 --rounds 2
  benches/overhead --callgrind --stream --idle 5 --rounds 0   # per-second cost without traffic
  benches/overhead --callgrind --stream --idle 30 --rounds 0 \
      --kinds prefix_router_pool64 prefix_router_pool64_nomembership   # the pool membership refresh

--callgrind runs every Envoy under valgrind's callgrind and reports the instructions Envoy executed
(all its threads) per request or streamed response instead of CPU time: a count that does not move
with the machine's load, so ratios of a few percent are resolved where CPU time spreads by ±20%.
Instructions are not time (cache misses and IPC differ), and under valgrind Envoy runs ~30x
slower, so the table mode sends `--requests` requests one after another instead of wrk's load,
and the stream mode wants few streams and a slow decode step so that Envoy under valgrind keeps up
(the chunks-per-response column shows whether SSE events coalesced). smg is not Envoy: not counted.

One module per mode in benches/overhead_modes/: table (wrk), count (--callgrind table), rss, stream
(--stream, --idle); common holds the proxies, their configs, wrk and the meters.

Pool kinds (idle only: --stream --idle S --rounds 0, S under 60): prefix_router_pool64 is the
filter with one pool model of 64 hosts (a file-based EDS file; nothing listens at those
addresses), reading the pool's membership from the admin's /clusters every second;
prefix_router_pool64_nomembership the same with --membership-ms 0. Their difference is what the
membership refresh costs. Load polls every 60 s (the filter reads membership only while load polls
are on), and each idle window starts right after a poll round; the window's membership reads and
polls are printed. --no-worker-address drops the static workers' `address` from the plugin
config (the config of envoy/gen before pools; what a filter build from before them accepts).

Installs what it needs (only for the proxies in --kinds): nginx and wrk with apt-get when missing, smg==1.13.0 into .venv-smg.
Envoy is .venv/bin/envoy (scripts/setup); the filter is target/wasm32-wasip1/release/prefix_router.wasm
(built here when missing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from prkit.ports import free_port
from prkit.wait import wait_http

from benches.overhead_modes import common
from benches.overhead_modes.common import KINDS, LOAD_CPU, OPTIONAL, POOL_KINDS, Proc, ensure_tools, nginx_conf, workdir
from benches.overhead_modes.count import run_count_table
from benches.overhead_modes.rss import run_rss
from benches.overhead_modes.stream import STREAM_KINDS, run_stream
from benches.overhead_modes.table import run_table


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="prompt sizes in KB")
    ap.add_argument("--secs", type=int, default=5, help="seconds per wrk run")
    ap.add_argument("--conns", type=int, default=16, help="connections for the throughput run")
    ap.add_argument("--rss", type=int, default=0, metavar="N", help="RSS mode: index N distinct prefixes")
    ap.add_argument("--kinds", nargs="+", default=[k for k, _ in KINDS if k not in OPTIONAL], help="which proxies")
    ap.add_argument("--json", help="also write raw results here")
    ap.add_argument("--stream", action="store_true", help="streamed responses: Envoy CPU per response")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 1024], help="--stream: tokens per response")
    ap.add_argument("--step-ms", type=float, default=2.0, help="--stream: the workers' decode step")
    ap.add_argument("--streams", type=int, default=16, help="--stream: concurrent streaming clients")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (every kind measured once per round)")
    ap.add_argument("--callgrind", action="store_true",
                    help="count Envoy's instructions under valgrind's callgrind instead of its CPU time")
    ap.add_argument("--requests", type=int, default=400, help="--callgrind table: requests per measurement")
    ap.add_argument("--idle", type=float, default=0, metavar="SECS",
                    help="--stream: first measure each proxy for SECS seconds without traffic (timers, load polls)")
    ap.add_argument("--no-worker-address", action="store_true",
                    help="static workers without `address` in the plugin config (as envoy/gen wrote it before pools)")
    ap.add_argument("--sglang-answers", action="store_true",
                    help="the upstream answers /v1/loads and /metrics as SGLang does (benches/sglang_answers/), "
                         "so load polls and counter reads succeed; otherwise it answers them with the chat completion")
    ap.add_argument("--keep", metavar="DIR",
                    help="work in DIR and keep it: Envoy configs and logs, callgrind dumps for callgrind_annotate")
    args = ap.parse_args()
    if (os.cpu_count() or 1) < 2:
        sys.exit("needs 2 cores (proxy on core 0, load on core 1)")
    if args.stream and args.kinds == [k for k, _ in KINDS if k not in OPTIONAL]:
        args.kinds = [k for k, _ in STREAM_KINDS if k not in OPTIONAL]
    pools = [k for k in args.kinds if k in POOL_KINDS]
    if pools and not (args.stream and args.idle and args.rounds == 0):
        sys.exit(f"{', '.join(pools)}: idle only (--stream --idle SECS --rounds 0): nothing listens at the pool's hosts")
    common.WORKER_ADDRESS = not args.no_worker_address
    ensure_tools(args.kinds, sim=args.stream)
    if args.callgrind:
        if not shutil.which("valgrind"):
            sys.exit("--callgrind needs valgrind (apt-get install valgrind)")
        args.kinds = [k for k in args.kinds if k != "smg"]  # not Envoy: nothing to count
    if args.stream:
        with workdir(args.keep, "pr-stream-") as tmp:
            run_stream(args, tmp)
        return
    with workdir(args.keep, "pr-overhead-") as tmp:
        (tmp / "nginx-body").mkdir(exist_ok=True)
        up = free_port()
        nginx = Proc(["/usr/sbin/nginx", "-c", str(nginx_conf(up, tmp, args.sglang_answers)), "-p", str(tmp)], LOAD_CPU, tmp / "nginx.log")
        try:
            wait_http(f"http://127.0.0.1:{up}/health", 20)
            if args.rss:
                run_rss(args, tmp, up)
            elif args.callgrind:
                run_count_table(args, tmp, up)
            else:
                run_table(args, tmp, up)
        finally:
            nginx.stop()


if __name__ == "__main__":
    main()
