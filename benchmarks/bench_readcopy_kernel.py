"""Mamba-2 replay step with a low-precision read copy vs mamba_ssm's ``selective_state_update``, one GPU.

    python benchmarks/bench_readcopy_kernel.py --out bench-results/readcopy [--batches 1,32,256]
        [--formats bf16,fp8_e4m3,nvfp4]
        [--configs 'APPLY_P=16;APPLY_P=32']   (launch configurations compared; default: the chosen one)

Per (batch, format), Nemotron-Super geometry (H=128, P=64, N=128, G=8), fp32 checkpoint, L=16: the non-flush step,
the flush step and the L-step average of ``replay_step_readcopy_triton`` (non-flush steps read only the copy),
beside our fp32 replay step (``replay_step_triton``) and the baseline (fp32 state read and written every step), all
timed in one run from CUDA graphs with the state sets rotated (cold L2), as in bench_mamba2_kernel.py. Before timing,
one non-flush step of the read-copy kernel is checked against the reference on the same copy. Design targets: L-step
average with an fp8 copy >= 3x the baseline, NVFP4 >= 4x, at batch 256.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mamba2_kernel import (  # noqa: E402
    bench_point,
    copy_bandwidth,
    load_baseline,
    random_step,
    reported,
    step_times,
    warm_clocks,
    write_results,
)

H, P, N, G, L = 128, 64, 128, 8, 16


def readcopy_point(fmt: str, bs: int, act=torch.bfloat16) -> dict:
    from replay_compile.kernels.mamba2_readcopy_reference import init_read_copy, replay_step_readcopy_reference
    from replay_compile.kernels.mamba2_readcopy_triton import LAST_LAUNCH, replay_step_readcopy_triton
    from replay_compile.kernels.mamba2_triton import kernel_resources
    from replay_compile.quant.formats import FORMATS

    dev = "cuda"
    copies = max(1, min(8, (256 * 2**20) // (bs * H * P * N * 4)))
    states = [torch.randn(bs, H, P, N, device=dev) for _ in range(copies)]
    reads = [init_read_copy(s, fmt) for s in states]
    rings, (x, dt, la, B, C) = random_step(bs, H, P, N, G, L, copies, act, dev)
    for r in rings:
        r[2].neg_().abs_().neg_()                                       # log-decays <= 0
    # correctness first: one non-flush step against the reference on the same copy
    rings[0][-1].fill_(L // 2)
    ref_in = [t.clone() for t in rings[0]]
    ref_copy = {k: v.clone() for k, v in reads[0].tensors.items()}
    y_ref = replay_step_readcopy_reference(states[0].clone(), ref_copy, fmt, *ref_in, x, dt, la, B, C)
    y = replay_step_readcopy_triton(states[0], reads[0], fmt, *rings[0], x, dt, la, B, C)
    resources = kernel_resources(LAST_LAUNCH.get("kernel"))
    err = float((y - y_ref).abs().max() / (y_ref.abs().max() + 1e-12))
    if not err < 1e-4:
        raise AssertionError(f"{fmt} bs{bs}: read-copy kernel differs from the reference by {err:.2e}")
    res = step_times(lambda k: replay_step_readcopy_triton(states[k], reads[k], fmt, *rings[k], x, dt, la, B, C),
                     [r[-1] for r in rings], L)
    res.update(check_err=err, resources=resources)
    res["copy_bytes_nonflush"] = bs * H * P * FORMATS[fmt].row_nbytes(N)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,128,256,512")
    ap.add_argument("--formats", default="bf16,fp8_e4m3,nvfp4")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--configs", default="", help="';'-separated mamba2_readcopy_triton.tuned strings")
    args = ap.parse_args(argv)
    from replay_compile.kernels.mamba2_readcopy_triton import tuned
    os.makedirs(args.out, exist_ok=True)
    ssu = load_baseline()
    warm_clocks()
    bw = copy_bandwidth()
    p = torch.cuda.get_device_properties(0)
    print(f"# {p.name}, torch {torch.__version__}, python {platform.python_version()}, copy bandwidth "
          f"{bw / 1e12:.2f} TB/s; Super geometry, fp32 checkpoint, L={L}; baseline: "
          f"{'mamba_ssm selective_state_update' if ssu else 'none'}")
    print(f"{'fmt':9} {'bs':>4} {'base us':>8} {'fp32 L-avg':>10} {'nonfl us':>9} {'flush us':>9} {'L-avg us':>9} "
          f"{'x base':>7} {'x fp32':>7} {'check':>8}")
    rows = []
    for bs in map(int, args.batches.split(",")):
        plain = bench_point(ssu, H, P, N, G, bs, torch.float32, L)          # our fp32 replay step + the baseline
        for fmt in args.formats.split(","):
            for spec in args.configs.split(";"):
                with tuned(spec):
                    r = reported(f"{fmt} {bs} {spec or 'default'}", readcopy_point, fmt, bs)
                if r is None:
                    continue
                base = plain.get("baseline_us", float("nan"))
                row = dict(fmt=fmt, geom="super", dtype=fmt if not spec else f"{fmt} {spec}", bs=bs, config=spec,
                           baseline_us=base, fp32_lavg_us=plain["lavg_us"], **r,
                           speedup=base / r["lavg_us"], vs_fp32=plain["lavg_us"] / r["lavg_us"])
                rows.append(row)
                print(f"{fmt:9} {bs:4d} {base:8.1f} {plain['lavg_us']:10.1f} {r['nonflush_us']:9.1f} "
                      f"{r['flush_us']:9.1f} {r['lavg_us']:9.1f} {row['speedup']:6.2f}x {row['vs_fp32']:6.2f}x "
                      f"{r['check_err']:8.1e}  {spec or 'default'}  {r['resources']}", flush=True)
                torch.cuda.empty_cache()
    write_results(rows, args.out, "readcopy_kernel", ["super"], args.formats.split(","),
                  "L-avg speedup vs selective_state_update")


if __name__ == "__main__":
    main()
