"""The Triton delta-rule (GDN/KDA) replay kernel against the reference and the exact recurrence.

Without a GPU the kernel runs under ``TRITON_INTERPRET=1`` (set by conftest) on small shapes; on a GPU the same
tests run it compiled on CUDA tensors.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from replay_compile.kernels import delta_triton as kd  # noqa: E402
from replay_compile.kernels.delta_reference import delta_replay_step_reference  # noqa: E402
from replay_compile.kernels.delta_triton import delta_replay_step_triton  # noqa: E402
from replay_compile.kernels.tuning import tuned  # noqa: E402
from replay_compile.state import DeltaRingSpec  # noqa: E402
from replay_compile.testing.strategies import (  # noqa: E402
    DeltaGeometry,
    ExactDeltaOracle,
    delta_geometries,
    delta_problem,
    step_schedules,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KEYS = ("q", "k", "v", "g", "beta")
# the one-launch kernel and the split launches (defaults: 32-wide slices), the split launches on 16-wide slices
# on 1 warp with the window launch on 4 warps, 64-wide slices, the fused kernel on 16-wide slices
VARIANTS = ("fused", "split", "split:BLOCK_V=16,num_warps=1,window_warps=4",
            "split:BLOCK_V=64,num_warps=2", "fused:BLOCK_V=16,num_warps=2")


def variant(name):
    """Force one kernel variant and configuration (``launch_config`` otherwise picks by batch size)."""
    return tuned(kd.TUNING, name)


def rings(geom, L, state, rec=torch.float32, fill=float("nan")):
    out = DeltaRingSpec(geom.HV, geom.Hk, geom.K, geom.V, L, rec, rec, geom.kda, torch.float32).allocate(
        state.shape[0], state.device)
    for r in out[:3]:
        r.fill_(fill)          # a slot the kernel reads before writing poisons the result
    return out


def rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).abs().max() / (b.double().abs().max().cpu() + 1e-12))


@settings(max_examples=10)
@given(geom=delta_geometries(max_batch=3, max_heads=4, max_k=20, max_v=20), L=st.integers(1, 6), data=st.data())
def test_kernel_tracks_the_exact_recurrence(geom, L, data):
    with variant(data.draw(st.sampled_from(VARIANTS), label="variant")):
        _track_exact(geom, L, data)


def _track_exact(geom, L, data):
    steps = 2 * L + 2
    sched = data.draw(step_schedules(geom.batch, steps), label="schedule")
    state0, seq = delta_problem(geom, steps, dtype=torch.float32, seed=data.draw(st.integers(0, 999)))
    state = state0.to(DEV)
    rg = rings(geom, L, state)
    oracle = ExactDeltaOracle(state0)
    for t, (inp, slots) in enumerate(zip(seq, sched)):
        idx = torch.tensor(slots, dtype=torch.int32, device=DEV)
        cur = rg[-1].clone()
        o = delta_replay_step_triton(state, *rg, *(inp[k].to(DEV) for k in KEYS), idx)
        assert rel(o, oracle.step(inp, slots)) < 1e-4, f"step {t}"
        flushed = [s for s in slots if s >= 0 and int(cur[s]) == L - 1]
        if flushed:
            assert rel(state[flushed], oracle.state[flushed]) < 1e-4, f"step {t}: checkpoint after flush"


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("kind", ["split", "fused"])
def test_flush_folds_a_full_window(kda, kind):
    """L = 16 fills the window axis (BLOCK_L = 16), so the flush folds a record from its last live slot, 14: the
    split pass's record loop runs BLOCK_L - 1 iterations. Outputs every step and the checkpoint after the flush
    against the fp64 recurrence."""
    geom = DeltaGeometry(batch=2, HV=2, Hk=1, K=8, V=16, kda=kda)
    L = 16
    state0, seq = delta_problem(geom, L + 2, dtype=torch.float32, seed=11 + kda)
    state = state0.to(DEV)
    rg = rings(geom, L, state)
    oracle = ExactDeltaOracle(state0)
    slots = list(range(geom.batch))
    with variant(kind):
        for t, inp in enumerate(seq):
            o = delta_replay_step_triton(state, *rg, *(inp[k].to(DEV) for k in KEYS), None)
            assert rel(o, oracle.step(inp, slots)) < 1e-4, f"step {t}"
            if t == L - 1:
                assert rel(state, oracle.state) < 1e-4, "checkpoint after the flush"
    assert int(rg[-1][0]) == 2                       # one flush, then two records


# the L = 20 geometry (a 32-long window axis, 43 interpreted steps: ~10 s per case) with bf16 activations only; the
# other geometries cover both activation dtypes (CI time)
_CONTRACT = [(g, L, a) for g, L in [(DeltaGeometry(2, 4, 2, 8, 6, False), 4), (DeltaGeometry(3, 4, 4, 20, 17, True), 3),
                                    (DeltaGeometry(2, 6, 3, 5, 40, False), 1)]
             for a in (torch.float32, torch.bfloat16)] + [(DeltaGeometry(2, 2, 1, 16, 16, True), 20, torch.bfloat16)]


@pytest.mark.slow
@pytest.mark.parametrize("geom, L, act", _CONTRACT)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", VARIANTS[:2])
def test_kernel_matches_reference_contract(geom, L, act, state_dtype, kind):
    """Same outputs, checkpoint, rings and cursors as the reference, step for step (padded and permuted rows)."""
    with variant(kind):
        _contract(geom, L, act, state_dtype)


def _contract(geom, L, act, state_dtype):
    # two flushes and a ring refill for short rings; for the long one (L = 20: a 32-record window axis) one flush
    # and three steps after it (CI time: 43 steps of it took ~10 s per case under the interpreter)
    st0, seq = delta_problem(geom, 2 * L + 3 if L <= 8 else L + 3, dtype=torch.float32, seed=3)
    sa = st0.to(DEV, state_dtype)
    sb = sa.clone()
    ra, rb = rings(geom, L, sa, fill=0.0), rings(geom, L, sb, fill=0.0)
    idx = torch.tensor([(i + 1) % geom.batch if i else -1 for i in range(geom.batch)], dtype=torch.int32, device=DEV)
    tol = 1e-5 if act == torch.float32 and state_dtype == torch.float32 else 2e-2
    for t, inp in enumerate(seq):
        i = {k: (v.to(DEV, act) if k in ("q", "k", "v") else v.to(DEV)) for k, v in inp.items()}
        oa = delta_replay_step_triton(sa, *ra, *(i[k] for k in KEYS), idx)
        ob = delta_replay_step_reference(sb, *rb, *(i[k] for k in KEYS), idx)
        assert rel(oa, ob) < tol, f"step {t}"
        assert rel(sa.float(), sb.float()) < tol, f"step {t}: checkpoint"
        assert torch.equal(ra[-1], rb[-1]), f"step {t}: cursor"
        for k in range(3):
            assert rel(ra[k].float(), rb[k].float()) < tol, f"step {t}: ring {k}"


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("kind", VARIANTS[:3])
def test_fp16_flush_rounding_is_bit_identical_to_the_reference(kda, kind):
    """Dyadic inputs and zero gates make every fold exact in fp32, so kernel and reference round the same values
    with the same hash: the fp16 checkpoints agree bit for bit."""
    geom = DeltaGeometry(2, 4, 2, 16, 20, kda)
    L = 3
    gen = torch.Generator().manual_seed(1)

    def grid(*shape, scale):
        return torch.randint(-8, 9, shape, generator=gen).float() * 2.0**-scale

    state = (1 + grid(2, 4, 16, 20, scale=4)).to(torch.float16)
    sa, sb = state.clone().to(DEV), state.clone()
    ra, rb = rings(geom, L, sa, fill=0.0), rings(geom, L, sb, fill=0.0)
    gshape = (2, 4, 16) if kda else (2, 4)
    for t in range(2 * L):
        inp = dict(q=grid(2, 2, 16, scale=4), k=grid(2, 2, 16, scale=4), v=grid(2, 4, 20, scale=3),
                   g=torch.zeros(gshape), beta=torch.full((2, 4), 0.5))
        with variant(kind):
            delta_replay_step_triton(sa, *ra, *(inp[k].to(DEV) for k in KEYS), None)
        delta_replay_step_reference(sb, *rb, *(inp[k] for k in KEYS), None)
        assert torch.equal(sa.cpu().view(torch.int16), sb.view(torch.int16)), f"step {t}: fp16 checkpoint bits"
    assert not torch.equal(sb, state)


@pytest.mark.parametrize("kind", VARIANTS[:3])
def test_padded_rows_are_untouched_and_zero(kind):
    geom = DeltaGeometry(2, 2, 1, 4, 4, True)
    st0, seq = delta_problem(geom, 1, dtype=torch.float32)
    state = st0.to(DEV)
    rg = rings(geom, 4, state, fill=0.0)
    before = [t.clone() for t in (state, *rg)]
    with variant(kind):
        o = delta_replay_step_triton(state, *rg, *(seq[0][k].to(DEV) for k in KEYS),
                                     torch.tensor([-1, -1], dtype=torch.int32, device=DEV))
    assert torch.count_nonzero(o) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, (state, *rg)))


@pytest.mark.slow
@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("kind", VARIANTS[1:])
def test_kernel_configs_track_the_exact_recurrence_with_poisoned_rings(kda, kind):
    """Every kernel configuration but the default fused one against the fp64 recurrence over 3 windows, rings filled
    with NaN (a stale or unwritten slot that leaks in shows), grouped heads, K and V not powers of two, a padded and a
    permuted row."""
    geom = DeltaGeometry(3, 4, 2, 12, 20, kda)
    L = 4
    steps = 3 * L
    state0, seq = delta_problem(geom, steps, dtype=torch.float32, seed=11 + kda)
    state = state0.to(DEV)
    rg = rings(geom, L, state)
    oracle = ExactDeltaOracle(state0)
    slots = [2, -1, 0]
    idx = torch.tensor(slots, dtype=torch.int32, device=DEV)
    with variant(kind):
        for t, inp in enumerate(seq):
            o = delta_replay_step_triton(state, *rg, *(inp[k].to(DEV) for k in KEYS), idx)
            assert rel(o, oracle.step(inp, slots)) < 1e-4, f"step {t}"
            assert torch.count_nonzero(o[1]) == 0, f"step {t}: padded row"
            if t % L == L - 1:
                assert rel(state[[2, 0]], oracle.state[[2, 0]]) < 1e-4, f"step {t}: checkpoint after flush"
    assert rg[-1][[0, 2]].tolist() == [0, 0]


def test_fused_launch_config_takes_32_wide_slices_on_4_warps():
    """The fused step runs 32-wide slices on 4 warps (GDN and KDA alike: measured fastest at bs 1-2 for both); a
    longer ring goes to warps by tile size, a 16-wide value head to 16-wide slices."""
    cfg = kd.launch_config(1, 32, 128, 128, 16)
    assert (cfg["variant"], cfg["BLOCK_V"], cfg["num_warps"]) == ("fused", 32, 4)
    long_ring = kd.launch_config(1, 32, 128, 128, 64)
    assert (long_ring["BLOCK_V"], long_ring["num_warps"]) == (32, 8)
    assert kd.launch_config(1, 32, 128, 16, 16)["BLOCK_V"] == 16


def test_launch_config_caps_registers_from_the_row_head_threshold():
    """The split checkpoint pass is capped at 128 registers from ``CAPPED_MIN_ROW_HEADS`` rows x value heads (it
    measured faster there, slower below); the fused kernel has no cap."""
    rows = kd.CAPPED_MIN_ROW_HEADS // 32
    assert kd.launch_config(rows, 32, 128, 128, 16)["maxnreg"] == 128
    assert kd.launch_config(rows - 1, 32, 128, 128, 16)["maxnreg"] == 0
    assert "maxnreg" not in kd.launch_config(1, 32, 128, 128, 16)


def test_register_cap_is_not_passed_to_traced_launches():
    """A launch handed to ``wrap_triton`` (inlined into an Inductor graph) gets no ``maxnreg``, as it gets no PDL."""
    from replay_compile.kernels.launch import reg_options, traced_launches

    assert reg_options(128) == {"maxnreg": 128} and reg_options(0) == {} and reg_options(None) == {}
    with traced_launches():
        assert reg_options(128) == {}
