"""Greedy speculative generation for HF hybrid models with the replay state.

Each round verifies ``[last token, d_1 .. d_k]`` in one forward: SSM layers through the output-only verify ops
(Mamba-2 mixers: :mod:`.mamba2_layer`, ``mamba2_spec_verify``; Gated DeltaNet and Kimi Delta Attention:
:mod:`.delta_layer`, ``delta_spec_verify``), attention layers as the model does it. The drafts that match the
model's own greedy choices are accepted; the SSM layers commit by moving cursors and the attention caches drop the
rejected positions. Every row commits the same count (the smallest over the batch), so the output of every row is
exactly its greedy decode.

Supported (checked against ``model.generate`` in transformers 5.24): NemotronH, Mamba2, Bamba, Zamba2,
GraniteMoeHybrid (Mamba-2 mixers); Qwen3.5, Qwen3.5-MoE, Qwen3-Next (Gated DeltaNet); Kimi-Linear (KDA). Any other
SSM layer, Falcon-H1's mixer included, raises :class:`~replay_compile.ReplayCompileError` naming it, also when only
the state it leaves in the cache gives it away: left to its own forward it would fold the rejected drafts into its
state.
"""

from __future__ import annotations

import contextlib
import inspect
import dataclasses
from typing import Callable

import torch

from ..errors import ReplayCompileError
from .drafts import PromptLookup
from ..integrations.hf_modules import (cache_kwarg, is_gated_deltanet, is_kimi_delta_attention, is_mamba2_mixer,
                                       looks_like_ssm, output_cache)
from .base import SpecLayer
from .delta_layer import SpecDeltaLayer
from .mamba2_layer import SpecMamba2Layer


@dataclasses.dataclass
class SpeculativeOutput:
    sequences: torch.Tensor          # [b, prompt + new] prompt and generated tokens
    cache: object                    # the model's cache, holding the true state of every fed token
    rounds: int                      # verify forwards
    accepted: list                   # tokens emitted per round (1 .. num_draft + 1)

    @property
    def tokens_per_round(self) -> float:
        return sum(self.accepted) / max(len(self.accepted), 1)


def _spec_layers(model, cache, B: int, T: int) -> list[SpecLayer]:
    """One spec layer per SSM layer; a clear error for any SSM layer of a kind not verified here, found either by its
    look or, as a backstop, by the recurrent / conv state it left in the cache after prefill (a layer left to its
    own forward would fold the rejected drafts into its state: silently wrong output)."""
    layers: list[SpecLayer] = []
    for name, m in model.named_modules():
        if is_mamba2_mixer(m) and (hasattr(m, "ssm_in_multiplier") or hasattr(m, "mup_vector")):
            raise _unsupported(name, m, "Falcon-H1's input multiplier, muP vector and optional gated norm are not "
                                        "in the Mamba-2 verify forward; ")
        elif is_mamba2_mixer(m):
            layers.append(SpecMamba2Layer(name, m, cache, B, T))
        elif is_gated_deltanet(m) or is_kimi_delta_attention(m):
            layers.append(SpecDeltaLayer(name, m, cache, B, T))
        elif looks_like_ssm(m):
            raise _unsupported(name, m)
    covered = {layer.mixer.layer_idx for layer in layers}
    for idx, cache_layer in enumerate(getattr(cache, "layers", [])):
        held = [t for attr in ("recurrent_states", "conv_states") for t in _states(getattr(cache_layer, attr, None))]
        if held and idx not in covered:
            owners = [(n, m) for n, m in model.named_modules() if getattr(m, "layer_idx", None) == idx
                      and any(isinstance(c, torch.nn.Conv1d) for c in m.children())]
            raise _unsupported(*owners[0]) if owners else ReplayCompileError(
                f"replay_compile.speculative: cache layer {idx} ({type(cache_layer).__name__}) holds recurrent or "
                f"conv state, but no layer this generator verifies owns it ({_SUPPORTED}). Use model.generate for "
                f"this model.")
    if not layers:
        raise ReplayCompileError(f"replay_compile.speculative: {type(model).__name__} has no SSM layer this generator "
                                 f"verifies ({_SUPPORTED})")
    return layers


_SUPPORTED = ("supported: the Mamba-2 mixers of NemotronH, Mamba2, Bamba, Zamba2 and GraniteMoeHybrid, Gated DeltaNet "
              "(Qwen3.5, Qwen3-Next), Kimi Delta Attention")


def _unsupported(name: str, m: torch.nn.Module, why: str = "") -> ReplayCompileError:
    return ReplayCompileError(
        f"replay_compile.speculative: {name} ({type(m).__name__}) is an SSM layer this generator cannot verify yet "
        f"({why}{_SUPPORTED}). Use model.generate for this model.")


def _states(held) -> list[torch.Tensor]:
    values = held.values() if isinstance(held, dict) else held if isinstance(held, (list, tuple)) else [held]
    return [t for t in values if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _verify_forwards(layers):
    """Route each mixer's forward to its verify forward for the duration (instance attribute over the class's)."""
    for layer in layers:
        layer.mixer.forward = layer.forward
    try:
        yield
    finally:
        for layer in layers:
            del layer.mixer.forward


def _drop_attention_tail(cache, n: int) -> None:
    """Forget the last ``n`` positions of every attention layer (the rejected drafts)."""
    if n <= 0:
        return
    for layer in getattr(cache, "layers", []):
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[-2] >= n:
            layer.keys = keys[..., :-n, :]
            layer.values = layer.values[..., :-n, :]


def _step_kwargs(model) -> tuple[str, bool]:
    """The forward's cache argument, and whether it takes ``position_ids``: explicit positions are passed because
    some models (Bamba in transformers 5.24) count a multi-token cached step from 0 without them, which silently
    shifts RoPE."""
    ck = cache_kwarg(model)
    if ck is None:
        raise ReplayCompileError(f"replay_compile.speculative: {type(model).__name__}.forward takes no cache argument")
    return ck, "position_ids" in inspect.signature(model.forward).parameters


def generate_speculative(model, input_ids: torch.Tensor, max_new_tokens: int, *, num_draft: int = 3,
                         draft: Callable | None = None, buffer_len: int = 16) -> SpeculativeOutput:
    """Greedy-decode ``max_new_tokens`` tokens with drafts verified ``num_draft`` at a time.

    Args:
        model: an HF causal LM whose SSM layers are Mamba-2 mixers, Gated DeltaNet or KDA layers (see the module
            docstring for the families; eval mode; runs eagerly).
        input_ids: [b, prompt] (no padding).
        draft: ``(tokens [b, n], k) -> [b, k]`` proposer; default :class:`PromptLookup`.
        buffer_len: history budget ``B`` of the replay rings (records folded into the checkpoint when a verify
            would not fit).
    Returns:
        :class:`SpeculativeOutput`; ``sequences`` equals ``model.generate(input_ids, max_new_tokens=...,
        do_sample=False)``'s, and ``cache`` holds the state after every fed token, as ``generate``'s does.
    """
    if max_new_tokens < 1 or num_draft < 1:
        raise ValueError(f"generate_speculative: need max_new_tokens >= 1 and num_draft >= 1, got {max_new_tokens}, "
                         f"{num_draft}")
    draft = draft or PromptLookup()
    T = num_draft + 1
    with torch.no_grad():
        out = model(input_ids, use_cache=True)
        cache = output_cache(out)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)                    # [b, 1], emitted, not yet fed
        tokens = torch.cat([input_ids, tok], dim=1)
        layers = _spec_layers(model, cache, buffer_len, T)
        ck, takes_positions = _step_kwargs(model)
        emitted, accepted = 1, []
        with _verify_forwards(layers):
            while emitted < max_new_tokens:
                k = min(num_draft, max_new_tokens - emitted - 1)   # never feed past what generate would
                drafts = draft(tokens, k) if k else tok[:, :0]
                window = torch.cat([tok, drafts.to(tok)], dim=1)              # [b, k + 1]
                fed = tokens.shape[1] - 1                                      # positions already in the cache
                pos = torch.arange(fed, fed + k + 1, device=window.device).expand(window.shape[0], -1)
                extra = {"position_ids": pos} if takes_positions else {}
                pred = model(window, **{ck: cache}, use_cache=True, **extra).logits.argmax(-1)
                ok = (drafts == pred[:, :k]).int().cumprod(-1).sum(-1) if k else torch.zeros_like(tok[:, 0])
                n = int(ok.min()) + 1                                          # same count on every row
                for layer in layers:
                    layer.commit(n)
                _drop_attention_tail(cache, k + 1 - n)
                tokens = torch.cat([tokens, pred[:, :n]], dim=1)
                tok = pred[:, n - 1:n]
                emitted += n
                accepted.append(n)
        for layer in layers:
            layer.finish()
    return SpeculativeOutput(sequences=tokens, cache=cache, rounds=len(accepted), accepted=accepted)
