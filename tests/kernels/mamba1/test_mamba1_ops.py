"""Mamba-1's replay ops (reference on CPU, the Triton kernel under the interpreter or on a GPU) against the exact
recurrence in fp64: outputs at every step, the true state (materialised, and in the checkpoint after each flush),
with serving-style schedules (rows in a new order every step, padded rows, slots left idle)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import replay_compile  # noqa: F401 - registers the ops
from replay_compile.kernels.mamba1_reference import mamba1_exact_step, mamba1_replay_step_reference
from replay_compile.state import Mamba1RingSpec

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ops = torch.ops.replay_compile


def _inputs(gen, b, D, N, dtype):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    dt = torch.nn.functional.softplus(r(b, D) - 1)
    return (dt * r(b, D)).to(dtype), dt.to(dtype), r(b, N).to(dtype), r(b, N).to(dtype)


def _schedule(gen, S, b, steps):
    """Per step a slot per row: a permutation of some slots, padded with -1 where fewer are live."""
    out = []
    for t in range(steps):
        live = int(torch.randint(max(1, b - 1), b + 1, (), generator=gen))
        slots = torch.randperm(S, generator=gen)[:live].tolist()
        out.append(slots + [-1] * (b - live))
    return out


def _run(step, S, b, D, N, L, steps, seed, dtype=torch.float64, device="cpu", tol=1e-12):
    gen = torch.Generator().manual_seed(seed)
    A = -torch.exp(torch.randn(D, N, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    state = torch.randn(S, D, N, generator=gen, dtype=torch.float64)
    exact = state.clone()
    state = state.to(dtype).to(device)
    spec = Mamba1RingSpec(D, N, L, rec_dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    rings = spec.allocate(S, device)
    for r in rings[:3]:
        r.fill_(float("nan"))              # a record read before it is written poisons the result
    for t, slots in enumerate(_schedule(gen, S, b, steps)):
        u, dt, B, C = (x.to(device) for x in _inputs(gen, b, D, N, dtype))
        slot_idx = torch.tensor(slots, device=device)
        y = step(state, *rings, u, dt, A.to(device), B, C, slot_idx)
        real = slot_idx >= 0
        idx = slot_idx[real].cpu()
        e = exact[idx].clone()
        want = mamba1_exact_step(e, u[real].cpu().double(), dt[real].cpu().double(), A.double(), B[real].cpu().double(),
                                 C[real].cpu().double())
        exact[idx] = e
        torch.testing.assert_close(y[real].cpu().double(), want, rtol=tol, atol=tol, msg=f"step {t} output")
        assert not y[~real].any(), "padding rows give zeros"
        torch.testing.assert_close(spec.materialize(state, rings).cpu().double(), exact, rtol=tol, atol=tol,
                                   msg=f"step {t} true state")
    spec.flush(state, rings)
    torch.testing.assert_close(state.cpu().double(), exact, rtol=tol, atol=tol)
    assert not rings[-1].any(), "a flush leaves every cursor at 0"


@settings(max_examples=15, deadline=None)
@given(D=st.integers(1, 9), N=st.integers(1, 6), L=st.integers(1, 6), b=st.integers(1, 4), seed=st.integers(0, 99))
def test_reference_op_tracks_the_exact_recurrence(D, N, L, b, seed):
    _run(ops.mamba1_step, S=b + 2, b=b, D=D, N=N, L=L, steps=2 * L + 3, seed=seed)


@pytest.mark.parametrize("D, N, L", [(40, 16, 4), (17, 5, 3), (8, 3, 1)])
def test_triton_kernel_tracks_the_exact_recurrence(D, N, L):
    pytest.importorskip("triton")
    from replay_compile.kernels.mamba1_triton import mamba1_replay_step_triton

    _run(mamba1_replay_step_triton, S=5, b=3, D=D, N=N, L=L, steps=2 * L + 3, seed=D, dtype=torch.float32,
         device=DEV, tol=2e-5)


def test_a_bad_argument_raises_before_anything_is_written():
    spec = Mamba1RingSpec(4, 3, 2)
    state = torch.randn(2, 4, 3)
    rings = spec.allocate(2, "cpu")
    before = [t.clone() for t in (state, *rings)]
    u = dt = torch.rand(2, 4)
    B = C = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"A must be \[D=4, N=3\]"):
        ops.mamba1_step(state, *rings, u, dt, torch.randn(3, 4), B, C, None)
    with pytest.raises(ValueError, match="dt_ring and A_keep must be float32"):
        ops.mamba1_step(state, rings[0], rings[1].half(), *rings[2:], u, dt, torch.randn(4, 3), B, C, None)
    with pytest.raises(ValueError, match="cursor"):
        bad = rings[-1].clone().fill_(5)
        ops.mamba1_step(state, *rings[:-1], bad, u, dt, torch.randn(4, 3), B, C, None)
    for a, b_ in zip(before, (state, *rings)):
        assert torch.equal(a, b_)


def test_reference_step_matches_the_exact_step_bit_for_bit():
    """The replay runs the records forward in the exact step's own order of operations."""
    gen = torch.Generator().manual_seed(0)
    D, N, L = 6, 4, 5
    state = torch.randn(1, D, N, generator=gen)
    exact = state.clone()
    rings = Mamba1RingSpec(D, N, L).allocate(1, "cpu")
    A = -torch.rand(D, N, generator=gen) - 0.1
    for _ in range(2 * L):
        u, dt, B, C = _inputs(gen, 1, D, N, torch.float32)
        y = mamba1_replay_step_reference(state, *rings, u, dt, A, B, C)
        assert torch.equal(y, mamba1_exact_step(exact, u, dt, A, B, C))
    assert torch.equal(state, exact)
