"""Speculative rounds compiled (``generate_speculative(..., compile=True)``) against ``model.generate`` on the tiny
HF models of every supported family, fp32, greedy.

Drafts come from tensor operations (so that they compile into the round): the true continuation with a
deterministic share of mistakes, different per row, so that rows accept different counts, run ahead of each other
and finish in different rounds; and prompt lookup on a repetitive prompt. The output must equal greedy ``generate``
token for token, the recurrent and conv states left behind must equal its cache's, and the round must compile into
one graph with no graph break. ``buffer_len=8`` with 4-token verifies flushes the rings every round or two.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("transformers")

from replay_compile import ReplayCompileError  # noqa: E402
from replay_compile.integrations.hf_modules import attention_layers, output_cache  # noqa: E402
from replay_compile.passes.validate import rel_err  # noqa: E402
from replay_compile.speculative import PromptLookup, generate_speculative  # noqa: E402
from replay_compile.speculative.generate import generate_rounds  # noqa: E402
from replay_compile.speculative.rounds import cache_positions  # noqa: E402
from replay_compile.testing.drafts import known_continuation  # noqa: E402
from replay_compile.testing.hf_models import build_for_speculation, make_inputs  # noqa: E402
from replay_compile.testing.tp_parity import _conv_states, _recurrent_states  # noqa: E402

NEW = 24
# the families under every transformers version CI runs (the attention cache's position bookkeeping changed between
# them); the others under the newest only
_EVERY_VERSION = ("nemotron_h", "qwen3_5", "kimi_linear")
FAMILIES = [pytest.param(f, marks=[pytest.mark.hf] if f in _EVERY_VERSION else [])
            for f in ("nemotron_h", "bamba", "mamba2", "zamba2", "granitemoehybrid", "qwen3_next", "qwen3_5",
                      "qwen3_5_moe", "kimi_linear", "olmo_hybrid", "bailing_hybrid")]


@pytest.fixture(scope="module", params=FAMILIES)
def reference(request):
    from replay_compile.testing.hf_models import available
    if not available(request.param):
        pytest.skip(f"{request.param} is not in this transformers")
    model = build_for_speculation(request.param)
    ids = make_inputs(model, batch=3, prompt_len=6, seed=1)
    ids = torch.cat([ids, ids[:, :4], ids], dim=1)                      # repetitive: prompt lookup finds matches
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    return request.param, model, ids, ref


@pytest.mark.slow
def test_compiled_rounds_match_generate_in_one_graph(reference):
    family, model, ids, ref = reference
    torch._dynamo.reset()
    counters.clear()
    out = generate_speculative(model, ids, NEW, num_draft=3, draft=known_continuation(ref.sequences, 5),
                               buffer_len=8, compile=True)
    assert torch.equal(out.sequences, ref.sequences), (family, out.accepted)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    counts = [n for rnd in out.accepted for n in rnd]
    assert max(counts) == 4 and len(set(counts)) >= 3, out.accepted          # full, partial and no acceptance
    assert any(len(set(rnd)) > 1 for rnd in out.accepted)                     # rows ran ahead of each other
    assert any(0 in rnd for rnd in out.accepted), out.accepted                # and finished in different rounds
    for row in range(ids.shape[0]):                                          # the first token: the prefill's
        assert sum(rnd[row] for rnd in out.accepted) == NEW - 1
    # the states left behind: after every fed token, as generate's (the last emitted token is not fed)
    ref_cache = output_cache(ref)
    for a, b in zip(_recurrent_states(out.cache) + _conv_states(out.cache),
                    _recurrent_states(ref_cache) + _conv_states(ref_cache), strict=True):
        assert a.shape == b.shape and rel_err(a, b) < 1e-4, (family, rel_err(a, b))


@pytest.mark.slow
def test_verify_windows_through_the_decode_attention_op(reference, monkeypatch):
    """The round's attention over the static cache (the token and its drafts, causal in the scratch window) becomes
    ``replay_compile::decode_attention``; the tokens stay ``generate``'s."""
    family, model, ids, ref = reference
    if family not in ("nemotron_h", "qwen3_5"):
        pytest.skip("one family per state kind")
    monkeypatch.setenv("REPLAY_COMPILE_DECODE_ATTENTION", "on")
    torch._dynamo.reset()
    counters.clear()
    out = generate_speculative(model, ids, NEW, num_draft=3, draft=known_continuation(ref.sequences, 5),
                               buffer_len=8, compile=True)
    assert torch.equal(out.sequences, ref.sequences), (family, out.accepted)
    layers = len(attention_layers(out.cache))
    assert layers and counters["replay_compile"]["decode_attention"] == layers, family


@pytest.mark.slow
def test_the_round_reports_no_state_update_left_unchanged(reference, monkeypatch, caplog):
    """A round's SSM mixers are verify layers already, so the SSM pass has nothing to rewrite there; it must not
    report their writes (nor the attention scratch's commit) as state updates it leaves unchanged, also where CPU
    graphs are rewritten."""
    family, model, ids, ref = reference
    if family != "qwen3_5":
        pytest.skip("one family: the SSM pass is off for every round alike")
    monkeypatch.setenv("REPLAY_COMPILE_DEVICES", "cpu,cuda")
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="replay_compile"):
        out = generate_speculative(model, ids, NEW, num_draft=3, draft=known_continuation(ref.sequences, 5),
                                   buffer_len=8, compile=True)
    assert torch.equal(out.sequences, ref.sequences), (family, out.accepted)
    unchanged = [r.getMessage() for r in caplog.records if "left unchanged" in r.getMessage()]
    assert not unchanged, unchanged[:3]


@pytest.mark.parametrize("every", [0, 2])
def test_eager_rounds_match_generate(reference, every):
    """The same rounds run eagerly (the code a compiled round traces): every draft right, or every other one wrong."""
    family, model, ids, ref = reference
    out = generate_rounds(model, ids, NEW, num_draft=3, draft=known_continuation(ref.sequences, every),
                          buffer_len=8, compiler=None)
    assert torch.equal(out.sequences, ref.sequences), (family, out.accepted)
    if every == 0:
        assert out.rounds <= -(-(NEW - 1) // 4) + 1


def test_prompt_lookup_rounds_match_generate(reference):
    family, model, ids, ref = reference
    out = generate_rounds(model, ids, NEW, num_draft=3, draft=PromptLookup(ngram=3), buffer_len=8, compiler=None)
    assert torch.equal(out.sequences, ref.sequences), (family, out.accepted)


def test_a_longer_static_cache_leaves_the_tokens_unchanged(reference):
    """``max_cache_len`` beyond what the rounds need: the extra positions stay masked, whatever they hold."""
    family, model, ids, ref = reference
    out = generate_speculative(model, ids, NEW, num_draft=3, draft=known_continuation(ref.sequences, 2),
                               buffer_len=8, compile=False, max_cache_len=ids.shape[1] + NEW + 8 + 21)
    assert torch.equal(out.sequences, ref.sequences), (family, out.accepted)
    assert all(layer.keys.shape[2] == ids.shape[1] + NEW + 8 + 21 for layer in attention_layers(out.cache))


def test_per_row_token_budgets_match_generate(reference):
    """One ``max_new_tokens`` per row: each row holds ``generate``'s greedy tokens up to its own budget, then
    padding, and the SSM and conv states left for a row are those ``generate`` leaves with that row's budget."""
    family, model, ids, ref = reference
    prompt = ids.shape[1]
    budgets = [NEW, 5, 13]
    out = generate_speculative(model, ids, budgets, num_draft=3, draft=known_continuation(ref.sequences, 2),
                               buffer_len=8, compile=False, eos_token_id=[], pad_token_id=-7)
    assert out.sequences.shape == (3, prompt + NEW)
    for row, n in enumerate(budgets):
        assert torch.equal(out.sequences[row, :prompt + n], ref.sequences[row, :prompt + n]), (family, row)
        assert (out.sequences[row, prompt + n:] == -7).all(), (family, row)
        assert sum(rnd[row] for rnd in out.accepted) == n - 1              # the first token: the prefill's
    with torch.no_grad():
        short = model.generate(ids[1:2], max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    for a, b in zip(_recurrent_states(out.cache) + _conv_states(out.cache),
                    _recurrent_states(output_cache(short)) + _conv_states(output_cache(short)), strict=True):
        assert rel_err(a[1:2], b) < 1e-4, (family, rel_err(a[1:2], b))


def test_token_budgets_are_checked_before_anything_runs():
    model = build_for_speculation("nemotron_h")
    ids = make_inputs(model, batch=2, prompt_len=5, seed=0)
    for budget, match in (([4], r"an int or 2 ints"), ([4, 0], r">= 1 on every row"), (0, ">= 1, got 0"),
                          ([4.0, 2.0], "an int or 2 ints"), (torch.ones(2, 1, dtype=torch.long), "an int or 2")):
        with pytest.raises(ValueError, match=match):
            generate_speculative(model, ids, budget, compile=False)
    with pytest.raises(ValueError, match="per_row=True"):
        generate_speculative(model, ids, [4, 2], compile=False, per_row=False)
    out = generate_speculative(model, ids, torch.tensor(3), compile=False)           # a 0-d tensor is an int
    assert out.sequences.shape == (2, 5 + 3)


def test_cache_positions_are_few_sizes_per_doubling():
    sizes = sorted({cache_positions(n) for n in range(1, 5000)})
    assert sizes[:6] == [64, 96, 128, 192, 256, 384] and sizes[-1] == 6144
    for n in range(1, 5000):
        assert n <= cache_positions(n) <= max(64, 3 * n // 2 + 1)


@pytest.mark.slow
def test_calls_of_similar_lengths_reuse_the_compiled_round(reference):
    """A second call with a shorter prompt, a smaller budget and per-row budgets, same batch: no new graph (the
    round's shapes come from the batch and the bucketed cache length alone), and ``generate``'s tokens."""
    family, model, ids, ref = reference
    if family != "qwen3_5":
        pytest.skip("one family: the round's shapes are family-neutral")
    torch._dynamo.reset()
    counters.clear()
    out = generate_speculative(model, ids, NEW, num_draft=3, draft=PromptLookup(ngram=3), buffer_len=8, compile=True)
    assert torch.equal(out.sequences, ref.sequences)
    assert counters["stats"]["unique_graphs"] == 1
    counters.clear()
    shorter = ids[:, 2:]
    with torch.no_grad():
        want = model.generate(shorter, max_new_tokens=NEW - 3, do_sample=False)
    out = generate_speculative(model, shorter, [NEW - 3, NEW - 3, 9], num_draft=3, draft=PromptLookup(ngram=3),
                               buffer_len=8, compile=True, eos_token_id=[], pad_token_id=-7)
    assert torch.equal(out.sequences[:2], want[:2])
    assert torch.equal(out.sequences[2, :shorter.shape[1] + 9], want[2, :shorter.shape[1] + 9])
    assert not counters["stats"]["unique_graphs"], dict(counters["stats"])


def test_a_static_cache_too_short_for_the_rounds_is_refused():
    model = build_for_speculation("nemotron_h")
    ids = make_inputs(model, batch=2, prompt_len=5, seed=0)
    with pytest.raises(ValueError, match=r"max_cache_len=20 is too small: .* need 21"):
        generate_speculative(model, ids, 8, num_draft=3, compile=False, max_cache_len=20)
    with pytest.raises(ValueError, match="max_cache_len"):
        generate_speculative(model, ids, 8, num_draft=3, compile=False, per_row=False, max_cache_len=40)


def test_compile_needs_per_row():
    with pytest.raises(ValueError, match="per_row"):
        generate_speculative(None, torch.zeros(1, 3, dtype=torch.long), 4, compile=True, per_row=False)


@pytest.mark.parametrize("how", ["compiled", "eager", "batch_min"])
def test_rows_end_at_their_end_of_sequence_token_as_generate(reference, how):
    """An end-of-sequence id that one row emits early: that row ends there (padding after), the others go on, and
    the output equals ``generate``'s with the same ids."""
    family, model, ids, ref = reference
    if how == "compiled" and family not in _EVERY_VERSION:
        pytest.skip("compiled end-of-sequence handling: checked on three families")
    new = ref.sequences[:, ids.shape[1]:]
    eos = int(new[0, 5])                                # row 0 emits it at its 6th token (or earlier)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
    kw = dict(num_draft=3, draft=known_continuation(ref.sequences, 5), buffer_len=8, eos_token_id=eos,
              pad_token_id=0)
    if how == "batch_min":
        kw["draft"] = lambda t, k: known_continuation(ref.sequences, 5)(t, k)
    out = generate_speculative(model, ids, NEW, compile=how == "compiled", per_row=how != "batch_min", **kw)
    assert torch.equal(out.sequences, want), (family, out.sequences, want)


def test_bad_drafts_raise_naming_the_source_and_commit_nothing(reference):
    family, model, ids, ref = reference
    vocab = model.get_input_embeddings().num_embeddings

    def out_of_vocab(tokens, k):
        return torch.full((tokens.shape[0], k), vocab + 5, dtype=torch.long)

    def wrong_shape(tokens, k):
        return torch.zeros(tokens.shape[0], k + 1, dtype=torch.long)

    def floats(tokens, k):
        return torch.zeros(tokens.shape[0], k)

    prefilled = generate_speculative(model, ids, 1, compile=False, eos_token_id=[])      # the state after prefill
    for draft, match in ((out_of_vocab, "out_of_vocab.*outside the vocabulary"),
                         (wrong_shape, r"wrong_shape must return \[b=3, k=3\]"), (floats, "floats must return")):
        with pytest.raises(ReplayCompileError, match=match):
            generate_speculative(model, ids, NEW, num_draft=3, draft=draft, compile=False)
    # the error left the cache holding the state after the prefill: a generation that fails on its first round
    # leaves what a one-token generation leaves
    got = {}

    def keep(tokens, k):
        return out_of_vocab(tokens, k)

    from replay_compile.speculative import generate as gen
    real = gen.Rounds

    class Spy(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            got["cache"] = self.cache
    gen.Rounds = Spy
    try:
        with pytest.raises(ReplayCompileError):
            generate_speculative(model, ids, NEW, num_draft=3, draft=keep, compile=False)
    finally:
        gen.Rounds = real
    for a, b in zip(_recurrent_states(got["cache"]) + _conv_states(got["cache"]),
                    _recurrent_states(prefilled.cache) + _conv_states(prefilled.cache), strict=True):
        assert torch.equal(a, b), family


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("family, match", [
    ("lara_mini", r"sliding-window attention \(cache layer 1, "),
    ("qwen4_exp", r"cache layer 3 \((Static|Dynamic)IndexedLayer\) holds \[.*'indexer_keys'"),
])
def test_cache_layers_the_rounds_cannot_roll_back_are_refused(family, match, per_row):
    """Lara-Mini's sliding-window attention keeps only its last positions; Qwen4-Exp's indexed attention keeps
    indexer keys beside its keys. The rounds cannot roll either back and say so, pointing to assisted generation
    (before these checks Lara-Mini's tokens and Qwen4-Exp's batch-min tokens silently departed from generate's)."""
    from replay_compile.testing.hf_models import DELTA_FAMILY, available

    if not available(family):
        pytest.skip(f"{family} is not in this transformers")
    model = DELTA_FAMILY[family]()
    ids = make_inputs(model, batch=2, prompt_len=6, seed=1)
    with pytest.raises(ReplayCompileError, match=match + ".*assisted"):
        generate_speculative(model, ids, 8, num_draft=3, compile=False, per_row=per_row)
