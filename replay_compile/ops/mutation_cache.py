"""Torch's Triton mutation analysis, memoised for our kernels: compile time of models with many identical layers.

When our ops are inlined into a compiled graph (:mod:`.library`), every traced launch of a user-defined Triton kernel
is analysed by torch for the tensors it writes (``torch._higher_order_ops.triton_kernel_wrap``: the kernel lowered to
TTIR, then its stores traced back to its pointer arguments), more than once per launch site (functionalization, and
again when Inductor lowers the graph). The analysis is a pure function of the kernel and of its arguments' kinds and
scalar values, and every layer of one geometry launches the same kernels with the same scalars, so all but the first
analysis of each kernel repeat one. The lowering's analysis (TensorBox arguments) repeats the trace's (fake tensors)
too: torch treats both kinds alike. On CI's CPU (``benchmarks/diag_inline_cpu.py``, tiny models, AOTAutograd only):
the delta ``split`` step of a 2-layer Qwen3.5 8 analyses -> 2 (0.87 -> 0.19 s), NemotronH ``pre`` 12 -> 3 (1.14 ->
0.28 s). What it is for (H200, cold compiles, Qwen3.5-4B dims, 8 layers): the first step took 19.5 /
18.3 s with our pass vs 18.1 / 14.4 s for plain torch.compile in two runs, AOTAutograd's metadata pass 1.78 vs
0.81 s; full-depth models have 3-4x the layers.

:func:`install` wraps the analysis entry points that exist in this torch (``identify_accessed_tensors`` in recent
torch, ``identify_mutated_tensors`` in older releases) in a memo that only ever answers for kernels defined in
``replay_compile`` and only when every argument has a plain kind (tensor, Inductor IR node, number, string, None,
dtype): its key holds each argument's name, type and dtype or exact value. Anything else (a symbolic size, another
library's kernel, keyword calls) goes to torch's function unchanged. Each answer is a deep copy of the first
analysis, so no caller can change what the next one gets.
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
import sys

import torch

from ..config import env_flag

log = logging.getLogger("replay_compile")

_ENTRY_POINTS = ("identify_accessed_tensors", "identify_mutated_tensors")
_PLAIN = (bool, int, float, str, type(None), torch.dtype)
_MISS = object()


def _identity(kernel):
    """``(python function, launch configurations)`` of a kernel: a ``JITFunction`` (``.fn``: the function), or the
    one-config ``Autotuner`` that ``wrap_triton`` builds around it for every launch passing ``num_warps`` (a new
    object per launch site, so the object itself cannot be the key); None where the function is not ours."""
    fn, configs = kernel, ()
    for _ in range(4):
        if getattr(fn, "configs", None) is not None:
            configs += tuple(str(c) for c in fn.configs)
        if not hasattr(fn, "fn"):
            break
        fn = fn.fn
    if not getattr(fn, "__module__", "").startswith("replay_compile."):
        return None
    return fn, configs


def _arg_key(value):
    """The part of an argument the analysis can depend on, or ``_MISS`` where it is not of a plain kind.

    A fake tensor (AOTAutograd's trace) and an Inductor ``TensorBox`` (the lowering) share one kind: torch's TTIR
    generation replaces both by ``torch.empty(2, dtype=...)`` and counts both as tensor arguments, so the lowering
    reuses the trace's analysis instead of generating each kernel's TTIR a second time."""
    if _is_fake_or_box(value):
        return ("fake or TensorBox", value.dtype if isinstance(value, torch.Tensor) else value.get_dtype())
    if isinstance(value, torch.Tensor):
        return ("tensor", type(value), value.dtype)
    if isinstance(value, _PLAIN):
        return (type(value), value)
    get_dtype = getattr(value, "get_dtype", None)         # Inductor IR nodes (TensorBox, buffers)
    if get_dtype is not None and type(value).__module__.startswith("torch._inductor"):
        try:
            return ("ir", type(value), get_dtype())
        except Exception:  # noqa: BLE001 - a node without a dtype: not cached
            return _MISS
    return _MISS


def _is_fake_or_box(value) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    if type(value) is FakeTensor:
        return True
    ir = sys.modules.get("torch._inductor.ir")      # no TensorBox can exist before Inductor is imported
    return ir is not None and type(value) is getattr(ir, "TensorBox", None)


def memo_key(kernel, kwargs, rest: tuple):
    """The cache key of one analysis call, or None where it must run (not our kernel, an argument of another kind,
    TMA descriptor metadata)."""
    ident = _identity(kernel)
    if ident is None or not isinstance(kwargs, dict) or any(rest):
        return None
    items = []
    for name, value in kwargs.items():
        k = _arg_key(value)
        if k is _MISS:
            return None
        items.append((name, k))
    return (ident, tuple(items))


def memoised(analyse):
    """``analyse(kernel, kwargs, *rest)`` with answers for our kernels remembered (see the module docstring)."""
    cache: dict = {}

    @functools.wraps(analyse)
    def wrapper(kernel, kwargs, *rest, **kw):
        key = None if kw else memo_key(kernel, kwargs, rest)
        try:
            hit = cache.get(key, _MISS) if key is not None else _MISS
        except TypeError:                                 # an unhashable value after all
            key, hit = None, _MISS
        if hit is not _MISS:
            try:
                return copy.deepcopy(hit)
            except Exception:  # noqa: BLE001 - an answer that cannot be copied: analyse as torch would
                cache.pop(key, None)
                key = None
        result = analyse(kernel, kwargs, *rest, **kw)
        if key is not None:
            try:
                cache[key] = copy.deepcopy(result)        # the caller may change its own copy
            except Exception:  # noqa: BLE001 - not cached
                pass
        return result

    wrapper._replay_compile_memo = cache
    return wrapper


@functools.lru_cache(maxsize=None)
def install() -> list[str]:
    """Wrap torch's analysis entry points (once per process); returns the names wrapped (none where this torch has
    neither, or with ``REPLAY_COMPILE_MUTATION_CACHE=0``: then nothing changes)."""
    if not env_flag("REPLAY_COMPILE_MUTATION_CACHE", True):
        return []
    try:
        mod = importlib.import_module("torch._higher_order_ops.triton_kernel_wrap")
    except ImportError:
        return []
    done = []
    for name in _ENTRY_POINTS:
        fn = getattr(mod, name, None)
        if callable(fn) and not hasattr(fn, "_replay_compile_memo"):
            setattr(mod, name, memoised(fn))
            done.append(name)
    log.debug("replay_compile: Triton mutation analysis memoised for our kernels (%s)", ", ".join(done) or "none")
    return done
