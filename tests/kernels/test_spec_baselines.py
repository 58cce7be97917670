"""The benchmark's per-draft snapshot baseline kernels (benchmarks/spec_baselines.py) against the exact recurrences:
a speed ratio against a wrong baseline would mean nothing. Interpreter on CPU, compiled on CUDA."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from spec_baselines import gdn_snapshot_step, mamba2_snapshot_step, snapshot_commit  # noqa: E402

from replay_compile.kernels.delta_reference import delta_exact_step  # noqa: E402
from replay_compile.kernels.mamba2_reference import mamba2_exact_step  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).abs().max() / (b.double().abs().max() + 1e-12))


@pytest.mark.parametrize("T", [1, 3])
def test_mamba2_snapshots_are_the_states_after_each_token(T):
    torch.manual_seed(0)
    b, H, P, N, G = 2, 4, 20, 12, 2
    pool = torch.randn(b, T + 1, H, P, N)
    src = torch.tensor([0, T], dtype=torch.int32)
    x, B, C = torch.randn(b, T, H, P), torch.randn(b, T, G, N), torch.randn(b, T, G, N)
    dt, A = torch.rand(b, T, H) + 0.1, -torch.rand(H) - 0.2
    la = dt * A
    ker = pool.clone().to(DEV)
    y = mamba2_snapshot_step(ker, src.to(DEV), *(t.to(DEV) for t in (x, dt, la, B, C)))
    for r in range(b):
        S = pool[r, int(src[r])][None].double().clone()
        for t in range(T):
            want = mamba2_exact_step(S, x[r:r + 1, t], dt[r:r + 1, t], A, B[r:r + 1, t], C[r:r + 1, t],
                                     dt_softplus=False)
            assert rel(y[r, t], want[0]) < 1e-5
            assert rel(ker[r, (int(src[r]) + 1 + t) % (T + 1)], S[0]) < 1e-5
        assert torch.equal(ker[r, int(src[r])].cpu(), pool[r, int(src[r])])            # the committed state is kept
    n = torch.tensor([T, 1], dtype=torch.int32)
    snapshot_commit(src, n, T)
    assert src.tolist() == [T % (T + 1), (T + 1) % (T + 1)]


@pytest.mark.parametrize("T", [1, 4])
def test_gdn_snapshots_are_the_states_after_each_token(T):
    torch.manual_seed(1)
    b, HV, Hk, K, V = 2, 4, 2, 12, 20
    pool = torch.randn(b, T + 1, HV, K, V)
    src = torch.tensor([1, 0], dtype=torch.int32)
    norm = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    q, k = norm(torch.randn(b, T, Hk, K)) * K ** -0.5, norm(torch.randn(b, T, Hk, K))
    v, g, beta = torch.randn(b, T, HV, V), -torch.rand(b, T, HV), torch.rand(b, T, HV)
    ker = pool.clone().to(DEV)
    o = gdn_snapshot_step(ker, src.to(DEV), *(t.to(DEV) for t in (q, k, v, g, beta)))
    for r in range(b):
        S = pool[r, int(src[r])][None].double().clone()
        for t in range(T):
            want = delta_exact_step(S, *(x[r:r + 1, t] for x in (q, k, v, g, beta)))
            assert rel(o[r, t], want[0]) < 1e-5
            assert rel(ker[r, (int(src[r]) + 1 + t) % (T + 1)], S[0]) < 1e-5
        assert torch.equal(ker[r, int(src[r])].cpu(), pool[r, int(src[r])])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_snapshot_layers_in_speculative_rounds_match_generate(family):
    """The whole-model baseline (the snapshot kernels where the replay verify sits): greedy tokens and the states
    left in the cache equal ``generate``'s, with rows accepting all, some or none of their drafts."""
    pytest.importorskip("transformers")
    from spec_baselines import snapshot_layers

    from replay_compile.integrations.hf_modules import output_cache
    from replay_compile.speculative.generate import generate_rounds
    from replay_compile.testing.drafts import known_continuation
    from replay_compile.testing.hf_models import build_for_speculation, make_inputs
    from replay_compile.testing.tp_parity import _conv_states, _recurrent_states

    model = build_for_speculation(family).to(DEV)
    ids = make_inputs(model, batch=3, prompt_len=6, seed=1).to(DEV)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    out = generate_rounds(model, ids, 12, num_draft=3, draft=known_continuation(ref.sequences, 5), buffer_len=8,
                          compiler=None, layers_for=snapshot_layers)
    assert torch.equal(out.sequences, ref.sequences)
    assert {1, 4} <= {n for rnd in out.accepted for n in rnd}, out.accepted
    ref_cache = output_cache(ref)
    for a, b in zip(_recurrent_states(out.cache) + _conv_states(out.cache),
                    _recurrent_states(ref_cache) + _conv_states(ref_cache), strict=True):
        assert rel(a, b) < 1e-4
