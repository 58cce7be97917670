"""The Mamba-2 replay ops against the exact recurrence, at every step, with the flushed state too."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import replay_compile  # noqa: F401 - registers the ops
from replay_compile.kernels.mamba2_reference import mamba2_exact_step, mamba2_plain_step
from replay_compile.state import Mamba2RingSpec
from replay_compile.testing.strategies import (
    ExactMamba2Oracle,
    buffer_lens,
    mamba2_geometries,
    mamba2_problem,
    step_schedules,
)

step_op = torch.ops.replay_compile.mamba2_step
flush_op = torch.ops.replay_compile.mamba2_flush
materialize_op = torch.ops.replay_compile.mamba2_materialize


def rings_for(state, geom, L, act_dtype, rec_dtype, fill=float("nan")):
    spec = Mamba2RingSpec(geom.H, geom.P, geom.N, geom.G, L, act_dtype, act_dtype, rec_dtype)
    rings = spec.allocate(state.shape[0], state.device)
    for r in rings[:4]:
        r.fill_(fill)  # never-written slots hold NaN: reading one would poison the result
    return rings


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / (b.double().abs().max() + 1e-12))


@given(geom=mamba2_geometries(), L=buffer_lens(32), data=st.data(),
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_step_matches_exact_recurrence_every_step(geom, L, data, dtype):
    """Random schedules (padding, permuted slots, so cursors desynchronise) over 2L+1 steps and beyond."""
    steps = data.draw(st.integers(2 * L + 1, 2 * L + 9), label="steps")
    sched = data.draw(step_schedules(geom.batch, steps), label="schedule")
    state0, seq = mamba2_problem(geom, steps, dtype=dtype, seed=data.draw(st.integers(0, 2**16), label="seed"))
    state = state0.clone()
    rings = rings_for(state, geom, L, dtype, dtype)
    oracle = ExactMamba2Oracle(state0)
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    for t, (inp, slots) in enumerate(zip(seq, sched)):
        slot_idx = torch.tensor(slots, dtype=torch.int32)
        before = state.clone()
        cursor_before = rings[-1].clone()
        y = step_op(state, *rings, inp["x"], inp["dt"], inp["la"], inp["B"], inp["C"], slot_idx)
        y_ref = oracle.step(inp, slots)
        assert rel_err(y, y_ref) <= tol, f"step {t}: output"
        assert torch.all(y[slot_idx < 0] == 0)
        # the checkpoint changes only in slots that flushed this step, and then equals the true state
        flushed = [s for s in slots if s >= 0 and int(cursor_before[s]) == L - 1]
        untouched = [s for s in range(geom.batch) if s not in flushed]
        assert torch.equal(state[untouched], before[untouched]), f"step {t}: non-flush slots written"
        if flushed:
            assert rel_err(state[flushed], oracle.state[flushed]) <= tol, f"step {t}: flushed checkpoint"
        # the materialised state of every slot is the truth
        assert rel_err(materialize_op(state, *rings), oracle.state) <= tol, f"step {t}: materialised state"
    flush_op(state, *rings)
    assert rel_err(state, oracle.state) <= tol
    assert torch.all(rings[-1] == 0)


@given(geom=mamba2_geometries(), data=st.data())
def test_buffer_len_one_is_the_plain_step_exactly(geom, data):
    state0, seq = mamba2_problem(geom, 5, dtype=torch.float32, seed=data.draw(st.integers(0, 999)))
    a, b = state0.clone(), state0.clone()
    rings = rings_for(a, geom, 1, torch.float32, torch.float32)
    for inp in seq:
        y = step_op(a, *rings, inp["x"], inp["dt"], inp["la"], inp["B"], inp["C"], None)
        y_ref = mamba2_plain_step(b, inp["x"], inp["dt"], inp["la"], inp["B"], inp["C"])
        torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert int(rings[-1].abs().sum()) == 0


@given(geom=mamba2_geometries(), L=st.integers(2, 16), data=st.data())
def test_materialize_any_count(geom, L, data):
    w = data.draw(st.integers(0, L - 1), label="records")
    state0, seq = mamba2_problem(geom, w, dtype=torch.float64, seed=data.draw(st.integers(0, 999)))
    state = state0.clone()
    rings = rings_for(state, geom, L, torch.float64, torch.float64)
    truths = [state0.clone()]
    oracle = ExactMamba2Oracle(state0)
    for inp in seq:
        step_op(state, *rings, inp["x"], inp["dt"], inp["la"], inp["B"], inp["C"], None)
        oracle.step(inp, list(range(geom.batch)))
        truths.append(oracle.state.clone())
    assert torch.equal(state, state0)
    counts = data.draw(st.lists(st.integers(0, w), min_size=geom.batch, max_size=geom.batch), label="counts")
    got = materialize_op(state, *rings, torch.tensor(counts), None)
    for row, c in enumerate(counts):
        if c == 0:
            assert torch.equal(got[row], state0[row]), "count 0 must be an exact copy"
        else:
            torch.testing.assert_close(got[row], truths[c][row], rtol=1e-10, atol=1e-10)


def test_materialize_rejects_count_beyond_cursor():
    from replay_compile.testing.strategies import Mamba2Geometry
    geom = Mamba2Geometry(2, 2, 3, 4, 1, 1)
    state, seq = mamba2_problem(geom, 1)
    rings = rings_for(state, geom, 4, torch.float64, torch.float64)
    step_op(state, *rings, seq[0]["x"], seq[0]["dt"], seq[0]["la"], seq[0]["B"], seq[0]["C"], None)
    with pytest.raises(ValueError, match="count"):
        materialize_op(state, *rings, torch.tensor([2, 0]), None)


def test_exact_step_matches_hf_semantics():
    """The oracle itself: softplus(dt + bias), A < 0, groups, D skip and z gate, against a literal loop."""
    torch.manual_seed(0)
    b, H, P, N, G = 2, 4, 3, 5, 2
    state = torch.randn(b, H, P, N, dtype=torch.float64)
    x, dt, z = torch.randn(b, H, P, dtype=torch.float64), torch.randn(b, H, dtype=torch.float64), \
        torch.randn(b, H, P, dtype=torch.float64)
    A, D, bias = -torch.rand(H, dtype=torch.float64) - 0.1, torch.randn(H, dtype=torch.float64), \
        torch.randn(H, dtype=torch.float64)
    B, C = torch.randn(b, G, N, dtype=torch.float64), torch.randn(b, G, N, dtype=torch.float64)
    expect_state = state.clone()
    y_loop = torch.zeros(b, H, P, dtype=torch.float64)
    for i in range(b):
        for h in range(H):
            g = h // (H // G)
            d = torch.nn.functional.softplus(dt[i, h] + bias[h])
            expect_state[i, h] = torch.exp(d * A[h]) * expect_state[i, h] + d * torch.outer(x[i, h], B[i, g])
            y_loop[i, h] = (expect_state[i, h] @ C[i, g] + D[h] * x[i, h]) * torch.nn.functional.silu(z[i, h])
    y = mamba2_exact_step(state, x, dt, A, B, C, D=D, z=z, dt_bias=bias, dt_softplus=True)
    torch.testing.assert_close(y, y_loop)
    torch.testing.assert_close(state, expect_state)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32])
def test_low_precision_checkpoint_and_activations(state_dtype, act_dtype):
    """bf16/fp16 checkpoints and bf16 records: close to the fp64 truth, rounding once per flush."""
    from replay_compile.testing.strategies import Mamba2Geometry
    geom, L = Mamba2Geometry(3, 4, 8, 6, 2, 2), 4
    state0, seq = mamba2_problem(geom, 3 * L + 1, dtype=torch.float64, seed=1)
    state = state0.to(state_dtype)
    rings = rings_for(state, geom, L, act_dtype, torch.float32)
    oracle = ExactMamba2Oracle(state.to(torch.float64))
    for inp in seq:
        inp_c = {k: v.to(act_dtype) if k in ("x", "B", "C") else v.float() for k, v in inp.items()}
        y = step_op(state, *rings, inp_c["x"], inp_c["dt"], inp_c["la"], inp_c["B"], inp_c["C"], None)
        y_ref = oracle.step({k: v.double() for k, v in inp_c.items()}, list(range(geom.batch)))
        assert rel_err(y, y_ref) < 3e-2
    assert y.dtype == torch.float32
    flush_op(state, *rings)
    assert state.dtype == state_dtype and rel_err(state, oracle.state) < 3e-2


def test_flush_on_empty_ring_is_a_no_op_and_padding_is_ignored():
    from replay_compile.testing.strategies import Mamba2Geometry
    geom = Mamba2Geometry(3, 2, 3, 4, 1, 1)
    state, seq = mamba2_problem(geom, 1)
    rings = rings_for(state, geom, 4, torch.float64, torch.float64)
    before = state.clone()
    flush_op(state, *rings)
    assert torch.equal(state, before)
    inp = seq[0]
    step_op(state, *rings, inp["x"], inp["dt"], inp["la"], inp["B"], inp["C"], torch.tensor([2, -1, 0]))
    assert rings[-1].tolist() == [1, 0, 1]
    flush_op(state, *rings, torch.tensor([-1, 2]))
    assert rings[-1].tolist() == [1, 0, 0]
    assert torch.equal(state[0], before[0]) and torch.equal(state[1], before[1])
    assert not torch.equal(state[2], before[2])


def test_stochastic_round_fp16_is_unbiased_and_picks_a_neighbour():
    from replay_compile.kernels.mamba2_reference import stochastic_round_fp16

    lo = torch.tensor([1.0, -3.0, 2.0**-20, 60000.0], dtype=torch.float16)       # normal, negative, subnormal, big
    hi = (lo.view(torch.int16) + 1).view(torch.float16)
    for frac in (0.1, 0.5, 0.9):
        v = lo.float() + frac * (hi.float() - lo.float())                          # [4], between neighbours
        vv = v[None, None, :, None].expand(1, 1, 4, 4096).contiguous()             # 4096 draws per value
        las = torch.linspace(-1, -0.01, 64)
        outs = torch.stack([stochastic_round_fp16(vv, la.view(1, 1), torch.tensor([0]), 1) for la in las])
        assert bool(((outs == lo[:, None]) | (outs == hi[:, None])).all()), "rounded to a non-neighbour"
        p_hi = (outs == hi[:, None]).double().mean(dim=(0, 1, 2, 4))               # per value
        assert torch.allclose(p_hi, torch.full_like(p_hi, frac), atol=0.01), (frac, p_hi)
    exact = torch.tensor([1.0, 0.0, -2.5, float("inf"), -float("inf")])[None, None, :, None]
    out = stochastic_round_fp16(exact, torch.tensor([[-0.5]]), torch.tensor([3]), 1)
    assert torch.equal(out.float(), exact), "representable values must not move"
    assert torch.isnan(stochastic_round_fp16(torch.full((1, 1, 1, 1), float("nan")), torch.tensor([[-0.5]]),
                                             torch.tensor([0]), 1)).all()
    big = stochastic_round_fp16(torch.full((1, 1, 1, 8), 1e6), torch.tensor([[-0.5]]), torch.tensor([0]), 1)
    assert bool(torch.isinf(big).all()) or bool((big == 65504).all())


def test_fp16_flush_rounds_stochastically_and_tracks_the_exact_state():
    """Many flushes of a slowly decaying state: stochastic rounding keeps the fp16 checkpoint unbiased where
    round-to-nearest of tiny increments would stall (each increment is below half an fp16 ulp)."""
    H, P, N, L = 1, 16, 16, 2
    state16 = torch.ones(1, H, P, N, dtype=torch.float16)
    exact = torch.ones(1, H, P, N, dtype=torch.float64)
    spec = Mamba2RingSpec(H, P, N, 1, L, torch.float32, torch.float32)
    rings = spec.allocate(1, "cpu")
    x = torch.full((1, H, P), 2.0**-7)
    B = torch.full((1, 1, N), 2.0**-7)
    C = torch.ones(1, 1, N)
    for t in range(400):
        la = torch.full((1, H), -1e-9 * (t + 1))           # a different key each flush
        dt = torch.ones(1, H)
        step_op(state16, *rings, x, dt, la, B, C)
        exact = exact * torch.exp(la.double())[..., None, None] + 2.0**-14
    # 400 increments of 2^-14 (a quarter ulp of fp16 at 1.0) add ~0.024: round-to-nearest would stay at 1.0
    got, want = state16.double().mean(), exact.mean()
    assert abs(float(got - want)) < 2e-3, (float(got), float(want))
