"""Host time per call of our step ops, outside CUDA graphs (``torch.compile``'s default mode pays it every step).

    python benchmarks/diag_host_overhead.py [--batch 1] [--calls 300]

Per op (Mamba-2 at Nemotron-Super geometry, GDN at Qwen3.5-4B, KDA at Kimi-Linear; fp32 state, L = 16): host µs
per call, measured as the wall time of ``--calls`` back-to-back calls with no synchronisation in between (small
batch: the GPU keeps up, so the host is what is timed), through

- ``torch.ops.replay_compile.<op>.default`` (the dispatcher, what compiled graphs call), and
- the Triton entry point directly (no dispatcher, no argument checks),

and, for scale, one dispatcher call of a no-op with the same five mutated arguments defined through
``torch.library.custom_op`` and through ``torch.library.Library`` (``replay_compile/ops/library.py`` says why we
use the second). A diagnostic, not a benchmark: it reports host time, which no speedup claim rests on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(__file__))
from bench_mamba2_kernel import random_step  # noqa: E402


def host_us(fn, calls: int) -> float:
    """Median over 5 rounds of the host wall time per call of ``calls`` unsynchronised calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def mamba2_calls(bs: int):
    from replay_compile.kernels.mamba2_triton import replay_step_triton

    rings, (x, dt, la, B, C) = random_step(bs, 128, 64, 128, 8, 16, 1, torch.bfloat16)
    state = torch.zeros(bs, 128, 64, 128, device="cuda")
    args = (state, *rings[0], x, dt, la, B, C, None)
    return (lambda: torch.ops.replay_compile.mamba2_step.default(*args)), (lambda: replay_step_triton(*args)), args


def delta_calls(bs: int, kda: bool):
    from replay_compile.kernels.delta_triton import delta_replay_step_triton
    from replay_compile.state import DeltaRingSpec

    Hk, HV, K, V = (32, 32, 128, 128) if kda else (16, 32, 128, 128)
    rings = DeltaRingSpec(HV, Hk, K, V, 16, torch.float32, torch.bfloat16, kda).allocate(bs, "cuda")
    state = torch.zeros(bs, HV, K, V, device="cuda")
    q = torch.nn.functional.normalize(torch.randn(bs, Hk, K, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(bs, Hk, K, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(bs, HV, V, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand((bs, HV, K) if kda else (bs, HV), device="cuda") * 0.1
    beta = torch.rand(bs, HV, device="cuda")
    args = (state, *rings, q, k, v, g, beta, None)
    return (lambda: torch.ops.replay_compile.delta_step.default(*args)), (lambda: delta_replay_step_triton(*args)), args


def delta_custom_op():
    """The delta step's Triton entry defined as a ``torch.library.custom_op`` (how our ops were defined before
    ``ops/library.py``), to compare the two registrations on the same work."""
    from replay_compile.kernels.delta_triton import delta_replay_step_triton

    def step(state: Tensor, d_ring: Tensor, k_ring: Tensor, g_ring: Tensor, cursor: Tensor, q: Tensor, k: Tensor,
             v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        return delta_replay_step_triton(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, None)

    op = torch.library.custom_op("replay_diag::delta_step_custom_op", step,
                                 mutates_args=("state", "d_ring", "k_ring", "g_ring", "cursor"))
    op.register_fake(lambda state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta:
                     torch.empty_like(v, dtype=torch.float32))
    return torch.ops.replay_diag.delta_step_custom_op.default


def compiled_default_mode(op, args):
    """``op`` inside a small ``torch.compile``d function (default mode: no CUDA graphs), as the rewritten graph
    calls it: the Inductor-generated wrapper around the call, the functionalised mutations re-inplaced."""
    def f(*a):
        return op(*a[:5], a[5] * 1.0, *a[6:]) + 1.0
    cf = torch.compile(f)
    cf(*args)
    return lambda: cf(*args)


def noop_ops():
    def body(a: Tensor, b: Tensor, c: Tensor, d: Tensor, e: Tensor, x: Tensor) -> Tensor:
        return torch.empty_like(x)

    mut = ("a", "b", "c", "d", "e")
    torch.library.custom_op("replay_diag::noop_custom_op", body, mutates_args=mut)
    lib = torch.library.Library("replay_diag", "FRAGMENT")
    lib.define("noop_library" + torch.library.infer_schema(body, mutates_args=mut))
    lib.impl("noop_library", body, "CUDA")
    ts = [torch.zeros(4, device="cuda") for _ in range(6)]
    return ((lambda: torch.ops.replay_diag.noop_custom_op.default(*ts)),
            (lambda: torch.ops.replay_diag.noop_library.default(*ts)), lib)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    import replay_compile  # noqa: F401 - registers the ops

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, host µs per call (no sync), bs{args.batch}")
    with torch.no_grad():
        nc, nl, _lib = noop_ops()
        print(f"no-op, 5 mutated args: custom_op {host_us(nc, args.calls):7.1f}"
              f"   Library {host_us(nl, args.calls):7.1f}")
        a10 = delta_calls(args.batch, False)[2][:10]
        custom = delta_custom_op()
        lib = lambda *a: torch.ops.replay_compile.delta_step.default(*a, None)  # noqa: E731
        print(f"delta_step gdn eager:    Library {host_us(lambda: lib(*a10), args.calls):7.1f}"
              f"   custom_op {host_us(lambda: custom(*a10), args.calls):7.1f}")
        print(f"delta_step gdn compiled: Library {host_us(compiled_default_mode(lib, a10), args.calls):7.1f}"
              f"   custom_op {host_us(compiled_default_mode(custom, a10), args.calls):7.1f}   (default mode)")
        for name, (op, direct, _) in (("mamba2_step super", mamba2_calls(args.batch)),
                                      ("delta_step gdn", delta_calls(args.batch, False)),
                                      ("delta_step kda", delta_calls(args.batch, True))):
            print(f"{name:20s} dispatcher {host_us(op, args.calls):7.1f}"
                  f"   triton entry {host_us(direct, args.calls):7.1f}")


if __name__ == "__main__":
    main()
