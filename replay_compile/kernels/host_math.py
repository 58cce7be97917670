"""Integer helpers for the launch code that runs on the host before every kernel launch.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction`` objects in Triton 3.6 (usable inside
kernels too), which costs ~3 µs per call from Python on a 2-core CPU (~1 µs on the H200's host) against ~0.03 µs for
the integer expression; the launch code calls them several times per op and decode step, and outside CUDA graphs
that host time is what the GPU waits for. Inside ``@triton.jit`` functions keep using Triton's own.
"""

from __future__ import annotations

import functools
import types
from typing import Callable


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``: the number of ``b``-wide blocks that cover ``a``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``triton.next_power_of_2``'s result for every ``n >= 0``; 0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def memo_unless_tuned(tuning: dict) -> Callable:
    """Decorator for a module's ``launch_config``: a pure function of its (hashable) arguments and of the module's
    ``TUNING`` overrides. While ``tuning`` is empty (always, outside benchmarks and tests) the result is computed once
    per argument tuple and returned read-only (a ``MappingProxyType``: a caller that tried to edit the shared dict
    would fail loudly); with overrides set it is recomputed on every call, so a benchmark's ``TUNING`` takes effect
    at once. Recomputing costs ~10-25 µs of host time per op call on a 2-core CPU."""
    def deco(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=512)(lambda *a, **k: types.MappingProxyType(fn(*a, **k)))

        @functools.wraps(fn)
        def launch_config(*args, **kwargs):
            return fn(*args, **kwargs) if tuning else cached(*args, **kwargs)

        launch_config.cache_clear = cached.cache_clear
        return launch_config

    return deco
