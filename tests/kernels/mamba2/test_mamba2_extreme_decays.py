"""Mamba-2 windows holding very negative or -inf log-decays, in fp32.

The same budget as the delta rule's (``replay_compile.testing.numerics``): every output and the true state within
10x of the exact fp32 step's error against fp64, never NaN where the exact step is finite. A record's weight is
``dt_j exp(Σ_{j<i<=w} la_i)``: computed as the inclusive suffix sum minus ``la_j`` it lost the small terms once
``la_j`` was -1e5, and was NaN for -inf. The reference op runs under hypothesis; the Triton kernels (the whole,
pre variants, and the speculative verify) on fixed seeds, under the interpreter on CPU.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import replay_compile  # noqa: F401 - registers the ops
from replay_compile.kernels.mamba2_reference import mamba2_plain_step
from replay_compile.kernels.mamba2_spec_reference import (
    spec_buf_len,
    spec_commit_reference,
    spec_reset_reference,
    spec_verify_reference,
)
from replay_compile.state import Mamba2RingSpec
from replay_compile.testing.numerics import Fp32Recurrence, check_within_budget, with_extremes
from replay_compile.testing.strategies import ExactMamba2Oracle, Mamba2Geometry, mamba2_geometries, mamba2_problem

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KEYS = ("x", "dt", "la", "B", "C")
EXTREMES = (-1e5, -float("inf"), -1e30, -60.0)


def extreme_problem(geom, steps, seed, frac, extreme):
    state0, seq = mamba2_problem(geom, steps, dtype=torch.float32, seed=seed)
    return state0, with_extremes(seq, "la", frac, extreme, seed + 1)


def fp32_exact(state0):
    """The exact fp32 step (the error budget)."""
    return Fp32Recurrence(state0, mamba2_plain_step, KEYS)


def run_decode(step, geom, L, steps, seed, frac, extreme):
    state0, seq = extreme_problem(geom, steps, seed, frac, extreme)
    truth, exact = ExactMamba2Oracle(state0), fp32_exact(state0)
    state = state0.to(DEV)
    rings = Mamba2RingSpec(geom.H, geom.P, geom.N, geom.G, L, torch.float32, torch.float32,
                           torch.float32).allocate(geom.batch, DEV)
    for t, inp in enumerate(seq):
        y = step(state, rings, {k: v.to(DEV) for k, v in inp.items()})
        check_within_budget(y, truth.step(inp, list(range(geom.batch))), exact.step(inp), f"step {t}")
    true_state = torch.ops.replay_compile.mamba2_materialize(state.cpu(), *(r.cpu() for r in rings))
    check_within_budget(true_state, truth.state, exact.state, "true state")


def reference_step(state, rings, inp):
    return torch.ops.replay_compile.mamba2_step(state, *rings, *(inp[k] for k in KEYS))


@settings(max_examples=20, deadline=None)
@given(geom=mamba2_geometries(max_batch=3, max_heads=4, max_p=8, max_n=8), L=st.integers(2, 16),
       extreme=st.sampled_from(EXTREMES), frac=st.sampled_from([0.05, 0.2, 0.5]), data=st.data())
def test_reference_step_keeps_exact_precision_with_extreme_decays(geom, L, extreme, frac, data):
    steps = data.draw(st.integers(L, 2 * L + 3), label="steps")
    run_decode(reference_step, geom, L, steps, data.draw(st.integers(0, 9999), label="seed"), frac, extreme)


triton = pytest.importorskip("triton")
from replay_compile.kernels import mamba2_triton as kt  # noqa: E402
from replay_compile.kernels.mamba2_spec_triton import spec_verify_triton  # noqa: E402

GEOM = Mamba2Geometry(batch=2, H=4, P=8, N=16, G=2, Gc=2)


@pytest.mark.parametrize("extreme", EXTREMES[:2])         # -1e30: the reference ops
@pytest.mark.parametrize("kind", ["whole", "pre:FLUSH_P=16,FLUSH_N=32"])
def test_kernel_keeps_exact_precision_with_extreme_decays(kind, extreme):
    with kt.tuned(kt.TUNING, kind):
        run_decode(lambda state, rings, inp: kt.replay_step_triton(state, *rings, *(inp[k] for k in KEYS)),
                   GEOM, 6, 14, seed=5, frac=0.2, extreme=extreme)


@pytest.mark.parametrize("extreme", EXTREMES[:2])
@pytest.mark.parametrize("verify", ["reference", "triton"])
def test_speculative_verify_keeps_exact_precision_with_extreme_decays(verify, extreme):
    """Every draft accepted: the verify's outputs are the decode outputs of the same tokens, over rounds that flush
    and wrap the ring."""
    b, H, P, N, G = GEOM.batch, GEOM.H, GEOM.P, GEOM.N, GEOM.G
    Bbud, T = 8, 3
    buf = spec_buf_len(Bbud, T)
    state0, seq = extreme_problem(GEOM, 5 * T, seed=4, frac=0.2, extreme=extreme)
    truth, exact = ExactMamba2Oracle(state0), fp32_exact(state0)
    rings = [state0.clone(), torch.zeros(b, H, buf, P), torch.zeros(b, H, buf), torch.zeros(b, H, buf),
             torch.zeros(b, G, buf, N), torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.int32),
             torch.zeros(b, dtype=torch.bool)]
    spec_reset_reference(*rings[5:], Bbud, T)
    if verify == "triton":
        rings = [r.to(DEV) for r in rings]
    run = spec_verify_reference if verify == "reference" else spec_verify_triton
    for rnd in range(5):
        win = {k: torch.stack([s[k] for s in seq[rnd * T:(rnd + 1) * T]], 1) for k in KEYS}   # [b, T, ...]
        y = run(*rings, *(win[k].to(rings[0].device) for k in KEYS))
        for t in range(T):
            inp = seq[rnd * T + t]
            check_within_budget(y[:, t], truth.step(inp, list(range(b))), exact.step(inp), f"round {rnd} token {t}")
        cpu = [r.cpu() for r in rings[5:]]
        spec_commit_reference(*cpu, torch.full((b,), T), Bbud, T, buf)
        for r, c in zip(rings[5:], cpu):
            r.copy_(c)
