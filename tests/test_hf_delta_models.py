"""Gated DeltaNet (Qwen3-Next, Qwen3.5 dense and MoE) and KDA (Kimi-Linear) through ``backend="replayssm"``:
greedy decoding through two flushes identical to eager, logits and the flushed cache states close, every
linear-attention layer rewritten with the right family and key-head groups."""

import pytest
import torch

pytest.importorskip("transformers")

import replay_compile  # noqa: E402
from replay_compile.testing import check_equivalence  # noqa: E402
from replay_compile.testing.hf_models import DELTA_FAMILY, make_inputs  # noqa: E402

EXPECT = {  # family, key heads (4 value heads in every tiny config)
    "qwen3_next": ("gdn", 2), "qwen3_5": ("gdn", 2), "qwen3_5_moe": ("gdn", 2), "kimi_linear": ("kda", 4),
}


@pytest.mark.parametrize("name", sorted(DELTA_FAMILY))
def test_delta_model_decodes_like_eager(name):
    torch._dynamo.utils.counters.clear()
    model = DELTA_FAMILY[name]()
    rep = check_equivalence(model, make_inputs(model), buffer_len=4)      # 9 steps: two flushes per layer
    assert rep.tokens_match, rep
    assert rep.max_logit_diff <= 1e-3 * rep.logit_scale, rep
    assert rep.states_compared > 0 and rep.max_state_diff < 1e-3, rep
    family, hk = EXPECT[name]
    layers = {r.layer for r in rep.rewrites}
    assert len(layers) == 2 and all(r.family == family and r.spec.Hk == hk for r in rep.rewrites), rep.rewrites
    assert not [s for s in rep.skipped if not s.quiet], rep.skipped
    assert torch._dynamo.utils.counters["replay_compile"][family] >= 2


def test_family_not_enabled_is_left_unchanged_and_says_so():
    model = DELTA_FAMILY["qwen3_5"]()
    replay_compile.clear_reports()
    rep = check_equivalence(model, make_inputs(model), buffer_len=4, options={"families": ("mamba2",)})
    assert rep.tokens_match and not rep.rewrites
    assert rep.skipped and all("state itself (a delta rule?)" in s.reason for s in rep.skipped), rep.skipped
