"""Launch-configuration overrides (``TUNING``): a key or variant a kernel module does not read raises at once."""

import importlib
import pathlib
import re

import pytest

from replay_compile.kernels.tuning import Tuning, parse_tuning, tuned

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "replay_compile" / "kernels"
MODULES = sorted(p.stem for p in KERNELS.glob("*.py") if re.search(r"^TUNING\b", p.read_text(), re.M))


def test_the_modules_with_overrides_are_found():
    assert {"mamba2_triton", "delta_triton", "mamba2_spec_triton"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_key_read_is_declared(name):
    """What ``launch_config`` reads from ``TUNING`` is exactly what the override accepts."""
    mod = importlib.import_module(f"replay_compile.kernels.{name}")
    assert isinstance(mod.TUNING, Tuning) and not mod.TUNING
    read = set(re.findall(r'TUNING(?:\.get\(|\[)"(\w+)"', (KERNELS / f"{name}.py").read_text()))
    assert read == set(mod.TUNING.keys_allowed), name


def test_unknown_key_and_variant_raise_naming_the_module():
    from replay_compile.kernels import delta_triton, mamba2_triton

    with pytest.raises(KeyError, match=r"mamba2_triton\.TUNING: unknown key 'BLOCK_PP'"):
        with tuned(mamba2_triton.TUNING, "pre:BLOCK_PP=32"):
            pass
    assert not mamba2_triton.TUNING
    with pytest.raises(ValueError, match="unknown variant 'fusd'"):
        delta_triton.TUNING["variant"] = "fusd"
    with pytest.raises(KeyError):
        delta_triton.TUNING.update(BLOCK_P=16)
    assert not delta_triton.TUNING


def test_tuned_sets_then_clears():
    from replay_compile.kernels import mamba2_spec_triton, mamba2_triton

    with tuned(mamba2_triton.TUNING, "whole:BLOCK_P=32,num_warps=2"):
        assert dict(mamba2_triton.TUNING) == {"variant": "whole", "BLOCK_P": 32, "num_warps": 2}
    assert not mamba2_triton.TUNING
    with tuned(mamba2_spec_triton.TUNING, "label:window_heads=2"):    # one variant: the name is a label
        assert dict(mamba2_spec_triton.TUNING) == {"window_heads": 2}
    assert not mamba2_spec_triton.TUNING


def test_parse_tuning_rejects_a_bare_key():
    assert parse_tuning("pre:BLOCK_P=16") == {"variant": "pre", "BLOCK_P": 16}
    with pytest.raises(ValueError, match="not KEY=integer"):
        parse_tuning("pre:BLOCK_P")
