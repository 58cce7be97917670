"""How fast mamba_ssm's ``selective_state_update`` runs under each way of calling and timing it: the kernel
benchmark's baseline must be the fastest form a user gets.

    python benchmarks/diag_ssu_baseline.py [--geoms super,nano] [--batches 256] [--dtypes float32]

Per (geometry, batch, state dtype), the same step timed several ways (µs per call, and the share of the copy
bandwidth its bytes, the state read and written once, reach):

* ``bench``: what ``bench_mamba2_kernel.py`` times: A, D, dt_bias and dt broadcast over the head dim (stride 0: the
  kernel's ``TIE_HDIM`` path, as transformers' Mamba-2 mixers call it), softplus on dt, D, bf16 x / B / C, 8 calls
  per CUDA graph on one state buffer;
* ``graph1``: the same, one call per CUDA graph (the graph's own launch latency in every figure);
* ``eager``: the same calls launched one after another without a graph, timed with CUDA events over 50 calls;
* ``untied``: A / D / dt_bias / dt as full ``[.., H, P(, N)]`` tensors (no ``TIE_HDIM``);
* ``fp32_in``: x / B / C in fp32;
* ``z``: with the z gate;
* ``rotate2``: two state buffers, alternate calls on each;
* ``do_bench``: ``triton.testing.do_bench`` of one call (it clears L2 before each call).

The baseline's source: mamba_ssm installed or under ``.baselines/`` (``bench_mamba2_kernel.load_baseline``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mamba2_kernel import GEOMS, copy_bandwidth, load_baseline, time_graph, warm_clocks  # noqa: E402


def forms(ssu, H, P, N, G, bs, state_dtype):
    """``{name: (fn, state_buffers)}``: each a zero-argument call of the baseline in one form."""
    dev, act = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    st = [torch.randn(bs, H, P, N, device=dev, generator=g).to(state_dtype) for _ in range(2)]
    x = torch.randn(bs, H, P, device=dev, dtype=act, generator=g)
    dt = torch.rand(bs, H, device=dev, generator=g) * 0.1
    B = torch.randn(bs, G, N, device=dev, dtype=act, generator=g)
    C = torch.randn(bs, G, N, device=dev, dtype=act, generator=g)
    z = torch.randn(bs, H, P, device=dev, dtype=act, generator=g)
    A1 = -torch.rand(H, device=dev, generator=g)
    D1 = torch.randn(H, device=dev, generator=g)
    b1 = torch.randn(H, device=dev, generator=g)
    A, Dp, dtb = A1[:, None, None].expand(H, P, N), D1[:, None].expand(H, P), b1[:, None].expand(H, P)
    dt_full = dt[:, :, None].expand(bs, H, P)
    kw = dict(D=Dp, dt_bias=dtb, dt_softplus=True)
    i = [0]

    def rotate():
        i[0] ^= 1
        ssu(st[i[0]], x, dt_full, A, B, C, **kw)

    return {
        "bench": lambda: ssu(st[0], x, dt_full, A, B, C, **kw),
        "untied": lambda: ssu(st[0], x, dt_full.contiguous(), A.contiguous(), B, C, D=Dp.contiguous(),
                              dt_bias=dtb.contiguous(), dt_softplus=True),
        "fp32_in": lambda: ssu(st[0], x.float(), dt_full, A, B.float(), C.float(), **kw),
        "z": lambda: ssu(st[0], x, dt_full, A, B, C, z=z, **kw),
        "rotate2": rotate,
    }


def eager_us(fn, n=50) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--geoms", default="super,nano")
    ap.add_argument("--batches", default="256")
    ap.add_argument("--dtypes", default="float32")
    args = ap.parse_args(argv)
    ssu = load_baseline()
    if ssu is None:
        raise SystemExit("diag_ssu_baseline: mamba_ssm is neither installed nor under .baselines/")
    import triton
    warm_clocks()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; µs per call (% of copy bandwidth for the state read + written)")
    for gname in args.geoms.split(","):
        H, P, N, G = GEOMS[gname]
        for bs in map(int, args.batches.split(",")):
            for dname in args.dtypes.split(","):
                sdt = getattr(torch, dname)
                floor_us = 2 * bs * H * P * N * torch.empty((), dtype=sdt).element_size() / bw * 1e6
                fs = forms(ssu, H, P, N, G, bs, sdt)
                res = {name: time_graph(fn, inner=8) for name, fn in fs.items()}
                res["graph1"] = time_graph(fs["bench"], inner=1)
                res["eager"] = eager_us(fs["bench"])
                res["do_bench"] = triton.testing.do_bench(fs["bench"], warmup=25, rep=200) * 1e3
                print(f"{gname} bs{bs} {dname} floor {floor_us:.1f} µs: " + ", ".join(
                    f"{k} {v:.1f} ({100 * floor_us / v:.0f}%)" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
