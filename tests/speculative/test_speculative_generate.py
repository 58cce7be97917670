"""Greedy speculative generation (``replay_compile.speculative``) against ``model.generate`` on tiny HF models:
the Mamba-2 hybrids and the delta-rule families (Gated DeltaNet: Qwen3-Next, Qwen3.5, Qwen3.5-MoE; KDA: Kimi-Linear).

Drafts: an oracle (the true continuation: every draft accepted), always wrong (every draft rejected: rollback on
every round), a seeded mix (random acceptance counts), and prompt lookup on a repetitive prompt. ``buffer_len=8``
with 4-token verifies makes the rings flush every round or two, across ring wrap. The output must equal greedy
``generate`` token for token, and the cache left behind must hold the same recurrent and conv states.

The GDN builds get slower gates first (:func:`~replay_compile.testing.hf_models.build_for_speculation`): with the
stock init (``A`` up to 16, ``dt_bias`` 1) the median per-step decay is ~0, so the state hardly matters (zeroing it
changes the next logits by 1-11%); after it the decays are ~0.4-0.9 and zeroing the state changes them by 48-114%.
Kimi-Linear's stock gates already keep memory (median decay ~0.9, 110%).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytestmark = [pytest.mark.hf]

from replay_compile import ReplayCompileError  # noqa: E402
from replay_compile.integrations.hf_modules import output_cache  # noqa: E402
from replay_compile.passes.validate import rel_err  # noqa: E402
from replay_compile.speculative import PromptLookup, generate_speculative  # noqa: E402
from replay_compile.testing.hf_models import DELTA_FAMILY, MAMBA2_FAMILY, build_for_speculation, make_inputs  # noqa: E402
from replay_compile.testing.tp_parity import _conv_states, _recurrent_states  # noqa: E402

NEW = 40


@pytest.fixture(scope="module", params=["nemotron_h", "bamba", "mamba2", "zamba2", "granitemoehybrid",
                                        "qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "olmo_hybrid"])
def reference(request):
    model = build_for_speculation(request.param)
    ids = make_inputs(model, batch=2, prompt_len=6, seed=1)
    ids = torch.cat([ids, ids[:, :4], ids], dim=1)                      # repetitive: prompt lookup finds matches
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    return request.param, model, ids, ref


def _truth(ref, t, k):
    """The true next ``k`` tokens of every row of ``t`` (rows right-aligned, left-padded with -1 once they run
    ahead of each other; past the reference's end: token 3)."""
    seq = torch.cat([ref.sequences, torch.full((ref.sequences.shape[0], k), 3)], dim=1)
    n = (t >= 0).sum(1)
    return torch.stack([seq[r, int(n[r]):int(n[r]) + k] for r in range(t.shape[0])])


def _oracle(ref):
    return lambda t, k: _truth(ref, t, k)


def _wrong(ref, vocab):
    return lambda t, k: (_truth(ref, t, k) + 1 - 3) % (vocab - 3) + 3


def _mixed(ref, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)

    def propose(t, k):
        good = _truth(ref, t, k)
        flip = torch.rand(good.shape, generator=g) < 0.3
        return torch.where(flip, (good + 1 - 3) % (vocab - 3) + 3, good)
    return propose


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("drafts", ["oracle", "wrong", "mixed", "prompt_lookup"])
def test_greedy_output_and_final_cache_match_generate(reference, drafts, per_row):
    family, model, ids, ref = reference
    vocab = model.config.vocab_size
    draft = {"oracle": _oracle(ref), "wrong": _wrong(ref, vocab), "mixed": _mixed(ref, vocab),
             "prompt_lookup": PromptLookup(ngram=3)}[drafts]
    out = generate_speculative(model, ids, NEW, num_draft=3, draft=draft, buffer_len=8, per_row=per_row)
    assert torch.equal(out.sequences, ref.sequences), (family, drafts, out.accepted)
    if per_row:                                    # no CUDA graph here: every round is a warm-up round
        assert out.timing["replay_rounds"] == 0 and out.timing["warmup"] > 0, out.timing
    counts = [n for rnd in out.accepted for n in rnd]
    for row in range(ids.shape[0]):                                     # the first token comes from the prefill
        assert sum(rnd[row] for rnd in out.accepted) == NEW - 1
    if drafts == "oracle":
        assert max(counts) == 4 and out.rounds < NEW // 2
    if drafts == "wrong":
        assert set(counts) == {1}
    if drafts == "mixed":
        assert len(set(counts)) >= 2                                     # several acceptance counts
        if per_row:          # rows ran ahead of each other, and one sat the last rounds out (slot -1)
            assert any(len(set(rnd)) > 1 for rnd in out.accepted) and out.attention_mask is not None
            assert any(0 in rnd for rnd in out.accepted), out.accepted
    ref_cache = output_cache(ref)
    # relative to each tensor's largest entry: the projections see T rows at once, so rounding differs slightly
    for a, b in zip(_recurrent_states(out.cache) + _conv_states(out.cache),
                    _recurrent_states(ref_cache) + _conv_states(ref_cache), strict=True):
        assert a.shape == b.shape and rel_err(a, b) < 1e-4, (family, drafts, rel_err(a, b))


def test_prompt_lookup_proposes_the_continuation_of_the_latest_match():
    pl = PromptLookup(ngram=2)
    t = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 10, 5, 6]])
    assert pl(t, 3).tolist() == [[9, 10, 5]]                          # latest earlier "5 6" is followed by 9 10 5
    assert pl(torch.tensor([[1, 2, 3]]), 2).tolist() == [[3, 3]]        # no match: repeat the last token
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(ngram=1, min_ngram=2)


def test_unsupported_ssm_layers_are_refused_clearly():
    # Falcon-H1's mixer has the Mamba-2 attributes but multiplies its input and projections (muP): refused by name
    model = MAMBA2_FAMILY["falcon_h1"]()
    ids = make_inputs(model, batch=1, prompt_len=4)
    with pytest.raises(ReplayCompileError, match=r"model\.layers\.0\.mamba \(FalconH1Mixer\).*cannot verify yet"):
        generate_speculative(model, ids, 4)
    # Mamba-1: an SSM layer of a kind not verified at all
    from transformers import MambaConfig, MambaForCausalLM
    model = MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=16, state_size=4, num_hidden_layers=1,
                                         expand=2, conv_kernel=4)).eval()
    with pytest.raises(ReplayCompileError, match=r"backbone\.layers\.0\.mixer \(MambaMixer\).*cannot verify yet"):
        generate_speculative(model, ids, 4)


def test_an_ssm_layer_missed_by_the_module_checks_is_caught_by_its_cache_state(monkeypatch):
    """The backstop: a layer whose look is not recognised still leaves state in the cache after prefill; left to its
    own forward it would fold rejected drafts into that state, so it must be refused, by name."""
    from replay_compile.speculative import generate as gen
    model = DELTA_FAMILY["qwen3_5"]()
    ids = make_inputs(model, batch=1, prompt_len=4)
    monkeypatch.setattr(gen, "looks_like_ssm", lambda m: False)
    real = gen.is_gated_deltanet
    monkeypatch.setattr(gen, "is_gated_deltanet", lambda m: real(m) and m.layer_idx != 2)
    with pytest.raises(ReplayCompileError, match=r"model\.layers\.2\.linear_attn \(Qwen3_5GatedDeltaNet\)"):
        generate_speculative(model, ids, 4)


@pytest.mark.slow
def test_a_model_trained_to_copy_makes_prompt_lookup_accept():
    """The copy task of the benchmarks (``testing.copy_task``): the tiny NemotronH, trained briefly on repeated
    phrases, continues a repeated phrase; prompt lookup on such a prompt then accepts most drafts, and the output is
    still exactly greedy ``generate``'s (the random-weight models accept nothing: 1.00 tokens per round)."""
    from replay_compile.testing.copy_task import copy_accuracy, copy_batch, train_copy

    torch.manual_seed(0)
    model = MAMBA2_FAMILY["nemotron_h"](dtype=torch.float32, seed=0, initializer_range=0.02)
    vocab = model.config.vocab_size
    assert copy_accuracy(model, phrase_len=8, vocab=vocab) < 0.2
    res = train_copy(model, 900, phrase_len=8, reps=4, vocab=vocab, batch=48, target=0.97, log=None)
    assert res["copy_acc"] >= 0.97 and not model.training, res
    ids = copy_batch(2, phrase_len=8, reps=2, vocab=vocab, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    out = generate_speculative(model, ids, 24, num_draft=3, draft=PromptLookup(ngram=3), buffer_len=8)
    assert torch.equal(out.sequences, ref)
    assert out.tokens_per_round > 2.5, out.accepted
    with pytest.raises(ValueError, match="fp32"):
        train_copy(model.to(torch.bfloat16), 1)


def test_copy_training_runs_delta_rules_through_torch():
    """``train_copy`` trains Gated DeltaNet models through transformers' torch chunked rule (fla's backward is
    refused on Hopper with Triton < 3.7.1): inside ``torch_delta_rules`` the model's modeling module calls the plain
    torch function, training steps run, and every patch is undone afterwards; a Mamba-2 model needs none."""
    import sys

    from replay_compile.testing.copy_task import default_lr, mlp_parameters, torch_delta_rules, train_copy

    model = DELTA_FAMILY["qwen3_5"](dtype=torch.float32, initializer_range=0.02)
    mod = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    before = mod.torch_chunk_gated_delta_rule
    with torch_delta_rules(model) as n:
        assert n >= 1
        assert not hasattr(mod.torch_chunk_gated_delta_rule, "__wrapped__")
    assert mod.torch_chunk_gated_delta_rule is before
    res = train_copy(model, 3, phrase_len=4, reps=2, vocab=model.config.vocab_size, batch=2, check_every=3, log=None)
    assert res["steps"] == 3 and math.isfinite(res["loss"]) and mod.torch_chunk_gated_delta_rule is before
    # under autocast the forward's matmuls run in bf16 while the parameters stay fp32
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    res = train_copy(model, 2, phrase_len=4, reps=2, vocab=model.config.vocab_size, batch=2, check_every=2,
                     autocast_dtype=torch.bfloat16, log=None)
    hook.remove()
    assert math.isfinite(res["loss"]) and set(seen) == {torch.bfloat16}, seen
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # the MLP blocks held fixed: their parameters unchanged and back to trainable afterwards, the rest trained
    mlp = mlp_parameters(model)
    assert {id(p) for p in mlp} == {id(p) for n, p in model.named_parameters() if ".mlp." in n} != set()
    before_mlp = [p.detach().clone() for p in mlp]
    before_all = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = train_copy(model, 2, phrase_len=4, reps=2, vocab=model.config.vocab_size, batch=2, check_every=2,
                     freeze_mlps=True, log=None)
    assert all(torch.equal(a, p) for a, p in zip(before_mlp, mlp)) and all(p.requires_grad for p in mlp)
    assert res["trained_params"] == sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in mlp)
    assert not torch.equal(before_all["model.layers.0.linear_attn.in_proj_qkv.weight"],
                           model.model.layers[0].linear_attn.in_proj_qkv.weight)
    # a mixture of experts is an MLP block (router included); the mixers and the model around them are not
    moe = DELTA_FAMILY["qwen3_5_moe"](dtype=torch.float32)
    held = {id(p) for p in mlp_parameters(moe)}
    names = {n for n, p in moe.named_parameters() if id(p) in held}
    assert names == {n for n in dict(moe.named_parameters()) if ".mlp." in n} and any(".experts." in n for n in names)
    assert any("gate" in n and "experts" not in n for n in names), names
    with torch_delta_rules(MAMBA2_FAMILY["nemotron_h"]()) as n:
        assert n == 0
    assert default_lr(model) == 3e-3 and abs(default_lr(type("M", (), {"config": type("C", (), {
        "hidden_size": 2048})})()) - 1.5e-3) < 1e-12


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_copy_training_with_activation_checkpointing_takes_the_same_steps(family):
    """``train_copy(checkpoint=True)`` recomputes each block's activations in the backward: the same losses and
    parameters as holding them (fp32 on CPU), and the model is left without checkpointing."""
    from replay_compile.testing.copy_task import train_copy

    build = {**DELTA_FAMILY, **MAMBA2_FAMILY}[family]
    models = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        model = build(dtype=torch.float32, initializer_range=0.02)
        losses, on = [], []

        def log(line, model=model):
            losses.append(line)
            on.append(any(getattr(m, "gradient_checkpointing", False) for m in model.modules()))
        res = train_copy(model, 3, phrase_len=4, reps=2, vocab=model.config.vocab_size, batch=2, check_every=1,
                         checkpoint=checkpoint, log=log)
        assert on == [checkpoint] * 3                                   # while training, and only if asked
        assert not getattr(model, "is_activation_checkpointing", None) and not any(
            getattr(m, "gradient_checkpointing", False) for m in model.modules())
        models.append((model, res, losses))
    (a, ra, la), (b, rb, lb) = models
    assert la == lb and ra["loss"] == rb["loss"], (la, lb)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), ngram=st.integers(1, 4), k=st.integers(0, 5))
def test_prompt_lookup_on_device_matches_the_row_by_row_rule(data, ngram, k):
    """The tensor form (fixed shapes, no host sync) proposes exactly what the row-by-row rule does, padding (-1 on
    the left, as the per-row rounds pass it) and short continuations included."""
    min_ngram = data.draw(st.integers(1, ngram), label="min_ngram")
    b = data.draw(st.integers(1, 4), label="b")
    n = data.draw(st.integers(1, 14), label="n")
    rows = [data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label=f"row {r}") for r in range(b)]
    pad = [data.draw(st.integers(0, n - 1), label=f"pad {r}") for r in range(b)]
    t = torch.tensor([[-1] * p + row[p:] for row, p in zip(rows, pad)])
    pl = PromptLookup(ngram=ngram, min_ngram=min_ngram)
    assert pl(t, k).tolist() == pl.reference(t, k).tolist()
