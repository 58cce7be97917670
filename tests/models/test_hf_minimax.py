"""MiniMax (lightning attention: a constant decay per head, a rank-1 ``k^T v`` update of a ``[K, V]`` state that its
cache list replaces every step) through ``backend="replayssm"``: greedy decoding through two flushes identical to
eager, logits and the flushed states close, every linear-attention layer rewritten, the cache list keeping one
tensor per layer."""

import pytest
import torch

pytest.importorskip("transformers")

from replay_compile.replay_tensor import ReplayTensor  # noqa: E402
from replay_compile.testing import check_equivalence  # noqa: E402
from replay_compile.testing.hf_models import LIGHTNING_FAMILY, make_inputs  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.mark.slow
@pytest.mark.parametrize("initializer_range", [None, 0.5])
def test_minimax_decodes_like_eager(initializer_range):
    model = LIGHTNING_FAMILY["minimax"](initializer_range=initializer_range)
    rep = check_equivalence(model, make_inputs(model), buffer_len=4)
    assert rep.tokens_match, rep
    assert rep.max_logit_diff <= 1e-4 * rep.logit_scale, rep
    assert rep.states_compared > 0 and rep.max_state_diff < 1e-5, rep
    assert rep.flushes_per_layer >= 2, rep
    assert {r.layer for r in rep.rewrites} == {"model.layers.0.self_attn"}, rep.rewrites
    assert all(r.family == "mamba2" and r.spec.transposed for r in rep.rewrites), rep.rewrites
    assert not rep.skipped, rep.skipped


def test_minimax_cache_keeps_one_protected_tensor_per_layer():
    """The compiled step returns the state it was given: the cache list holds the same tensor (as a ReplayTensor
    from the second decode step on) instead of a new one per step, and indexing it reads the current state."""
    from transformers import LogitsProcessor, LogitsProcessorList
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    model = LIGHTNING_FAMILY["minimax"](initializer_range=0.5)
    ids = make_inputs(model, batch=3)
    cache, seen = MiniMaxCache(), []

    class Watch(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(cache.linear_cache[0])
            return scores

    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
        model.forward = torch.compile(model.forward, backend="replayssm", options={"buffer_len": 4,
                                                                                     "lower": "eager"})
        got = model.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                             past_key_values=cache, logits_processor=LogitsProcessorList([Watch()]))
    assert torch.equal(got.sequences, ref.sequences)
    decode = seen[2:]
    assert decode and all(isinstance(t, ReplayTensor) for t in decode), [type(t) for t in decode]
    assert all(t is decode[0] for t in decode), "one tensor per layer for the whole decode"
    torch.testing.assert_close(cache.linear_cache[0][[2, 0]], ref.past_key_values.linear_cache[0][[2, 0]],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_minimax_decodes_like_eager_on_gpu():
    model = LIGHTNING_FAMILY["minimax"](initializer_range=0.5).cuda()
    rep = check_equivalence(model, make_inputs(model).cuda(), buffer_len=4)
    assert rep.rewrites and all(r.spec.transposed for r in rep.rewrites), (rep.rewrites, rep.skipped)
    assert rep.tokens_match, rep
    assert rep.max_logit_diff <= 1e-3 * rep.logit_scale, rep
    assert rep.states_compared > 0 and rep.max_state_diff < 1e-4, rep
