"""TP = 2 parity (see ``test_tensor_parallel``) for the other layouts: KDA with low-rank gates (Kimi-Linear) and
full-rank gates (Ling-3.0-Flash), GLM-5.3-Flash's per-head ``A_log``, OLMo-Hybrid's separate GDN projections (its
attention left replicated). Run under the newest transformers only: the sharding reads module attributes that
``test_tensor_parallel``'s families already check under every version CI runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from test_tensor_parallel import _when_slow_tests, check_tp2_parity  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("family", [
    "kimi_linear", "bailing_hybrid", "olmo_hybrid",
    # Kimi-Linear's KDA sharding with Ling-3.0-Flash's A_log layout, both above
    pytest.param("glm5_next", marks=_when_slow_tests("GLM-5.3-Flash's tiny model takes ~100 s here")),
])
def test_tp2_matches_tp1_and_eager(family):
    check_tp2_parity(family, "eager")
