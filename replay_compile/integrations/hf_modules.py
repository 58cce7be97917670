"""What replay_compile needs to know about transformers' modules and outputs, in one place.

Used by the tensor-parallel sharding, the speculative generator and the bench, which all walk HF hybrid models.
"""

from __future__ import annotations

import inspect

import torch

_MAMBA2_MIXER_ATTRS = ("in_proj", "conv1d", "A_log", "dt_bias", "D", "norm", "out_proj", "num_heads", "head_dim",
                       "n_groups", "ssm_state_size", "intermediate_size", "conv_dim", "layer_idx")


def is_mamba2_mixer(m: torch.nn.Module) -> bool:
    """An HF Mamba-2 mixer (NemotronH, Mamba2, Bamba, Falcon-H1, Zamba2, GraniteMoeHybrid layout)."""
    return all(hasattr(m, a) for a in _MAMBA2_MIXER_ATTRS)


def cache_kwarg(model) -> str | None:
    """The forward's cache argument: ``cache`` (transformers >= 5.2x), else ``past_key_values`` / ``cache_params``;
    None if it takes none. A wrong name is swallowed by ``**kwargs`` and silently decodes without a cache, so callers
    must look it up rather than guess."""
    params = inspect.signature(model.forward).parameters
    return next((n for n in ("cache", "past_key_values", "cache_params") if n in params), None)


def output_cache(out):
    """The cache of a model output or ``generate`` result (``cache`` in newer transformers, else
    ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
