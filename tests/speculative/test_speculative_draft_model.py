"""Draft-model proposals (``replay_compile.speculative.DraftModel``): a small attention-only model with its own
static cache that follows the target's acceptance by cache position, inside the round.

Its drafts must equal, in every round, the draft model's own greedy ``generate`` on each row's tokens so far, under
every acceptance pattern (all of a round's drafts, some, none, rows that are done), and the speculative output must
equal the target's greedy ``generate``, compiled into one graph with the draft model's forwards in it.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("transformers")

from replay_compile import ReplayCompileError  # noqa: E402
from replay_compile.speculative import DraftModel, generate_speculative  # noqa: E402
from replay_compile.testing.drafts import known_continuation, shadowed, tiny_draft_model  # noqa: E402
from replay_compile.testing.hf_models import build_for_speculation, make_inputs  # noqa: E402

NEW = 20


def _reference(family):
    model = build_for_speculation(family)
    ids = make_inputs(model, batch=3, prompt_len=6, seed=1)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    return model, ids, ref


@pytest.mark.parametrize("family", [pytest.param("nemotron_h", marks=pytest.mark.hf), "qwen3_5"])
def test_draft_model_follows_every_acceptance_pattern(family):
    model, ids, ref = _reference(family)
    shadow, log = DraftModel(tiny_draft_model()), []
    out = generate_speculative(model, ids, NEW, num_draft=3, draft=shadowed(known_continuation(ref, 5), shadow, log),
                               buffer_len=8, compile=False)
    assert torch.equal(out.sequences, ref)
    counts = {n for rnd in out.accepted for n in rnd}
    assert {0, 1, 4} <= counts and len(counts) >= 4, out.accepted      # none .. all accepted, rows that were done
    for i, (tokens, drafts) in enumerate(log):
        live = [r for r in range(tokens.shape[0]) if out.accepted[i][r] > 0]          # done rows' drafts are unused
        assert torch.equal(drafts[live], shadow.reference(tokens[live], 3)), (family, i)


@pytest.mark.slow
def test_draft_model_round_compiles_into_one_graph():
    model, ids, ref = _reference("nemotron_h")
    torch._dynamo.reset()
    counters.clear()
    out = generate_speculative(model, ids, NEW, num_draft=3, draft=DraftModel(tiny_draft_model()), buffer_len=8,
                               compile=True)
    assert torch.equal(out.sequences, ref)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def test_draft_model_must_be_attention_only():
    with pytest.raises(ReplayCompileError, match=r"layers\.0\.mixer.*recurrent layer.*attention-only"):
        DraftModel(build_for_speculation("nemotron_h"))


def test_draft_model_needs_start():
    with pytest.raises(ReplayCompileError, match="start"):
        DraftModel(tiny_draft_model())(torch.zeros(1, 4, dtype=torch.long), 3)
