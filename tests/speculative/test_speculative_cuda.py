"""Speculative rounds on CUDA, where they run as a captured CUDA graph after two compiled rounds: the replayed
rounds must give what the compiled ones give (greedy ``generate``'s tokens and states, fp32), a draft model and the
sampling draws must run inside the graph, and a draft that turns bad in a replayed round must stop everything from
that round on. Skipped without a GPU (the CPU tests run the same round code, compiled, without the capture)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

from replay_compile import ReplayCompileError  # noqa: E402
from replay_compile.integrations.hf_modules import output_cache  # noqa: E402
from replay_compile.passes.validate import rel_err  # noqa: E402
from replay_compile.speculative import DraftModel, generate_speculative  # noqa: E402
from replay_compile.testing.drafts import known_continuation, tiny_draft_model  # noqa: E402
from replay_compile.testing.hf_models import build_for_speculation, make_inputs  # noqa: E402
from replay_compile.testing.tp_parity import _conv_states, _recurrent_states  # noqa: E402

NEW = 24


def _setup(family):
    model = build_for_speculation(family).cuda()
    ids = make_inputs(model, batch=3, prompt_len=6, seed=1).cuda()
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    return model, ids, ref


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5", "kimi_linear"])
def test_replayed_rounds_match_generate(family):
    model, ids, ref = _setup(family)
    out = generate_speculative(model, ids, NEW, num_draft=3, draft=known_continuation(ref.sequences, 5),
                               buffer_len=8, compile=True)
    assert out.rounds > 4, out.accepted                                        # rounds ran from the graph
    assert torch.equal(out.sequences, ref.sequences), (family, out.accepted)
    t = out.timing                                 # the replayed rounds are those after the warm-up ones
    if t["replay_rounds"] or family != "kimi_linear":  # (transformers 5.17's MoE fallback copies from the host)
        assert t["replay_rounds"] == out.rounds - 2 and t["replay"] > 0, t
        assert t["replay_tokens"] == sum(map(sum, out.accepted[2:])), t
    for a, b in zip(_recurrent_states(out.cache) + _conv_states(out.cache),
                    _recurrent_states(output_cache(ref)) + _conv_states(output_cache(ref)), strict=True):
        assert rel_err(a, b) < 1e-4, family
    again = generate_speculative(model, ids, NEW, num_draft=3, draft=known_continuation(ref.sequences, 5),
                                 buffer_len=8, compile=True)                  # new tensors, the same compiled step
    assert torch.equal(again.sequences, ref.sequences)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_a_generator_replays_its_kept_graph_from_the_first_round(family):
    """The second call of a shape replays the graph the first captured, from its first round (no warm-up rounds, no
    capture), over a new prompt and per-row budgets written into the same buffers, and folds its rings into the
    cache by replaying the final fold captured after the first call: generate's tokens and states, on every later
    call."""
    from replay_compile.speculative import PromptLookup, SpeculativeGenerator

    model, ids, ref = _setup(family)
    gen = SpeculativeGenerator(model, num_draft=3, draft=PromptLookup(ngram=3), buffer_len=8)
    first = gen(ids, NEW)
    assert torch.equal(first.sequences, ref.sequences) and first.timing["reused"] == 0.0
    assert first.timing["finish_replayed"] == 0.0
    other = make_inputs(model, batch=3, prompt_len=5, seed=2).cuda()
    with torch.no_grad():
        want = model.generate(other, max_new_tokens=NEW - 4, do_sample=False, return_dict_in_generate=True)
    out = gen(other, NEW - 4)
    t = out.timing
    assert t["reused"] == 1.0 and t["replay_rounds"] == out.rounds, t             # every round from the kept graph
    assert t["finish_replayed"] == 1.0, t
    assert torch.equal(out.sequences, want.sequences), (family, out.accepted)
    for a, b in zip(_recurrent_states(out.cache) + _conv_states(out.cache),
                    _recurrent_states(output_cache(want)) + _conv_states(output_cache(want)), strict=True):
        assert rel_err(a, b) < 1e-4, family
    again = gen(ids, NEW)                          # the captured fold again, over the first prompt's rings
    assert again.timing["finish_replayed"] == 1.0 and torch.equal(again.sequences, ref.sequences)
    for a, b in zip(_recurrent_states(again.cache), _recurrent_states(output_cache(ref)), strict=True):
        assert rel_err(a, b) < 1e-4, family


def test_draft_model_in_the_graph():
    model, ids, ref = _setup("nemotron_h")
    out = generate_speculative(model, ids, NEW, num_draft=3, draft=DraftModel(tiny_draft_model().cuda()),
                               buffer_len=8, compile=True)
    assert torch.equal(out.sequences, ref.sequences)


def test_draft_turning_bad_in_a_replayed_round_stops_every_later_round():
    model, ids, ref = _setup("nemotron_h")
    good = known_continuation(ref.sequences)
    vocab = model.get_input_embeddings().num_embeddings
    limit = ids.shape[1] + 13                           # rows reach it after the two compiled rounds

    def turns_bad(tokens, k):
        return torch.where(((tokens >= 0).sum(1) >= limit)[:, None], vocab + 1, good(tokens, k))
    with pytest.raises(ReplayCompileError, match="turns_bad.*outside the vocabulary"):
        generate_speculative(model, ids, NEW, num_draft=3, draft=turns_bad, buffer_len=8, compile=True)


def test_sampling_in_the_graph_draws_fresh_numbers_every_round():
    """Rows of one prompt, sampled: the draws differ between rows and between rounds (a replay that reused its
    random numbers would make every row, and every round of a row, alike)."""
    model = build_for_speculation("nemotron_h").cuda()
    ids = make_inputs(model, batch=1, prompt_len=6, seed=1).cuda().expand(64, -1).contiguous()
    torch.manual_seed(0)
    out = generate_speculative(model, ids, 16, num_draft=3, draft=known_continuation(ids), compile=True,
                               do_sample=True, temperature=1.0, top_k=0, eos_token_id=[])
    new = out.sequences[:, ids.shape[1]:]
    assert out.rounds > 4
    assert len({tuple(r) for r in new.tolist()}) > 48
    assert len({tuple(new[:, j].tolist()) for j in range(4, 16)}) == 12


def test_a_round_that_cannot_be_captured_runs_as_compiled_calls(caplog):
    """A proposer that copies from the host (as transformers' grouped-matmul fallback for MoE layers does, in
    Kimi-Linear) cannot be captured: the reason is logged and the rounds run as compiled calls, same tokens."""
    model, ids, ref = _setup("nemotron_h")
    good = known_continuation(ref.sequences, 5)

    @torch.compiler.disable
    def host_copy(tokens, k):
        return good(tokens, k) + torch.zeros(1, dtype=torch.long).to(tokens.device)
    with caplog.at_level("WARNING", logger="replay_compile"):
        out = generate_speculative(model, ids, NEW, num_draft=3, draft=host_copy, buffer_len=8, compile=True)
    assert torch.equal(out.sequences, ref.sequences)
    assert any("cannot be captured" in r.getMessage() for r in caplog.records)
    assert out.timing["replay_rounds"] == 0 and out.timing["replay"] == 0.0
