"""The benchmark's per-draft snapshot baseline kernels (benchmarks/spec_baselines.py) against the exact recurrences:
a speed ratio against a wrong baseline would mean nothing. Interpreter on CPU, compiled on CUDA."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

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
