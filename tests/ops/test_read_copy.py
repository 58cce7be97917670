"""Read copies of the checkpoint, reference level: ordinary verifies read their outputs' checkpoint term
from the copy, flushes fold the fp32 checkpoint (never the copy) and rewrite the copy; and the drift experiment
(benchmarks/drift.py) on a short run: the exact control drifts not at all, a bf16 read copy drifts far less than a
bf16-stored state."""

import os
import sys

import pytest
import torch

from replay_compile.kernels.mamba2_spec_reference import (
    spec_buf_len,
    spec_commit_reference,
    spec_reset_reference,
    spec_verify_reference,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def _problem(b=2, H=2, P=3, N=4, G=1, T=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tok = dict(x=torch.randn(b, T, H, P, generator=g, dtype=torch.float64),
               dt=0.1 + torch.rand(b, T, H, generator=g, dtype=torch.float64),
               B=torch.randn(b, T, G, N, generator=g, dtype=torch.float64),
               C=torch.randn(b, T, G, N, generator=g, dtype=torch.float64))
    tok["la"] = -tok["dt"] * 0.3
    return tok


def test_ordinary_rows_read_the_copy_and_flushes_fold_the_fp32_checkpoint():
    b, H, P, N, G, T, Bbud = 2, 2, 3, 4, 1, 2, 4
    buf = spec_buf_len(Bbud, T)
    state = torch.randn(b, H, P, N, dtype=torch.float64)
    copy = state + 0.25                                              # a visibly different read copy
    rings = [torch.zeros(b, H, buf, P, dtype=torch.float64), torch.zeros(b, H, buf, dtype=torch.float64),
             torch.zeros(b, H, buf, dtype=torch.float64), torch.zeros(b, G, buf, N, dtype=torch.float64)]
    curs = [torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.bool)]
    spec_reset_reference(*curs, Bbud, T)
    fmt = lambda s: s * 2                                          # noqa: E731 - any function: it is what gets stored
    flushed = False
    for step in range(4):
        tok = _problem(T=T, seed=step)
        args = [tok[k] for k in ("x", "dt", "la", "B", "C")]
        before, copy_before, was_flush = state.clone(), copy.clone(), curs[2].clone()
        plain_rings = [r.clone() for r in rings]
        y_copy = spec_verify_reference(state, *rings, *curs, *args, read_state=copy, read_format=fmt)
        y_with = spec_verify_reference(copy_before.clone(), *plain_rings, *curs, *args)
        for s in range(b):
            if not was_flush[s]:
                assert torch.equal(state[s], before[s])              # the checkpoint is untouched
                assert torch.equal(copy[s], copy_before[s])
                assert torch.allclose(y_copy[s], y_with[s])          # outputs as if the copy were the checkpoint
            else:
                flushed = True
                assert not torch.equal(state[s], before[s])          # folded from the fp32 checkpoint ...
                assert torch.equal(copy[s], fmt(state[s]))           # ... and the copy rewritten from it
        spec_commit_reference(*curs, torch.full((b,), T), Bbud, T, buf)
    assert flushed


def test_drift_control_is_exact_and_a_read_copy_drifts_less_than_a_stored_state():
    pytest.importorskip("transformers")
    import drift

    per_pos, summary = drift.run(tokens=96, formats=["bf16"], buffer_len=16, device="cpu")
    s = {r["variant"]: r for r in summary}
    assert s["replay/fp32"]["mean_kl"] < 1e-6
    assert s["replay/bf16"]["mean_kl"] * 10 < s["quantized/bf16"]["mean_kl"]
    assert per_pos["quantized/bf16"].shape == (96,)


@pytest.mark.parametrize("kda", [False, True])
def test_delta_rule_recurrence_never_sees_the_copy(kda):
    """With a garbage read copy (all zeros after every flush), the fp32 checkpoint still follows the exact
    recurrence of the accepted tokens: flushes re-run it over the raw inputs instead of using the stored corrected
    values (which were computed from the copy)."""
    from replay_compile.kernels.delta_reference import delta_exact_step
    from replay_compile.kernels.delta_spec_reference import delta_spec_exact_fold, delta_spec_verify_reference
    from replay_compile.testing.strategies import DeltaGeometry, delta_problem

    geom = DeltaGeometry(batch=2, HV=2, Hk=1, K=3, V=4, kda=kda)
    T, Bbud, rounds = 3, 8, 12
    buf = spec_buf_len(Bbud, T)
    state0, seq = delta_problem(geom, rounds * T, seed=3)
    state = state0.clone()
    true = state0.clone()
    b, HV, Hk, K, V = 2, 2, 1, 3, 4
    gshape = (b, HV, buf, K) if kda else (b, HV, buf)
    rings = [torch.zeros(b, HV, buf, V, dtype=torch.float64), torch.zeros(b, Hk, buf, K, dtype=torch.float64),
             torch.zeros(gshape, dtype=torch.float64)]
    raw = dict(v_ring=torch.zeros(b, HV, buf, V, dtype=torch.float64),
               beta_ring=torch.zeros(b, HV, buf, dtype=torch.float64))
    copy = torch.zeros_like(state)
    curs = [torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.bool)]
    spec_reset_reference(*curs, Bbud, T)
    g = torch.Generator().manual_seed(0)
    for r in range(rounds):
        toks = seq[r * T:(r + 1) * T]
        win = [torch.stack([t[key] for t in toks], 1) for key in ("q", "k", "v", "g", "beta")]
        delta_spec_verify_reference(state, *rings, *curs, *win, read_state=copy, read_format=torch.zeros_like, **raw)
        n = torch.randint(1, T + 1, (b,), generator=g)
        for s in range(b):
            for t in range(int(n[s])):
                delta_exact_step(true[s:s + 1], *(toks[t][key][s:s + 1] for key in ("q", "k", "v", "g", "beta")))
        spec_commit_reference(*curs, n, Bbud, T, buf)
        for s in range(b):
            got = delta_spec_exact_fold(state, rings[1], rings[2], raw["v_ring"], raw["beta_ring"], curs[0], curs[1], s)
            assert torch.allclose(got, true[s], rtol=1e-10, atol=1e-12), f"round {r} slot {s}"


def test_drift_read_copy_helps_the_delta_rule_too():
    pytest.importorskip("transformers")
    import drift

    _, summary = drift.run(tokens=64, formats=["bf16"], buffer_len=16, device="cpu", family="qwen3_5")
    s = {r["variant"]: r for r in summary}
    assert s["replay/fp32"]["mean_kl"] < 1e-6
    assert s["replay/bf16"]["mean_kl"] * 10 < s["quantized/bf16"]["mean_kl"]
