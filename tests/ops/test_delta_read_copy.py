"""Delta-rule (GDN / KDA) read copy: non-flush steps read a low-precision copy; every flush re-runs the
exact recurrence from the fp32 checkpoint over the raw values, so the checkpoint after a flush is the exact state
whatever the copy holds (even a copy of zeros), while outputs carry the copy's rounding. Against the fp64 oracle,
random schedules (padding, desynchronised cursors), GDN and KDA; then unmodified transformers GDN / KDA models."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_compile.ops.mamba2_readcopy import allocate_copy
from replay_compile.state import DeltaRingSpec
from replay_compile.testing.strategies import (
    ExactDeltaOracle,
    buffer_lens,
    delta_geometries,
    delta_problem,
    step_schedules,
)

OPS = torch.ops.replay_compile
OUT_TOL = {"bf16": 2e-2, "fp8_e4m3": 1.5e-1, "nvfp4": 6e-1, "nvfp4_row": 6e-1}


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / (b.double().abs().max() + 1e-12))


def args(inp):
    return [inp[k].float() for k in ("q", "k", "v", "g", "beta")]


def setup(geom, L, fmt, state0, encode=True):
    spec = DeltaRingSpec(geom.HV, geom.Hk, geom.K, geom.V, L, kda=geom.kda, read_copy=fmt)
    state = state0.float().clone()
    rings = spec.allocate(state.shape[0], "cpu")
    if encode:
        spec.sync_copy(state, rings)
    return spec, state, rings


@settings(max_examples=25, deadline=None)
@given(geom=delta_geometries(min_v=16, max_v=32), L=buffer_lens(12), data=st.data(),
       fmt=st.sampled_from(["bf16", "fp8_e4m3", "nvfp4", "nvfp4_row"]))
def test_flushed_checkpoint_is_exact_whatever_the_copy(geom, L, data, fmt):
    steps = data.draw(st.integers(2 * L + 1, 2 * L + 5), label="steps")
    sched = data.draw(step_schedules(geom.batch, steps), label="schedule")
    state0, seq = delta_problem(geom, steps, dtype=torch.float64, seed=data.draw(st.integers(0, 999), label="seed"))
    spec, state, rings = setup(geom, L, fmt, state0)
    oracle = ExactDeltaOracle(state0)
    out_err = 0.0
    for t, (inp, slots) in enumerate(zip(seq, sched)):
        idx = torch.tensor(slots, dtype=torch.int64)
        before = rings[-1].clone()
        o = OPS.delta_step_rc(state, *rings, *args(inp), idx, fmt)
        out_err = max(out_err, rel_err(o, oracle.step(inp, slots)))
        flushed = [s for s in slots if s >= 0 and int(before[s]) == L - 1]
        if flushed:
            assert rel_err(state[flushed], oracle.state[flushed]) < 2e-5, f"step {t}: checkpoint after flush"
    assert out_err < OUT_TOL[fmt], out_err
    # exact materialize and explicit flush (the raw rings, not the copy-derived corrected values)
    assert rel_err(OPS.delta_materialize_rc(state, *rings[:5], rings[-1]), oracle.state) < 2e-5
    spec.flush(state, rings)
    assert int(rings[-1].abs().sum()) == 0
    assert rel_err(state, oracle.state) < 2e-5


@pytest.mark.parametrize("kda", [False, True])
def test_a_zero_copy_spoils_outputs_but_not_the_recurrence(kda):
    """The copy is never re-encoded (left all zero): outputs between flushes are wrong, every flushed checkpoint is
    still exact, and after a flush the op rewrites the copy, so the next window's outputs are right again."""
    from replay_compile.testing.strategies import DeltaGeometry
    geom = DeltaGeometry(batch=2, HV=2, Hk=1, K=8, V=16, kda=kda)
    L = 4
    state0, seq = delta_problem(geom, 3 * L, dtype=torch.float64, seed=3)
    spec, state, rings = setup(geom, L, "bf16", state0, encode=False)
    oracle = ExactDeltaOracle(state0)
    errs = []
    for t, inp in enumerate(seq):
        o = OPS.delta_step_rc(state, *rings, *args(inp), None, "bf16")
        errs.append(rel_err(o, oracle.step(inp, [0, 1])))
        if t % L == L - 1:
            assert rel_err(state, oracle.state) < 2e-5, f"step {t}"
    assert max(errs[:L - 1]) > 0.1                       # first window: read from a zero copy
    assert max(errs[L:]) < OUT_TOL["bf16"]               # later windows: the flush rewrote the copy


def test_op_contract_and_errors():
    from replay_compile.testing.strategies import DeltaGeometry
    geom = DeltaGeometry(batch=2, HV=2, Hk=1, K=8, V=16, kda=False)
    state0, seq = delta_problem(geom, 2, dtype=torch.float64, seed=1)
    spec, state, rings = setup(geom, 4, "bf16", state0)
    torch.library.opcheck(OPS.delta_step_rc.default, (state, *rings, *args(seq[0]), None, "bf16"))
    torch.library.opcheck(OPS.delta_flush_rc.default, (state, *rings, "bf16"))
    bad = list(rings)
    bad[3] = torch.zeros(2, 2, 3, 16)                    # v_ring with the wrong L
    with pytest.raises(ValueError, match=r"v_ring must be \[S=2, HV=2, L=4, V=16\]"):
        OPS.delta_step_rc(state, *bad, *args(seq[0]), None, "bf16")
    with pytest.raises(ValueError, match="unknown read-copy format"):
        allocate_copy("int8", (2, 2, 8, 16), "cpu")


transformers = pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.parametrize("family, fmt", [("qwen3_5", "bf16"), ("qwen3_5", "nvfp4"), ("kimi_linear", "fp8_e4m3")])
def test_hf_delta_models_with_a_read_copy(family, fmt):
    from transformers import DynamicCache

    import replay_compile
    from replay_compile.bench import cache_kwarg
    from replay_compile.testing.hf_models import DELTA_FAMILY, make_inputs

    L = 4
    ref = DELTA_FAMILY[family](dtype=torch.float32, seed=0)
    rc = DELTA_FAMILY[family](dtype=torch.float32, seed=0)
    rc.forward = torch.compile(rc.forward, backend="replayssm",
                               options={"buffer_len": L, "lower": "eager", "read_copy": fmt,
                                        "read_copy_families": "gdn,kda"})
    caches = [DynamicCache(config=ref.config) for _ in range(2)]

    def logits(model, cache, tok):
        with torch.no_grad():
            return model(input_ids=tok, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1]

    replay_compile.clear_reports()
    ids = make_inputs(ref, batch=2, prompt_len=5, seed=0)
    e, c = logits(ref, caches[0], ids), logits(rc, caches[1], ids)
    tok = e.argmax(-1, keepdim=True)
    worst = 0.0
    for _ in range(2 * L + 1):
        e, c = logits(ref, caches[0], tok), logits(rc, caches[1], tok)
        worst = max(worst, rel_err(c, e))
        tok = e.argmax(-1, keepdim=True)
    assert 0.0 < worst < OUT_TOL[fmt], worst
    rewrites = [w for r in replay_compile.reports() for w in r.rewrites]
    assert rewrites and all(w.spec.read_copy == fmt for w in rewrites), [str(w) for w in rewrites]
    assert replay_compile.flush(caches[1]) >= 1


@pytest.mark.hf
def test_delta_layers_read_exactly_unless_their_family_is_given(caplog):
    """``read_copy`` alone gives the copy to Mamba-2 layers only (the delta read-copy step measured slower than exact
    reads on the H200): GDN layers keep the exact op, and the log says how to opt in."""
    import logging

    from transformers import DynamicCache

    import replay_compile
    from replay_compile.bench import cache_kwarg
    from replay_compile.testing.hf_models import DELTA_FAMILY, make_inputs

    model = DELTA_FAMILY["qwen3_5"](dtype=torch.float32, seed=0)
    fwd = torch.compile(model.forward, backend="replayssm",
                        options={"buffer_len": 4, "lower": "eager", "read_copy": "fp8_e4m3"})
    replay_compile.clear_reports()
    with caplog.at_level(logging.INFO, logger="replay_compile"), torch.no_grad():
        cache = DynamicCache(config=model.config)
        ids = make_inputs(model, batch=2, prompt_len=4, seed=0)
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        fwd(input_ids=ids[:, :1], use_cache=True, **{cache_kwarg(model): cache})
    rewrites = [w for r in replay_compile.reports() for w in r.rewrites]
    assert rewrites and all(w.spec.read_copy is None for w in rewrites)
    assert "add 'gdn' to read_copy_families" in caplog.text
