"""Speculative sampling (``generate_speculative(..., do_sample=True)``): every emitted token distributed as plain
sampling's, whatever the drafts.

The acceptance rule is checked against the exact distributions it must reproduce (the first emitted token of a round
is distributed as the target's first distribution; given that the first ``j`` drafts were emitted, the next token as
the distribution after them), the warpers against ``generate``'s, and the whole compiled path on a tiny model by the
total-variation distance of its token histograms from plain ``generate(do_sample=True)``'s, against the distance
between two runs of plain sampling (the sampling noise).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from replay_compile.speculative import generate_speculative  # noqa: E402
from replay_compile.speculative.sampling import Sampling, accept  # noqa: E402
from replay_compile.testing.drafts import known_continuation  # noqa: E402
from replay_compile.testing.hf_models import build_for_speculation, make_inputs  # noqa: E402


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def _hist(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / max(tokens.numel(), 1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.sampled_from([0.3, 1.0, 1.7]), top_k=st.sampled_from([None, 0, 1, 5]),
       top_p=st.sampled_from([None, 0.3, 0.9, 1.0]))
def test_warpers_match_generate(seed, temperature, top_k, top_p):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(seed)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                  + ([TopKLogitsWarper(top_k)] if top_k else [])
                                  + ([TopPLogitsWarper(top_p)] if top_p is not None and top_p < 1 else []))
    want = warpers(None, logits.clone()).softmax(-1)
    got = Sampling(temperature, top_k, top_p).probs(logits)
    assert torch.allclose(got, want, atol=1e-6), (got, want)


def test_accept_emits_each_token_with_the_target_distribution():
    torch.manual_seed(0)
    V, k, N = 6, 2, 200_000
    probs = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10],      # after the last token: draft 1 fairly likely
                          [0.02, 0.50, 0.08, 0.10, 0.00, 0.30],      # after draft 1: draft 2 unlikely
                          [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]])     # after draft 2
    drafts = torch.tensor([0, 4])
    ok, tokens = accept(probs.expand(N, -1, -1), drafts.expand(N, -1), Sampling())
    assert ok.min() >= 0 and ok.max() <= k
    # the first emitted token ~ p_0; after draft 1 was emitted, the next ~ p_1; after both, the next ~ p_2
    assert _tv(_hist(tokens[:, 0], V), probs[0].double()) < 0.01
    second = tokens[ok >= 1, 1]
    assert abs(second.numel() / N - 0.30) < 0.01 and _tv(_hist(second, V), probs[1].double()) < 0.015
    assert not bool((ok == 2).any())                                 # draft 2 has probability 0 after draft 1
    sure = accept(probs.expand(N, -1, -1), torch.tensor([0, 1]).expand(N, -1), Sampling())[1]
    third = sure[(sure[:, 0] == 0) & (sure[:, 1] == 1), 2]
    assert _tv(_hist(third, V), probs[2].double()) < 0.02


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_arguments(bad):
    with pytest.raises(ValueError, match="sampling"):
        Sampling(**bad)


@pytest.mark.slow
def test_sampled_tokens_are_distributed_as_plain_sampling():
    """2,000 rows of one prompt, 4 new tokens, compiled rounds with the greedy continuation as drafts (accepted
    where the sampled path agrees with it): each position's histogram must be within twice the distance between two
    plain-sampling runs of plain sampling's."""
    model = build_for_speculation("nemotron_h")
    ids = make_inputs(model, batch=1, prompt_len=6, seed=1)
    N, NEW, P = 2000, 4, ids.shape[1]
    V = model.config.vocab_size
    kw = dict(do_sample=True, temperature=0.5, top_k=20, eos_token_id=[])
    rows = ids.expand(N, -1).contiguous()
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        plain = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            plain.append(model.generate(rows, max_new_tokens=NEW, **kw))
    torch.manual_seed(2)
    torch._dynamo.reset()
    out = generate_speculative(model, rows, NEW, num_draft=3, draft=known_continuation(greedy.expand(N, -1)),
                               compile=True, **kw)
    assert out.tokens_per_round > 1.2, out.tokens_per_round                  # drafts were accepted
    for pos in range(NEW):
        noise = _tv(_hist(plain[0][:, P + pos], V), _hist(plain[1][:, P + pos], V))
        got = _tv(_hist(plain[0][:, P + pos], V), _hist(out.sequences[:, P + pos], V))
        assert got < 2 * noise + 0.01, (pos, got, noise)
