"""transformers integration: the recurrent states of transformers' caches become ``ReplayTensor``s.

Installed once: by ``import replay_compile`` when transformers is already imported, else the first time the backend
compiles a graph while transformers is imported. It wraps:

* ``GenerationMixin._update_model_kwargs_for_generation`` (called by every decoding method after every forward,
  outside compiled code): each recurrent state of the cache that a compiled replay step has bound and that is still
  a plain tensor is replaced in the cache by a :class:`~replay_compile.replay_tensor.ReplayTensor` over it (its
  replay state goes with it; states no replay step touched stay plain, for any other backend). From then on any
  path that touches the state -- an eager fallback, the user's own code, another thread's ``generate`` ending --
  sees or writes the current state (see :mod:`replay_compile.replay_tensor`). The first
  compiled ``generate`` of a process gets its wrappers from its first decode step on, because the method is looked
  up afresh on every step;
* ``GenerationMixin.generate``: flush the caches of that call (the one passed in and the one returned) when it
  returns, so they hold the true state as plain storage too; never another call's cache. A call asking for
  assisted generation (``prompt_lookup_num_tokens`` / ``assistant_model``) on a model with SSM layers the
  speculative layers cover runs under :func:`replay_compile.speculative.assisted.assisted_generation`;
* ``Cache.reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` / ``crop`` / ``offload``: flush
  that cache first (beam search and friends copy rows of the state); a cache class that overrides one of them
  (MiniMax's, whose states sit in a list) gets its own override wrapped, at install and at every compile;
* ``Cache.reset`` and the linear-attention layers' ``reset``: drop the held records of that cache (the zeroed
  tensor is the truth; folding the records of the old sequence into it at a later flush would corrupt it). A flush
  also notices the write through the tensor's version counter, but inference-mode tensors have none.

A cache whose states are plain tensors (one that ``generate`` never handled, stepped in a hand-written loop) keeps
the registry's rules: call :func:`replay_compile.protect` on it after the prefill to get the same guarantees, or
``replay_compile.flush(cache)`` before reading it outside compiled code.
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


_CACHE_KWARGS = ("cache", "past_key_values", "cache_params")


def _caches_of(kwargs: dict, result=None) -> list:
    found = [kwargs.get(k) for k in _CACHE_KWARGS]
    found += [getattr(result, k, None) for k in _CACHE_KWARGS] if result is not None else []
    out = []
    for c in found:
        if c is not None and all(c is not o for o in out):
            out.append(c)
    return out


def _flushing_generate(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        from ..speculative.assisted import assisted_generation, wants_assistance

        result = None
        try:
            if wants_assistance(self, kwargs):
                with assisted_generation(self, kwargs):
                    result = fn(self, *args, **kwargs)
            else:
                result = fn(self, *args, **kwargs)
            return result
        finally:
            if replay_state.registered():
                for cache in _caches_of(kwargs, result):
                    replay_state.flush(cache)

    wrapper._replay_compile_wrapped = True
    return wrapper


def _protecting_kwargs_update(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        model_kwargs = fn(self, *args, **kwargs)
        for cache in _caches_of(model_kwargs):
            protect(cache, stepped_only=True)
        return model_kwargs

    wrapper._replay_compile_wrapped = True
    return wrapper


def protect(cache, stepped_only: bool = False) -> int:
    """Replace every recurrent state tensor held by ``cache`` (a transformers cache: ``cache.layers[i].
    recurrent_states``, or a list of the cache's own that a compiled step stepped) by a ``ReplayTensor`` over it;
    returns how many were replaced. States already wrapped are
    left alone. The wrapped checkpoint keeps its static address, so CUDA graphs are unaffected.

    ``stepped_only``: only the states a compiled replay step has bound (the hook after every ``generate`` forward):
    a state no replay step touched holds no records, and left plain it stays usable by any other backend (a wrapper
    refuses to be traced by one, since it could hold records by the time that graph runs)."""
    import torch

    from .. import state as replay_state
    from ..replay_tensor import ReplayTensor

    n = 0
    holders = [getattr(layer, "recurrent_states", None) for layer in getattr(cache, "layers", ())]
    # a cache that keeps its states in a list of its own (MiniMax's ``linear_cache``): the states a compiled step
    # stepped (its other tensors are no recurrent states)
    holders += [v for v in vars(cache).values() if isinstance(v, list)]
    for states in holders:
        if not isinstance(states, (dict, list)):
            continue
        bound_only = stepped_only or isinstance(states, list)
        for key, t in (states.items() if isinstance(states, dict) else enumerate(states)):
            if isinstance(t, torch.Tensor) and not isinstance(t, ReplayTensor) and t.dim() >= 3 \
                    and not (bound_only and replay_state.lookup(t) is None):
                rt = ReplayTensor(t)        # finds the replay state a compiled step bound to t, if any
                if getattr(t, "_dynamo_static_input_type", None):
                    torch._dynamo.mark_static_address(rt)
                states[key] = rt
                n += 1
    return n


def _wrap(owner, name: str, wrap) -> None:
    fn = getattr(owner, name, None)
    if fn is not None and not getattr(fn, "_replay_compile_wrapped", False):
        setattr(owner, name, wrap(fn))


def _wrap_cache_classes(cache_cls) -> None:
    """Wrap the cache methods of ``cache_cls`` and of every subclass that defines its own (model modules are
    imported lazily, so this runs again at each compile)."""
    todo = [cache_cls]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        for name in _CACHE_METHODS:
            if name in cls.__dict__:
                _wrap(cls, name, _flushing_method)
        if "reset" in cls.__dict__:
            _wrap(cls, "reset", _resetting_method)


def install() -> None:
    """Idempotent; safe to call whether or not transformers is importable."""
    global _INSTALLED
    if _INSTALLED:
        from transformers import cache_utils
        _wrap_cache_classes(cache_utils.Cache)
        return
    try:
        from transformers import cache_utils
        from transformers.generation.utils import GenerationMixin
    except Exception as e:  # noqa: BLE001 - transformers missing or broken: nothing to integrate with
        log.debug("replay_compile: transformers integration not installed: %s", e)
        return
    _wrap(GenerationMixin, "generate", _flushing_generate)
    _wrap(GenerationMixin, "_update_model_kwargs_for_generation", _protecting_kwargs_update)
    _wrap_cache_classes(cache_utils.Cache)
    layer_mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    if layer_mixin is not None:
        _wrap(layer_mixin, "reset", _resetting_method)
    _INSTALLED = True
