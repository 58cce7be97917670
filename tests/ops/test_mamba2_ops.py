"""torch.library contract of the Mamba-2 ops: opcheck, declared mutation, clear errors on bad input."""

import pytest
import torch

import replay_compile  # noqa: F401
from replay_compile.state import Mamba2RingSpec

OPS = torch.ops.replay_compile


def problem(b=2, H=4, P=3, N=5, G=2, L=4, dtype=torch.float32, cursor=None):
    torch.manual_seed(0)
    state = torch.randn(b, H, P, N, dtype=dtype)
    rings = list(Mamba2RingSpec(H, P, N, G, L, dtype, dtype).allocate(b, "cpu"))
    for r in rings[:4]:
        r.normal_()
    rings[-1].copy_(torch.tensor(cursor if cursor is not None else [0, L - 1][:b] + [1] * (b - 2)))
    inputs = (torch.randn(b, H, P, dtype=dtype), torch.rand(b, H) + 0.1, -torch.rand(b, H),
              torch.randn(b, G, N, dtype=dtype), torch.randn(b, G, N, dtype=dtype))
    return state, rings, inputs


@pytest.mark.parametrize("slot_idx", [None, "perm", "pad"])
def test_opcheck_step(slot_idx):
    state, rings, inputs = problem(b=3)
    idx = {None: None, "perm": torch.tensor([2, 0, 1]), "pad": torch.tensor([1, -1, 0])}[slot_idx]
    torch.library.opcheck(OPS.mamba2_step.default, (state, *rings, *inputs, idx))


def test_opcheck_flush_and_materialize():
    state, rings, _ = problem(b=3, cursor=[0, 2, 3])
    torch.library.opcheck(OPS.mamba2_flush.default, (state, *rings, None))
    state, rings, _ = problem(b=3, cursor=[0, 2, 3])
    torch.library.opcheck(OPS.mamba2_materialize.default, (state, *rings, torch.tensor([0, 1, 3]), None))


def test_step_mutates_only_declared_tensors_and_allocates_fresh_output():
    state, rings, inputs = problem()
    ins = [t.clone() for t in inputs]
    y = OPS.mamba2_step(state, *rings, *inputs, None)
    assert all(torch.equal(a, b) for a, b in zip(ins, inputs)), "inputs must not be written"
    assert all(y.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in (state, *rings, *inputs))


@pytest.mark.parametrize("mutate, match", [
    (lambda s, r, i: (s[0], r, i), r"state must be \[S, H, P, N\]"),
    (lambda s, r, i: (s.to(torch.int32), r, i), "state dtype"),
    (lambda s, r, i: (s, [r[0][:, :, :, :2]] + r[1:], i), "x_ring must be"),
    (lambda s, r, i: (s, r[:1] + [r[1].half()] + r[2:], i), "dt_ring must be float32"),
    (lambda s, r, i: (s, r[:4] + [r[4].long()], i), "cursor must be int32"),
    (lambda s, r, i: (s, r, (i[0][:, :3],) + i[1:]), r"x must be \[b, H=4, P=3\]"),
    (lambda s, r, i: (s, r, i[:3] + (i[3][:, :1],) + i[4:]), r"B must be \[b=2, G=2, N=5\]"),
    (lambda s, r, i: (s, r, i[:4] + (torch.randn(2, 3, 5),)), "H % Gc == 0"),
])
def test_bad_input_errors_name_tensor_and_shape(mutate, match):
    state, rings, inputs = problem()
    s, r, i = mutate(state, rings, inputs)
    with pytest.raises(ValueError, match=match):
        OPS.mamba2_step(s, *r, *i, None)


def test_batch_must_match_slots_without_slot_idx():
    state, rings, inputs = problem(b=2)
    with pytest.raises(ValueError, match="without slot_idx"):
        OPS.mamba2_step(state, *rings, *(t[:1] for t in inputs), None)
