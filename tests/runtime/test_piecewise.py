"""Piecewise lowering: the rewritten graph split at mutating nodes, pure pieces compiled by Inductor on
CPU, stateful ops eager; same outputs as the whole-graph path on hybrid models. The Torch-TensorRT per-piece
compiler runs where torch_tensorrt imports and is skipped with the reason elsewhere; its missing-library error is
tested here."""

import pytest
import torch
import torch.fx as fx

from replay_compile.errors import ReplayCompileError
from replay_compile.piecewise import is_stateful, lower_piecewise, split_stateful


def _tensorrt_available() -> bool:
    try:
        import torch_tensorrt  # noqa: F401 - importability is the question
    except Exception:  # noqa: BLE001 - a plain Exception when TensorRT's libraries are missing
        return False
    return True


def _toy(x, cache, idx):
    y = torch.sin(x) * 2 + 1
    cache.index_copy_(0, idx, y)            # stateful
    z = cache.sum(0) + torch.cos(x).sum(0)
    cache.mul_(0.5)                         # stateful
    return z * cache.mean()


def test_split_isolates_every_mutation_and_keeps_results():
    gm = fx.symbolic_trace(_toy)
    split, stateful = split_stateful(gm)
    kinds = {name: [n.target for n in sub.graph.nodes if n.op in ("call_function", "call_method")]
             for name, sub in split.named_children()}
    assert len(stateful) == 2
    for name in stateful:
        assert len(kinds[name]) == 1 and is_stateful(next(n for n in split.get_submodule(name).graph.nodes
                                                          if n.op in ("call_function", "call_method")))
    x, idx = torch.randn(3, 4), torch.tensor([0, 2])
    c1, c2 = torch.randn(3, 4), None
    c2 = c1.clone()
    want = _toy(x[:2], c1, idx)
    fn = lower_piecewise(gm, [x[:2], c2, idx], "piecewise")
    got = fn(x[:2], c2, idx)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(c2, c1)                      # the cache was mutated the same way
    assert fn.replay_pieces[1] == 2


transformers = pytest.importorskip("transformers")


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_piecewise_decode_matches_eager_on_hybrid_models(family):
    """Eager prefill, then decode steps through the piecewise-compiled forward (one graph: the decode step) against
    the unmodified model decoding on its own cache, over two flushes."""
    from transformers import DynamicCache

    import replay_compile
    from replay_compile.bench import cache_kwarg
    from replay_compile.testing.hf_models import DELTA_FAMILY, MAMBA2_FAMILY, make_inputs

    build = {**MAMBA2_FAMILY, **DELTA_FAMILY}[family]
    # L = 2: 2L + 1 = 5 decode steps still cross two flushes. Pieces compile per argument shape and the attention
    # pieces' shapes grow with the KV cache, so every further step compiles them again.
    L = 2
    ref, model = build(dtype=torch.float32, seed=0), build(dtype=torch.float32, seed=0)
    step = torch.compile(model.forward, backend="replayssm", options={"buffer_len": L, "lower": "piecewise"})
    caches = [DynamicCache(config=ref.config) for _ in range(2)]
    ck = cache_kwarg(ref)

    def logits(fwd, cache, tok):
        with torch.no_grad():
            return fwd(input_ids=tok, use_cache=True, **{ck: cache}).logits[:, -1]

    replay_compile.clear_reports()
    ids = make_inputs(ref, batch=2, prompt_len=4, seed=0)
    a, b = logits(ref.forward, caches[0], ids), logits(model.forward, caches[1], ids)
    tok = a.argmax(-1, keepdim=True)
    for t in range(2 * L + 1):
        a, b = logits(ref.forward, caches[0], tok), logits(step, caches[1], tok)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * float(a.abs().max()), msg=f"step {t}")
        tok = a.argmax(-1, keepdim=True)
    assert sum(len(r.rewrites) for r in replay_compile.reports()) >= 2      # every SSM layer rewritten
    assert replay_compile.flush(caches[1]) >= 1


@pytest.mark.skipif(_tensorrt_available(), reason="torch_tensorrt imports here: the missing-library error cannot occur")
def test_tensorrt_lowering_without_tensorrt_says_what_to_install():
    gm = fx.symbolic_trace(_toy)
    with pytest.raises(ReplayCompileError, match="pip install torch-tensorrt"):
        lower_piecewise(gm, [torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 2])], "tensorrt")


@pytest.mark.gpu
@pytest.mark.skipif(not _tensorrt_available(),
                    reason="needs torch_tensorrt with TensorRT's libraries (NVIDIA's package index)")
def test_tensorrt_pieces_match_eager():
    gm = fx.symbolic_trace(_toy)
    x, idx = torch.randn(2, 4, device="cuda"), torch.tensor([0, 2], device="cuda")
    c1 = torch.randn(3, 4, device="cuda")
    c2 = c1.clone()
    want = _toy(x, c1, idx)
    got = lower_piecewise(gm, [x, c2, idx], "tensorrt")(x, c2, idx)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(c2, c1)
