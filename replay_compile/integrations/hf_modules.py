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
    """The cache of a model output or ``generate`` result: ``cache`` in newer transformers, else ``past_key_values``,
    or ``cache_params`` (Mamba2 in transformers 5.17)."""
    for name in ("cache", "past_key_values", "cache_params"):
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    raise AttributeError(f"{type(out).__name__} carries no cache (looked for cache, past_key_values, cache_params)")


_DELTA_ATTRS = ("conv1d", "layer_idx", "activation", "conv_kernel_size")
_GDN_ATTRS = _DELTA_ATTRS + ("A_log", "dt_bias", "num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim",
                             "value_dim")
# the projections of each GDN layout transformers has
_GDN_LAYOUTS = (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj"),          # Qwen3.5
                ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering", "norm", "out_proj"),  # Qwen3-Next
                ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_norm", "o_proj"))     # OLMo-Hybrid
_KDA_ATTRS = _DELTA_ATTRS + ("q_proj", "k_proj", "v_proj", "forget_gate", "b_proj", "o_norm", "o_proj", "num_heads",
                             "head_dim", "qkv_dim")
_KDA_OUTPUT_GATES = (("g_a_proj", "g_b_proj"), ("g_proj",))          # Kimi-Linear (low rank), Ling-3.0-Flash


def is_gated_deltanet(m: torch.nn.Module) -> bool:
    """An HF Gated DeltaNet layer: Qwen3.5 / Qwen3.5-MoE (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``), Qwen3-Next (``in_proj_qkvz``, ``in_proj_ba`` grouped per key head) or OLMo-Hybrid (``q_proj``,
    ``k_proj``, ``v_proj``, ``a_proj``, ``b_proj``, the output gate ``g_proj``)."""
    return all(hasattr(m, a) for a in _GDN_ATTRS) and any(all(hasattr(m, a) for a in lay) for lay in _GDN_LAYOUTS)


def is_kimi_delta_attention(m: torch.nn.Module) -> bool:
    """An HF Kimi Delta Attention layer (per-key-channel forget gate): Kimi-Linear (low-rank output gate
    ``g_b_proj(g_a_proj(h))``) or Ling-3.0-Flash (``BailingHybridDeltaAttention``, output gate ``g_proj``)."""
    return all(hasattr(m, a) for a in _KDA_ATTRS) and any(all(hasattr(m, a) for a in g) for g in _KDA_OUTPUT_GATES)


def looks_like_ssm(m: torch.nn.Module) -> bool:
    """A module that has the shape of a recurrent (SSM / linear-attention) layer: a conv1d child and a decay
    parameter in it or its children, or a class name of that kind. Wide on purpose: callers use it to refuse layers
    they do not know rather than let them run unnoticed."""
    if not any(isinstance(c, torch.nn.Conv1d) for c in m.children()):
        return False
    decay = hasattr(m, "A_log") or any(hasattr(c, "A_log") for c in m.children())
    return decay or type(m).__name__.endswith(("DeltaNet", "DeltaAttention", "Mixer", "Mamba", "ShortConv"))


def ssm_layer_states(cache, layer_idx: int):
    """``(recurrent state, conv state)`` an HF cache holds for SSM layer ``layer_idx`` (``None`` where it holds none
    yet). transformers 5.24 has ``get_recurrent_state`` / ``get_conv_state``; 5.17 only the layer's
    ``recurrent_states`` / ``conv_states`` dicts (state index 0), which both versions share."""
    layer = cache.layers[layer_idx]
    if hasattr(layer, "has_previous_state") and not layer.has_previous_state.get(0, False):
        return None, None
    rs, cs = getattr(layer, "recurrent_states", None), getattr(layer, "conv_states", None)
    return (rs.get(0) if isinstance(rs, dict) else None), (cs.get(0) if isinstance(cs, dict) else None)


def attention_layers(cache) -> list:
    """The attention layers of a ``StaticCache`` (``keys`` / ``values`` [b, heads, M, head_dim])."""
    return [layer for layer in getattr(cache, "layers", [])
            if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4
            and isinstance(getattr(layer, "values", None), torch.Tensor)]


def write_at(layer, position: int) -> None:
    """Make a static attention layer write its next keys at ``position``: transformers from 5.2x counts positions in
    the layer (``cumulative_length``, also the mask's query offset); older ones take ``cache_position`` (passed too)."""
    count = getattr(layer, "cumulative_length", None)
    if isinstance(count, torch.Tensor):
        count.fill_(position)
    elif count is not None:
        layer.cumulative_length = position
