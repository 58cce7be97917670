"""Delta-rule replay step (GDN, KDA) vs fla's fused recurrent kernels, on one GPU, in one run.

    python benchmarks/bench_delta_kernel.py --out bench-results/delta       # full sweep
    python benchmarks/bench_delta_kernel.py --geoms qwen35_4b --batches 256
    python benchmarks/bench_delta_kernel.py --batches 1,256 --configs 'fused;split:BLOCK_V=8,num_warps=1'

Per (geometry, batch, state dtype): the baseline step (fla ``fused_recurrent_gated_delta_rule`` for GDN,
``fused_recurrent_kda`` for KDA, T = 1, reading ``initial_state`` and writing the final state), our non-flush step,
our flush step and the L-step average, each replayed from a CUDA graph (cold L2 as in bench_mamba2_kernel.py).
Bytes are the fewest a step must move; "% bw" against the copy bandwidth measured at the start. fla comes from an
installed ``fla-core`` (a small pure-Python/Triton wheel, ``pip install --no-deps``; offline GPU machines:
benchmarks/README.md).
fla always writes an fp32 final state, so its bf16-state row moves more bytes than ours: compare fp32 rows.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mamba2_kernel import (  # noqa: E402
    compare_configs,
    copy_bandwidth,
    desync_cells,
    desync_header,
    graph_calls,
    held_records,
    step_times,
    time_graph,
    warm_clocks,
    write_results,
)

# name: (Hk, HV, K, V, kda)
GEOMS = {"qwen35_4b": (16, 32, 128, 128, False), "qwen35_122b": (16, 64, 128, 128, False),
         "kimi_linear": (32, 32, 128, 128, True)}


def load_baseline(kda: bool):
    try:
        if kda:
            from fla.ops.kda import fused_recurrent_kda as fn
        else:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
        return fn
    except Exception as e:  # noqa: BLE001 - not installed: the sweep runs without a baseline
        print(f"# fla not importable ({type(e).__name__}: {e}); no baseline")
        return None


def random_delta_step(bs, Hk, HV, K, V, kda, L, copies, act, dev="cuda"):
    """``copies`` ring sets (d, k, g rings and cursor) with random records, and one token's random inputs
    ``(q, k, v, g, beta)``; shared by the delta step benchmarks (as ``bench_mamba2_kernel.random_step`` is by the
    Mamba-2 ones)."""
    from replay_compile.state import DeltaRingSpec

    spec = DeltaRingSpec(HV, Hk, K, V, L, torch.float32, act, kda)
    rings = [spec.allocate(bs, dev) for _ in range(copies)]
    for r in rings:
        for t in r[:3]:
            t.normal_()
        r[2].neg_().abs_().neg_()                                   # log-gates <= 0
    norm = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    q = norm(torch.randn(bs, Hk, K, device=dev)).to(act)
    k = norm(torch.randn(bs, Hk, K, device=dev)).to(act)
    v = torch.randn(bs, HV, V, device=dev, dtype=act)
    g = -torch.rand((bs, HV, K) if kda else (bs, HV), device=dev) * 0.1
    beta = torch.rand(bs, HV, device=dev)
    return rings, (q, k, v, g, beta)


def bench_point(base_fn, Hk, HV, K, V, kda, bs, state_dtype, L, act=torch.bfloat16, desync=False):
    from replay_compile.kernels.delta_triton import delta_replay_step_triton

    dev = "cuda"
    es = torch.empty((), dtype=state_dtype).element_size()
    state_bytes = bs * HV * K * V * es
    copies = max(1, min(8, (256 * 2**20) // max(state_bytes, 1)))
    states = [torch.randn(bs, HV, K, V, device=dev).to(state_dtype) for _ in range(copies)]
    rings, (q, k, v, g, beta) = random_delta_step(bs, Hk, HV, K, V, kda, L, copies, act, dev)
    i = [0]
    res = step_times(lambda j: delta_replay_step_triton(states[j], *rings[j], q, k, v, g, beta, None),
                     [r[-1] for r in rings], L, desync)
    if base_fn is not None:
        q4, k4, v4 = q[:, None], k[:, None], v[:, None]
        g4, b4 = g[:, None], beta[:, None]

        def base():
            j = i[0] = (i[0] + 1) % copies
            base_fn(q4, k4, v4, g=g4, beta=b4, initial_state=states[j], output_final_state=True)
        res["baseline_us"] = time_graph(base, inner=graph_calls(copies))
    ea = torch.empty((), dtype=act).element_size()
    sb = bs * HV * K * V * es
    ring_read = int(bs * held_records(L) * (HV * V * 4 + Hk * K * ea + HV * (K if kda else 1) * 4))
    res["bytes_baseline"] = sb + bs * HV * K * V * 4                # fla writes an fp32 final state
    res["bytes_nonflush"] = sb + ring_read
    res["bytes_flush"] = 2 * sb + 2 * ring_read
    return res


def sweep_configs(bw, L, out, configs, batches, geoms):
    """``compare_configs`` for the delta kernel, fp32 state, against the fla baseline of each point."""
    from replay_compile.kernels import delta_triton as kd

    def points():
        for gname in geoms:
            Hk, HV, K, V, kda = GEOMS[gname]
            base_fn = load_baseline(kda)
            for bs in batches:
                base = float("nan")
                if base_fn is not None:
                    base = bench_point(base_fn, Hk, HV, K, V, kda, bs, torch.float32, L)["baseline_us"]
                yield gname, bs, base, lambda: bench_point(None, Hk, HV, K, V, kda, bs, torch.float32, L)
    compare_configs(kd.TUNING, points(), configs, bw, os.path.join(out, "delta_kernel_configs.csv"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--geoms", default=",".join(GEOMS))
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--configs", default="",
                    help="';'-separated launch configs (e.g. 'fused;split:BLOCK_V=8,num_warps=1') compared at "
                         "--batches, fp32 state, instead of the sweep")
    ap.add_argument("--desync", action="store_true",
                    help="also time steps with every row at its own ring position (step_times' desync_us)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    warm_clocks()
    bw = copy_bandwidth()
    p = torch.cuda.get_device_properties(0)
    print(f"# {p.name} sm_{p.major}{p.minor}, torch {torch.__version__}, python {platform.python_version()}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s, L={args.L}, bf16 activations")
    if args.configs:
        return sweep_configs(bw, args.L, args.out, args.configs.split(";"), list(map(int, args.batches.split(","))),
                             args.geoms.split(","))
    print(f"{'geom':12} {'dtype':8} {'bs':>4} {'base us':>9} {'nonfl us':>9} {'%bw':>5} {'flush us':>9} "
          f"{'L-avg us':>9} {'speedup':>7}" + desync_header(args.desync))
    from replay_compile.kernels.delta_triton import launch_config

    rows = []
    for gname in args.geoms.split(","):
        Hk, HV, K, V, kda = GEOMS[gname]
        base_fn = load_baseline(kda)
        for dname in args.dtypes.split(","):
            sdt = getattr(torch, dname)
            for bs in map(int, args.batches.split(",")):
                r = bench_point(base_fn, Hk, HV, K, V, kda, bs, sdt, args.L, desync=args.desync)
                base = r.get("baseline_us", float("nan"))
                pct = r["bytes_nonflush"] / (r["nonflush_us"] * 1e-6) / bw * 100
                row = dict(geom=gname, dtype=dname, bs=bs, L=args.L, copy_bw_TBs=bw / 1e12,
                           variant=launch_config(bs, HV, K, V, args.L)["variant"], **r,
                           speedup=base / r["lavg_us"])
                rows.append(row)
                print(f"{gname:12} {dname:8} {bs:>4} {base:>9.1f} {r['nonflush_us']:>9.1f} {pct:>5.0f} "
                      f"{r['flush_us']:>9.1f} {r['lavg_us']:>9.1f} {row['speedup']:>7.2f}" +
                      desync_cells(r, base, args.desync), flush=True)
    write_results(rows, args.out, "delta_kernel", args.geoms.split(","), args.dtypes.split(","),
                  "L-step average speedup vs fla fused recurrent")

if __name__ == "__main__":
    main()
