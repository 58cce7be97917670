"""Host-side launch helpers: integer maths equal to Triton's, launch configurations cached only while no
benchmark override (``TUNING``) is set."""

import pytest
import triton

from replay_compile.kernels import delta_triton, mamba2_triton
from replay_compile.kernels.host_math import cdiv, memo_unless_tuned, next_pow2


def test_integer_helpers_match_triton():
    assert all(next_pow2(n) == triton.next_power_of_2(n) for n in range(0, 4097))
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 257) for b in range(1, 65))


def test_config_is_cached_and_read_only_until_tuned():
    tuning, calls = {}, []

    @memo_unless_tuned(tuning)
    def config(b, L=16):
        calls.append(b)
        return {"BLOCK": tuning.get("BLOCK", 16), "b": b}

    a, a2 = config(4), config(4)
    assert a is a2 and calls == [4] and a["BLOCK"] == 16
    with pytest.raises(TypeError):
        a["BLOCK"] = 32                                    # shared: editing it must fail, not leak
    tuning["BLOCK"] = 64
    assert config(4)["BLOCK"] == 64 and calls == [4, 4]    # an override takes effect at once, uncached
    tuning.clear()
    assert config(4) is a                                  # and the untuned entry is still right


@pytest.mark.parametrize("mod, args", [(mamba2_triton, (256, 128, 64, 128, 16)),
                                       (delta_triton, (256, 32, 128, 128, 16))])
def test_module_configs_follow_their_tuning(mod, args):
    base = dict(mod.launch_config(*args))
    mod.TUNING["BLOCK_P" if mod is mamba2_triton else "BLOCK_V"] = 8
    try:
        tuned = dict(mod.launch_config(*args))
    finally:
        mod.TUNING.clear()
    assert tuned != base and dict(mod.launch_config(*args)) == base
