"""transformers integration: flush replay state wherever transformers reads a cache outside compiled code.

Installed once: by ``import replay_compile`` when transformers is already imported, else the first time the backend
compiles a graph while transformers is imported. It wraps:

* ``GenerationMixin.generate``: flush every stepped cache when it returns, so ``past_key_values`` read by the user,
  or passed into the next ``generate``, holds the true state;
* ``GenerationMixin._has_unfinished_sequences`` (the loop condition of every decoding method): flush every stepped
  cache when it answers False, i.e. when the decoding loop ends. The ``generate`` wrapper cannot do this for a call
  that is already running when the integration gets installed (installed by the first compile, which happens inside
  the first compiled ``generate``, after that call entered the unwrapped function); the loop condition is looked up
  afresh on every iteration, so this wrapper also covers that call;
* ``Cache.reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` / ``crop`` / ``offload``: flush
  that cache first (beam search and friends copy rows of the state);
* ``Cache.reset`` and the linear-attention layers' ``reset``: drop the held records of that cache (the zeroed
  tensor is the truth; folding the records of the old sequence into it at a later flush would corrupt it). A flush
  also notices the write through the tensor's version counter, but inference-mode tensors have none.

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


def _resetting_method(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        # collected first: a reset may rebind the layer's tensors; the old ones must not be folded later either
        states = replay_state.states_of(self) if replay_state.registered() else ()
        out = fn(self, *args, **kwargs)
        for rs in states:
            rs.reset()
        return out

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


def _flushing_loop_condition(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        more = fn(self, *args, **kwargs)
        if not more and replay_state.registered():
            replay_state.flush(None)
        return more

    wrapper._replay_compile_wrapped = True
    return wrapper


def _wrap(owner, name: str, wrap) -> None:
    fn = getattr(owner, name, None)
    if fn is not None and not getattr(fn, "_replay_compile_wrapped", False):
        setattr(owner, name, wrap(fn))


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
    _wrap(GenerationMixin, "generate", _flushing_generate)
    _wrap(GenerationMixin, "_has_unfinished_sequences", _flushing_loop_condition)
    for name in _CACHE_METHODS:
        _wrap(cache_utils.Cache, name, _flushing_method)
    _wrap(cache_utils.Cache, "reset", _resetting_method)
    layer_mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    if layer_mixin is not None:
        _wrap(layer_mixin, "reset", _resetting_method)
    _INSTALLED = True
