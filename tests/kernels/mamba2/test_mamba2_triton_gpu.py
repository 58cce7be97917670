"""GPU-only: the Triton kernel at real Nemotron geometries against an fp64 reference, over 4L steps.

fp32 checkpoint, bf16 and fp32 activations; every output vs the exact fp64 recurrence (rtol 1e-4 for fp32
activations), the checkpoint after every flush. Runs wherever CUDA is available (the H200 in this project); on CPU
machines the interpreter tests in test_mamba2_triton.py cover the same code on small shapes.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

from replay_compile.kernels import mamba2_triton as kt  # noqa: E402
from replay_compile.kernels.mamba2_triton import replay_step_triton  # noqa: E402
from replay_compile.state import Mamba2RingSpec  # noqa: E402
from replay_compile.testing.strategies import ExactMamba2Oracle, Mamba2Geometry, mamba2_problem  # noqa: E402


def rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).abs().max() / (b.double().abs().max().cpu() + 1e-12))


@pytest.mark.parametrize("geom, L", [
    (Mamba2Geometry(4, 128, 64, 128, 8, 8), 16),      # Nemotron-Super
    (Mamba2Geometry(3, 96, 80, 128, 8, 8), 16),       # Nemotron-Nano
    (Mamba2Geometry(2, 8, 24, 40, 2, 2), 64),         # the longest buffer
])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["whole", "pre"])
def test_real_geometry_vs_fp64_over_4L_steps(geom, L, act, kind):
    with kt.tuned(kt.TUNING, kind):
        _vs_fp64(geom, L, act)


def _vs_fp64(geom, L, act):
    steps = 4 * L
    state0, seq = mamba2_problem(geom, steps, dtype=torch.float32, seed=7, decay=(0.9, 1.0))
    state = state0.cuda()
    rings = Mamba2RingSpec(geom.H, geom.P, geom.N, geom.G, L, act, act).allocate(geom.batch, "cuda")
    oracle = ExactMamba2Oracle(state0)
    rows = list(range(geom.batch))
    tol = 1e-4 if act == torch.float32 else 2e-2
    for t, inp in enumerate(seq):
        inp = {k: (v.to(act) if k in ("x", "B", "C") else v) for k, v in inp.items()}
        y = replay_step_triton(state, *rings, *(inp[k].cuda() for k in ("x", "dt", "la", "B", "C")), None)
        y_ref = oracle.step({k: v.double() for k, v in inp.items()}, rows)
        assert rel(y, y_ref) <= tol, f"step {t}"
        if t % L == L - 1:
            assert int(rings[-1].max()) == 0
            assert rel(state, oracle.state) <= tol, f"step {t}: checkpoint after flush"


def _staggered_rows(geom, L, device):
    """``geom.batch`` rows on as many slots, in a shuffled order with every 7th row padding, the slots' cursors
    staggered (a quarter flushes each step at L = 4): outputs vs fp64 at every step, each flushed checkpoint."""
    steps = 3 * L
    state0, seq = mamba2_problem(geom, steps, dtype=torch.float32, seed=3, decay=(0.9, 1.0))
    state = state0.to(device)
    rg = Mamba2RingSpec(geom.H, geom.P, geom.N, geom.G, L, torch.float32, torch.float32).allocate(geom.batch, device)
    for r in rg[:4]:            # the records below a staggered cursor are identity steps (x = dt = 0, log-decay 0)
        r.zero_()
    rg[-1].copy_(torch.arange(geom.batch) % L)
    slots = torch.randperm(geom.batch, generator=torch.Generator().manual_seed(0))
    slots[::7] = -1
    slot_list = slots.tolist()
    idx = slots.to(torch.int32).to(device)
    oracle = ExactMamba2Oracle(state0)
    for t, inp in enumerate(seq):
        cur = rg[-1].clone()
        y = replay_step_triton(state, *rg, *(inp[k].to(device) for k in ("x", "dt", "la", "B", "C")), idx)
        assert rel(y, oracle.step({k: v.double() for k, v in inp.items()}, slot_list)) <= 1e-4, f"step {t}"
        flushed = [s for s in slot_list if s >= 0 and int(cur[s]) == L - 1]
        assert flushed and rel(state[flushed], oracle.state[flushed]) <= 1e-4, f"step {t}: flushed checkpoints"


@pytest.mark.parametrize("kind", ["pre", "pre:flush_per_sm=1"])
def test_many_rows_staggered_cursors_and_padding(kind):
    """300 rows: the flush walk's list holds ~65 rows on each step, never the same ones twice in a row, walked by
    the default grid and by one program per SM (many tiles each); a wrong list entry folds the wrong slot."""
    with kt.tuned(kt.TUNING, kind):
        _staggered_rows(Mamba2Geometry(300, 4, 8, 16, 2, 2), 4, "cuda")
