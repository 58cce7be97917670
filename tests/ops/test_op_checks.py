"""Out-of-contract arguments to the step / flush / materialize ops of both families: a ValueError that names the
argument, raised before anything is written (checkpoint, rings and cursor bit-identical afterwards)."""

import pytest
import torch

import replay_compile  # noqa: F401
from replay_compile.state import DeltaRingSpec, Mamba2RingSpec

OPS = torch.ops.replay_compile
L = 4


def mamba2(b=3, cursor=(0, 3, 1)):
    g = torch.Generator().manual_seed(0)
    H, P, N, G = 4, 3, 5, 2
    state = torch.randn(b, H, P, N, generator=g)
    rings = list(Mamba2RingSpec(H, P, N, G, L, torch.float32, torch.float32).allocate(b, "cpu"))
    for r in rings[:4]:
        r.copy_(torch.randn(r.shape, generator=g))
    rings[-1].copy_(torch.tensor(cursor, dtype=torch.int32))
    inputs = [torch.randn(b, H, P, generator=g), torch.rand(b, H, generator=g) + 0.1, -torch.rand(b, H, generator=g),
              torch.randn(b, G, N, generator=g), torch.randn(b, G, N, generator=g)]
    return dict(state=state, rings=rings, inputs=inputs, step=OPS.mamba2_step, flush=OPS.mamba2_flush,
                materialize=OPS.mamba2_materialize)


def delta(b=3, cursor=(0, 3, 1), kda=False):
    g = torch.Generator().manual_seed(0)
    HV, Hk, K, V = 4, 2, 6, 5
    state = torch.randn(b, HV, K, V, generator=g)
    rings = list(DeltaRingSpec(HV, Hk, K, V, L, kda=kda).allocate(b, "cpu"))
    for r in rings[:3]:
        r.copy_(torch.randn(r.shape, generator=g))
    rings[-1].copy_(torch.tensor(cursor, dtype=torch.int32))
    gate = -torch.rand((b, HV, K) if kda else (b, HV), generator=g)
    inputs = [torch.randn(b, Hk, K, generator=g), torch.randn(b, Hk, K, generator=g),
              torch.randn(b, HV, V, generator=g), gate, torch.rand(b, HV, generator=g)]
    return dict(state=state, rings=rings, inputs=inputs, step=OPS.delta_step, flush=OPS.delta_flush,
                materialize=OPS.delta_materialize)


PROBLEMS = {"mamba2": mamba2, "gdn": delta, "kda": lambda **kw: delta(kda=True, **kw)}


def call(p, op, slot_idx=None, count=None):
    if op == "step":
        return p["step"](p["state"], *p["rings"], *p["inputs"], slot_idx)
    if op == "flush":
        return p["flush"](p["state"], *p["rings"], slot_idx)
    return p["materialize"](p["state"], *p["rings"], count, slot_idx)


def snapshot(p):
    return [t.clone() for t in (p["state"], *p["rings"])]


def assert_refused(p, op, match, **kw):
    """``op`` raises a ValueError matching ``match`` and leaves the checkpoint, rings and cursor bit-identical."""
    before = snapshot(p)
    with pytest.raises(ValueError, match=match):
        call(p, op, **kw)
    after = (p["state"], *p["rings"])
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused call wrote something"


@pytest.mark.parametrize("family", sorted(PROBLEMS))
@pytest.mark.parametrize("op", ["step", "flush", "materialize"])
@pytest.mark.parametrize("bad", [-1, L, 100])
def test_a_cursor_out_of_range_is_refused_before_anything_is_written(family, op, bad):
    p = PROBLEMS[family](cursor=(L - 1, bad, 1))    # rows 0 and 2 valid: a step would flush row 0 first
    assert_refused(p, op, rf"cursor values must be in \[0, L={L}\)")


@pytest.mark.parametrize("family", sorted(PROBLEMS))
@pytest.mark.parametrize("op", ["step", "flush", "materialize"])
def test_a_slot_named_twice_is_refused(family, op):
    p = PROBLEMS[family](cursor=(3, 3, 1))      # slot 0 would flush twice
    assert_refused(p, op, "slot_idx names 1 slot", slot_idx=torch.tensor([0, 0, 2]))


@pytest.mark.parametrize("family", sorted(PROBLEMS))
@pytest.mark.parametrize("op", ["step", "flush", "materialize"])
def test_a_slot_past_the_end_is_refused(family, op):
    assert_refused(PROBLEMS[family](), op, "slot_idx values must be below S=3", slot_idx=torch.tensor([0, 3, 1]))


@pytest.mark.parametrize("family", sorted(PROBLEMS))
def test_padding_rows_are_still_accepted(family):
    p = PROBLEMS[family]()
    y = call(p, "step", slot_idx=torch.tensor([2, -1, 0]))
    assert torch.isfinite(y).all() and not y[1].any()


@pytest.mark.parametrize("family", sorted(PROBLEMS))
def test_materialize_count_beyond_the_held_records_is_refused(family):
    p = PROBLEMS[family](cursor=(0, 3, 1))
    with pytest.raises(ValueError, match=r"count must be in \[0, cursor\] per row.*\[2\]"):
        call(p, "materialize", count=torch.tensor([0, 2, 2]))


@pytest.mark.parametrize("family, ring, name", [("mamba2", 0, "x_ring"), ("mamba2", 3, "B_ring"),
                                                ("gdn", 0, "d_ring"), ("gdn", 1, "k_ring")])
@pytest.mark.parametrize("op", ["step", "flush"])
def test_an_integer_ring_is_refused(family, ring, name, op):
    p = PROBLEMS[family]()
    p["rings"][ring] = p["rings"][ring].to(torch.int32)
    assert_refused(p, op, f"{name} must be a floating-point tensor")


@pytest.mark.parametrize("family", sorted(PROBLEMS))
@pytest.mark.parametrize("op", ["step", "flush", "materialize"])
def test_meta_tensors_are_refused(family, op):
    p = PROBLEMS[family]()
    p["state"], p["rings"] = p["state"].to("meta"), [r.to("meta") for r in p["rings"]]
    p["inputs"] = [t.to("meta") for t in p["inputs"]]
    with pytest.raises((ValueError, NotImplementedError, RuntimeError), match="meta"):
        call(p, op)
