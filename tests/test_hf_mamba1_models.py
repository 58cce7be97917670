"""Mamba-1 models (Mamba, Falcon-Mamba, Jamba) through ``backend="replayssm"``: greedy decoding through two flushes
identical to eager, logits and the flushed cache states close, every Mamba-1 layer rewritten."""

import pytest
import torch

pytest.importorskip("transformers")

import replay_compile  # noqa: E402
from replay_compile.testing import check_equivalence  # noqa: E402
from replay_compile.testing.hf_models import MAMBA1_FAMILY, make_inputs  # noqa: E402

pytestmark = pytest.mark.hf
LAYERS = {"mamba": 2, "falcon_mamba": 2, "jamba": 1}       # Mamba-1 layers in each tiny config


@pytest.mark.parametrize("name", sorted(MAMBA1_FAMILY))
def test_mamba1_model_decodes_like_eager(name):
    torch._dynamo.utils.counters.clear()
    model = MAMBA1_FAMILY[name]()
    rep = check_equivalence(model, make_inputs(model), buffer_len=4)
    assert rep.tokens_match, rep
    assert rep.max_logit_diff <= 1e-4 * rep.logit_scale, rep
    assert rep.states_compared > 0 and rep.max_state_diff < 1e-5, rep
    assert rep.flushes_per_layer >= 2, rep
    assert {r.layer for r in rep.rewrites} and len({r.layer for r in rep.rewrites}) == LAYERS[name], rep.rewrites
    assert all(r.family == "mamba1" for r in rep.rewrites), rep.rewrites
    assert not rep.skipped, rep.skipped


def test_mamba1_family_not_enabled_is_left_unchanged_and_says_so():
    model = MAMBA1_FAMILY["mamba"]()
    replay_compile.clear_reports()
    rep = check_equivalence(model, make_inputs(model), buffer_len=4, options={"families": ("mamba2",)})
    assert rep.tokens_match and not rep.rewrites
    assert rep.skipped and all("'mamba1' is not enabled" in s.reason for s in rep.skipped), rep.skipped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton replay kernel through Inductor needs a GPU")
@pytest.mark.parametrize("name", sorted(MAMBA1_FAMILY))
def test_mamba1_model_decodes_like_eager_on_gpu(name):
    model = MAMBA1_FAMILY[name]().cuda()
    rep = check_equivalence(model, make_inputs(model).cuda(), buffer_len=4)
    assert rep.rewrites and all(r.family == "mamba1" for r in rep.rewrites), (rep.rewrites, rep.skipped)
    assert rep.tokens_match, rep
    assert rep.max_logit_diff <= 1e-3 * rep.logit_scale, rep
    assert rep.states_compared > 0 and rep.max_state_diff < 1e-4, rep
    assert rep.flushes_per_layer >= 2, rep
