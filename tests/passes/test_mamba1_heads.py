"""A Mamba-1 state ``[b, heads, D, N]`` stepped head by head through ``state[:, h]`` (Zamba's mixer): each head
rewritten as one Mamba-1 step on its slice, the heads sharing one ring set. Exact against the fp64 recurrence at
every step, the true state through ``materialize`` and after flushes; a state not every head of which is stepped is
left unchanged with the reason."""

import pytest
import torch

import replay_compile
from replay_compile.config import SUPPORTED_FAMILIES

b, H, D, N, L = 3, 2, 6, 4, 4
OPTS = {"buffer_len": L, "lower": "eager", "families": SUPPORTED_FAMILIES}


class HeadByHead(torch.nn.Module):
    def __init__(self, heads=H):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.A_log = torch.nn.Parameter(torch.rand(H, D, N, generator=g).log1p())
        self.heads = heads

    def forward(self, state, x, dt, B, C):
        A = -torch.exp(self.A_log.float())
        outs = []
        for h in range(self.heads):
            s = state[:, h]
            d = torch.nn.functional.softplus(dt[:, h])
            new = torch.exp(d[..., None] * A[h]) * s + (d * x[:, h])[..., None] * B[:, h, None, :]
            s.copy_(new)
            outs.append(torch.matmul(new, C[:, h, :, None]).squeeze(-1))
        return torch.stack(outs, 1)


def exact(mod, S, x, dt, B, C):
    A = -torch.exp(mod.A_log.double())
    d = torch.nn.functional.softplus(dt.double())
    S.mul_(torch.exp(d[..., None] * A)).add_((d * x.double())[..., None] * B.double()[:, :, None, :])
    return (S * C.double()[:, :, None, :]).sum(-1)


def _inputs(t):
    g = torch.Generator().manual_seed(10 + t)
    return (torch.randn(b, H, D, generator=g), torch.randn(b, H, D, generator=g), torch.randn(b, H, N, generator=g),
            torch.randn(b, H, N, generator=g))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_heads_are_rewritten_and_track_the_exact_recurrence(device):
    """On CPU the rewritten graph as is; on a GPU through Inductor and the Triton kernel (each head's op mutating
    slices of the state and of the shared rings)."""
    torch._dynamo.reset()
    mod = HeadByHead().to(device)
    opts = OPTS if device == "cpu" else {k: v for k, v in OPTS.items() if k != "lower"}
    cmod = torch.compile(mod, backend="replayssm", options=opts)
    state = torch.randn(b, H, D, N, device=device)
    oracle = state.double().clone()
    replay_compile.clear_reports()
    with torch.no_grad():
        for t in range(2 * L + 2):
            inp = [v.to(device) for v in _inputs(t)]
            y = cmod(state, *inp)
            want = exact(mod, oracle, *inp)
            torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4, msg=f"step {t}")
            torch.testing.assert_close(replay_compile.materialize(state).double(), oracle, rtol=1e-4, atol=1e-4,
                                       msg=f"step {t} true state")
            if t % L == L - 1:
                torch.testing.assert_close(state.double(), oracle, rtol=1e-4, atol=1e-4, msg=f"step {t} flushed")
    rw = [w for r in replay_compile.reports() for w in r.rewrites]
    assert sorted(w.detail.split("head ")[1] for w in rw) == [f"{h} of {H}" for h in range(H)], rw
    assert all(w.spec.heads == H for w in rw)
    written = state + 1.0
    state.add_(1.0)             # an outside write: its contents are the truth, the held records are dropped
    replay_compile.flush(state)
    torch.testing.assert_close(state, written)


def test_a_state_with_a_head_not_stepped_is_left_unchanged_with_the_reason():
    mod = HeadByHead(heads=H - 1)
    cmod = torch.compile(mod, backend="replayssm", options=OPTS)
    replay_compile.clear_reports()
    with torch.no_grad():
        cmod(torch.randn(b, H, D, N), *_inputs(0))
    reps = replay_compile.reports()
    assert not any(r.rewrites for r in reps)
    assert any("heads are not each taken once" in s.reason for r in reps for s in r.skipped), \
        [str(s) for r in reps for s in r.skipped]
