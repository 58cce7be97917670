"""The delta-rule replay ops (GDN, KDA) against the exact recurrence, at every step, with the flushed state too."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import replay_compile  # noqa: F401 - registers the ops
from replay_compile.kernels.delta_reference import delta_exact_step
from replay_compile.state import DeltaRingSpec
from replay_compile.testing.strategies import (
    DeltaGeometry,
    ExactDeltaOracle,
    buffer_lens,
    delta_geometries,
    delta_problem,
    step_schedules,
)

step_op = torch.ops.replay_compile.delta_step
flush_op = torch.ops.replay_compile.delta_flush
materialize_op = torch.ops.replay_compile.delta_materialize


def rings_for(state, geom, L, dtype, fill=float("nan")):
    rings = DeltaRingSpec(geom.HV, geom.Hk, geom.K, geom.V, L, dtype, dtype, geom.kda, dtype).allocate(
        state.shape[0], state.device)
    for r in rings[:3]:
        r.fill_(fill)  # never-written slots hold NaN: reading one would poison the result
    return rings


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / (b.double().abs().max() + 1e-12))


def args(inp):
    return [inp[k] for k in ("q", "k", "v", "g", "beta")]


@given(geom=delta_geometries(), L=buffer_lens(32), data=st.data(),
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_step_matches_exact_recurrence_every_step(geom, L, data, dtype):
    """Random schedules (padding, permuted slots: cursors desynchronise) over 2L+1 steps and beyond; GDN and KDA;
    grouped value heads; outputs every step, checkpoint after every flush, materialised state at the end."""
    steps = data.draw(st.integers(2 * L + 1, 2 * L + 9), label="steps")
    sched = data.draw(step_schedules(geom.batch, steps), label="schedule")
    state0, seq = delta_problem(geom, steps, dtype=dtype, seed=data.draw(st.integers(0, 2**16), label="seed"))
    state = state0.clone()
    rings = rings_for(state, geom, L, dtype)
    oracle = ExactDeltaOracle(state0)
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    for t, (inp, slots) in enumerate(zip(seq, sched)):
        idx = torch.tensor(slots, dtype=torch.int64)
        before = rings[-1].clone()
        o = step_op(state, *rings, *args(inp), idx)
        assert rel_err(o, oracle.step(inp, slots)) < tol, f"step {t}"
        flushed = [s for s in slots if s >= 0 and int(before[s]) == L - 1]
        if flushed:
            assert rel_err(state[flushed], oracle.state[flushed]) < tol, f"step {t}: checkpoint after flush"
    assert rel_err(materialize_op(state, *rings), oracle.state) < tol
    flush_op(state, *rings)
    assert int(rings[-1].abs().sum()) == 0
    assert rel_err(state, oracle.state) < tol


@given(geom=delta_geometries(), data=st.data())
def test_buffer_len_one_is_the_plain_step_exactly(geom, data):
    state0, seq = delta_problem(geom, 5, seed=data.draw(st.integers(0, 999)))
    a, b = state0.clone(), state0.clone()
    rings = rings_for(a, geom, 1, torch.float64)
    for inp in seq:
        oa = step_op(a, *rings, *args(inp))
        ob = delta_exact_step(b, *args(inp))
        assert rel_err(oa, ob) < 1e-12
        assert rel_err(a, b) < 1e-12


@given(geom=delta_geometries(), L=st.integers(2, 16), data=st.data())
def test_materialize_any_count_and_non_flush_leaves_checkpoint(geom, L, data):
    steps = data.draw(st.integers(0, L - 1))
    state0, seq = delta_problem(geom, steps, seed=data.draw(st.integers(0, 999)))
    state = state0.clone()
    rings = rings_for(state, geom, L, torch.float64)
    truth = [state0.clone()]
    s = state0.clone()
    for inp in seq:
        step_op(state, *rings, *args(inp))
        delta_exact_step(s, *args(inp))
        truth.append(s.clone())
    assert torch.equal(state, state0), "a non-flush step wrote the checkpoint"
    n = data.draw(st.integers(0, steps))
    got = materialize_op(state, *rings, torch.full((geom.batch,), n, dtype=torch.int64))
    assert rel_err(got, truth[n]) < 1e-10
    if n == 0:
        assert torch.equal(got, state0)


def test_kda_gate_differs_per_channel():
    """Negative control: a per-channel gate must not be treated as a per-head one."""
    geom = DeltaGeometry(2, 2, 2, 4, 3, kda=True)
    state0, seq = delta_problem(geom, 3, seed=1)
    state = state0.clone()
    rings = rings_for(state, geom, 4, torch.float64)
    oracle = ExactDeltaOracle(state0)
    for inp in seq:
        o = step_op(state, *rings, *args(inp))
        assert rel_err(o, oracle.step(inp, [0, 1])) < 1e-12
    head_gate = {**seq[-1], "g": seq[-1]["g"].mean(-1)}
    o_head = delta_exact_step(oracle.state.clone(), *args(head_gate))
    o_chan = delta_exact_step(oracle.state.clone(), *args(seq[-1]))
    assert rel_err(o_head, o_chan) > 1e-3


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kda", [False, True])
def test_low_precision_checkpoint(state_dtype, kda):
    geom = DeltaGeometry(2, 4, 2, 8, 6, kda)
    L = 4
    state0, seq = delta_problem(geom, 3 * L, dtype=torch.float32, seed=5)
    state = state0.to(state_dtype)
    rings = rings_for(state, geom, L, torch.float32)
    oracle = ExactDeltaOracle(state.float())
    for t, inp in enumerate(seq):
        o = step_op(state, *rings, *args(inp))
        ref = oracle.step(inp, [0, 1])
        assert rel_err(o, ref) < (1e-5 if state_dtype == torch.float32 else 3e-2), f"step {t}"
    assert rel_err(state.float(), oracle.state) < (1e-5 if state_dtype == torch.float32 else 3e-2)


def test_clear_errors_name_the_tensor():
    geom = DeltaGeometry(2, 4, 2, 8, 6, False)
    state0, seq = delta_problem(geom, 1, dtype=torch.float32)
    rings = rings_for(state0, geom, 4, torch.float32)
    inp = seq[0]
    with pytest.raises(ValueError, match=r"g must be \[2, 4\]"):
        step_op(state0, *rings, inp["q"], inp["k"], inp["v"], inp["g"][..., None].expand(2, 4, 8), inp["beta"])
    with pytest.raises(ValueError, match="k must be"):
        step_op(state0, *rings, inp["q"], inp["k"][:, :1], inp["v"], inp["g"], inp["beta"])
    bad = (rings[0], rings[1], rings[2].half(), rings[3])
    with pytest.raises(ValueError, match="g_ring must be float32"):
        step_op(state0, *bad, *args(inp))


def test_padding_rows_are_untouched_and_opcheck():
    geom = DeltaGeometry(3, 4, 2, 5, 6, True)
    state0, seq = delta_problem(geom, 1, dtype=torch.float32)
    rings = rings_for(state0, geom, 4, torch.float32, fill=0.0)
    before = [t.clone() for t in (state0, *rings)]
    o = step_op(state0, *rings, *args(seq[0]), torch.tensor([-1, -1, -1]))
    assert torch.count_nonzero(o) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, (state0, *rings)))
    torch.library.opcheck(step_op, (state0.clone(), *(r.clone() for r in rings), *args(seq[0]),
                                    torch.tensor([2, -1, 0])))
    torch.library.opcheck(flush_op, (state0.clone(), *(r.clone() for r in rings)))
    torch.library.opcheck(materialize_op, (state0.clone(), *rings))
