"""Run a few non-flush replay steps eagerly, for Nsight Compute to profile one kernel of them.

    ncu --kernel-name regex:_delta_apply_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
        python benchmarks/diag_ncu_step.py --family delta --geom kimi_linear --batch 256

Eager launches (no CUDA graph): a profiler replays one launch at a time anyway. The cursors start mid-window
(``--cursor``, default 7 of L = 16) and the step count stays below the next flush, so every profiled launch is a
non-flush one unless ``--cursor`` says otherwise. Timing belongs to the sweeps (``bench_*_kernel.py``); this only
gives a profiler the launches.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_delta_kernel import GEOMS as DELTA_GEOMS  # noqa: E402
from bench_delta_kernel import load_baseline, random_delta_step
from bench_mamba2_kernel import random_step  # noqa: E402

MAMBA2_GEOMS = {"super": (128, 64, 128, 8), "nano": (96, 80, 128, 8)}


def delta_steps(geom: str, bs: int, dtype: torch.dtype, L: int, cursor: int, steps: int):
    from replay_compile.kernels.delta_triton import delta_replay_step_triton

    Hk, HV, K, V, kda = DELTA_GEOMS[geom]
    state = torch.randn(bs, HV, K, V, device="cuda").to(dtype)
    rings, (q, k, v, g, beta) = random_delta_step(bs, Hk, HV, K, V, kda, L, 1, torch.bfloat16, "cuda")
    rings[0][-1].fill_(cursor)
    for _ in range(steps):
        delta_replay_step_triton(state, *rings[0], q, k, v, g, beta, None)


def fla_delta_steps(geom: str, bs: int, dtype: torch.dtype, L: int, cursor: int, steps: int):
    """The baseline's launches on the same inputs: fla's fused recurrent GDN / KDA step (fp32 state, as the sweep)."""
    Hk, HV, K, V, kda = DELTA_GEOMS[geom]
    fn = load_baseline(kda)
    if fn is None:
        raise SystemExit("--baseline needs fla (pip install fla-core flash-linear-attention; benchmarks/README.md)")
    state = torch.randn(bs, HV, K, V, device="cuda")
    _, (q, k, v, g, beta) = random_delta_step(bs, Hk, HV, K, V, kda, L, 1, torch.bfloat16, "cuda")
    for _ in range(steps):
        fn(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], initial_state=state,
           output_final_state=True)


def mamba2_steps(geom: str, bs: int, dtype: torch.dtype, L: int, cursor: int, steps: int):
    from replay_compile.kernels.mamba2_triton import replay_step_triton

    H, P, N, G = MAMBA2_GEOMS[geom]
    state = torch.randn(bs, H, P, N, device="cuda").to(dtype)
    rings, (x, dt, la, B, C) = random_step(bs, H, P, N, G, L, 1, torch.bfloat16, "cuda")
    rings[0][-1].fill_(cursor)
    for _ in range(steps):
        replay_step_triton(state, *rings[0], x, dt, la, B, C, None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=("delta", "mamba2"), required=True)
    ap.add_argument("--geom", required=True, help="delta: qwen35_4b, kimi_linear, ...; mamba2: super, nano")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--state-dtype", default="float32")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--cursor", type=int, default=7)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--baseline", action="store_true", help="delta: fla's fused recurrent kernel instead of ours")
    a = ap.parse_args()
    if a.cursor + a.steps > a.L - 1 and a.cursor < a.L - 1:
        ap.error(f"--cursor {a.cursor} + --steps {a.steps} reaches the flush at {a.L - 1}")
    if a.baseline and a.family != "delta":
        ap.error("--baseline: delta only (Mamba-2's baseline is mamba_ssm, profiled by name)")
    fn = (fla_delta_steps if a.baseline else delta_steps) if a.family == "delta" else mamba2_steps
    fn(a.geom, a.batch, getattr(torch, a.state_dtype), a.L, a.cursor, a.steps)
    torch.cuda.synchronize()
    who = "fla" if a.baseline else "ours"
    print(f"{a.family} ({who}) {a.geom} bs{a.batch} {a.state_dtype}: {a.steps} steps from cursor {a.cursor}")


if __name__ == "__main__":
    main()
