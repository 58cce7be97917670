"""Delta-rule windows holding very negative or -inf log-gates (GDN, KDA), in fp32.

A gate of -1e5 (or -inf, or -1e30: a decay that underflows) in the window must not cost precision in the records
after it: every output stays within 10x of the error the exact fp32 step makes (both measured against fp64), the
true state likewise, and nothing is NaN where the exact step is finite. The reference op runs under hypothesis; the
Triton kernels (every launch form: fused, split with the record-by-record and the tile window, the speculative
verify) run on fixed seeds, under the interpreter on CPU.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import replay_compile  # noqa: F401 - registers the ops
from replay_compile.kernels.delta_reference import delta_exact_step
from replay_compile.kernels.mamba2_spec_reference import spec_buf_len, spec_commit_reference, spec_reset_reference
from replay_compile.state import DeltaRingSpec
from replay_compile.testing.numerics import ULP_FLOOR, Fp32Recurrence, check_within_budget, with_extremes
from replay_compile.testing.numerics import rel_err as err
from replay_compile.testing.strategies import DeltaGeometry, ExactDeltaOracle, delta_geometries, delta_problem

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KEYS = ("q", "k", "v", "g", "beta")
EXTREMES = (-1e5, -float("inf"), -1e30, -60.0)


def extreme_problem(geom, steps, seed, frac, extreme):
    """:func:`delta_problem` in fp32 with a fraction ``frac`` of the gate entries replaced by ``extreme``."""
    state0, seq = delta_problem(geom, steps, dtype=torch.float32, seed=seed)
    return state0, with_extremes(seq, "g", frac, extreme, seed + 1)


def fp32_exact(state0):
    """The exact fp32 step (the error budget)."""
    return Fp32Recurrence(state0, delta_exact_step, KEYS)


def rings_for(geom, L, b, device=DEV):
    return DeltaRingSpec(geom.HV, geom.Hk, geom.K, geom.V, L, torch.float32, torch.float32, geom.kda,
                         torch.float32).allocate(b, device)


def run_decode(step, geom, L, steps, seed, frac, extreme):
    """Decode ``steps`` tokens through ``step(state, rings, inp) -> o``; check each output and the final true state."""
    state0, seq = extreme_problem(geom, steps, seed, frac, extreme)
    truth, exact = ExactDeltaOracle(state0), fp32_exact(state0)
    state, rings = state0.to(DEV), rings_for(geom, L, geom.batch)
    for t, inp in enumerate(seq):
        o = step(state, rings, {k: x.to(DEV) for k, x in inp.items()})
        check_within_budget(o, truth.step(inp, list(range(geom.batch))), exact.step(inp), f"step {t}")
    true_state = torch.ops.replay_compile.delta_materialize(state.cpu(), *(r.cpu() for r in rings))
    check_within_budget(true_state, truth.state, exact.state, "true state")


def reference_step(state, rings, inp):
    return torch.ops.replay_compile.delta_step(state, *rings, *(inp[k] for k in KEYS))


@settings(max_examples=20, deadline=None)
@given(geom=delta_geometries(max_batch=3, max_heads=4, max_k=16, max_v=16), L=st.integers(2, 16),
       extreme=st.sampled_from(EXTREMES), frac=st.sampled_from([0.05, 0.2, 0.5]), data=st.data())
def test_reference_step_keeps_exact_precision_with_extreme_gates(geom, L, extreme, frac, data):
    steps = data.draw(st.integers(L, 2 * L + 3), label="steps")
    run_decode(reference_step, geom, L, steps, data.draw(st.integers(0, 9999), label="seed"), frac, extreme)


def test_running_sums_would_fail_this_check():
    """The check has teeth: a window that stores running sums of the gates and subtracts them (``E_j = G_w - G_j``)
    misses the 10x budget with one gate of -1e5 among ordinary ones."""
    g = torch.log(torch.linspace(0.5, 0.95, 8, dtype=torch.float64))
    g[2] = -1e5
    exact = torch.flip(torch.cumsum(torch.flip(g, [0]), 0), [0])        # Σ_{i>=j} g_i, in fp64
    G = torch.cumsum(g.float(), 0)
    by_difference = torch.exp(G[-1] - G + g.float())                   # exp(Σ_{i>=j} g_i) from running sums
    by_suffix = torch.exp(torch.flip(torch.cumsum(torch.flip(g.float(), [0]), 0), [0]))
    tail = slice(3, None)                                               # the records after the -1e5 gate
    assert err(by_suffix[tail], torch.exp(exact[tail])) < ULP_FLOOR
    assert err(by_difference[tail], torch.exp(exact[tail])) > 100 * ULP_FLOOR


triton = pytest.importorskip("triton")
from replay_compile.kernels import delta_spec_triton as kst  # noqa: E402
from replay_compile.kernels import delta_triton as kd  # noqa: E402
from replay_compile.kernels.delta_spec_reference import delta_spec_verify_reference  # noqa: E402
from replay_compile.kernels.delta_spec_triton import delta_spec_verify_triton  # noqa: E402
from replay_compile.kernels.tuning import tuned  # noqa: E402

GEOMS = (DeltaGeometry(batch=2, HV=4, Hk=2, K=16, V=16, kda=False), DeltaGeometry(batch=2, HV=2, Hk=2, K=16, V=16,
                                                                                    kda=True))


@pytest.mark.slow
@pytest.mark.parametrize("extreme", EXTREMES[:2])         # -1e30: the reference ops
@pytest.mark.parametrize("geom", GEOMS, ids=["gdn", "kda"])
@pytest.mark.parametrize("kind", ["fused", "split"])
def test_kernel_keeps_exact_precision_with_extreme_gates(kind, geom, extreme):
    with tuned(kd.TUNING, kind):
        run_decode(lambda state, rings, inp: kd.delta_replay_step_triton(state, *rings, *(inp[k] for k in KEYS)),
                   geom, 6, 14, seed=7, frac=0.2, extreme=extreme)


@pytest.mark.parametrize("extreme", EXTREMES[:2])
@pytest.mark.parametrize("geom", GEOMS, ids=["gdn", "kda"])
@pytest.mark.parametrize("verify", ["reference", "triton"])
def test_speculative_verify_keeps_exact_precision_with_extreme_gates(verify, geom, extreme):
    """Every draft accepted: the verify's outputs are the decode outputs of the same tokens, checked as above over
    rounds that flush and wrap the ring."""
    b, HV, Hk, K, V = geom.batch, geom.HV, geom.Hk, geom.K, geom.V
    Bbud, T = 8, 3
    buf = spec_buf_len(Bbud, T)
    state0, seq = extreme_problem(geom, 5 * T, seed=3, frac=0.2, extreme=extreme)
    truth, exact = ExactDeltaOracle(state0), fp32_exact(state0)
    gshape = (b, HV, buf, K) if geom.kda else (b, HV, buf)
    rings = [state0.clone(), torch.zeros(b, HV, buf, V), torch.zeros(b, Hk, buf, K), torch.zeros(gshape),
             torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.bool)]
    spec_reset_reference(*rings[4:], Bbud, T)
    if verify == "triton":
        rings = [r.to(DEV) for r in rings]
    run = delta_spec_verify_reference if verify == "reference" else delta_spec_verify_triton
    kst.TUNING.clear()
    for rnd in range(5):
        win = {k: torch.stack([s[k] for s in seq[rnd * T:(rnd + 1) * T]], 1) for k in KEYS}   # [b, T, ...]
        o = run(*rings, *(win[k].to(rings[0].device) for k in KEYS))
        for t in range(T):
            inp = seq[rnd * T + t]
            check_within_budget(o[:, t], truth.step(inp, list(range(b))), exact.step(inp), f"round {rnd} token {t}")
        cpu = [r.cpu() for r in rings[4:]]
        spec_commit_reference(*cpu, torch.full((b,), T), Bbud, T, buf)
        for r, c in zip(rings[4:], cpu):
            r.copy_(c)
