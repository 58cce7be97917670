"""Greedy speculative generation (``replay_compile.speculative``) against ``model.generate`` on tiny HF models.

Drafts: an oracle (the true continuation: every draft accepted), always wrong (every draft rejected: rollback on
every round), a seeded mix (random acceptance counts), and prompt lookup on a repetitive prompt. ``buffer_len=8``
with 4-token verifies makes the rings flush every round or two, across ring wrap. The output must equal greedy
``generate`` token for token, and the cache left behind must hold the same recurrent and conv states.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = [pytest.mark.hf]

from replay_compile import ReplayCompileError  # noqa: E402
from replay_compile.speculative import PromptLookup, generate_speculative  # noqa: E402
from replay_compile.testing.hf_models import DELTA_FAMILY, MAMBA2_FAMILY, make_inputs  # noqa: E402
from replay_compile.integrations.hf_modules import output_cache  # noqa: E402
from replay_compile.passes.validate import rel_err  # noqa: E402
from replay_compile.testing.tp_parity import _recurrent_states  # noqa: E402

NEW = 40


def _conv_states(cache):
    out = []
    for layer in cache.layers:
        cs = getattr(layer, "conv_states", None)
        out += [t for t in (cs.values() if isinstance(cs, dict) else []) if isinstance(t, torch.Tensor)]
    return out


@pytest.fixture(scope="module", params=["nemotron_h", "bamba", "mamba2", "zamba2", "granitemoehybrid"])
def reference(request):
    model = MAMBA2_FAMILY[request.param]()
    ids = make_inputs(model, batch=2, prompt_len=6, seed=1)
    ids = torch.cat([ids, ids[:, :4], ids], dim=1)                      # repetitive: prompt lookup finds matches
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    return request.param, model, ids, ref


def _oracle(ref):
    return lambda t, k: ref.sequences[:, t.shape[1]:t.shape[1] + k]


def _wrong(ref, vocab):
    return lambda t, k: (ref.sequences[:, t.shape[1]:t.shape[1] + k] + 1 - 3) % (vocab - 3) + 3


def _mixed(ref, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)

    def propose(t, k):
        good = ref.sequences[:, t.shape[1]:t.shape[1] + k]
        flip = torch.rand(good.shape, generator=g) < 0.3
        return torch.where(flip, (good + 1 - 3) % (vocab - 3) + 3, good)
    return propose


@pytest.mark.parametrize("drafts", ["oracle", "wrong", "mixed", "prompt_lookup"])
def test_greedy_output_and_final_cache_match_generate(reference, drafts):
    family, model, ids, ref = reference
    vocab = model.config.vocab_size
    draft = {"oracle": _oracle(ref), "wrong": _wrong(ref, vocab), "mixed": _mixed(ref, vocab),
             "prompt_lookup": PromptLookup(ngram=3)}[drafts]
    out = generate_speculative(model, ids, NEW, num_draft=3, draft=draft, buffer_len=8)
    assert torch.equal(out.sequences, ref.sequences), (family, drafts, out.accepted)
    assert sum(out.accepted) == NEW - 1                                  # the first token comes from the prefill
    if drafts == "oracle":
        assert max(out.accepted) == 4 and out.rounds < NEW // 2
    if drafts == "wrong":
        assert set(out.accepted) == {1}
    if drafts == "mixed":
        assert len(set(out.accepted)) >= 2                                # several acceptance counts
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
    model = DELTA_FAMILY["qwen3_5"]()
    ids = make_inputs(model, batch=1, prompt_len=4)
    with pytest.raises(ReplayCompileError, match="cannot verify yet"):
        generate_speculative(model, ids, 4)
