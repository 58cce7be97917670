"""The Triton speculative verify kernel and the device-side commit against the reference, step for step.

Random acceptance sequences over many verify/commit rounds (flush rows, ring wrap, padded and permuted rows):
outputs, checkpoint, the ring slots that hold records, and the cursors must agree with
``spec_verify_reference`` / ``spec_commit_reference``; and against the exact recurrence through the reference's
own property test (test_mamba2_spec_reference.py). Interpreter on CPU, compiled on CUDA.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from replay_compile.kernels.mamba2_spec_reference import (  # noqa: E402
    spec_buf_len,
    spec_commit_reference,
    spec_reset_reference,
    spec_verify_reference,
)
from replay_compile.kernels.mamba2_spec_triton import POISONED, spec_commit_triton, spec_verify_triton  # noqa: E402
from replay_compile.testing.strategies import mamba2_geometries  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def held_records(ring, w, origin, buf, slot):
    """The committed history of one slot in logical order (what verify may read): [..., w, ...] along dim 1 or 2."""
    pos = [(int(origin[slot]) + j) & (buf - 1) for j in range(int(w[slot]))]
    return ring[slot][:, pos] if ring.dim() >= 3 else ring[slot][pos]


@pytest.mark.slow
@settings(max_examples=6, deadline=None)       # CI time: ~6 s per example under the interpreter
@given(geom=mamba2_geometries(max_batch=3, max_heads=4, max_p=20, max_n=20), Bbud=st.sampled_from([8, 16]),
       T=st.integers(1, 5), act=st.sampled_from([torch.float32, torch.bfloat16]),
       state_dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())
def test_verify_and_commit_match_the_reference(geom, Bbud, T, act, state_dtype, data):
    b, H, P, N, G, Gc = geom.batch, geom.H, geom.P, geom.N, geom.G, geom.Gc
    buf = spec_buf_len(Bbud, T)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 9999), label="seed"))
    st0 = torch.randn(b, H, P, N, generator=g).to(state_dtype)
    rings0 = (torch.zeros(b, H, buf, P, dtype=act), torch.zeros(b, H, buf), torch.zeros(b, H, buf),
              torch.zeros(b, G, buf, N, dtype=act))
    curs0 = (torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.bool))
    spec_reset_reference(*curs0, Bbud, T)
    ref = [st0.clone(), *(r.clone() for r in rings0), *(c.clone() for c in curs0)]
    ker = [t.clone().to(DEV) for t in ref]
    tol = 1e-5 if act == torch.float32 and state_dtype == torch.float32 else 2e-2
    for step in range(3 * Bbud // T + 3):
        tok = dict(x=torch.randn(b, T, H, P, generator=g).to(act), dt=0.05 + torch.rand(b, T, H, generator=g),
                   la=torch.log(0.5 + 0.5 * torch.rand(b, T, H, generator=g)),
                   B=torch.randn(b, T, G, N, generator=g).to(act), C=torch.randn(b, T, Gc, N, generator=g).to(act))
        slots = data.draw(st.permutations(list(range(b))), label=f"slots {step}")
        pad = data.draw(st.lists(st.booleans(), min_size=b, max_size=b), label=f"pad {step}")
        slots = [-1 if p and step % 3 == 2 else s for s, p in zip(slots, pad)]
        idx = torch.tensor(slots, dtype=torch.int32)
        y_ref = spec_verify_reference(*ref, *(tok[k] for k in ("x", "dt", "la", "B", "C")), idx)
        y = spec_verify_triton(*ker, *(tok[k].to(DEV) for k in ("x", "dt", "la", "B", "C")), idx.to(DEV))
        assert rel(y, y_ref) < tol, f"step {step}: outputs"
        assert rel(ker[0].float(), ref[0].float()) < tol, f"step {step}: checkpoint"
        n = torch.tensor(data.draw(st.lists(st.integers(1, T), min_size=b, max_size=b), label=f"accepted {step}"))
        spec_commit_reference(*ref[5:], n, Bbud, T, buf, idx)
        spec_commit_triton(*ker[5:], n.to(DEV), Bbud, T, buf, idx.to(DEV))
        for k in range(5, 8):
            assert torch.equal(ker[k].cpu(), ref[k]), f"step {step}: cursor {k - 5}"
        for s in range(b):                           # the records a later verify reads
            for k in range(1, 5):
                a = held_records(ker[k].cpu(), ref[5], ref[6], buf, s)
                r = held_records(ref[k], ref[5], ref[6], buf, s)
                assert rel(a.float(), r.float()) < tol if a.numel() else True, f"step {step}: ring {k} slot {s}"


@pytest.mark.slow
@pytest.mark.parametrize("heads", [2, 4])
def test_window_programs_over_several_heads_match_one_head_per_program(heads):
    """``TUNING["window_heads"]``: B·C computed once for heads that share their groups; same outputs and records."""
    from replay_compile.kernels import mamba2_spec_triton as kt

    b, H, P, N, G, Gc, Bbud, T = 2, 8, 4, 16, 2, 2, 8, 3
    buf = spec_buf_len(Bbud, T)
    g = torch.Generator().manual_seed(heads)
    sets = []
    for _ in range(2):
        st0 = torch.Generator().manual_seed(0)
        sets.append([torch.randn(b, H, P, N, generator=st0).to(DEV), torch.zeros(b, H, buf, P, device=DEV),
                     torch.zeros(b, H, buf, device=DEV), torch.zeros(b, H, buf, device=DEV),
                     torch.zeros(b, G, buf, N, device=DEV), torch.zeros(b, dtype=torch.int32, device=DEV),
                     torch.zeros(b, dtype=torch.int32, device=DEV), torch.zeros(b, dtype=torch.bool, device=DEV)])
    for step in range(2 * Bbud // T + 2):
        tok = [torch.randn(b, T, H, P, generator=g), 0.05 + torch.rand(b, T, H, generator=g),
               torch.log(0.5 + 0.5 * torch.rand(b, T, H, generator=g)), torch.randn(b, T, G, N, generator=g),
               torch.randn(b, T, Gc, N, generator=g)]
        tok = [t.to(DEV) for t in tok]
        n = torch.randint(1, T + 1, (b,), generator=g).to(DEV)
        ys = []
        for i, heads_i in enumerate((1, heads)):
            kt.TUNING["window_heads"] = heads_i
            try:
                ys.append(spec_verify_triton(*sets[i], *tok))
            finally:
                kt.TUNING.pop("window_heads", None)
            spec_commit_triton(*sets[i][5:], n, Bbud, T, buf)
        assert torch.allclose(ys[0], ys[1], rtol=1e-6, atol=1e-6), f"step {step}"
        for a, r in zip(sets[0], sets[1]):
            assert torch.equal(a, r), f"step {step}"


def test_a_row_that_does_not_fit_the_ring_gets_nan_and_touches_nothing():
    H, P, N, Bbud, T = 2, 4, 16, 8, 3
    buf = spec_buf_len(Bbud, T)
    state = torch.randn(1, H, P, N, device=DEV)
    rings = [torch.randn(1, H, buf, P, device=DEV), torch.rand(1, H, buf, device=DEV),
             -torch.rand(1, H, buf, device=DEV), torch.randn(1, 1, buf, N, device=DEV)]
    w = torch.tensor([buf - 1], dtype=torch.int32, device=DEV)        # w + T > buf: a commit would never allow it
    origin, is_flush = torch.zeros(1, dtype=torch.int32, device=DEV), torch.zeros(1, dtype=torch.bool, device=DEV)
    before = [t.clone() for t in (state, *rings)]
    y = spec_verify_triton(state, *rings, w, origin, is_flush, torch.randn(1, T, H, P, device=DEV),
                           torch.rand(1, T, H, device=DEV), -torch.rand(1, T, H, device=DEV),
                           torch.randn(1, T, 1, N, device=DEV), torch.randn(1, T, 1, N, device=DEV))
    assert torch.isnan(y).all()
    assert all(torch.equal(a, b) for a, b in zip(before, (state, *rings)))


def test_an_invalid_accepted_count_poisons_the_row_so_its_next_verify_is_nan():
    H, P, N, Bbud, T = 2, 4, 16, 8, 4
    buf = spec_buf_len(Bbud, T)
    w, origin, is_flush = (torch.zeros(3, dtype=torch.int32, device=DEV), torch.zeros(3, dtype=torch.int32, device=DEV),
                           torch.zeros(3, dtype=torch.bool, device=DEV))
    n = torch.tensor([1, 5, 7], dtype=torch.int32, device=DEV)
    spec_commit_triton(w, origin, is_flush, n, Bbud, T, buf, torch.tensor([0, 1, -1], dtype=torch.int32, device=DEV))
    assert w.tolist() == [1, POISONED, 0]                  # row 2 is padding: its count is ignored
    state = torch.randn(3, H, P, N, device=DEV)
    rings = [torch.zeros(3, H, buf, P, device=DEV), torch.zeros(3, H, buf, device=DEV),
             torch.zeros(3, H, buf, device=DEV), torch.zeros(3, 1, buf, N, device=DEV)]
    y = spec_verify_triton(state, *rings, w, origin, is_flush, torch.randn(3, T, H, P, device=DEV),
                           torch.rand(3, T, H, device=DEV), -torch.rand(3, T, H, device=DEV),
                           torch.randn(3, T, 1, N, device=DEV), torch.randn(3, T, 1, N, device=DEV))
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all() and torch.isfinite(y[2]).all()
