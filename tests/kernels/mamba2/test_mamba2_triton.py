"""The Triton Mamba-2 replay kernel against the reference and the exact recurrence.

On a machine without a GPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest) on small shapes; on a
GPU the same tests run the compiled kernels on CUDA tensors.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from replay_compile.kernels import mamba2_triton as kt  # noqa: E402
from replay_compile.kernels.mamba2_reference import replay_step_reference  # noqa: E402
from replay_compile.kernels.mamba2_triton import replay_step_triton  # noqa: E402
from replay_compile.state import Mamba2RingSpec  # noqa: E402
from replay_compile.testing.strategies import (  # noqa: E402
    ExactMamba2Oracle,
    Mamba2Geometry,
    mamba2_geometries,
    mamba2_problem,
    step_schedules,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# pre with small flush tiles so that the interpreter's shapes take several of them
VARIANTS = ("whole", "pre:FLUSH_P=16,FLUSH_N=32")


def variant(name):
    """Force one kernel variant and configuration (``launch_config`` otherwise picks by batch size)."""
    return kt.tuned(kt.TUNING, name)


def rings(geom, L, act, state):
    spec = Mamba2RingSpec(geom.H, geom.P, geom.N, geom.G, L, act, act, torch.float32)
    out = spec.allocate(state.shape[0], state.device)
    for r in out[:4]:
        r.fill_(float("nan"))        # a slot the kernel reads before writing poisons the result
    return out


def rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).abs().max() / (b.double().abs().max().cpu() + 1e-12))


@settings(max_examples=10)
@given(geom=mamba2_geometries(max_batch=3, max_heads=4, max_p=20, max_n=20), L=st.integers(1, 6), data=st.data())
def test_kernel_tracks_the_exact_recurrence(geom, L, data):
    with variant(data.draw(st.sampled_from(VARIANTS), label="variant")):
        _track_exact(geom, L, data)


def _track_exact(geom, L, data):
    steps = 2 * L + 2
    sched = data.draw(step_schedules(geom.batch, steps), label="schedule")
    state0, seq = mamba2_problem(geom, steps, dtype=torch.float32, seed=data.draw(st.integers(0, 999)))
    state = state0.to(DEV)
    rg = rings(geom, L, torch.float32, state)
    oracle = ExactMamba2Oracle(state0)
    for t, (inp, slots) in enumerate(zip(seq, sched)):
        inp_d = {k: v.to(DEV) for k, v in inp.items()}
        idx = torch.tensor(slots, dtype=torch.int32, device=DEV)
        cur = rg[-1].clone()
        y = replay_step_triton(state, *rg, inp_d["x"], inp_d["dt"], inp_d["la"], inp_d["B"], inp_d["C"], idx)
        y_ref = oracle.step(inp, slots)
        assert rel(y, y_ref) < 1e-4, f"step {t}"
        flushed = [s for s in slots if s >= 0 and int(cur[s]) == L - 1]
        if flushed:
            assert rel(state[flushed], oracle.state[flushed]) < 1e-4, f"step {t}: checkpoint after flush"


@pytest.mark.slow
@pytest.mark.parametrize("geom, L", [(Mamba2Geometry(2, 4, 5, 6, 2, 4), 4), (Mamba2Geometry(3, 6, 20, 17, 3, 1), 3),
                                     (Mamba2Geometry(1, 2, 3, 40, 1, 2), 1), (Mamba2Geometry(2, 2, 8, 8, 2, 2), 20)])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", VARIANTS)
def test_kernel_matches_reference_bitwise_contract(geom, L, act, state_dtype, kind):
    """Same outputs, same checkpoint, same rings and cursors as the reference, step for step."""
    with variant(kind):
        _match_reference(geom, L, act, state_dtype)


@pytest.mark.slow
@pytest.mark.parametrize("geom, L", [(Mamba2Geometry(2, 4, 5, 6, 2, 4), 4), (Mamba2Geometry(2, 2, 8, 8, 2, 2), 20),
                                     (Mamba2Geometry(2, 2, 64, 8, 2, 2), 4)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["pre:flush_per_sm=1,FLUSH_P=16,FLUSH_N=16"])
def test_pre_variant_launch_options(geom, L, state_dtype, kind):
    """``pre`` with 4 flush programs walking more tiles than there are programs; P = 64 takes the checkpoint pass's
    ``(n_pb, b, H)`` grid (the other geometries' P takes ``(n_pb, H, b)``)."""
    with variant(kind):
        _match_reference(geom, L, torch.float32, state_dtype)


@pytest.mark.parametrize("kind, int_poison", [("pre", 2)])
def test_pre_step_scratch_poisoned(kind, int_poison, monkeypatch):
    """Every scratch buffer of the ``pre`` step is written before it is read: with each fresh allocation poisoned
    (int32 to ``int_poison``, floats to NaN) the step still matches the reference, padding rows and flushes
    included. The flush list comes from ``torch.empty`` and only its count is zeroed; a count not zeroed lists
    poisoned entries, row 2 (slot 0), which then folds on steps where it must not."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(int_poison) if t.dtype == torch.int32 else t.fill_(float("nan")) if t.is_floating_point() \
            else t
    monkeypatch.setattr(torch, "empty", poisoned)
    geom, L = Mamba2Geometry(3, 4, 5, 6, 2, 2), 3
    st0, seq = mamba2_problem(geom, 2 * L + 3, dtype=torch.float32, seed=5)
    sa, sb = st0.to(DEV), st0.to(DEV).clone()
    ra, rb = rings(geom, L, torch.float32, sa), rings(geom, L, torch.float32, sb)
    for r in ra[:4] + rb[:4]:
        r.zero_()
    idx = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEV)          # row 1 pads; slot 1 is never stepped
    with variant(kind):
        for t, inp in enumerate(seq):
            i = {k: v.to(DEV) for k, v in inp.items()}
            ya = replay_step_triton(sa, *ra, i["x"], i["dt"], i["la"], i["B"], i["C"], idx)
            yb = replay_step_reference(sb, *rb, i["x"], i["dt"], i["la"], i["B"], i["C"], idx)
            assert rel(ya, yb) < 1e-5 and torch.count_nonzero(ya[1]) == 0, f"step {t}"
            assert rel(sa, sb) < 1e-5 and torch.equal(sa[1], st0[1].to(DEV)), f"step {t}: checkpoint"
            assert torch.equal(ra[-1], rb[-1]), f"step {t}: cursor"


def test_folded_cursor_advance_walks_more_rows_than_programs():
    """6 rows, 4 flush programs (interpreter): each program advances more than one row's cursor."""
    with variant("pre:flush_per_sm=1"):
        _match_reference(Mamba2Geometry(6, 1, 4, 8, 1, 1), 3, torch.float32, torch.float32)


@pytest.mark.parametrize("geom", [Mamba2Geometry(3, 6, 5, 8, 2, 2), Mamba2Geometry(2, 12, 4, 8, 1, 1)], ids=str)
@pytest.mark.parametrize("kind", ["pre"])
def test_padded_window_head_axis(geom, kind):
    """3 (or 12) heads per group on a 4- (16-) long head axis, the padded lanes masked."""
    with variant(kind):
        _match_reference(geom, 3, torch.float32, torch.float32)


def test_window_heads_share_one_group_and_bound_the_window():
    from replay_compile.kernels.mamba2_pre_triton import window_heads

    # a padded head axis, any divisor of the group
    assert window_heads(8, 2, 4, 8, 16) == (2, 2)
    assert window_heads(96, 8, 8, 16, 16) == (12, 16)           # Nano, cb form (no P axis): a program per group
    assert window_heads(96, 8, 8, 80, 16) == (6, 8)             # with the x window: 8 x 16 x 128 lanes at most
    assert window_heads(6, 2, 2, 8, 16) == (3, 4)
    assert window_heads(128, 8, 8, 64, 16) == (16, 16)
    assert window_heads(96, 8, 8, 80, 64) == (2, 2)             # L = 64, P = 80: 2 x 64 x 128 lanes at most


def test_launch_config_picks_whole_for_small_batches_and_pre_above():
    assert kt.launch_config(8, 128, 64, 128, 16)["variant"] == "whole"
    assert kt.launch_config(9, 128, 64, 128, 16)["variant"] == "pre"
    assert kt.launch_config(8, 128, 64, 128, 16, 2)["variant"] == "whole"
    with pytest.raises(ValueError, match="unknown variant 'bogus'"), variant("bogus"):
        kt.launch_config(1, 1, 1, 1, 1)
    assert not kt.TUNING


@pytest.mark.parametrize("P, state_bytes, tile",
                         [(64, 4, (64, 2)), (80, 4, (16, 1)), (64, 2, (32, 1)), (80, 2, (32, 1))])
def test_pre_pass_tile_follows_the_checkpoint_width(P, state_bytes, tile):
    """The checkpoint pass's tile and warps (H200 sweeps): whole 64-row heads on 2 warps where 64 divides P and
    16 rows on 1 warp elsewhere for fp32 checkpoints; 32 rows on 1 warp for 2-byte ones at both."""
    cfg = kt.launch_config(256, 96, P, 128, 16, state_bytes)
    assert (cfg["variant"], cfg["BLOCK_P"], cfg["num_warps"]) == ("pre", *tile)


def _match_reference(geom, L, act, state_dtype):
    st0, seq = mamba2_problem(geom, 2 * L + 3, dtype=torch.float32, seed=3)
    sa = st0.to(DEV, state_dtype)
    sb = sa.clone()
    ra, rb = rings(geom, L, act, sa), rings(geom, L, act, sb)
    for r in ra[:4] + rb[:4]:
        r.zero_()
    idx = torch.tensor([(i * 2) % geom.batch - (1 if i == 1 and geom.batch > 2 else 0)
                        for i in range(geom.batch)], dtype=torch.int32, device=DEV)
    idx = idx if len(set(idx.tolist()) - {-1}) == len([i for i in idx.tolist() if i >= 0]) else None
    tol = 1e-5 if act == torch.float32 and state_dtype == torch.float32 else 2e-2
    for t, inp in enumerate(seq):
        i = {k: (v.to(DEV, act) if k in ("x", "B", "C") else v.to(DEV)) for k, v in inp.items()}
        ya = replay_step_triton(sa, *ra, i["x"], i["dt"], i["la"], i["B"], i["C"], idx)
        yb = replay_step_reference(sb, *rb, i["x"], i["dt"], i["la"], i["B"], i["C"], idx)
        assert rel(ya, yb) < tol, f"step {t}"
        assert rel(sa.float(), sb.float()) < tol, f"step {t}: checkpoint"
        assert torch.equal(ra[-1], rb[-1]), f"step {t}: cursor"
        for k in range(4):
            assert rel(ra[k].float(), rb[k].float()) < tol, f"step {t}: ring {k}"


@pytest.mark.parametrize("kind", VARIANTS)
def test_padded_rows_are_untouched_and_zero(kind):
    with variant(kind):
        _padded_rows()


def _padded_rows():
    geom = Mamba2Geometry(2, 2, 4, 4, 1, 1)
    st0, seq = mamba2_problem(geom, 1, dtype=torch.float32)
    state = st0.to(DEV)
    rg = rings(geom, 4, torch.float32, state)
    for r in rg[:4]:
        r.zero_()
    before = [t.clone() for t in (state, *rg)]
    i = {k: v.to(DEV) for k, v in seq[0].items()}
    y = replay_step_triton(state, *rg, i["x"], i["dt"], i["la"], i["B"], i["C"],
                           torch.tensor([-1, -1], dtype=torch.int32, device=DEV))
    assert torch.count_nonzero(y) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, (state, *rg)))


@pytest.mark.parametrize("kind", VARIANTS)
def test_fp16_flush_stochastic_rounding_is_bit_identical_to_the_reference(kind):
    with variant(kind):
        _fp16_stochastic()


def _fp16_stochastic():
    """Inputs on a dyadic grid make every fold exact in fp32 whatever the summation order, so the kernel and the
    reference round the same fp32 values with the same hash: the fp16 checkpoints must agree bit for bit, and
    they must differ from plain round-to-nearest (the stochastic path is really taken)."""
    H, P, N, G, L, b = 4, 20, 24, 2, 4, 3
    gen = torch.Generator().manual_seed(0)

    def grid(*shape, scale):                    # integers in [-8, 8] times 2^-scale: exact products and sums
        return torch.randint(-8, 9, shape, generator=gen).float() * 2.0**-scale

    state = (1 + grid(b, H, P, N, scale=4)).to(torch.float16)
    sa, sb, sc = state.clone().to(DEV), state.clone(), state.float()          # sc: fp32 checkpoint, exact here
    geom = Mamba2Geometry(b, H, P, N, G, G)
    ra, rb, rc = (rings(geom, L, torch.float32, s) for s in (sa, sb, sc))
    for t in range(2 * L):
        x, B, C = grid(b, H, P, scale=6), grid(b, G, N, scale=6), grid(b, G, N, scale=3)
        dt, la = torch.full((b, H), 0.25), torch.zeros(b, H)
        ya = replay_step_triton(sa, *ra, x.to(DEV), dt.to(DEV), la.to(DEV), B.to(DEV), C.to(DEV), None)
        yb = replay_step_reference(sb, *rb, x, dt, la, B, C, None)
        replay_step_reference(sc, *rc, x, dt, la, B, C, None)
        assert rel(ya, yb) < 1e-6, f"step {t}"
        assert torch.equal(sa.cpu().view(torch.int16), sb.view(torch.int16)), f"step {t}: fp16 checkpoint bits"
        assert torch.equal(ra[-1].cpu(), rb[-1]), f"step {t}: cursor"
        if t == L - 1:                          # first flush: stochastic vs nearest rounding of the same values
            ulp = (sb.float() - sc).abs() / sc.abs().clamp_min(2.0**-14)
            assert float(ulp.max()) <= 2.0**-10, "more than one fp16 ulp from the exact fold"
            assert not torch.equal(sb, sc.to(torch.float16)), "stochastic rounding was not applied"
            assert not torch.equal(sb, state), "the fold must have changed the state"
