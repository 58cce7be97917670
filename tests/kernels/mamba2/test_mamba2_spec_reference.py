"""Speculative decoding with ReplaySSM (Mamba-2 reference): random acceptance sequences track sequential decoding.

Every verify step's T outputs must equal decoding those T tokens one by one from the committed state (fp64 exact,
fp32 close), the committed state after every commit must equal the oracle's, non-flush verifies must leave the
checkpoint bit-unchanged, across flush boundaries and ring wrap-around, for T in 1..8 and B in {8, 16, 32}.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_compile.kernels.mamba2_reference import mamba2_plain_step
from replay_compile.kernels.mamba2_spec_reference import (
    spec_buf_len,
    spec_commit_reference,
    spec_materialize_reference,
    spec_reset_reference,
    spec_verify_reference,
)
from replay_compile.testing.strategies import mamba2_geometries


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / (b.double().abs().max() + 1e-12))


def draw_tokens(g, b, T, H, P, N, G, Gc, dtype):
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(x=r(b, T, H, P), dt=(0.05 + u(b, T, H)).to(dtype), la=torch.log(0.5 + 0.5 * u(b, T, H)).to(dtype),
                B=r(b, T, G, N), C=r(b, T, Gc, N))


def oracle_outputs(S, tok, row, T):
    """Decode the row's T tokens one by one from the true state S (a copy); outputs [T, H, P] and the states."""
    S = S.clone()[None]
    ys, states = [], []
    for t in range(T):
        pick = lambda k: tok[k][row:row + 1, t].double()  # noqa: E731
        ys.append(mamba2_plain_step(S, pick("x"), pick("dt"), pick("la"), pick("B"), pick("C"))[0])
        states.append(S[0].clone())
    return torch.stack(ys), states


@settings(max_examples=12, deadline=None)
@given(geom=mamba2_geometries(max_batch=3, max_heads=4, max_p=5, max_n=5), Bbud=st.sampled_from([8, 16, 32]),
       T=st.integers(1, 8), data=st.data(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_random_acceptance_tracks_sequential_decoding(geom, Bbud, T, data, dtype):
    b, H, P, N, G, Gc = geom.batch, geom.H, geom.P, geom.N, geom.G, geom.Gc
    buf = spec_buf_len(Bbud, T)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 9999), label="seed"))
    state = torch.randn(b, H, P, N, generator=g, dtype=torch.float64).to(dtype)
    true = [state[s].double().clone() for s in range(b)]
    rings = (torch.full((b, H, buf, P), float("nan"), dtype=dtype), torch.full((b, H, buf), float("nan"), dtype=dtype),
             torch.full((b, H, buf), float("nan"), dtype=dtype), torch.full((b, G, buf, N), float("nan"), dtype=dtype))
    w, origin, is_flush = (torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.int32),
                           torch.zeros(b, dtype=torch.bool))
    spec_reset_reference(w, origin, is_flush, Bbud, T)
    tol = 1e-10 if dtype == torch.float64 else 3e-4
    flushes = wraps = 0
    for step in range(40):
        tok = draw_tokens(g, b, T, H, P, N, G, Gc, dtype)
        before = state.clone()
        was_flush = is_flush.clone()
        y = spec_verify_reference(state, *rings, w, origin, is_flush, tok["x"], tok["dt"], tok["la"], tok["B"],
                                  tok["C"])
        n = torch.tensor(data.draw(st.lists(st.integers(1, T), min_size=b, max_size=b), label=f"accepted {step}"))
        for s in range(b):
            want, states = oracle_outputs(true[s], tok, s, T)
            assert rel(y[s], want) < tol, f"step {step} row {s}: verify outputs"
            if not was_flush[s]:
                assert torch.equal(state[s], before[s]), f"step {step} row {s}: non-flush verify wrote the checkpoint"
            true[s] = states[int(n[s]) - 1]
        flushes += int(was_flush.sum())
        old_origin = origin.clone()
        spec_commit_reference(w, origin, is_flush, n, Bbud, T, buf)
        wraps += int((origin < old_origin).sum())
        assert bool((w + T <= buf).all()) and bool((w <= Bbud).all() | (T > Bbud))
        for s in range(b):
            got = spec_materialize_reference(state, *rings, w, origin, s)
            assert rel(got, true[s]) < tol, f"step {step} row {s}: committed state"
    assert flushes > 0


def test_ring_wraps_and_flushes_on_a_long_run():
    """Deterministic long run, all drafts accepted: the origin must wrap around the ring several times."""
    H, P, N, Bbud, T = 2, 3, 4, 8, 3
    buf = spec_buf_len(Bbud, T)
    g = torch.Generator().manual_seed(0)
    state = torch.randn(1, H, P, N, generator=g, dtype=torch.float64)
    true = state[0].clone()
    rings = (torch.zeros(1, H, buf, P, dtype=torch.float64), torch.zeros(1, H, buf, dtype=torch.float64),
             torch.zeros(1, H, buf, dtype=torch.float64), torch.zeros(1, 1, buf, N, dtype=torch.float64))
    w, origin, fl = (torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                     torch.zeros(1, dtype=torch.bool))
    spec_reset_reference(w, origin, fl, Bbud, T)
    origins = []
    for step in range(60):
        tok = draw_tokens(g, 1, T, H, P, N, 1, 1, torch.float64)
        y = spec_verify_reference(state, *rings, w, origin, fl, tok["x"], tok["dt"], tok["la"], tok["B"], tok["C"])
        want, states = oracle_outputs(true, tok, 0, T)
        assert rel(y[0], want) < 1e-10
        true = states[-1]
        spec_commit_reference(w, origin, fl, torch.tensor([T]), Bbud, T, buf)
        origins.append(int(origin[0]))
    wraps = sum(1 for a, b in zip(origins, origins[1:]) if b < a)
    assert wraps >= 3, origins
    assert rel(spec_materialize_reference(state, *rings, w, origin, 0), true) < 1e-10


def test_ops_wrap_the_reference_and_pass_opcheck():
    import replay_compile  # noqa: F401 - registers the ops
    verify, commit = torch.ops.replay_compile.mamba2_spec_verify, torch.ops.replay_compile.spec_commit
    H, P, N, G, Bbud, T, b = 2, 3, 4, 1, 8, 3, 2
    buf = spec_buf_len(Bbud, T)
    g = torch.Generator().manual_seed(1)
    state = torch.randn(b, H, P, N, generator=g)
    rings = (torch.zeros(b, H, buf, P), torch.zeros(b, H, buf), torch.zeros(b, H, buf), torch.zeros(b, G, buf, N))
    w, origin, fl = (torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.int32),
                     torch.zeros(b, dtype=torch.bool))
    true = [state[s].double().clone() for s in range(b)]
    for step in range(8):
        tok = draw_tokens(g, b, T, H, P, N, G, G, torch.float32)
        args = (tok["x"], tok["dt"], tok["la"], tok["B"], tok["C"])
        if step == 0:
            torch.library.opcheck(verify, (state.clone(), *(r.clone() for r in rings), w.clone(), origin.clone(),
                                           fl.clone(), *args))
        y = verify(state, *rings, w, origin, fl, *args)
        n = torch.tensor([1 + step % T, T])
        for s in range(b):
            want, states = oracle_outputs(true[s], tok, s, T)
            assert rel(y[s], want) < 3e-4
            true[s] = states[int(n[s]) - 1]
        if step == 0:
            torch.library.opcheck(commit, (w.clone(), origin.clone(), fl.clone(), n, Bbud, T))
        commit(w, origin, fl, n, Bbud, T)
    bad = torch.zeros(b, H, 12, P)                    # not a power of two
    import pytest
    with pytest.raises(ValueError, match="power of two"):
        verify(state, bad, torch.zeros(b, H, 12), torch.zeros(b, H, 12), torch.zeros(b, G, 12, N), w, origin, fl, *args)
