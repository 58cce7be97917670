"""Device time of the speculative verify kernels per launch (window, checkpoint pass), with every row flushing or
none, per launch configuration; outputs and checkpoint checked against the first configuration's.

    python benchmarks/diag_spec_verify_profile.py --geoms nano,super "" "BLOCK_P=32,num_warps=2"
    python benchmarks/diag_spec_verify_profile.py --geoms qwen35_4b --batches 256 "" "BLOCK_V=16"
    python benchmarks/diag_spec_verify_profile.py --geoms qwen35_4b --module path/to/variant.py ""

Configurations are the verify module's ``TUNING`` knobs. ``--module`` (repeatable): also time another
implementation of the same verify (a Python file defining ``spec_verify_triton`` or ``delta_spec_verify_triton`` and
``TUNING``), every configuration on each implementation whose ``TUNING`` has its knobs, checked against the first
configuration of the shipped one. T = 4, history budget 16 (a
32-slot ring), fp32 checkpoint, bf16 (Mamba-2) or fp32 (GDN) activations; non-flush rows hold 8 records, flush rows
16. Per configuration: the verify alone captured 8 times in a CUDA graph (µs per call, median of 10 replays),
torch.profiler's device time per launch, the registers and spill bytes of each launch's kernel, and the bytes floor
(the checkpoint read, and written back on flush rows) at the copy bandwidth measured first.
"""

import argparse
import collections
import importlib.util
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mamba2_kernel import copy_bandwidth, time_graph, warm_clocks  # noqa: E402
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


def kernel_resources(module) -> str:
    """Registers / spill bytes of every Triton kernel of ``module`` compiled so far (the last specialisation)."""
    out = []
    for name in sorted(dir(module)):
        fn = getattr(module, name)
        caches = getattr(fn, "device_caches", None)
        if not name.startswith("_") or not caches:
            continue
        for dev_cache in caches.values():
            kernels = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for k in list(kernels.values())[-1:]:
                out.append(f"{name.strip('_')}: {getattr(k, 'n_regs', '?')} regs {getattr(k, 'n_spills', '?')} B spill")
    return "; ".join(out)


def load(path):
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--geoms", default="nano,super")
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--module", action="append", default=[],
                    help="another implementation to time beside the shipped one (repeatable)")
    ap.add_argument("configs", nargs="*", default=[""])
    args = ap.parse_args(argv)
    import replay_compile  # noqa: F401 - registers the ops
    from replay_compile.kernels import delta_spec_triton, mamba2_spec_triton

    warm_clocks()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s")
    configs = args.configs or [""]
    for gname, bs in itertools.product(args.geoms.split(","), map(int, args.batches.split(","))):
        family, dims = GEOMS[gname]
        shipped = mamba2_spec_triton if family == "mamba2" else delta_spec_triton
        impls = [("shipped", shipped)] + [(os.path.splitext(os.path.basename(m))[0][:7], load(m)) for m in args.module]
        entry = "spec_verify_triton" if family == "mamba2" else "delta_spec_verify_triton"
        p = Problem(family, dims, bs, 4, 16)
        c = p.ours[0]
        if family == "mamba2":
            c[1].normal_(0, 0.3), c[4].normal_(0, 0.3), c[2].uniform_(0.01, 0.1)       # x, B, dt rings
            c[3].copy_(-0.5 * c[2])                                                     # log-decay ring
            inp = [p.inp[k] for k in ("x", "dt", "la", "B", "C")]
        else:
            c[1].normal_(0, 0.1), c[3].uniform_(-0.1, 0.0)                              # d, g rings
            c[2].copy_(torch.nn.functional.normalize(torch.randn_like(c[2]), dim=-1))   # unit keys
            inp = [p.inp[k] for k in ("q", "k", "v", "g", "beta")]
        for mode, w, flush in (("non-flush", 8, False), ("flush", 16, True)):
            c[-3].fill_(w), c[-2].fill_(5), c[-1].fill_(flush)
            s0 = c[0].clone()
            first = None
            for (iname, mod), cfg in itertools.product(impls, configs):
                run = getattr(mod, entry)
                mod.TUNING.clear()
                knobs = {k: int(v) for k, v in (kv.split("=") for kv in cfg.split(",") if kv)}
                if not set(knobs) <= mod.TUNING.keys_allowed:       # a knob of another implementation
                    continue
                mod.TUNING.update(knobs)
                chk = [t.clone() for t in c]
                y = run(*chk, *inp)
                first = first or (y, chk[0])
                err = max(float((y - first[0]).abs().max() / first[0].abs().max()),
                          float((chk[0] - first[1]).abs().max() / first[1].abs().max()))
                us = time_graph(lambda: run(*c, *inp), inner=8, reps=10)
                launches = per_launch_us(lambda: run(*c, *inp))
                c[0].copy_(s0)
                floor = p.state_bytes * (2 if flush else 1) / bw * 1e6
                ks = " ".join(f"{k.strip('_')}={v:.1f}" for k, v in sorted(launches.items()) if v > 0.5)
                print(f"{gname:9} bs{bs:<4} {iname:7} [{cfg:24}] {mode:9} {us:7.1f} us  floor {floor:6.1f}  "
                      f"diff {err:.1e} | {ks} | {kernel_resources(mod)}", flush=True)
                mod.TUNING.clear()
        del p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
