"""Importing replay_compile (which installs its transformers hooks) must not change what other backends do: a
``generate`` compiled with AOTAutograd (``aot_eager``, the path Inductor takes) on a hybrid model gives eager's
tokens, because states no replay step touched stay plain tensors. (A state a replay step did touch is refused by
other backends, loudly: ``tests/models/test_cache_contract.py``.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from replay_compile.integrations import hf as hf_integration  # noqa: E402
from replay_compile.integrations.hf_modules import output_cache  # noqa: E402
from replay_compile.replay_tensor import ReplayTensor  # noqa: E402
from replay_compile.testing.hf_models import DELTA_FAMILY, MAMBA2_FAMILY, make_inputs  # noqa: E402
from replay_compile.testing.tp_parity import _recurrent_states  # noqa: E402


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_generate_compiled_by_another_backend_is_untouched(family):
    hf_integration.install()
    model = {**MAMBA2_FAMILY, **DELTA_FAMILY}[family]()
    ids = make_inputs(model)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="aot_eager")
        out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert not any(isinstance(t, ReplayTensor) for t in _recurrent_states(output_cache(out)))
