"""Speculative decoding with ReplaySSM, delta rule (GDN and KDA reference): random acceptance sequences over 40
steps track sequential decoding of the accepted tokens; committed state after every commit; non-flush verifies
leave the checkpoint bit-unchanged; T in 1..8, B in {8, 16, 32}."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_compile.kernels.delta_reference import delta_exact_step
from replay_compile.kernels.delta_spec_reference import delta_spec_materialize_reference, delta_spec_verify_reference
from replay_compile.kernels.mamba2_spec_reference import spec_buf_len, spec_commit_reference, spec_reset_reference
from replay_compile.testing.strategies import delta_geometries, delta_problem


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / (b.double().abs().max() + 1e-12))


@settings(max_examples=12, deadline=None)
@given(geom=delta_geometries(max_batch=3, max_heads=4, max_k=5, max_v=5), Bbud=st.sampled_from([8, 16, 32]),
       T=st.integers(1, 8), data=st.data(), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_random_acceptance_tracks_sequential_decoding(geom, Bbud, T, data, dtype):
    b, HV, Hk, K, V = geom.batch, geom.HV, geom.Hk, geom.K, geom.V
    buf = spec_buf_len(Bbud, T)
    seed = data.draw(st.integers(0, 9999), label="seed")
    state0, seq = delta_problem(geom, 40 * T, dtype=dtype, seed=seed)
    state = state0.clone()
    true = [state0[s].double().clone() for s in range(b)]
    nan = float("nan")
    gshape = (b, HV, buf, K) if geom.kda else (b, HV, buf)
    rings = (torch.full((b, HV, buf, V), nan, dtype=dtype), torch.full((b, Hk, buf, K), nan, dtype=dtype),
             torch.full(gshape, nan, dtype=dtype))
    w, origin, fl = (torch.zeros(b, dtype=torch.int32), torch.zeros(b, dtype=torch.int32),
                     torch.zeros(b, dtype=torch.bool))
    spec_reset_reference(w, origin, fl, Bbud, T)
    tol = 1e-10 if dtype == torch.float64 else 3e-4
    for step in range(40):
        toks = seq[step * T:(step + 1) * T]
        win = {key: torch.stack([t[key] for t in toks], 1) for key in ("q", "k", "v", "g", "beta")}   # [b, T, ...]
        before, was_flush = state.clone(), fl.clone()
        o = delta_spec_verify_reference(state, *rings, w, origin, fl,
                                        *(win[key] for key in ("q", "k", "v", "g", "beta")))
        n = data.draw(st.lists(st.integers(1, T), min_size=b, max_size=b), label=f"accepted {step}")
        for s in range(b):
            S = true[s].clone()[None]
            for t in range(T):
                pick = lambda key: toks[t][key][s:s + 1].double()  # noqa: E731
                want = delta_exact_step(S, *(pick(key) for key in ("q", "k", "v", "g", "beta")))[0]
                assert rel(o[s, t], want) < tol, f"step {step} row {s} token {t}"
                if t == n[s] - 1:
                    true[s] = S[0].clone()
            if not was_flush[s]:
                assert torch.equal(state[s], before[s]), f"step {step} row {s}: non-flush verify wrote the checkpoint"
        spec_commit_reference(w, origin, fl, torch.tensor(n), Bbud, T, buf)
        for s in range(b):
            got = delta_spec_materialize_reference(state, *rings, w, origin, s)
            assert rel(got, true[s]) < tol, f"step {step} row {s}: committed state"


def test_ops_wrap_the_reference_and_pass_opcheck():
    """``delta_spec_verify`` + ``spec_commit`` as ops: opcheck, outputs track sequential decoding of the accepted
    tokens (GDN and KDA), clear errors on bad shapes."""
    import pytest

    import replay_compile  # noqa: F401 - registers the ops
    from replay_compile.testing.strategies import DeltaGeometry

    verify, commit = torch.ops.replay_compile.delta_spec_verify, torch.ops.replay_compile.spec_commit
    for kda in (False, True):
        geom = DeltaGeometry(2, 4, 2, 5, 3, kda)
        Bbud, T = 8, 3
        buf = spec_buf_len(Bbud, T)
        state0, seq = delta_problem(geom, 8 * T, dtype=torch.float32, seed=2)
        state = state0.clone()
        true = [state0[s].double().clone() for s in range(2)]
        gshape = (2, 4, buf, 5) if kda else (2, 4, buf)
        rings = (torch.zeros(2, 4, buf, 3), torch.zeros(2, 2, buf, 5), torch.zeros(gshape))
        w, origin, fl = (torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                         torch.zeros(2, dtype=torch.bool))
        for step in range(8):
            toks = seq[step * T:(step + 1) * T]
            args = tuple(torch.stack([t[key] for t in toks], 1) for key in ("q", "k", "v", "g", "beta"))
            if step == 0:
                torch.library.opcheck(verify, (state.clone(), *(r.clone() for r in rings), w.clone(), origin.clone(),
                                               fl.clone(), *args))
            o = verify(state, *rings, w, origin, fl, *args)
            n = torch.tensor([1 + step % T, T])
            for s in range(2):
                S = true[s][None].clone()
                for t in range(T):
                    ref = delta_exact_step(S, *(a[s:s + 1, t].double() for a in args))[0]
                    assert rel(o[s, t], ref) < 3e-4, f"kda={kda} step {step} row {s} token {t}"
                    if t == int(n[s]) - 1:
                        true[s] = S[0].clone()
            if step == 0:
                torch.library.opcheck(commit, (w.clone(), origin.clone(), fl.clone(), n, Bbud, T))
            commit(w, origin, fl, n, Bbud, T)
        with pytest.raises(ValueError, match="delta_spec: v must be"):
            verify(state, *rings, w, origin, fl, *args[:2], args[2][:, 0], *args[3:])
