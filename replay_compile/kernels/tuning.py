"""Launch-configuration overrides for benchmarks and tests.

Each kernel module's ``launch_config`` is the shipped choice; its ``TUNING`` (a :class:`Tuning`) is empty in use and
lets a benchmark or test force other tile sizes, warps or a kernel variant for a block of code (:func:`tuned`). A
key the module's ``launch_config`` does not read, or a variant it does not have, raises at once: a misspelt
override would otherwise time the shipped configuration under another name.
"""

from __future__ import annotations

import contextlib


class Tuning(dict):
    """A kernel module's override dict: only ``keys`` (what its ``launch_config`` reads) may be set; ``variants``:
    the values ``"variant"`` may take (none: the module has one variant and ``"variant"`` is not a key)."""

    def __init__(self, module: str, keys, variants=()):
        super().__init__()
        self.module = module
        self.variants = tuple(variants)
        self.keys_allowed = frozenset(keys) | ({"variant"} if self.variants else set())

    def _check(self, key, value) -> None:
        if key not in self.keys_allowed:
            raise KeyError(f"{self.module}.TUNING: unknown key {key!r}; its launch_config reads "
                           f"{sorted(self.keys_allowed)}")
        if key == "variant" and value not in self.variants:
            raise ValueError(f"{self.module}.TUNING: unknown variant {value!r}; one of {list(self.variants)}")

    def __setitem__(self, key, value) -> None:
        self._check(key, value)
        super().__setitem__(key, value)

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


def parse_tuning(spec: str) -> dict:
    """``"pre:BLOCK_P=32,num_warps=4"`` -> ``{"variant": "pre", "BLOCK_P": 32, "num_warps": 4}``."""
    name, _, rest = spec.partition(":")
    out: dict = {"variant": name}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"tuning string {spec!r}: {item!r} is not KEY=integer")
        out[key.strip()] = int(val)
    return out


@contextlib.contextmanager
def tuned(tuning: Tuning, spec: str):
    """Force ``tuning`` to the :func:`parse_tuning` string ``spec`` for the duration of the block; cleared
    afterwards, also on errors. For a module with one variant the name before ``:`` is only a label."""
    parsed = parse_tuning(spec)
    if not tuning.variants:
        parsed.pop("variant")
    tuning.clear()
    try:
        tuning.update(parsed)
        yield
    finally:
        tuning.clear()
