"""GPU-only: the Triton delta-rule kernel at real Qwen3.5 / Kimi-Linear geometries against an fp64 reference.

fp32 checkpoint over 4L steps, fp32 and bf16 activations: every output vs the exact fp64 recurrence (rtol 1e-4 for
fp32 activations), the checkpoint after every flush; row r sits out its first r steps, so rows flush at different
steps. On CPU machines the interpreter tests in test_delta_triton.py cover the same code on small shapes.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

from replay_compile.kernels import delta_triton as kd  # noqa: E402
from replay_compile.kernels.delta_triton import delta_replay_step_triton  # noqa: E402
from replay_compile.kernels.tuning import tuned  # noqa: E402
from replay_compile.state import DeltaRingSpec  # noqa: E402
from replay_compile.testing.strategies import DeltaGeometry, ExactDeltaOracle, delta_problem  # noqa: E402

KEYS = ("q", "k", "v", "g", "beta")


def rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).abs().max() / (b.double().abs().max().cpu() + 1e-12))


@pytest.mark.parametrize("geom, L", [
    (DeltaGeometry(3, 32, 16, 128, 128, False), 16),    # Qwen3.5-4B (GDN, 2 value heads per key head)
    (DeltaGeometry(2, 32, 32, 128, 128, True), 16),     # Kimi-Linear (KDA)
    (DeltaGeometry(2, 6, 3, 96, 80, False), 64),        # K, V not powers of two; the longest buffer
    (DeltaGeometry(2, 4, 2, 72, 40, True), 5),          # KDA, odd L
])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["fused", "split", "split:BLOCK_V=32,num_warps=4"])
def test_real_geometry_vs_fp64_over_4L_steps(geom, L, act, kind):
    with tuned(kd.TUNING, kind):
        _vs_fp64(geom, L, act)


def _vs_fp64(geom, L, act):
    steps = 4 * L
    state0, seq = delta_problem(geom, steps, dtype=torch.float32, seed=11, decay=(0.9, 1.0))
    state = state0.cuda()
    spec = DeltaRingSpec(geom.HV, geom.Hk, geom.K, geom.V, L, torch.float32, act, geom.kda)
    rings = spec.allocate(geom.batch, "cuda")
    oracle = ExactDeltaOracle(state0)
    tol = 1e-4 if act == torch.float32 else 2e-2
    for t, inp in enumerate(seq):
        inp = {k: (v.to(act) if k in ("q", "k", "v") else v) for k, v in inp.items()}
        # row r sits out its first r steps (padded), so rows flush at different steps
        slots = [r if t >= r else -1 for r in range(geom.batch)]
        idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
        before = rings[-1].clone()
        o = delta_replay_step_triton(state, *rings, *(inp[k].cuda() for k in KEYS), idx)
        o_ref = oracle.step({k: v.double() for k, v in inp.items()}, slots)
        assert rel(o, o_ref) <= tol, f"step {t}"
        flushed = [s for s in slots if s >= 0 and int(before[s]) == L - 1]
        if flushed:
            assert rel(state[flushed], oracle.state[flushed]) <= tol, f"step {t}: checkpoint after flush"
    assert any(int(c) != int(rings[-1][0]) for c in rings[-1][1:]) or geom.batch == 1 or L == 1
