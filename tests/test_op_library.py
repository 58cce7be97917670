"""``replay_compile.ops.library.replay_op``: the schema, dispatch and version bumps that ``torch.library.custom_op``
gave our ops, kept after moving them onto ``torch.library.Library``."""

import pytest
import torch
from torch import Tensor

import replay_compile  # noqa: F401 - registers the ops
from replay_compile.ops.library import ReplayOp, replay_op


def test_schema_marks_every_declared_mutation():
    schema = torch.ops.replay_compile.delta_step.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["state", "d_ring", "k_ring", "g_ring", "cursor"]
    assert not any(a.alias_info for a in torch.ops.replay_compile.delta_materialize.default._schema.arguments)


def test_mutated_tensors_get_a_version_bump_and_others_do_not():
    from replay_compile.state import DeltaRingSpec

    S, Hk, HV, K, V, L = 2, 1, 2, 4, 4, 3
    rings = DeltaRingSpec(HV, Hk, K, V, L, torch.float32, torch.float32, False).allocate(S, "cpu")
    state = torch.randn(S, HV, K, V)
    q, k = torch.randn(S, Hk, K), torch.randn(S, Hk, K)
    v, g, beta = torch.randn(S, HV, V), -torch.rand(S, HV), torch.rand(S, HV)
    before = [t._version for t in (state, *rings, q, v)]
    torch.ops.replay_compile.delta_step.default(state, *rings, q, k, v, g, beta, None)
    after = [t._version for t in (state, *rings, q, v)]
    assert all(a > b for a, b in zip(after[:5], before[:5]))        # state, three rings, cursor
    assert after[5:] == before[5:]                                  # inputs read only


def test_kernel_registration_takes_precedence_and_bumps(monkeypatch):
    calls = []

    @replay_op("replay_compile::_test_bump", mutates_args=("a",))
    def op(a: Tensor, b: Tensor) -> Tensor:
        calls.append("default")
        return b.clone()

    @op.register_kernel("cpu")
    def _(a, b):
        calls.append("cpu")            # writes nothing through torch: the wrapper must still bump a's version
        return b.clone()

    @op.register_fake
    def _(a, b):
        return torch.empty_like(b)

    a, b = torch.zeros(3), torch.ones(3)
    v = a._version
    assert torch.equal(op(a, b), b)
    assert calls == ["cpu"] and a._version > v
    torch.library.opcheck(op.default, (torch.zeros(3), torch.ones(3)))
    assert isinstance(op, ReplayOp)


def test_bad_definitions_fail_with_the_name():
    with pytest.raises(ValueError, match="not parameters"):
        replay_op("replay_compile::_test_bad", mutates_args=("x",))(lambda a: a)
    with pytest.raises(ValueError, match="qualname"):
        replay_op("other::op", mutates_args=())
    with pytest.raises(ValueError, match="device type"):
        torch_op = replay_op("replay_compile::_test_dev", mutates_args=())

        def f(a: Tensor) -> Tensor:
            return a.clone()
        torch_op(f).register_kernel("tpu")
