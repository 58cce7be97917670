"""transformers' assisted generation on hybrid models (``model.generate(..., prompt_lookup_num_tokens=k)`` and
``assistant_model=``) with ``replay_compile`` installed: the SSM layers verify through the replay rings and roll back
through the cache's ``crop``. Greedy output and the states left in the cache must equal plain ``generate``'s; the
cache, the mixers and the model get their own methods back afterwards."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from replay_compile import ReplayCompileError  # noqa: E402
from replay_compile.integrations import hf as hf_integration  # noqa: E402
from replay_compile.integrations.hf_modules import cache_kwarg, output_cache  # noqa: E402
from replay_compile.passes.validate import rel_err  # noqa: E402
from replay_compile.testing.drafts import tiny_draft_model  # noqa: E402
from replay_compile.testing.hf_models import available, build_for_speculation, make_inputs  # noqa: E402
from replay_compile.testing.tp_parity import _conv_states, _recurrent_states  # noqa: E402

hf_integration.install()
_EVERY_VERSION = ("nemotron_h", "mamba2", "qwen3_5", "kimi_linear")
FAMILIES = [pytest.param(f, marks=[pytest.mark.hf] if f in _EVERY_VERSION else [])
            for f in ("nemotron_h", "bamba", "mamba2", "zamba2", "granitemoehybrid", "qwen3_next", "qwen3_5",
                      "qwen3_5_moe", "kimi_linear", "olmo_hybrid", "bailing_hybrid", "lara_mini", "qwen4_exp",
                      "glm5_next")]


@pytest.mark.parametrize("family", FAMILIES)
def test_assisted_generation_matches_generate(family):
    if not available(family):
        pytest.skip(f"{family} is not in this transformers")
    model = build_for_speculation(family)
    ids = make_inputs(model, batch=1, prompt_len=6, seed=1)
    ids = torch.cat([ids, ids, ids], dim=1)                          # repetitive: prompt lookup finds drafts
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    if cache_kwarg(model) == "cache_params":                         # a cache class of its own (Mamba2, 5.17)
        with pytest.raises(ReplayCompileError, match="generate_speculative"):
            model.generate(ids, max_new_tokens=20, prompt_lookup_num_tokens=3)
        return
    for assist in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=tiny_draft_model())):
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=20, do_sample=False, return_dict_in_generate=True, **assist)
        assert torch.equal(out.sequences, ref.sequences), (family, list(assist))
        cache, want = output_cache(out), output_cache(ref)
        for a, b in zip(_recurrent_states(cache) + _conv_states(cache), _recurrent_states(want) + _conv_states(want),
                        strict=True):
            assert a.shape == b.shape and rel_err(a, b) < 1e-4, (family, list(assist))
        assert "crop" not in type(cache).__dict__                    # the cache's own class again
    assert "_is_stateful" not in vars(model)
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.hf
def test_assisted_generation_samples_and_runs_compiled_models_eagerly():
    model = build_for_speculation("qwen3_5")
    ids = make_inputs(model, batch=1, prompt_len=6, seed=1)
    ids = torch.cat([ids, ids, ids], dim=1)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False)
        model.forward = torch.compile(model.forward, backend="replayssm")
        out = model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
        torch.manual_seed(0)
        sampled = model.generate(ids, max_new_tokens=12, do_sample=True, prompt_lookup_num_tokens=3)
    assert torch.equal(out, ref)
    assert sampled.shape[1] <= ref.shape[1] and bool((sampled[:, :ids.shape[1]] == ids).all())


def test_growing_draft_schedules_are_refused():
    model = build_for_speculation("nemotron_h")
    assistant = tiny_draft_model()
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    with pytest.raises(ReplayCompileError, match="num_assistant_tokens_schedule"):
        model.generate(make_inputs(model, batch=1), max_new_tokens=4, assistant_model=assistant)
