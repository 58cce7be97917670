"""The Triton delta-rule speculative verify kernel (GDN and KDA) against the reference, round for round.

Random acceptance sequences over many verify/commit rounds (flush rows, ring wrap, padded and permuted rows, fp32
and bf16 checkpoints, fp16 with its stochastic rounding): outputs, checkpoint, the ring slots that hold records
and the cursors must agree with ``delta_spec_verify_reference`` / ``spec_commit_reference``; the reference itself
is checked against the exact recurrence in test_delta_spec_reference.py. Interpreter on CPU, compiled on CUDA.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from replay_compile.kernels import delta_spec_triton as kt  # noqa: E402
from replay_compile.kernels.delta_spec_reference import delta_spec_verify_reference  # noqa: E402
from replay_compile.kernels.delta_spec_triton import delta_spec_verify_triton  # noqa: E402
from replay_compile.kernels.mamba2_spec_reference import spec_buf_len, spec_commit_reference, spec_reset_reference  # noqa: E402
from replay_compile.kernels.mamba2_spec_triton import spec_commit_triton  # noqa: E402
from replay_compile.testing.strategies import delta_geometries, delta_problem  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ARGS = ("q", "k", "v", "g", "beta")


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def held_records(ring, w, origin, buf, slot):
    """The committed history of one slot in logical order (what a later verify reads), along the ring axis 1."""
    pos = [(int(origin[slot]) + j) & (buf - 1) for j in range(int(w[slot]))]
    return ring[slot][:, pos]


@pytest.mark.slow
@settings(max_examples=7, deadline=None)        # CI time: ~3 s per example under the interpreter
@given(geom=delta_geometries(max_batch=3, max_heads=4, max_k=20, max_v=20), Bbud=st.sampled_from([8, 16]),
       T=st.integers(1, 8), state_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       data=st.data())
def test_verify_matches_the_reference_over_rounds(geom, Bbud, T, state_dtype, data):
    # the launch configuration large batches get (32 columns, 1-warp window) or the small-batch one
    tuning = data.draw(st.sampled_from([{}, {"BLOCK_V": 32, "num_warps": 1, "window_warps": 1}]), label="tuning")
    kt.TUNING.clear()
    kt.TUNING.update(tuning)
    try:
        _rounds(geom, Bbud, T, state_dtype, data)
    finally:
        kt.TUNING.clear()


def _rounds(geom, Bbud, T, state_dtype, data):
    b, HV, Hk, K, V = geom.batch, geom.HV, geom.Hk, geom.K, geom.V
    buf = spec_buf_len(Bbud, T)
    seed = data.draw(st.integers(0, 9999), label="seed")
    rounds = 2 * Bbud // T + 3                      # several flushes and a ring wrap
    state0, seq = delta_problem(geom, rounds * T, dtype=torch.float32, seed=seed)
    gshape = (b, HV, buf, K) if geom.kda else (b, HV, buf)
    ref = [state0.to(state_dtype), torch.zeros(b, HV, buf, V), torch.zeros(b, Hk, buf, K), torch.zeros(gshape),
           torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.bool)]
    spec_reset_reference(*ref[4:], Bbud, T)
    ker = [t.clone().to(DEV) for t in ref]
    # fp16 flushes round stochastically from the same key on both sides; allow one fp16 ulp of the checkpoint
    tol = 2e-5 if state_dtype == torch.float32 else 1e-2
    for step in range(rounds):
        win = {key: torch.stack([t[key] for t in seq[step * T:(step + 1) * T]], 1) for key in ARGS}   # [b, T, ...]
        slots = data.draw(st.permutations(list(range(b))), label=f"slots {step}")
        pad = data.draw(st.lists(st.booleans(), min_size=b, max_size=b), label=f"pad {step}")
        slots = [-1 if p and step % 3 == 2 else s for s, p in zip(slots, pad)]
        idx = torch.tensor(slots, dtype=torch.int32)
        inp = win
        o_ref = delta_spec_verify_reference(*ref, *(inp[key] for key in ARGS), idx)
        o = delta_spec_verify_triton(*ker, *(inp[key].to(DEV) for key in ARGS), idx.to(DEV))
        assert rel(o, o_ref) < tol, f"step {step}: outputs"
        assert all(bool((o[r] == 0).all()) for r in range(b) if slots[r] < 0), f"step {step}: padded rows"
        assert rel(ker[0].float(), ref[0].float()) < tol, f"step {step}: checkpoint"
        n = torch.tensor(data.draw(st.lists(st.integers(1, T), min_size=b, max_size=b), label=f"accepted {step}"))
        spec_commit_reference(*ref[4:], n, Bbud, T, buf, idx)
        spec_commit_triton(*ker[4:], n.to(DEV, torch.int32), Bbud, T, buf, idx.to(DEV))
        for k in (4, 5, 6):
            assert torch.equal(ker[k].cpu(), ref[k]), f"step {step}: cursor {k - 4}"
        for s in range(b):                          # the records a later verify reads
            for k in (1, 2, 3):
                a = held_records(ker[k].cpu(), ref[4], ref[5], buf, s)
                r = held_records(ref[k], ref[4], ref[5], buf, s)
                assert a.numel() == 0 or rel(a, r) < tol, f"step {step}: ring {k} slot {s}"


@pytest.mark.parametrize("kda", [False, True])
def test_non_flush_verify_leaves_the_checkpoint_bit_unchanged_and_a_row_past_the_ring_gets_nan(kda):
    HV, Hk, K, V, Bbud, T = 2, 1, 8, 6, 8, 3
    buf = spec_buf_len(Bbud, T)
    gshape = (2, HV, buf, K) if kda else (2, HV, buf)
    state = torch.randn(2, HV, K, V, device=DEV)
    rings = [torch.randn(2, HV, buf, V, device=DEV), torch.randn(2, Hk, buf, K, device=DEV),
             -torch.rand(gshape, device=DEV)]
    w = torch.tensor([3, buf - 1], dtype=torch.int32, device=DEV)     # row 1: w + T > buf, a commit never allows it
    origin = torch.tensor([5, 0], dtype=torch.int32, device=DEV)
    is_flush = torch.zeros(2, dtype=torch.bool, device=DEV)
    g = -torch.rand((2, T, HV, K) if kda else (2, T, HV), device=DEV)
    before = state.clone()
    ring1 = rings[0][1].clone()
    o = delta_spec_verify_triton(state, *rings, w, origin, is_flush, torch.randn(2, T, Hk, K, device=DEV),
                                 torch.nn.functional.normalize(torch.randn(2, T, Hk, K, device=DEV), dim=-1),
                                 torch.randn(2, T, HV, V, device=DEV), g, torch.rand(2, T, HV, device=DEV))
    assert torch.equal(state, before)
    assert torch.isfinite(o[0]).all() and torch.isnan(o[1]).all()
    assert torch.equal(rings[0][1], ring1)
