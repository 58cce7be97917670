"""Gated DeltaNet (Qwen3-Next, Qwen3.5 dense and MoE, OLMo-Hybrid, Lara-Mini) and KDA (Kimi-Linear, Ling-3.0-Flash's
bailing_hybrid) through ``backend="replayssm"``: greedy decoding through two flushes identical to eager, logits and
the flushed cache states close, every linear-attention layer rewritten with the right family and key-head groups."""

import pytest
import torch

pytest.importorskip("transformers")

import replay_compile  # noqa: E402
from replay_compile.testing import check_equivalence  # noqa: E402
from replay_compile.testing.hf_models import DELTA_FAMILY, available, make_inputs  # noqa: E402

EXPECT = {  # family, key heads (4 value heads in every tiny config)
    "qwen3_next": ("gdn", 2), "qwen3_5": ("gdn", 2), "qwen3_5_moe": ("gdn", 2), "kimi_linear": ("kda", 4),
    "olmo_hybrid": ("gdn", 2), "lara_mini": ("gdn", 2), "bailing_hybrid": ("kda", 4), "qwen4_exp": ("gdn", 2),
    "glm5_next": ("kda", 4),
}
# families added with transformers 5.2x: run with the release CI installs (5.24 has them all), not again per version
_NEWER = ("olmo_hybrid", "lara_mini", "bailing_hybrid", "qwen4_exp", "glm5_next")
_INDUCTOR = ("qwen3_5", "kimi_linear", "qwen4_exp")
FAMILIES = [pytest.param(f, marks=[] if f in _NEWER else [pytest.mark.hf]) for f in sorted(DELTA_FAMILY)]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_delta_model_decodes_like_eager(name):
    if not available(name):
        pytest.skip(f"{name} is not in this transformers")
    torch._dynamo.utils.counters.clear()
    model = DELTA_FAMILY[name]()
    # 9 steps: two flushes per layer (GLM-5.3-Flash and Qwen4-Exp: 5 steps at L = 2; their graph breaks make every
    # step compile). Inductor lowers one family per state kind and graph form (Qwen3.5: Gated DeltaNet, Kimi-Linear:
    # KDA, Qwen4-Exp: a graph per layer); the others' rewritten graphs run as traced (``lower="eager"``): what they
    # add is how their layers spell the update, which the rewrite reads, and the ops they become are the same.
    # Inductor's C++ build of GLM-5.3-Flash's and Ling-3.0-Flash's graphs took 191 s and 135 s of the CI's 2 cores,
    # the traced graphs 37 s and 9 s.
    lower = None if name in _INDUCTOR else {"lower": "eager"}
    rep = check_equivalence(model, make_inputs(model), buffer_len=2 if name in ("glm5_next", "qwen4_exp") else 4,
                            options=lower)
    assert rep.tokens_match, rep
    assert rep.max_logit_diff <= 1e-3 * rep.logit_scale, rep
    assert rep.states_compared > 0 and rep.max_state_diff < 1e-3, rep
    family, hk = EXPECT[name]
    if name in ("qwen4_exp", "glm5_next"):
        # their indexed attention (`nonzero`) breaks the decode step into a graph per layer; each SSM update is
        # rewritten in the graph that holds it (named from that graph's frame, so counted rather than listed)
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) > 0
        assert torch._dynamo.utils.counters["replay_compile"][family] >= (3 if name == "qwen4_exp" else 1)
    layers = {r.layer for r in rep.rewrites}
    assert (name in ("qwen4_exp", "glm5_next") or len(layers) == 2) and \
        all(r.family == family and r.spec.Hk == hk for r in rep.rewrites), rep.rewrites
    assert not [s for s in rep.skipped if not s.quiet], rep.skipped
    assert torch._dynamo.utils.counters["replay_compile"][family] >= 2


@pytest.mark.slow
@pytest.mark.hf
def test_family_not_enabled_is_left_unchanged_and_says_so():
    model = DELTA_FAMILY["qwen3_5"]()
    replay_compile.clear_reports()
    rep = check_equivalence(model, make_inputs(model), buffer_len=4,
                            options={"families": ("mamba2",), "lower": "eager"})
    assert rep.tokens_match and not rep.rewrites
    assert rep.skipped and all("state itself (a delta rule?)" in s.reason for s in rep.skipped), rep.skipped


def _teacher_forced(model, forward, seq, prompt_len):
    """Logits [B, steps, V] (fp32) of the prefill and of one step per token of ``seq[:, prompt_len:-1]``."""
    from transformers import DynamicCache

    from replay_compile.bench import cache_kwarg

    cache = DynamicCache(config=model.config)
    ck = {cache_kwarg(model): cache}            # "cache" in transformers >= 5.2x, "past_key_values" before
    out = []
    with torch.no_grad():
        o = forward(input_ids=seq[:, :prompt_len], use_cache=True, **ck)
        out.append(o.logits[:, -1].float())
        for t in range(prompt_len, seq.shape[1] - 1):
            o = forward(input_ids=seq[:, t:t + 1], use_cache=True, **ck)
            out.append(o.logits[:, -1].float())
    return torch.stack(out, 1), cache


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear"])
def test_bf16_teacher_forced_logits_match_eager(name):
    """bf16 weights and activations (fp32 recurrence inside the op): per-step logits within 5% of eager, over two
    flushes; and a negative control with the gate scaled by 0.9 that must miss that tolerance."""
    from replay_compile.kernels import delta_reference

    model = DELTA_FAMILY[name](dtype=torch.bfloat16)
    ids = make_inputs(model)
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=12, do_sample=False)
    want, _ = _teacher_forced(model, model.forward, seq, ids.shape[1])
    forward = torch.compile(model.forward, backend="replayssm", options={"buffer_len": 4, "lower": "eager"})
    got, cache = _teacher_forced(model, forward, seq, ids.shape[1])
    errs = (got - want).norm(dim=(0, 2)) / want.norm(dim=(0, 2))
    assert errs.max() <= 0.05 and errs.mean() <= 0.025, errs.tolist()
    assert replay_compile.flush(cache) == 2

    step = delta_reference.delta_replay_step_reference
    try:
        delta_reference.delta_replay_step_reference = \
            lambda s, d, k_, g_, c, q, k, v, g, beta, slot_idx=None: \
            step(s, d, k_, g_, c, q, k, v, 0.9 * g, beta, slot_idx)
        torch._dynamo.reset()
        bad = torch.compile(model.forward, backend="replayssm", options={"buffer_len": 4, "lower": "eager"})
        got_bad, _ = _teacher_forced(model, bad, seq, ids.shape[1])
    finally:
        delta_reference.delta_replay_step_reference = step
    errs_bad = (got_bad - want).norm(dim=(0, 2)) / want.norm(dim=(0, 2))
    assert errs_bad.max() > 0.05 or errs_bad.mean() > 0.025, errs_bad.tolist()


@pytest.mark.slow
@pytest.mark.hf
def test_second_generate_continues_from_a_fresh_cache():
    """Two compiled generate calls: each matches eager, and the second starts from its own fresh cache (rings bound
    to the old cache tensors must not leak into the new one). The runner around the lowered graph binds the rings
    to the cache tensors it is called with, whatever the lowering: the rewritten graph runs as traced."""
    model = DELTA_FAMILY["qwen3_next"]()
    for seed in (0, 1):
        ids = make_inputs(model, seed=seed)
        rep = check_equivalence(model, ids, buffer_len=4, max_new_tokens=11, options={"lower": "eager"})
        assert rep.tokens_match and rep.max_state_diff < 1e-3, rep
