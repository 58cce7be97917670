"""Families whose recurrent state a replay step cannot serve: left unchanged, with the true reason, and their
decode identical to eager.

xLSTM's mLSTM updates its matrix memory ``C`` with a decay taken relative to a running max ``m`` (the stabiliser:
``exp(logσ(f) + m_old − m_new)``, ``m_new = max(logσ(f) + m_old, i)``), a state the same step writes: a replay window
could not recompute a record's decay from the records.
"""

import pytest
import torch

import replay_compile

pytestmark = pytest.mark.hf


def _unchanged_skips(model) -> list:
    """Greedy-decode ``model`` eagerly and compiled: tokens identical, nothing rewritten; returns the skips."""
    ids = torch.randint(3, 64, (2, 5))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=4, do_sample=False)
        replay_compile.clear_reports()
        model.forward = torch.compile(model.forward, backend="replayssm", options={"lower": "eager"})
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref)
    reps = replay_compile.reports()
    assert not any(r.rewrites for r in reps)
    return [s for r in reps for s in r.skipped]


def test_xlstm_is_left_unchanged_with_the_stabiliser_as_the_reason():
    from transformers import xLSTMConfig, xLSTMForCausalLM

    torch.manual_seed(0)
    model = xLSTMForCausalLM(xLSTMConfig(vocab_size=64, hidden_size=128, embedding_dim=128, num_hidden_layers=2,
                                         num_heads=4)).eval()
    skipped = _unchanged_skips(model)
    assert skipped and all("another recurrent state this step writes" in s.reason for s in skipped), skipped
