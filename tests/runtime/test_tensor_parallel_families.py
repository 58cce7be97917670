"""TP = 2 parity (see ``test_tensor_parallel``) for the other layouts: KDA with low-rank gates (Kimi-Linear) and
full-rank gates (Ling-3.0-Flash), GLM-5.3-Flash's per-head ``A_log``, OLMo-Hybrid's separate GDN projections (its
attention left replicated). Run under the newest transformers only: the sharding reads module attributes that
``test_tensor_parallel``'s families already check under every version CI runs.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

from test_tensor_parallel import check_tp2_parity  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("family", [
    "kimi_linear", "bailing_hybrid", "olmo_hybrid",
    pytest.param("glm5_next", marks=pytest.mark.skipif(
        not os.environ.get("REPLAY_COMPILE_SLOW_TESTS"),
        reason="GLM-5.3-Flash's tiny model takes ~100 s here (its KDA sharding is Kimi-Linear's with Ling-3.0-Flash's "
               "A_log layout, both above); set REPLAY_COMPILE_SLOW_TESTS=1 to run it")),
])
def test_tp2_matches_tp1_and_eager(family):
    check_tp2_parity(family, "eager")
