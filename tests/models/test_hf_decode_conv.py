"""The decode-conv rewrite on transformers' models: every SSM layer's depthwise conv (``causal_conv1d_update``'s
``F.conv1d`` over ``[conv state | new input]``) is rewritten in the decode graph of each family, and greedy decoding
gives what the same compile without the rewrite gives (fp32: tokens identical, logits within rounding).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("transformers")

from replay_compile import backend as rb  # noqa: E402
from replay_compile.passes import decode_conv  # noqa: E402
from replay_compile.testing.hf_models import (  # noqa: E402
    DELTA_FAMILY,
    MAMBA1_FAMILY,
    MAMBA2_FAMILY,
    available,
    greedy_static_decode,
)

pytestmark = pytest.mark.hf

PROMPT, STEPS, M = 5, 4, 16
MODELS = {**MAMBA2_FAMILY, **DELTA_FAMILY, **MAMBA1_FAMILY}
FAST = ["nemotron_h", "qwen3_5", "kimi_linear"]                 # Mamba-2, Gated DeltaNet, KDA
# Qwen4-Exp and GLM-5.3-Flash split their decode step into a graph per layer (a minute each on CPU)
SLOW = [f for f in MODELS if f not in FAST + ["qwen4_exp", "glm5_next"]]


def _decode(model, forward):
    from transformers import StaticCache

    return greedy_static_decode(model, forward, StaticCache(config=model.config, max_cache_len=M), PROMPT, STEPS)


def _depthwise_convs(model) -> int:
    return sum(isinstance(m, torch.nn.Conv1d) and m.groups == m.in_channels == m.out_channels
               for m in model.modules())


def _compare(family: str, lower: str, monkeypatch) -> None:
    if not available(family):
        pytest.skip(f"{family} is not in this transformers")
    model = MODELS[family](dtype=torch.float32)
    families = ("mamba1",) if family in MAMBA1_FAMILY else ("mamba2", "gdn", "kda")
    left, rewrite = [], decode_conv.rewrite

    def recording(gm, **kw):
        done, skipped = rewrite(gm, **kw)
        left.extend(skipped)
        return done, skipped
    monkeypatch.setattr(decode_conv, "rewrite", recording)
    runs = {}
    with torch.no_grad():
        for mode in ("off", "on"):
            torch._dynamo.reset()
            counters.clear()
            rb.clear_reports()
            fwd = torch.compile(model.forward, backend="replayssm",
                                options={"decode_conv": mode, "lower": lower, "families": families})
            runs[mode] = _decode(model, fwd)
            runs[mode + " convs"] = counters["replay_compile"]["decode_conv"]
            runs[mode + " layers"] = {layer for r in rb.reports() for layer in r.convs}
    assert runs["off convs"] == 0
    # every SSM layer's conv, in every decode graph (a recompile for a new shape rewrites them again)
    assert runs["on convs"] >= _depthwise_convs(model) > 0, runs["on layers"]
    assert not left, left
    assert torch.equal(runs["on"][0], runs["off"][0]), family
    torch.testing.assert_close(runs["on"][1], runs["off"][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAST)
def test_every_ssm_layer_conv_is_rewritten_and_decoding_is_unchanged(family, monkeypatch):
    _compare(family, "eager", monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("family", SLOW)
def test_the_other_families(family, monkeypatch):
    _compare(family, "eager", monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_through_inductor(family, monkeypatch):
    _compare(family, "inductor", monkeypatch)
