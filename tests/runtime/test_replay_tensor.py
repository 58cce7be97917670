"""``ReplayTensor``: a state stepped by a compiled graph, then read and written by every other path, against the
exact recurrence (the same module run eagerly on a plain tensor) at every step and at the end.

The module is a Mamba-2 step in einsum spelling (the pass's property tests cover the spellings), compiled with
``backend="replayssm"`` and ``lower="eager"``; ``L = 4`` so a few steps cross flushes.
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import replay_compile
from replay_compile import ReplayTensor
from replay_compile import state as replay_state

b, H, P, N, G = 3, 4, 6, 5, 2
L = 4


class Step(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.A = torch.nn.Parameter(-torch.rand(H, generator=g) - 0.1)

    def forward(self, state, x, dt, B, C):
        d = F.softplus(dt)
        decay = torch.exp(torch.einsum("bh,h->bh", d, self.A))[:, :, None, None]
        Bh = torch.repeat_interleave(B, H // G, dim=1)
        upd = d[:, :, None, None] * (x.unsqueeze(-1) * Bh.unsqueeze(2))
        new = state * decay + upd
        state.copy_(new)
        return torch.einsum("bhpn,bhn->bhp", new, torch.repeat_interleave(C, H // G, dim=1))


@pytest.fixture(scope="module")
def step():
    module = Step().requires_grad_(False)        # decoding: no autograd history on the states
    return module, torch.compile(module, backend="replayssm", options={"buffer_len": L, "lower": "eager"})


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, H, P, generator=g), torch.randn(b, H, generator=g), torch.randn(b, G, N, generator=g),
            torch.randn(b, G, N, generator=g))


def close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(want.abs().max())))


def stepped(step, n=6, seed=0):
    """A ReplayTensor stepped ``n`` times by the compiled module, and the exact state beside it."""
    module, compiled = step
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(b, H, P, N, generator=g)
    rt = ReplayTensor(exact.clone())
    for i in range(n):
        inp = inputs(seed * 100 + i)
        close(compiled(rt, *inp), module(exact, *inp))
    return rt, exact


def test_the_compiled_step_holds_records_and_a_read_folds_them(step):
    rt, exact = stepped(step, n=6)               # 6 steps, L = 4: two records held
    rs = replay_state.lookup(rt)
    assert rs is rt.replay and rs.dirty and rs.cursor.tolist() == [2] * b
    assert (rt.checkpoint - exact).abs().max() > 1e-3          # the storage is the checkpoint ...
    close(rt * 1, exact)                                        # ... a read is the current state
    assert rs.cursor.tolist() == [0] * b and not rs.dirty


def test_aliases_of_the_whole_state_share_its_replay_state(step):
    rt, exact = stepped(step)
    for alias in (rt.detach(), rt.data, rt[:], rt.view(b, H, P, N)):
        assert isinstance(alias, ReplayTensor) and alias.replay is rt.replay
    part = rt[1]
    assert type(part) is torch.Tensor
    close(part, exact[1])


def test_a_write_to_one_slot_folds_only_that_slot(step):
    module, compiled = step
    rt, exact = stepped(step, n=6)
    rt[1].mul_(0.5)
    exact[1].mul_(0.5)
    assert rt.replay.cursor.tolist() == [2, 0, 2]      # the other slots keep their records
    rt[0:2].add_(1.0)
    exact[0:2].add_(1.0)
    assert rt.replay.cursor.tolist() == [0, 0, 2]
    for i in range(3):
        inp = inputs(50 + i)
        close(compiled(rt, *inp), module(exact, *inp))
    close(rt * 1, exact)


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_fresh_alias_of_the_state_each_step_keeps_one_replay_state(step, wrapped):
    """A cache that hands the compiled step ``state[:]`` (a new tensor object every call)."""
    module, compiled = step
    exact = torch.randn(b, H, P, N, generator=torch.Generator().manual_seed(1))
    state = ReplayTensor(exact.clone()) if wrapped else exact.clone()
    for i in range(2 * L + 3):
        inp = inputs(i)
        close(compiled(state[:], *inp), module(exact, *inp))
    assert replay_state.lookup(state).steps == 2 * L + 3
    assert replay_state.lookup(state).cursor.tolist() == [3] * b      # records held: no fold on taking an alias
    replay_compile.flush(state)
    close(state * 1, exact)


@pytest.mark.parametrize("how", ["deepcopy", "save", "numpy", "tolist", "repr"])
def test_every_way_out_sees_the_current_state(step, how):
    rt, exact = stepped(step)
    if how == "deepcopy":
        got = copy.deepcopy(rt)
        assert type(got) is torch.Tensor
    elif how == "save":
        buf = io.BytesIO()
        torch.save(rt, buf)
        buf.seek(0)
        got = torch.load(buf)
    elif how == "numpy":
        got = torch.from_numpy(rt.numpy().copy())
    elif how == "tolist":
        got = torch.tensor(rt.tolist())
    else:
        assert repr(rt).startswith("ReplayTensor(tensor(")
        got = rt.checkpoint
    close(got, exact)


def test_a_whole_write_drops_the_records(step):
    module, compiled = step
    rt, exact = stepped(step)
    new = torch.randn(b, H, P, N)
    rt.copy_(new)
    exact.copy_(new)
    assert not rt.replay.dirty and rt.replay.cursor.tolist() == [0] * b
    close(rt.checkpoint, new)
    inp = inputs(999)
    close(compiled(rt, *inp), module(exact, *inp))


def test_another_inductor_backend_is_refused_with_the_fix(step):
    rt, _ = stepped(step)
    with pytest.raises(Exception, match="backend other than 'replayssm'"):
        torch.compile(lambda s: s * 2, backend="inductor")(rt)


OPS = st.sampled_from(["compiled", "compiled", "compiled", "eager", "row", "flush", "materialize", "reset", "read"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=24), seed=st.integers(0, 10_000))
def test_any_interleaving_of_steps_reads_and_writes_is_exact(step, ops, seed):
    """Compiled steps, eager steps (transformers' own code on the state, as in a Dynamo fallback), a write to one
    row, flushes, materialize, resets and reads, in any order, on one state; every output and the final state
    against the exact recurrence."""
    module, compiled = step
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(b, H, P, N, generator=g)
    rt = ReplayTensor(exact.clone())
    for i, op in enumerate(ops):
        inp = inputs(seed + i)
        if op == "compiled":
            close(compiled(rt, *inp), module(exact, *inp))
        elif op == "eager":
            close(module(rt, *inp), module(exact, *inp))
        elif op == "row":
            r = i % b
            rt[r].mul_(0.5)
            exact[r].mul_(0.5)
        elif op == "flush":
            replay_compile.flush(rt)
            close(rt.checkpoint, exact)
        elif op == "materialize":
            close(replay_compile.materialize(rt), exact)
        elif op == "reset":
            rt.zero_()
            exact.zero_()
        else:
            close(rt + 0, exact)
    close(rt.clone(), exact)
