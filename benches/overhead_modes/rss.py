"""The RSS mode (`benches/overhead --rss N`): Envoy's memory after indexing N distinct prefixes."""

from __future__ import annotations

import time
from pathlib import Path

from .common import start_proxy, wrk


WRK_DISTINCT_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, "/v1/completions", nil,
    '{{"model":"llama","prompt":"' .. n .. ' {pad}"}}')
end
"""


def run_rss(args, tmp: Path, upstream: int):
    p, url = start_proxy("prefix_router", tmp, upstream)
    try:
        base = p.rss_kib()
        lua = tmp / "distinct.lua"
        lua.write_text(WRK_DISTINCT_LUA.format(pad="x" * 200))
        done, t0 = 0, time.time()
        while done < args.rss:
            before = done
            r = wrk(url.replace("/v1/chat/completions", "/v1/completions"), lua, 16, 10)
            done += int(r["rps"] * 10)
            print(f"  ~{done} distinct prefixes indexed, RSS {p.rss_kib() / 1024:.1f} MiB "
                  f"({r['rps']:.0f} rps)", flush=True)
            if done == before:
                break
        rss = p.rss_kib()
        print(f"\nEnvoy + prefix-router RSS: {base / 1024:.1f} MiB at start, {rss / 1024:.1f} MiB after "
              f"~{done} distinct prefixes ({time.time() - t0:.0f} s), index capacity 262144 entries (default)")
    finally:
        p.stop()
