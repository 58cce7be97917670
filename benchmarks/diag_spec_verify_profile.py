"""Device time of the Mamba-2 speculative verify per launch (window, checkpoint pass), with every row flushing or
none, per launch configuration; outputs and checkpoint checked against the first configuration's.

    python benchmarks/diag_spec_verify_profile.py "" "BLOCK_P=32,num_warps=2"      # configs: TUNING knobs

Nano and Super dimensions, batch 32 and 256, T = 4, history budget 16 (a 32-slot ring), fp32 checkpoint, bf16
activations; non-flush rows hold 8 records, flush rows 16. Per configuration: the verify alone captured 8 times in
a CUDA graph (µs per call, median of 10 replays), torch.profiler's device time per launch, and the bytes floor
(the checkpoint read, and written back on flush rows) at 4.3 TB/s.
"""

import collections
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mamba2_kernel import time_graph, warm_clocks  # noqa: E402
from bench_spec_step import GEOMS, Problem  # noqa: E402


def per_launch_us(fn, n=20) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    agg = collections.defaultdict(float)
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name.split("(")[0]] += e.device_time_total
    return {k: v / n for k, v in agg.items()}


def main(configs):
    import replay_compile  # noqa: F401 - registers the ops
    from replay_compile.kernels import mamba2_spec_triton as K

    warm_clocks()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for gname, bs in itertools.product(["nano", "super"], [32, 256]):
        family, dims = GEOMS[gname]
        p = Problem(family, dims, bs, 4, 16)
        c = p.ours[0]
        c[1].normal_(0, 0.3), c[4].normal_(0, 0.3), c[2].uniform_(0.01, 0.1)       # x, B, dt rings
        c[3].copy_(-0.5 * c[2])                                                     # log-decay ring
        inp = [p.inp[k] for k in ("x", "dt", "la", "B", "C")]
        for mode, w, flush in (("non-flush", 8, False), ("flush", 16, True)):
            c[5].fill_(w), c[6].fill_(5), c[7].fill_(flush)
            s0 = c[0].clone()
            first = None
            for cfg in configs:
                K.TUNING.clear()
                K.TUNING.update({k: int(v) for k, v in (kv.split("=") for kv in cfg.split(",") if kv)})
                chk = [t.clone() for t in c]
                y = K.spec_verify_triton(*chk, *inp)
                first = first or (y, chk[0])
                err = max(float((y - first[0]).abs().max() / first[0].abs().max()),
                          float((chk[0] - first[1]).abs().max() / first[1].abs().max()))
                us = time_graph(lambda: K.spec_verify_triton(*c, *inp), inner=8, reps=10)
                launches = per_launch_us(lambda: K.spec_verify_triton(*c, *inp))
                c[0].copy_(s0)
                floor = p.state_bytes * (2 if flush else 1) / 4.3e12 * 1e6
                ks = " ".join(f"{k.removeprefix('_mamba2_spec_')}={v:.1f}" for k, v in sorted(launches.items())
                              if v > 0.5)
                print(f"{gname:6} bs{bs:<4} [{cfg:24}] {mode:9} {us:7.1f} us  floor {floor:6.1f}  "
                      f"diff {err:.1e} | {ks}", flush=True)
            K.TUNING.clear()
        del p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or [""])
