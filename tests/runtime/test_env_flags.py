"""The ``REPLAY_COMPILE_*`` environment variables: one spelling rule for every on/off switch, a clear error for a
value that is neither, and every variable the package reads documented (``config.ENV_VARS`` /
``config.OTHER_ENV_VARS``) and listed in the README's table."""

import pathlib
import re

import pytest
import torch

from replay_compile.config import ENV_VARS, OTHER_ENV_VARS, ReplayConfig, env_flag, parse_flag
from replay_compile.kernels import launch as kl
from replay_compile.ops import mutation_cache

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value, expect", [("1", True), ("true", True), ("On", True), (" YES ", True),
                                           ("0", False), ("False", False), ("off", False), ("no", False)])
def test_flag_spellings(value, expect):
    assert parse_flag(value) is expect
    assert env_flag("REPLAY_COMPILE_X", not expect, {"REPLAY_COMPILE_X": value}) is expect


def test_unset_or_empty_flag_is_the_default():
    for default in (True, False):
        assert env_flag("REPLAY_COMPILE_X", default, {}) is default
        assert env_flag("REPLAY_COMPILE_X", default, {"REPLAY_COMPILE_X": "  "}) is default


def test_misspelt_flag_names_the_variable():
    with pytest.raises(ValueError, match=r"'fasle' for REPLAY_COMPILE_X: expected one of"):
        env_flag("REPLAY_COMPILE_X", True, {"REPLAY_COMPILE_X": "fasle"})


def test_config_switches_share_the_spellings():
    cfg = ReplayConfig.from_env({"REPLAY_COMPILE_STRICT": "yes", "REPLAY_COMPILE_VALIDATE": "off",
                                 "REPLAY_COMPILE_DISABLE": "false"})
    assert cfg.strict and not cfg.validate and cfg.enabled
    assert not ReplayConfig.from_env({"REPLAY_COMPILE_DISABLE": "On"}).enabled
    empty = ReplayConfig.from_env({"REPLAY_COMPILE_VALIDATE": "", "REPLAY_COMPILE_BUFFER_LEN": ""})
    assert empty.validate and empty.buffer_len == 16                         # empty = unset
    with pytest.raises(ValueError, match="REPLAY_COMPILE_STRICT"):
        ReplayConfig.from_env({"REPLAY_COMPILE_STRICT": "maybe"})


def test_pdl_switch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(kl, "_major", lambda index: 9)
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("REPLAY_COMPILE_PDL", "Off")
    assert not kl.pdl_on(cuda)
    monkeypatch.setenv("REPLAY_COMPILE_PDL", "yes")
    assert kl.pdl_on(cuda)
    monkeypatch.setenv("REPLAY_COMPILE_PDL", "2")
    with pytest.raises(ValueError, match="REPLAY_COMPILE_PDL"):
        kl.pdl_on(cuda)


def test_mutation_cache_switch(monkeypatch):
    monkeypatch.setenv("REPLAY_COMPILE_MUTATION_CACHE", "false")
    assert mutation_cache.install.__wrapped__() == []                        # the uncached body: nothing wrapped


def _variables_read_by_the_package() -> set[str]:
    names = set()
    for path in (ROOT / "replay_compile").rglob("*.py"):
        names |= set(re.findall(r"REPLAY_COMPILE_[A-Z][A-Z_]*", path.read_text()))
    return names


def test_every_variable_is_documented_and_in_the_readme():
    documented = set(ENV_VARS) | set(OTHER_ENV_VARS)
    assert _variables_read_by_the_package() <= documented, _variables_read_by_the_package() - documented
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"^\| `(REPLAY_COMPILE_[A-Z_]+)` \|", readme, flags=re.M))
    assert documented <= table, documented - table


@pytest.mark.parametrize("var, good, bad", [
    ("REPLAY_COMPILE_KERNELS", {"reference": "reference", "Triton": "triton", "": "triton"}, "refrence"),
    ("REPLAY_COMPILE_INLINE_KERNELS", {"latency": "latency", "0": "off", "1": "all", "": "all"}, "latncy"),
])
def test_kernel_choices_are_validated_naming_the_variable(var, good, bad):
    from replay_compile.config import inline_kernels_choice, kernels_choice

    parse = kernels_choice if var == "REPLAY_COMPILE_KERNELS" else inline_kernels_choice
    for raw, meaning in good.items():
        assert parse({var: raw}) == meaning
    with pytest.raises(ValueError, match=f"bad value '{bad}' for {var}; expected one of"):
        parse({var: bad})
