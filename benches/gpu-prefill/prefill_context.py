#!/usr/bin/env python3
"""Prefill time against cached context on the GPU at hand: the shape policy/cost.rs assumes.

Runs a decoder with a Llama-3.1-8B shape (32 layers, hidden 4096, 32 query / 8 KV heads,
SwiGLU 14336, bf16, random weights, one layer's weights reused by every layer: the arithmetic
and memory traffic are the same) through PyTorch's fused attention, for one request of `n` new
tokens attending to `c` cached tokens (a lower-right causal mask over a KV buffer of c + n).
Prints one JSON line per cell and a fit of t(n, c) = n * (a + b * (c + n/2) / 1000); the router's
cost (filter/src/policy/cost.rs) uses w(n, c) = n * (1 + (c + max(0, n - C)/2) / K) with
K = 1000 * a / b and C the prefill chunk. `--new 8192` with several contexts times the chunks
of one long prompt as SGLang's chunked prefill computes them (docs/gpu-cost.md).

Needs a CUDA GPU and PyTorch >= 2.5; prints why and exits 0 otherwise.
Usage: python3 benches/gpu-prefill/prefill_context.py [--shape 8b|32b] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["8b", "32b"], default="8b",
                    help="8b: Llama-3.1-8B (32 layers, 4096, 32/8 heads, 14336); "
                    "32b: Qwen2.5-32B (64 layers, 5120, 40/8 heads, 27648)")
    ap.add_argument("--layers", type=int, default=0, help="override the shape's layer count")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new", default="512,2048,8192")
    ap.add_argument("--context", default="0,4096,16384,32768")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right
    except Exception as e:  # noqa: BLE001 - report and leave
        print(json.dumps({"skipped": f"no usable torch: {e}"}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    dev, dt = "cuda", torch.bfloat16
    layers, hidden, heads, kv_heads, hd, ffn = {
        "8b": (32, 4096, 32, 8, 128, 14336), "32b": (64, 5120, 40, 8, 128, 27648)}[args.shape]
    layers = args.layers or layers
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g) * 0.02

    wq, wk, wv, wo = w(hidden, hidden), w(hidden, kv_heads * hd), w(hidden, kv_heads * hd), w(hidden, hidden)
    wg, wu, wd = w(hidden, ffn), w(hidden, ffn), w(ffn, hidden)
    news = [int(x) for x in args.new.split(",")]
    ctxs = [int(x) for x in args.context.split(",")]
    kbuf = w(1, kv_heads, max(ctxs) + max(news), hd)
    vbuf = w(1, kv_heads, max(ctxs) + max(news), hd)

    def rms(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)

    @torch.inference_mode()
    def prefill(n: int, c: int) -> None:
        x = w(n, hidden)
        mask = causal_lower_right(n, c + n)
        k_all, v_all = kbuf[:, :, : c + n], vbuf[:, :, : c + n]
        for _ in range(layers):
            h = rms(x)
            q = (h @ wq).view(n, heads, hd).transpose(0, 1).unsqueeze(0)
            k_all[0, :, c:] = (h @ wk).view(n, kv_heads, hd).transpose(0, 1)
            v_all[0, :, c:] = (h @ wv).view(n, kv_heads, hd).transpose(0, 1)
            a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
            x = x + a.squeeze(0).transpose(0, 1).reshape(n, hidden) @ wo
            h = rms(x)
            x = x + (F.silu(h @ wg) * (h @ wu)) @ wd

    rows = []
    for n in news:
        for c in ctxs:
            prefill(n, c)
            times = []
            for _ in range(args.reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                prefill(n, c)
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            ms = statistics.median(times)
            row = {"new": n, "context": c, "ms": round(ms, 2), "tok_per_s": round(n / ms * 1000)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    # Least squares of t/n = a + b * (c + n/2)/1000 (us per token).
    xs = [(r["context"] + r["new"] / 2) / 1000 for r in rows]
    ys = [r["ms"] * 1000 / r["new"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    print(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape, "torch": torch.__version__,
                      "us_per_token": round(a, 2), "us_per_token_per_1k_context": round(b, 3),
                      "K_tokens": round(1000 * a / b) if b > 0 else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
