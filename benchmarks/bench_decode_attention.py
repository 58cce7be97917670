"""Decode attention of one layer: ``replay_compile::decode_attention`` against what a compiled transformers model
runs and against PyTorch's own grouped-query SDPA, with the bytes floor beside it.

    python benchmarks/bench_decode_attention.py [--batches 1,32,256] [--contexts 1040:1024,8200:8192]
        [--tokens 1,4] [--configs] [--out DIR]

Per geometry (Nemotron-Nano-4B: 32 query heads over 8 key/value heads of 128; Qwen3.5-4B: 16 over 4 of 256), batch,
context and window, bf16; ``--contexts`` lists ``static:filled`` pairs: a static cache of ``static`` positions of
which the first ``filled`` hold tokens (the mask). With ``T > 1`` tokens (a speculative verify window) the window
sits right after the filled positions, each token seeing those and the window's tokens up to itself.

* ``repeat_kv``: transformers' compiled path, ``repeat_kv`` then SDPA with the mask, under ``torch.compile``
  (Inductor materialises the expanded heads, SDPA reads every static position);
* ``gqa``: SDPA with ``enable_gqa=True`` and the mask (no expanded copy; PyTorch picks its kernel; it reads every
  static position);
* ``ours``: the op (split-K Triton kernel, only the kept positions read).

Times are medians of CUDA-graph replays of 20 calls (no host overhead; at batch 1 the cache stays in L2 between
calls, so small batches measure latency, not bandwidth). ``floor``: the kept keys and values read once at a
device-to-device copy's bandwidth. Each variant's output is checked against the float64 reference first.
``--configs`` also times every launch configuration of the kernel in a grid (tile width, warps, pipeline stages,
splits) and prints the best per point beside the shipped one.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os

import torch

GEOMS = {"nano4b": (32, 8, 128), "qwen35_4b": (16, 4, 256)}


def window_mask(b: int, T: int, S: int, filled: int, device) -> torch.Tensor:
    """``[b, 1, T, S]`` bool: the first ``filled`` positions and the window's tokens up to each token, the window
    written right after the filled positions (where a static cache puts it)."""
    pos = torch.arange(S, device=device)
    tok = torch.arange(T, device=device)[:, None]
    keep = (pos < filled) | ((pos >= filled) & (pos - filled <= tok)) if T > 1 else (pos < filled)[None]
    return keep[None, None].expand(b, 1, T, S)


def config_grid(b, KV, S, rows, dk_pad, device):
    from replay_compile.kernels.decode_attention_triton import LaunchConfig, launch_config

    shipped = launch_config(b, KV, S, rows, dk_pad, device)
    for block, warps, stages, n_split in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (shipped.n_split,)):
        tiles = -(-S // block)
        if n_split > tiles or (block == 128 and dk_pad > 128):
            continue
        per = -(-tiles // n_split)
        yield LaunchConfig(block, -(-tiles // per), per, warps, stages)


def main(argv=None):
    from replay_compile.kernels import decode_attention_triton as kt
    from replay_compile.kernels.decode_attention_reference import decode_attention_reference
    from replay_compile.ops.decode_attention import decode_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--contexts", default="1040:1024", help="static:filled pairs, comma-separated")
    ap.add_argument("--tokens", default="1", help="query tokens per row (1: decode; T > 1: a verify window)")
    ap.add_argument("--geoms", default="nano4b,qwen35_4b")
    ap.add_argument("--configs", action="store_true", help="also time a grid of the kernel's launch configurations")
    ap.add_argument("--bandwidth", type=float, default=0.0,
                    help="bytes/s of the floor (default: a device-to-device copy's, measured first)")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from bench_mamba2_kernel import time_graph, warm_clocks

    from replay_compile.bench import copy_bandwidth

    dt = torch.bfloat16
    warm_clocks()
    bw = args.bandwidth or copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, floor at {bw / 1e12:.2f} TB/s")
    print(f"{'geom':10} {'static':>6} {'filled':>6} {'T':>2} {'bs':>4} {'variant':10} {'us':>9} {'x repeat_kv':>11} "
          f"{'floor us':>9} {'% floor':>8} {'max err':>8}")
    rows, tuning = [], []
    for name, ctx, T, b in itertools.product(args.geoms.split(","), args.contexts.split(","),
                                             map(int, args.tokens.split(",")), map(int, args.batches.split(","))):
        H, KV, d = GEOMS[name]
        G = H // KV
        S, filled = map(int, ctx.split(":"))
        if filled + (T if T > 1 else 0) > S:
            raise SystemExit(f"--contexts {ctx}: {filled} filled positions and a {T}-token window need a static cache "
                             f"of at least {filled + T} positions")
        scale = d ** -0.5

        def repeat_kv(x):
            bb, kv, s, dd = x.shape
            return x[:, :, None].expand(bb, kv, G, s, dd).reshape(bb, kv * G, s, dd)

        @torch.compile
        def hf_path(q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask,
                                                                    scale=scale)

        def gqa(q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                    enable_gqa=True)

        g = torch.Generator(device="cuda").manual_seed(b)
        q = torch.randn(b, H, T, d, device="cuda", dtype=dt, generator=g)
        k = torch.randn(b, KV, S, d, device="cuda", dtype=dt, generator=g)
        v = torch.randn(b, KV, S, d, device="cuda", dtype=dt, generator=g)
        mask = window_mask(b, T, S, filled, "cuda")
        mask3 = mask[:, 0].contiguous()
        want = decode_attention_reference(q.double(), k.double(), v.double(), mask3, scale)
        kept = int(mask3[0].any(0).sum())
        floor = b * KV * kept * 2 * d * 2 / bw
        variants = {"repeat_kv": lambda: hf_path(q, k, v, mask), "gqa": lambda: gqa(q, k, v, mask),
                    "ours": lambda: decode_attention(q, k, v, mask3, scale)}
        base = None
        for var, fn in variants.items():
            torch._dynamo.reset()
            try:
                out = fn()
                err = float((out.double() - want).abs().max())
                t = time_graph(fn, reps=10, inner=20) * 1e-6
            except Exception as e:                           # a path PyTorch does not offer for this shape
                print(f"{name:10} {S:6d} {filled:6d} {T:2d} {b:4d} {var:10} failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:80]}")
                continue
            base = t if var == "repeat_kv" else base
            ratio = base / t if base else float("nan")
            rows.append(dict(geom=name, static=S, filled=filled, tokens=T, batch=b, variant=var, us=t * 1e6,
                             x_repeat_kv=ratio, floor_us=floor * 1e6, pct_floor=100 * floor / t, max_err=err))
            print(f"{name:10} {S:6d} {filled:6d} {T:2d} {b:4d} {var:10} {t * 1e6:9.1f} {ratio:10.2f}x "
                  f"{floor * 1e6:9.1f} {100 * floor / t:7.1f}% {err:8.1e}", flush=True)
        if args.configs:
            rows_pad, dk_pad = kt._pow2(G * T), kt._pow2(d)
            shipped = kt.launch_config(b, KV, S, rows_pad, dk_pad, q.device)
            timed = []
            for cfg in config_grid(b, KV, S, rows_pad, dk_pad, q.device):
                try:
                    def fn(cfg=cfg):
                        return kt.decode_attention_triton(q, k, v, mask3, scale, config=cfg)
                    if float((fn().double() - want).abs().max()) > 2e-2:
                        print(f"#   {cfg}: wrong result")
                        continue
                    timed.append((time_graph(fn, reps=5, inner=10), cfg))
                except Exception as e:                       # out of shared memory / registers
                    print(f"#   {cfg}: {type(e).__name__}")
            timed.sort(key=lambda x: x[0])
            ship = next((t for t, c in timed if c == shipped), float("nan"))
            for t, cfg in timed[:3]:
                print(f"#   best {t:8.1f} us {100 * floor * 1e6 / t:5.1f}% floor  {cfg}")
            print(f"#   shipped {ship:8.1f} us  {shipped}", flush=True)
            fields = ("block", "n_split", "tiles_per_split", "num_warps", "num_stages")
            tuning += [dict(geom=name, static=S, filled=filled, tokens=T, batch=b, us=t,
                            pct_floor=100 * floor * 1e6 / t, shipped=c == shipped, **{f: getattr(c, f) for f in fields})
                       for t, c in timed]
    with open(os.path.join(args.out, "decode_attention.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if tuning:
        with open(os.path.join(args.out, "decode_attention_configs.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(tuning[0]))
            w.writeheader()
            w.writerows(tuning)


if __name__ == "__main__":
    main()
