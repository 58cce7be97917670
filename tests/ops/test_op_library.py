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


def test_only_cuda_kernels_are_inlined():
    from replay_compile.ops.mamba2 import mamba2_step

    with pytest.raises(ValueError, match="only CUDA kernels are inlined"):
        mamba2_step.register_kernel("cpu", inline=lambda *a, **k: True)


def test_inline_switches(monkeypatch):
    from replay_compile.ops.library import inline_mode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("REPLAY_COMPILE_KERNELS", raising=False)
    monkeypatch.delenv("REPLAY_COMPILE_INLINE_KERNELS", raising=False)
    assert inline_mode() == "all"
    monkeypatch.setenv("REPLAY_COMPILE_INLINE_KERNELS", "latency")
    assert inline_mode() == "latency"
    for var, val in (("REPLAY_COMPILE_INLINE_KERNELS", "0"), ("REPLAY_COMPILE_KERNELS", "reference"),
                     ("TRITON_INTERPRET", "1")):
        with monkeypatch.context() as m:
            m.setenv(var, val)
            assert inline_mode() == "off"


def test_latency_predicates_follow_the_launch_configuration():
    """The ops are inlined by default where they launch their latency kernel (small batch), not elsewhere."""
    from replay_compile.kernels import delta_triton as kd
    from replay_compile.kernels import mamba2_triton as km
    from replay_compile.ops import delta, mamba2
    from replay_compile.state import DeltaRingSpec, Mamba2RingSpec

    def m2(b):
        st = torch.zeros(b, 128, 64, 128)
        rings = Mamba2RingSpec(128, 64, 128, 8, 16, torch.bfloat16, torch.bfloat16).allocate(b, "cpu")
        return mamba2._latency_launch(st, *rings, torch.zeros(b, 128, 64))
    assert m2(1) and not m2(64)
    with km.tuned(km.TUNING, "pre"):
        assert not m2(1)

    def d(b, kda=False):
        st = torch.zeros(b, 32, 128, 128)
        rings = DeltaRingSpec(32, 16, 128, 128, 16, torch.float32, torch.bfloat16, kda).allocate(b, "cpu")
        q = torch.zeros(b, 16, 128)
        return delta._latency_launch(st, *rings, q, q, torch.zeros(b, 32, 128))
    assert d(1) and d(1, kda=True) and not d(256)
    with km.tuned(kd.TUNING, "split"):
        assert not d(1)


def test_launch_wraps_only_while_tracing(monkeypatch):
    from replay_compile.kernels.launch import launch, traced_launches, tracing

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kernel = object()                     # never wrapped outside tracing (compiled), whatever it is
    assert launch(kernel) is kernel and not tracing()
    with traced_launches():
        with traced_launches():
            assert tracing()
        assert tracing()
    assert not tracing()


def test_interpreted_launches_pass_every_parameter(monkeypatch):
    """Under the interpreter a launch that leaves a kernel parameter to its default fails, naming it: inside a
    compiled graph ``wrap_triton`` applies no defaults (the inlined step then breaks on the GPU only)."""
    from replay_compile.kernels.launch import launch

    class Kernel:
        __name__ = "k"
        arg_names = ["a", "b", "FLAG"]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: ("ran", grid, args, kwargs)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch(Kernel())[(2,)](1, 2, FLAG=3, num_warps=1) == ("ran", (2,), (1, 2), {"FLAG": 3, "num_warps": 1})
    assert launch(Kernel())[(2,)](1, b=2, FLAG=3)[0] == "ran"
    with pytest.raises(TypeError, match=r"k launched without \['FLAG'\]"):
        launch(Kernel())[(2,)](1, 2)


def test_inline_cache_tag_follows_tuning_and_switch(monkeypatch):
    from replay_compile.kernels import mamba2_triton as kt
    from replay_compile.ops.library import inline_cache_tag

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    base = inline_cache_tag()
    assert inline_cache_tag() == base
    with kt.tuned(kt.TUNING, "pre:BLOCK_P=32"):
        assert inline_cache_tag() != base
    assert inline_cache_tag() == base
    monkeypatch.setenv("REPLAY_COMPILE_INLINE_KERNELS", "latency")
    assert inline_cache_tag() != base


def test_traced_inputs_are_compacted_but_mutated_ones_untouched():
    """The inline rule's argument pass (``compact_inputs``): a read-only input that is a strided view of a big
    broadcast (HF's log-decay) is made contiguous, so Inductor does not allocate the big layout for it; tensors the
    op mutates are the caller's own objects, strided or not."""
    from replay_compile.ops.library import compact_inputs

    big = torch.randn(4, 3, 5, 7)
    decay = big[..., 0, 0]                                   # [4, 3], strides (105, 35)
    state = torch.randn(7, 4, 3).transpose(0, 1)             # non-contiguous, mutated in place by the op
    out = compact_inputs((state, decay, 2, None), {0})
    assert out[0] is state
    assert out[1].is_contiguous() and out[1].stride() == (3, 1) and torch.equal(out[1], decay)
    assert out[2:] == (2, None)
    kw = compact_inputs({"state": state, "la": decay}, {"state"})
    assert kw["state"] is state and kw["la"].is_contiguous() and torch.equal(kw["la"], decay)
