"""transformers' assisted generation on hybrid models: ``model.generate(..., prompt_lookup_num_tokens=k)`` or
``assistant_model=...``, with the SSM layers rolled back through the replay rings.

transformers refuses assisted generation for models with recurrent state (``_is_stateful``, and its caches report
that they cannot ``crop`` a recurrent state). With ``replay_compile`` imported, ``generate`` calls that ask for it on
a model whose SSM layers the speculative layers cover go through :func:`assisted_generation`:

* the first forward (transformers' prefill, prompt and first drafts in one call) runs each SSM mixer's own forward
  on all but the last ``T`` tokens and the layer's verify forward (:mod:`.mamba2_layer` / :mod:`.delta_layer`) on
  those ``T`` (``T``: the most tokens a verify can hold, one more than the drafts per round); every later forward of
  the call (the last token and the drafts) is a verify forward: outputs from the checkpoint and the ring, the state
  itself untouched;
* the cache's ``crop(-r)``, which transformers calls after each verify with ``r`` the rejected drafts, keeps the
  first ``T - r`` tokens of that verify in the SSM layers (cursor moves, the conv state advanced by the kept inputs
  only) and crops the attention layers as before; the cache says it can crop;
* when ``generate`` returns, the rings are folded into the cache's states (it holds the true state of every kept
  token, as after a plain ``generate``), and the cache, the mixers and the model get their own methods back.

Greedy output equals ``generate``'s without assistance; with ``do_sample`` transformers' own acceptance rule applies.
Batch size 1, as transformers' assisted generation. The call runs the model eagerly, also when its forward was
compiled (``torch.compiler.set_stance("force_eager")``): the layers' rings are allocated inside the first forward
and each round's verify has its own length. :func:`~replay_compile.speculative.generate_speculative` is the
compiled, batched form. Needs transformers' layered caches (``cache.layers``, linear-attention layers holding
``recurrent_states``); a model whose transformers gives it a cache class of its own (Mamba2 in 5.17) gets a clear
error.
"""

from __future__ import annotations

import contextlib

import torch

from .._logging import log
from ..errors import ReplayCompileError
from ..integrations.hf_modules import cache_kwarg, ssm_layer_states
from .generate import spec_mixers

# history budget of the rings: records kept before a verify folds them into the checkpoint
_BUFFER_LEN = 16


def wants_assistance(model, kwargs: dict) -> bool:
    """Whether a ``generate(**kwargs)`` call on ``model`` is assisted generation this module serves."""
    cfg = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    lookup = kwargs.get("prompt_lookup_num_tokens", getattr(cfg, "prompt_lookup_num_tokens", None))
    assistant = kwargs.get("assistant_model")
    # a model with SSM layers no verify forward mirrors gets the error naming the layer (left to its own forward,
    # such a layer would keep the rejected drafts in its state)
    return bool(lookup or assistant is not None) and bool(spec_mixers(model))


def _max_tokens_per_verify(model, kwargs: dict) -> int:
    cfg = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    lookup = kwargs.get("prompt_lookup_num_tokens", getattr(cfg, "prompt_lookup_num_tokens", None))
    if lookup:
        return int(lookup) + 1
    acfg = getattr(kwargs["assistant_model"], "generation_config", None)
    n = kwargs.get("num_assistant_tokens", getattr(acfg, "num_assistant_tokens", None)) or 20
    schedule = getattr(acfg, "num_assistant_tokens_schedule", None) or "constant"
    if schedule != "constant":
        raise ReplayCompileError(
            f"replay_compile: assisted generation with the assistant's num_assistant_tokens_schedule={schedule!r} "
            f"grows the drafts per round without bound, and the replay rings are sized for a fixed number; set "
            f"assistant_model.generation_config.num_assistant_tokens_schedule = 'constant'")
    return int(n) + 1


class _Assisted:
    """The spec layers of one ``generate`` call, created at its first forward, and the cache they serve."""

    def __init__(self, model, mixers: list, T: int):
        self.model, self.T = model, T
        self.classes = {m: cls for _, m, cls in mixers}       # mixer -> its spec layer class
        self.cache = None
        self.layers: dict = {}                      # mixer -> spec layer
        self.window = 0                             # tokens of the pending verify

    def forward(self, name: str, mixer, own, hidden_states, *args, **kwargs):
        cache = _cache_in(args, kwargs)
        layer = self.layers.get(mixer)
        if layer is None or cache is not self.cache:
            if cache is None:
                return own(hidden_states, *args, **kwargs)
            if cache is not self.cache:
                self.adopt(cache)
            return self._first(name, mixer, own, cache, hidden_states, args, kwargs)
        self.window = hidden_states.shape[1]
        return layer.forward(hidden_states, *args, **kwargs)

    def _first(self, name, mixer, own, cache, h, args, kwargs):
        """The prefill: the mixer's own forward on all but the last ``T`` tokens (at least one), then the verify
        forward on those, so that the drafts the prefill carries can still be rolled back."""
        if ssm_layer_states(cache, mixer.layer_idx)[0] is not None:
            raise ReplayCompileError(f"replay_compile: assisted generation: {name} already holds a state in this "
                                     f"cache; start from an empty cache")
        L = h.shape[1]
        head = max(1, L - self.T)
        mask = kwargs.get("attention_mask")
        head_kwargs = dict(kwargs)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] == L:
            head_kwargs["attention_mask"] = mask[:, :head]
            kwargs = {**kwargs, "attention_mask": mask[:, head:]}
        out_head = own(h[:, :head], *args, **head_kwargs)
        _stop_recording(cache.layers[mixer.layer_idx], mixer.conv1d.kernel_size[0])
        layer = self.layers[mixer] = self.classes[mixer](name, mixer, cache, _BUFFER_LEN, self.T)
        if head == L:
            self.window = 0
            return out_head
        self.window = L - head
        return torch.cat([out_head, layer.forward(h[:, head:], *args, **kwargs)], dim=1)

    def adopt(self, cache) -> None:
        """Serve ``cache``: its class becomes one whose ``crop`` rolls the SSM layers back through the rings."""
        self.finish()
        self.cache, self.layers = cache, {}
        cache._replay_assisted = self
        cache.__class__ = _croppable(type(cache))

    def crop(self, cache, tokens_to_remove) -> None:
        tokens_to_remove = int(tokens_to_remove)               # transformers 5.17 passes a 0-d tensor
        if tokens_to_remove > 0:
            raise ReplayCompileError("replay_compile: assisted generation crops by a negative count (tokens to "
                                     f"remove), got {tokens_to_remove}")
        keep = self.window + tokens_to_remove
        if self.window and keep < 1:
            raise ReplayCompileError(f"replay_compile: crop({tokens_to_remove}) after a verify of {self.window} tokens "
                                     f"would drop the verified token itself")
        for layer in self.layers.values():
            if self.window and layer.pending_conv is not None:
                layer.commit(keep)
        self.window = 0
        for cache_layer in cache.layers:
            if isinstance(getattr(cache_layer, "recurrent_states", None), dict):
                _crop_attention_part(cache_layer, tokens_to_remove)      # Zamba2's layers hold both
            else:
                cache_layer.crop(tokens_to_remove)

    def finish(self) -> None:
        """Fold the rings into the cache's states; hand the cache its own class back."""
        for layer in self.layers.values():
            layer.pending_conv = None                  # a verify nobody cropped (an error in between): not kept
            layer.finish()
        self.layers = {}
        if self.cache is not None:
            self.cache.__class__ = self.cache._replay_assisted_base
            del self.cache._replay_assisted
            self.cache = None


def _stop_recording(cache_layer, width: int) -> None:
    """A linear-attention cache layer that records its past for ``crop`` (transformers then keeps every conv input of
    the prefill, however many) goes back to a conv state of the kernel's ``width``: the rings roll it back."""
    if not getattr(cache_layer, "record_past", False):
        return
    cache_layer.record_past = False
    for key, t in cache_layer.conv_states.items():
        if isinstance(t, torch.Tensor) and t.shape[-1] != width:      # the last inputs, zeros before the first
            cache_layer.conv_states[key] = torch.nn.functional.pad(t, (max(width - t.shape[-1], 0), 0))[..., -width:]
            cache_layer.conv_kernel_size[key] = width


def _crop_attention_part(cache_layer, tokens_to_remove: int) -> None:
    """Crop the attention keys and values of a cache layer that also holds recurrent states (the ``crop`` of the
    first attention-only class in its bases), leaving its recurrent part to the rings."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    if not isinstance(getattr(cache_layer, "keys", None), torch.Tensor):
        return
    for klass in type(cache_layer).__mro__:
        if "crop" in vars(klass) and not issubclass(klass, LinearAttentionCacheLayerMixin):
            klass.crop(cache_layer, tokens_to_remove)
            return


def _cache_in(args, kwargs):
    from transformers.cache_utils import Cache

    for value in list(kwargs.values()) + list(args):
        if isinstance(value, Cache):
            return value
    return None


_CROPPABLE: dict = {}


def _croppable(base: type) -> type:
    """``base`` with a ``crop`` that goes through the assisted call's rings, and ``is_croppable`` true."""
    if base in _CROPPABLE.values():
        return base
    if base not in _CROPPABLE:
        def crop(self, tokens_to_remove: int) -> None:
            self._replay_assisted.crop(self, tokens_to_remove)

        _CROPPABLE[base] = type(base.__name__, (base,), {
            "crop": crop, "is_croppable": property(lambda self: True), "_replay_assisted_base": base,
            "__module__": base.__module__})
    return _CROPPABLE[base]


@contextlib.contextmanager
def assisted_generation(model, generate_kwargs: dict):
    """For the duration of one ``generate(**generate_kwargs)`` call: ``model``'s SSM mixers verify through the replay
    rings, its cache crops through them, and transformers' refusal of stateful models is lifted for it."""
    from transformers import cache_utils

    if not hasattr(cache_utils, "LinearAttentionCacheLayerMixin") or cache_kwarg(model) == "cache_params":
        import transformers

        raise ReplayCompileError(
            f"replay_compile: assisted generation on {type(model).__name__}: transformers {transformers.__version__} "
            f"keeps this model's recurrent states in a cache class of its own, which its assisted generation does "
            f"not take; use replay_compile.speculative.generate_speculative (prompt lookup or a DraftModel).")
    mixers = spec_mixers(model)
    T = _max_tokens_per_verify(model, generate_kwargs)
    run = _Assisted(model, mixers, T)
    had_stateful = "_is_stateful" in vars(model)
    stateful = vars(model).get("_is_stateful")
    model._is_stateful = False
    for name, mixer, _ in mixers:
        own = mixer.forward

        def forward(hidden_states, *args, _name=name, _mixer=mixer, _own=own, **kwargs):
            return run.forward(_name, _mixer, _own, hidden_states, *args, **kwargs)
        mixer.forward = forward
    log.info("replay_compile: assisted generation on %s: %d SSM layers verify through the replay rings, up to %d "
             "tokens per verify", type(model).__name__, len(mixers), T)
    try:
        # eager: the spec layers come to life inside the first forward (their rings allocated there), and the verify
        # forwards change length from round to round; the compiled form of speculation is generate_speculative
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            yield run
    finally:
        with torch.no_grad():
            run.finish()
        for _, mixer, _ in mixers:
            del mixer.forward
        if had_stateful:
            model._is_stateful = stateful
        else:
            del model._is_stateful
