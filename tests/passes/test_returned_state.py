"""A recurrent state whose next value is *returned* for the caller to store (MiniMax's lightning attention: the cache
list holds a new tensor every step) and laid out ``[b, H, K, V]`` with the readout ``q @ S``: read as an in-place
write, the graph returns the state itself, the op steps its transposed view. Exact against the fp64 recurrence at
every step, the true state through flushes, the caller's tensor the same object throughout."""

import pytest
import torch

import replay_compile

b, H, K, V, L = 3, 4, 8, 6, 4


def step(S, q, k, v, slope):
    """One lightning-attention decode step as transformers' MiniMax writes it (functional state)."""
    ratio = torch.exp(-slope)                                   # [H, 1, 1]: one decay per head
    S = ratio * S + torch.matmul(k.transpose(-1, -2), v)        # [b, H, K, V]
    return torch.matmul(q, S), S                                # [b, H, 1, V]


def exact(S, q, k, v, slope):
    S = torch.exp(-slope.double()) * S + k.double().transpose(-1, -2) @ v.double()
    return q.double() @ S, S


def _inputs(t):
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(b, H, 1, d, generator=g) for d in (K, K, V)]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_returned_state_is_rewritten_and_tracks_the_exact_recurrence(device):
    """On CPU the rewritten graph runs as is; on a GPU through Inductor and the Triton kernels (the op mutating a
    transposed view of a graph input that the graph also returns)."""
    torch._dynamo.reset()
    slope = (torch.rand(H, 1, 1) * 0.5).to(device)
    opts = {"buffer_len": L, "lower": "eager"} if device == "cpu" else {"buffer_len": L}
    cstep = torch.compile(step, backend="replayssm", options=opts)
    state = torch.randn(b, H, K, V, device=device)
    cache = [state]
    oracle = state.double().clone()
    replay_compile.clear_reports()
    with torch.no_grad():
        for t in range(2 * L + 3):
            inp = [x.to(device) for x in _inputs(t)]
            y, cache[0] = cstep(cache[0], *inp, slope)
            want, oracle = exact(oracle, *inp, slope)
            assert cache[0] is state, "the caller keeps storing its own tensor"
            torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4, msg=f"step {t}")
            torch.testing.assert_close(replay_compile.materialize(state).double(), oracle, rtol=1e-4, atol=1e-4,
                                       msg=f"step {t} true state")
    rw = [w for r in replay_compile.reports() for w in r.rewrites]
    assert rw and all(w.family == "mamba2" and w.spec.transposed for w in rw), rw
    replay_compile.flush(state)
    torch.testing.assert_close(state.double(), oracle, rtol=1e-4, atol=1e-4)


def test_returned_state_of_another_dtype_is_left_unchanged_with_the_reason():
    """A next value the cache would store with another dtype than the old tensor's cannot become an in-place
    write of it: left as it is, reported."""
    slope = torch.rand(H, 1, 1) * 0.5

    def widening(S, q, k, v):
        S = torch.exp(-slope) * S.double() + torch.matmul(k.transpose(-1, -2), v).double()
        return torch.matmul(q.double(), S), S

    cstep = torch.compile(widening, backend="replayssm", options={"buffer_len": L, "lower": "eager"})
    replay_compile.clear_reports()
    state = torch.randn(b, H, K, V)
    with torch.no_grad():
        y, new = cstep(state, *_inputs(0))
    want, _ = widening(state, *_inputs(0))
    torch.testing.assert_close(y, want)
    reps = replay_compile.reports()
    assert not any(r.rewrites for r in reps)
    assert any("returned as a new tensor" in s.reason for r in reps for s in r.skipped), reps


@pytest.mark.parametrize("readout", ["einsum", "mul-sum"])
def test_transposed_state_written_in_place_with_other_readouts(readout):
    """The [K, V] layout written in place, read by an einsum or a mul-sum over dim -2."""
    slope = torch.rand(H) * 0.5

    def inplace(S, q, k, v):
        new = torch.exp(-slope)[None, :, None, None] * S + k[..., :, None] * v[..., None, :]
        S.copy_(new)
        if readout == "einsum":
            return torch.einsum("bhkv,bhk->bhv", new, q)
        return (new * q[..., :, None]).sum(-2)

    cstep = torch.compile(inplace, backend="replayssm", options={"buffer_len": L, "lower": "eager"})
    state = torch.randn(b, H, K, V)
    oracle = state.double().clone()
    replay_compile.clear_reports()
    with torch.no_grad():
        for t in range(2 * L + 1):
            q, k, v = (x[:, :, 0] for x in _inputs(t))
            y = cstep(state, q, k, v)
            oracle = torch.exp(-slope.double())[None, :, None, None] * oracle + \
                k.double()[..., :, None] * v.double()[..., None, :]
            want = torch.einsum("bhkv,bhk->bhv", oracle, q.double())
            torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5, msg=f"step {t}")
    rw = [w for r in replay_compile.reports() for w in r.rewrites]
    assert rw and all(w.spec.transposed for w in rw), [s for r in replay_compile.reports() for s in r.skipped]
    torch.testing.assert_close(replay_compile.materialize(state).double(), oracle, rtol=1e-5, atol=1e-5)
