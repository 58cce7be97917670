"""transformers integration: flush replay state wherever transformers reads a cache outside compiled code.

Installed once, the first time the backend compiles a graph while transformers is imported. It wraps:

* ``GenerationMixin.generate``: flush every stepped cache when it returns, so ``past_key_values`` read by the user,
  or passed into the next ``generate``, holds the true state;
* ``Cache.reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` / ``crop``: flush that cache
  first (beam search and friends copy rows of the state).

Other callers that read a cache tensor outside a graph compiled by this backend must call
``replay_compile.flush(cache)`` first.
"""

from __future__ import annotations

import functools

from .. import state as replay_state
from .._logging import log

_INSTALLED = False
_CACHE_METHODS = ("reorder_cache", "batch_select_indices", "batch_repeat_interleave", "crop", "offload")


def _flushing_method(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if replay_state.registered():
            replay_state.flush(self)
        return fn(self, *args, **kwargs)

    wrapper._replay_compile_wrapped = True
    return wrapper


def _flushing_generate(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        finally:
            if replay_state.registered():
                replay_state.flush(None)

    wrapper._replay_compile_wrapped = True
    return wrapper


def install() -> None:
    """Idempotent; safe to call whether or not transformers is importable."""
    global _INSTALLED
    if _INSTALLED:
        return
    try:
        from transformers import cache_utils
        from transformers.generation.utils import GenerationMixin
    except Exception as e:  # noqa: BLE001 - transformers missing or broken: nothing to integrate with
        log.debug("replay_compile: transformers integration not installed: %s", e)
        return
    if not getattr(GenerationMixin.generate, "_replay_compile_wrapped", False):
        GenerationMixin.generate = _flushing_generate(GenerationMixin.generate)
    for name in _CACHE_METHODS:
        fn = getattr(cache_utils.Cache, name, None)
        if fn is not None and not getattr(fn, "_replay_compile_wrapped", False):
            setattr(cache_utils.Cache, name, _flushing_method(fn))
    _INSTALLED = True
