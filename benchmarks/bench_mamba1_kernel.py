"""Mamba-1 replay step vs mamba_ssm's ``selective_state_update`` in its Mamba-1 form, on one GPU, in one run.

    python benchmarks/bench_mamba1_kernel.py --out bench-results/mamba1          # full sweep
    python benchmarks/bench_mamba1_kernel.py --geoms falcon_mamba_7b --batches 256 --L 4,6,8

Per (geometry, batch, state dtype, L): the baseline step (``selective_state_update(state [b, D, N], x [b, D],
dt [b, D], A [D, N], B [b, N], C [b, N], D, dt_bias, dt_softplus=True)``, state read and written), our non-flush
step, our flush step and the L-step average, each replayed from a CUDA graph with rotated buffers (cold L2), as
``bench_mamba2_kernel.py`` times them. Bytes are the fewest a step must move (``docs/design/mamba1.md``): the
baseline reads and writes the state; our non-flush step reads the checkpoint and the held records (fp32 ``u``,
``dt`` per channel, ``B`` per token) and writes one record; "% bw" is against the copy bandwidth measured at the
start. mamba_ssm comes from an installed package or its source under ``.baselines/mamba_ssm``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mamba2_kernel import (  # noqa: E402
    copy_bandwidth,
    graph_calls,
    held_records,
    load_baseline,
    step_times,
    time_graph,
    warm_clocks,
    write_results,
)

# name: (D = d_inner, N = d_state)
GEOMS = {"falcon_mamba_7b": (8192, 16), "jamba_1_5_mini": (8192, 16), "mamba_2_8b": (5120, 16)}


def bench_point(ssu, D, N, bs, state_dtype, L, act=torch.bfloat16):
    from replay_compile.kernels.mamba1_triton import mamba1_replay_step_triton
    from replay_compile.state import Mamba1RingSpec

    dev = "cuda"
    es = torch.empty((), dtype=state_dtype).element_size()
    sb = bs * D * N * es
    copies = max(1, min(8, (256 * 2**20) // max(sb, 1)))              # rotate buffers: keep L2 (60 MB) cold
    states = [torch.randn(bs, D, N, device=dev).to(state_dtype) for _ in range(copies)]
    spec = Mamba1RingSpec(D, N, L)
    rings = [spec.allocate(bs, dev) for _ in range(copies)]
    for r in rings:
        for t in r[:3]:
            t.normal_()
        r[1].abs_().mul_(0.1)                                          # time steps > 0
    x = torch.randn(bs, D, device=dev, dtype=act)
    dt = torch.nn.functional.softplus(torch.randn(bs, D, device=dev)).to(act)
    A = -torch.rand(D, N, device=dev) - 0.5
    B, C = torch.randn(bs, N, device=dev, dtype=act), torch.randn(bs, N, device=dev, dtype=act)
    u = (dt.float() * x.float()).contiguous()
    dtf = dt.float().contiguous()
    res = step_times(lambda k: mamba1_replay_step_triton(states[k], *rings[k], u, dtf, A, B, C, None),
                     [r[-1] for r in rings], L)
    if ssu is not None:
        Dp, dtb = torch.randn(D, device=dev), torch.randn(D, device=dev)
        base_states = [s.float() if state_dtype == torch.float32 else s for s in states]
        i = [0]

        def base():
            k = i[0] = (i[0] + 1) % copies
            ssu(base_states[k], x, dt, A, B, C, D=Dp, dt_bias=dtb, dt_softplus=True)
        res["baseline_us"] = time_graph(base, inner=graph_calls(copies))
    held = held_records(L)
    rec = bs * (2 * D + N) * 4                                          # one token's record, fp32
    res["bytes_baseline"] = 2 * sb + D * N * 4
    res["bytes_nonflush"] = sb + int(held * rec) + rec + D * N * 4
    res["bytes_flush"] = 2 * sb + (L - 1) * rec + rec + D * N * 4
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--geoms", default="falcon_mamba_7b")
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--L", default="4,8,16", help="comma list of buffer lengths")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ssu = load_baseline()
    warm_clocks()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} python {platform.python_version()}; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; baseline {'mamba_ssm' if ssu else 'none'}")
    print(f"{'geom':>16} {'dtype':>8} {'L':>3} {'bs':>4} {'base us':>9} {'nonflush':>9} {'flush':>8} {'L-avg':>8} "
          f"{'x L-avg':>7} {'% bw nf':>7} {'% bw base':>9}")
    rows = []
    for gname in args.geoms.split(","):
        D, N = GEOMS[gname]
        for dname in args.dtypes.split(","):
            for L in map(int, args.L.split(",")):
                for bs in map(int, args.batches.split(",")):
                    r = bench_point(ssu, D, N, bs, getattr(torch, dname), L)
                    base = r.get("baseline_us", math.nan)
                    pct = lambda b, us: 100 * b / (us * 1e-6) / bw if us == us else math.nan  # noqa: E731
                    row = dict(geom=f"{gname}/L{L}", dtype=dname, L=L, bs=bs, baseline_us=base,
                               nonflush_us=r["nonflush_us"], flush_us=r["flush_us"], lavg_us=r["lavg_us"],
                               speedup=base / r["lavg_us"],
                               pct_bw_nonflush=pct(r["bytes_nonflush"], r["nonflush_us"]),
                               pct_bw_baseline=pct(r["bytes_baseline"], base))
                    rows.append(row)
                    print(f"{gname:>16} {dname:>8} {L:>3} {bs:>4} {base:>9.1f} {row['nonflush_us']:>9.1f} "
                          f"{row['flush_us']:>8.1f} {row['lavg_us']:>8.1f} {row['speedup']:>7.2f} "
                          f"{row['pct_bw_nonflush']:>7.0f} {row['pct_bw_baseline']:>9.0f}", flush=True)
    series = [f"{g}/L{L}" for g in args.geoms.split(",") for L in map(int, args.L.split(","))]
    write_results(rows, args.out, "mamba1_sweep", series, args.dtypes.split(","),
                  "speedup over selective_state_update (L-step average)")


if __name__ == "__main__":
    main()
