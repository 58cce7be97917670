"""The decode-attention rewrite: every supported family's one-token attention over its static cache becomes
``replay_compile::decode_attention``, decode stays exact (fp32 tokens identical to eager, logits within rounding),
and what is not decode attention is left alone with the reason.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from replay_compile import backend as rb  # noqa: E402
from replay_compile.passes import decode_attention as da  # noqa: E402
from replay_compile.testing.hf_models import (  # noqa: E402
    DELTA_FAMILY,
    MAMBA2_FAMILY,
    available,
    greedy_static_decode,
    make_inputs,
)

PROMPT, STEPS, M = 5, 6, 16
FAMILIES = ["nemotron_h", "bamba", "zamba2", "granitemoehybrid", "falcon_h1", "qwen3_next", "qwen3_5", "kimi_linear",
            "olmo_hybrid", "bailing_hybrid"]


def _decode(model, forward, cache):
    return greedy_static_decode(model, forward, cache, PROMPT, STEPS)


def _attention_layers(model) -> int:
    cfg = model.config
    for name in ("layers_block_type", "layer_types", "hybrid_override_pattern", "layers_block_types"):
        types = getattr(cfg, name, None)
        if isinstance(types, (list, tuple)) and types:
            return sum(t in ("attention", "full_attention", "hybrid", "*") for t in types)
    return -1


def _use_attention(model, implementation: str) -> None:
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None:
            cfg._attn_implementation = implementation


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_exactly_with_its_attention_rewritten(family, implementation):
    """transformers' SDPA attention and its eager attention (softmax of scaled scores plus the mask) alike."""
    from transformers import StaticCache

    if not available(family):
        pytest.skip(f"{family} is not in this transformers")
    model = {**MAMBA2_FAMILY, **DELTA_FAMILY}[family](dtype=torch.float32)
    _use_attention(model, implementation)
    rb.clear_reports()
    with torch.no_grad():
        ref = _decode(model, model.forward, StaticCache(config=model.config, max_cache_len=M))
        fwd = torch.compile(model.forward, backend="replayssm", options={"decode_attention": "on", "lower": "eager"})
        got = _decode(model, fwd, StaticCache(config=model.config, max_cache_len=M))
    assert torch.equal(got[0], ref[0]), family
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
    rewritten = {layer for r in rb.reports() for layer in r.attention}
    assert rewritten, family
    expected = _attention_layers(model)
    if expected > 0 and family != "zamba2":        # Zamba2's shared block: one module, several cache layers
        assert len(rewritten) == expected, (family, rewritten)


@pytest.mark.slow
def test_through_inductor():
    from transformers import StaticCache

    model = MAMBA2_FAMILY["nemotron_h"](dtype=torch.float32)
    with torch.no_grad():
        ref = _decode(model, model.forward, StaticCache(config=model.config, max_cache_len=M))
        fwd = torch.compile(model.forward, backend="replayssm", options={"decode_attention": "on"})
        got = _decode(model, fwd, StaticCache(config=model.config, max_cache_len=M))
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
    assert torch._dynamo.utils.counters["replay_compile"]["decode_attention"] >= 1


def test_auto_leaves_cpu_graphs_to_sdpa():
    from transformers import StaticCache

    model = MAMBA2_FAMILY["nemotron_h"](dtype=torch.float32)
    rb.clear_reports()
    with torch.no_grad():
        fwd = torch.compile(model.forward, backend="replayssm", options={"lower": "eager", "decode_attention": "auto"})
        _decode(model, fwd, StaticCache(config=model.config, max_cache_len=M))
    assert not any(r.attention for r in rb.reports())
    assert rb.ReplayConfig().decode_attention == "auto"             # the default: CUDA graphs only


def test_a_dynamic_cache_is_rewritten_with_symbolic_positions():
    """``generate``'s default dynamic cache grows by a token a step: after the first recompile Dynamo makes the
    positions symbolic (the keys and values with symbols of their own); that graph's attention is rewritten too."""
    model = MAMBA2_FAMILY["nemotron_h"](dtype=torch.float32)
    ids = make_inputs(model, batch=2, prompt_len=PROMPT, seed=0)
    rb.clear_reports()
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=STEPS, do_sample=False)
        model.forward = torch.compile(model.forward, backend="replayssm",
                                      options={"decode_attention": "on", "lower": "eager"})
        got = model.generate(ids, max_new_tokens=STEPS, do_sample=False)
    assert torch.equal(got, ref)
    decode_graphs = [r for r in rb.reports() if r.attention]
    assert len(decode_graphs) == 2, [r.attention for r in rb.reports()]     # the first step's shape, then dynamic


def test_the_op_refuses_keys_and_values_of_different_lengths():
    """The pass accepts keys and values whose symbolic lengths it cannot prove equal; the op checks them when it
    runs."""
    from replay_compile.ops.decode_attention import decode_attention

    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KV, S, D), torch.randn(B, KV, S - 1, D)
    with pytest.raises(ValueError, match=r"v must be \[b=2, KV=2, S=9, dv\]"):
        decode_attention(q, k, v, torch.ones(1, 1, S, dtype=torch.bool), D ** -0.5)


# -- graphs written by hand: what is and is not decode attention ------------------------------------------------

B, H, KV, S, D = 2, 4, 2, 9, 8


def _graph(fn, *shapes, dtype=torch.float32):
    """``fn`` traced by Dynamo into the graph the pass sees (the first graph of a capturing backend)."""
    graphs = []

    def capture(gm, ex):
        graphs.append(gm)
        return gm.forward
    def make(s):
        if s == "mask":
            return torch.arange(S)[None, None, None, :] < 6
        if s == "window_mask":                          # rows filled to 3 and 5, a causal window of 3 at the end
            pos, tok = torch.arange(S), torch.arange(3)[:, None]
            fill = torch.tensor([3, 5])[:, None, None, None]
            return (pos < fill) | ((pos >= S - 3) & (pos - (S - 3) <= tok))
        return torch.randn(*s, dtype=dtype)
    args = [make(s) for s in shapes]
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs[0], args


def _rewrite(fn, *shapes):
    gm, args = _graph(fn, *shapes)
    want = fn(*args)
    done, left = da.rewrite(gm, cuda_only=False)
    if done:
        by_name = dict(zip("qkvm", args))                  # Dynamo orders its placeholders by first use
        ordered = [by_name[p.target.strip("L_").strip("_")] for p in gm.graph.nodes if p.op == "placeholder"]
        torch.testing.assert_close(gm(*ordered)[0], want)
        assert not any(n.op == "call_method" and n.target == "expand" for n in gm.graph.nodes)
    return done, left


def _repeat_kv(x, G):
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, G, s, d).reshape(b, kv * G, s, d)


def _sdpa(q, k, v, mask=None, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


Q, K, MASK = (B, H, 1, D), (B, KV, S, D), "mask"


@pytest.mark.parametrize("spelling", ["repeat_kv", "repeat_interleave", "enable_gqa", "no_mask", "repeat"])
def test_grouped_head_spellings_are_rewritten(spelling):
    """Exact against the graph's own SDPA (``_rewrite``). ``repeat`` maps head h to h % KV, not repeat_kv's h // G:
    read as its own H-head tensor, never as grouped heads."""
    fns = {
        "repeat": lambda q, k, v, m: _sdpa(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), m),
        "repeat_kv": lambda q, k, v, m: _sdpa(q, _repeat_kv(k, 2), _repeat_kv(v, 2), m),
        "repeat_interleave": lambda q, k, v, m: _sdpa(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1),
                                                      m),
        "enable_gqa": lambda q, k, v, m: _sdpa(q, k, v, m, enable_gqa=True),
        "no_mask": lambda q, k, v, m: _sdpa(q, _repeat_kv(k, 2), _repeat_kv(v, 2)),
    }
    done, left = _rewrite(fns[spelling], Q, K, K, MASK)
    assert len(done) == 1 and not left, left
    assert done[0].kv_heads == (H if spelling == "repeat" else KV)


@pytest.mark.parametrize("case, reason", [
    ("prefill", "17 query tokens"),
    ("causal", "is_causal"),
    ("dropout", "dropout_p"),
    ("per_head_mask", "shared by the heads"),
])
def test_other_attention_is_left_unchanged_with_the_reason(case, reason):
    fns = {
        "prefill": (lambda q, k, v, m: _sdpa(q, _repeat_kv(k, 2), _repeat_kv(v, 2), m), (B, H, 17, D)),
        "causal": (lambda q, k, v, m: _sdpa(q, _repeat_kv(k, 2), _repeat_kv(v, 2), is_causal=True), Q),
        "dropout": (lambda q, k, v, m: _sdpa(q, _repeat_kv(k, 2), _repeat_kv(v, 2), m, dropout_p=0.1), Q),
        "per_head_mask": (lambda q, k, v, m: _sdpa(q, _repeat_kv(k, 2), _repeat_kv(v, 2),
                                                   m.expand(B, H, 1, S).clone()), Q),
    }
    fn, q = fns[case]
    gm, _ = _graph(fn, q, K, K, MASK)
    done, left = da.rewrite(gm, cuda_only=False)
    assert not done and len(left) == 1 and reason in left[0][1], left


def _eager(q, k, v, m, scale=D ** -0.5, divide=False, softcap=None, weights=False, probs_dtype=None):
    """transformers' ``eager_attention_forward`` with an additive mask, and the variants the pass must refuse."""
    k, v = _repeat_kv(k, 2), _repeat_kv(v, 2)
    scores = torch.matmul(q, k.transpose(2, 3))
    scores = scores / (1 / scale) if divide else scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + torch.where(m, 0.0, torch.finfo(q.dtype).min)
    p = torch.nn.functional.softmax(scores, dim=-1, dtype=probs_dtype or torch.float32).to(q.dtype)
    p = torch.nn.functional.dropout(p, p=0.0, training=False)
    out = torch.matmul(p, v)
    return (out, p) if weights else out


@pytest.mark.parametrize("divide", [False, True])
def test_eager_attention_is_rewritten(divide):
    done, left = _rewrite(lambda q, k, v, m: _eager(q, k, v, m, divide=divide), Q, K, K, MASK)
    assert len(done) == 1 and not left, left
    assert done[0].scale == pytest.approx(D ** -0.5) and done[0].kv_heads == KV
    gm, _ = _graph(lambda q, k, v, m: _eager(q, k, v, m), Q, K, K, MASK)
    da.rewrite(gm, cuda_only=False)
    left_ops = {da.op_name(n) for n in gm.graph.nodes}
    assert not left_ops & {"softmax", "matmul", "dropout", "expand"}, left_ops      # the old attention is gone


@pytest.mark.parametrize("case, reason", [
    ("weights", "readers besides the attention"),
    ("softcap", "not a matmul of queries and keys"),
    ("half_softmax", "a dtype other than float32"),
])
def test_other_eager_attention_is_left_unchanged_with_the_reason(case, reason):
    kw = {"weights": dict(weights=True), "softcap": dict(softcap=30.0),
          "half_softmax": dict(probs_dtype=torch.float64)}[case]
    gm, args = _graph(lambda q, k, v, m: _eager(q, k, v, m, **kw), Q, K, K, MASK)
    done, left = da.rewrite(gm, cuda_only=False)
    assert not done and len(left) == 1 and reason in left[0][1], left


@pytest.mark.parametrize("mask", ["window_mask", "mask"])
def test_a_verify_window_is_rewritten(mask):
    """Three tokens (a token and two drafts) over the cache, each under its own mask row (causal in the window), or
    under one mask shared by the window's tokens."""
    done, left = _rewrite(lambda q, k, v, m: _sdpa(q, _repeat_kv(k, 2), _repeat_kv(v, 2), m), (B, H, 3, D), K, K,
                          mask)
    assert len(done) == 1 and not left, left
    assert done[0].tokens == 3 and done[0].mask_rows == (3 if mask == "window_mask" else 1)


def test_more_query_rows_than_the_tile_holds_are_left_unchanged():
    gm, _ = _graph(lambda q, k, v, m: _sdpa(q, _repeat_kv(k, 2), _repeat_kv(v, 2), m), (B, 2 * 40, 1, D),
                   (B, 40, S, D), (B, 40, S, D), MASK)
    done, _ = da.rewrite(gm, cuda_only=False)
    assert len(done) == 1
    gm, _ = _graph(lambda q, k, v, m: _sdpa(q, _repeat_kv(k, 8), _repeat_kv(v, 8), m), (B, 16, 16, D),
                   (B, 2, S, D), (B, 2, S, D), MASK)
    done, left = da.rewrite(gm, cuda_only=False)
    assert not done and "more query rows than the kernel's tile holds" in left[0][1], left


def test_the_op_check_leaves_a_configuration_it_fails_unchanged(monkeypatch):
    gm, _ = _graph(lambda q, k, v, m: _sdpa(q, _repeat_kv(k, 2), _repeat_kv(v, 2), m), Q, K, K, MASK)
    monkeypatch.setattr(da, "_CHECKED", {})
    monkeypatch.setattr(da, "_check", lambda m: "max difference 1 from SDPA")
    done, left = da.rewrite(gm, cuda_only=False)
    assert not done and "failed its check" not in left[0][1] and "max difference" in left[0][1]
    assert any(isinstance(n.target, type(torch._C._nn.scaled_dot_product_attention)) or "scaled_dot" in str(n.target)
               for n in gm.graph.nodes)


def test_a_bad_option_value_names_the_choices():
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        rb.ReplayConfig.from_options({"decode_attention": "yes"})

