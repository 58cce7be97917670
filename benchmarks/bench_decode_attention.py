"""Decode attention of one layer: ``replay_compile::decode_attention`` against what a compiled transformers model
runs, with the bytes floor beside it.

    python benchmarks/bench_decode_attention.py [--batches 1,32,256] [--positions 1040] [--filled 1024] [--out DIR]

Per geometry (Nemotron-Nano-4B: 32 query heads over 8 key/value heads of 128; Qwen3.5-4B: 16 over 4 of 256) and
batch, bf16, a static cache of ``--positions`` positions of which the first ``--filled`` hold tokens (the mask):

* ``repeat_kv``: transformers' compiled decode path, ``repeat_kv`` then SDPA with the mask, under
  ``torch.compile`` (Inductor materialises the expanded heads, SDPA reads every static position);
* ``gqa``: SDPA with ``enable_gqa=True`` and the mask (no expanded copy; PyTorch picks its kernel);
* ``ours``: the op (split-K Triton kernel, only the filled positions read).

Times are medians of CUDA-graph replays of 20 calls (no host overhead). ``floor``: the filled keys and values read
once at a device-to-device copy's bandwidth. Each variant's output is checked against the float64 reference first.
"""

from __future__ import annotations

import argparse
import csv
import os

import torch

GEOMS = {"nano4b": (32, 8, 128), "qwen35_4b": (16, 4, 256)}


def main(argv=None):
    from replay_compile.kernels.decode_attention_reference import decode_attention_reference
    from replay_compile.ops.decode_attention import decode_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--positions", type=int, default=1040)
    ap.add_argument("--filled", type=int, default=1024)
    ap.add_argument("--geoms", default="nano4b,qwen35_4b")
    ap.add_argument("--bandwidth", type=float, default=0.0,
                    help="bytes/s of the floor (default: a device-to-device copy's, measured first)")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from bench_mamba2_kernel import time_graph, warm_clocks

    from replay_compile.bench import copy_bandwidth

    dt = torch.bfloat16
    S, filled = args.positions, args.filled
    warm_clocks()
    bw = args.bandwidth or copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {S} static positions, {filled} "
          f"filled, floor at {bw / 1e12:.2f} TB/s")
    print(f"{'geom':10} {'bs':>4} {'variant':10} {'us':>9} {'x repeat_kv':>11} {'floor us':>9} {'% floor':>8} "
          f"{'max err':>8}")
    rows = []
    for name in args.geoms.split(","):
        H, KV, d = GEOMS[name]
        G = H // KV

        def repeat_kv(x):
            b, kv, s, dd = x.shape
            return x[:, :, None].expand(b, kv, G, s, dd).reshape(b, kv * G, s, dd)

        @torch.compile
        def hf_path(q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask,
                                                                    scale=d ** -0.5)

        def gqa(q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5,
                                                                    enable_gqa=True)

        for b in map(int, args.batches.split(",")):
            g = torch.Generator(device="cuda").manual_seed(b)
            q = torch.randn(b, H, 1, d, device="cuda", dtype=dt, generator=g)
            k = torch.randn(b, KV, S, d, device="cuda", dtype=dt, generator=g)
            v = torch.randn(b, KV, S, d, device="cuda", dtype=dt, generator=g)
            mask = (torch.arange(S, device="cuda") < filled)[None, None, None, :].expand(b, 1, 1, S)
            want = decode_attention_reference(q[:, :, 0].double(), k.double(), v.double(), mask[:, 0, 0], d ** -0.5)
            floor = b * KV * filled * 2 * d * 2 / bw
            variants = {"repeat_kv": lambda: hf_path(q, k, v, mask), "gqa": lambda: gqa(q, k, v, mask),
                        "ours": lambda: decode_attention(q[:, :, 0], k, v, mask[:, 0, 0], d ** -0.5)}
            base = None
            for var, fn in variants.items():
                try:
                    out = fn()
                    err = float((out.reshape(want.shape).double() - want).abs().max())
                    t = time_graph(fn, reps=10, inner=20) * 1e-6
                except Exception as e:                           # a path PyTorch does not offer for this shape
                    print(f"{name:10} {b:4d} {var:10} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                    continue
                base = t if var == "repeat_kv" else base
                ratio = base / t if base else float("nan")
                rows.append(dict(geom=name, batch=b, variant=var, us=t * 1e6, x_repeat_kv=ratio, floor_us=floor * 1e6,
                                 pct_floor=100 * floor / t, max_err=err, positions=S, filled=filled))
                print(f"{name:10} {b:4d} {var:10} {t * 1e6:9.1f} {ratio:10.2f}x {floor * 1e6:9.1f} "
                      f"{100 * floor / t:7.1f}% {err:8.1e}", flush=True)
    with open(os.path.join(args.out, "decode_attention.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
