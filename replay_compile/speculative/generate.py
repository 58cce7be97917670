"""Speculative generation for HF hybrid models with the replay state (greedy, or sampling with the speculative
sampling rule).

Each round verifies ``[last token, d_1 .. d_k]`` in one forward: SSM layers through the output-only verify ops
(Mamba-2 mixers: :mod:`.mamba2_layer`, ``mamba2_spec_verify``; Gated DeltaNet and Kimi Delta Attention:
:mod:`.delta_layer`, ``delta_spec_verify``), attention layers as the model does it. The drafts that match the
model's own greedy choices are accepted; the SSM layers commit by moving cursors. Each row keeps its own accepted
count and ends on its own (the rounds of :mod:`.rounds`, compiled on CUDA; ``per_row=False``: every row commits the
batch's smallest count and the attention caches drop the rest, eagerly). Either way the output of every row is
exactly its greedy decode.

Supported (checked against ``model.generate`` in transformers 5.24): NemotronH, Mamba2, Bamba, Zamba2,
GraniteMoeHybrid (Mamba-2 mixers); Qwen3.5, Qwen3.5-MoE, Qwen3-Next (Gated DeltaNet); Kimi-Linear (KDA). Any other
SSM layer, Falcon-H1's mixer included, raises :class:`~replay_compile.ReplayCompileError` naming it, also when only
the state it leaves in the cache gives it away: left to its own forward it would fold the rejected drafts into its
state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from typing import Callable, Sequence

import torch

from .._logging import log
from ..errors import ReplayCompileError
from ..integrations.hf_modules import (
    cache_kwarg,
    is_gated_deltanet,
    is_kimi_delta_attention,
    is_mamba2_mixer,
    looks_like_ssm,
    output_cache,
)
from .base import SpecLayer
from .delta_layer import SpecDeltaLayer
from .drafts import PromptLookup
from .mamba2_layer import SpecMamba2Layer
from .rounds import Rounds, cache_positions, refuse_what_cannot_roll_back
from .sampling import Sampling


@dataclasses.dataclass
class SpeculativeOutput:
    sequences: torch.Tensor          # [b, prompt + new] prompt and generated tokens
    cache: object                    # the model's cache, holding the true state of every fed token
    rounds: int                      # verify forwards
    accepted: list                   # per round, tokens emitted per row (1 .. num_draft + 1; 0: the row was done)
    attention_mask: torch.Tensor | None = None   # per_row: [b, cache positions], 1 where a row's token sits
    # wall-clock seconds of the call's phases (device work included): "prefill", "warmup" (the compiled rounds run
    # before one is captured, and the capture), "replay" (the captured rounds to the last), "finish" (the rings
    # folded into the cache), and "replay_rounds" / "replay_tokens" (rounds replayed, tokens they emitted over all
    # rows): a serving loop's steady state is replay_tokens / replay; "reused": 1.0 where the call ran on the
    # buffers and captured graph a SpeculativeGenerator kept from its last call; "finish_replayed": 1.0 where its
    # finish replayed the fold captured after that call
    timing: dict = dataclasses.field(default_factory=dict)

    @property
    def tokens_per_round(self) -> float:
        """Tokens emitted per row and round, over the rounds each row took part in."""
        counts = [n for per_row in self.accepted for n in per_row if n > 0]
        return sum(counts) / max(len(counts), 1)


def _spec_layers(model, cache, B: int, T: int) -> list[SpecLayer]:
    """One spec layer per SSM layer; a clear error for any SSM layer of a kind not verified here, found either by its
    look or, as a backstop, by the recurrent / conv state it left in the cache after prefill (a layer left to its
    own forward would fold the rejected drafts into its state: silently wrong output)."""
    layers = [cls(name, m, cache, B, T) for name, m, cls in spec_mixers(model)]
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


def spec_mixers(model) -> list[tuple[str, torch.nn.Module, type]]:
    """``(name, module, spec layer class)`` of every SSM layer of ``model`` (Mamba-2 mixers: :class:`SpecMamba2Layer`;
    Gated DeltaNet and KDA: :class:`SpecDeltaLayer`); a clear error for an SSM layer no verify forward mirrors."""
    out = []
    for name, m in model.named_modules():
        if is_mamba2_mixer(m) and (hasattr(m, "ssm_in_multiplier") or hasattr(m, "mup_vector")):
            raise _unsupported(name, m, "Falcon-H1's input multiplier, muP vector and optional gated norm are not "
                                        "in the Mamba-2 verify forward; ")
        elif is_mamba2_mixer(m):
            out.append((name, m, SpecMamba2Layer))
        elif is_gated_deltanet(m) or is_kimi_delta_attention(m):
            out.append((name, m, SpecDeltaLayer))
        elif looks_like_ssm(m):
            raise _unsupported(name, m)
    return out


_SUPPORTED = ("supported: the Mamba-2 mixers of NemotronH, Mamba2, Bamba, Zamba2 and GraniteMoeHybrid, Gated DeltaNet "
              "(Qwen3.5, Qwen3-Next, OLMo-Hybrid), Kimi Delta Attention (Kimi-Linear, Ling-3.0-Flash)")


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


def generate_speculative(model, input_ids: torch.Tensor, max_new_tokens: int | Sequence[int] | torch.Tensor, *,
                         num_draft: int = 3,
                         draft: Callable | None = None, buffer_len: int = 16, per_row: bool = True,
                         compile: bool | None = None, backend: str = "replayssm", mode: str | None = None,
                         eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                         do_sample: bool = False, temperature: float | None = None, top_k: int | None = None,
                         top_p: float | None = None, max_cache_len: int | None = None) -> SpeculativeOutput:
    """Decode ``max_new_tokens`` tokens (greedy, or sampled with ``do_sample``) with drafts verified ``num_draft`` at
    a time. A loop calling this again and again is served better by
    :class:`~replay_compile.speculative.SpeculativeGenerator`, which keeps its buffers and CUDA graph between calls.

    Args:
        model: an HF causal LM whose SSM layers are Mamba-2 mixers, Gated DeltaNet or KDA layers (see the module
            docstring for the families; eval mode).
        input_ids: [b, prompt] (no padding).
        max_new_tokens: new tokens per row: an int, or one per row ([b] ints; ``per_row`` only). A row that has its
            tokens sits the remaining rounds out at no cost, and its later positions hold ``pad_token_id``.
        draft: ``(tokens [b, n], k) -> [b, k]`` proposer; default :class:`PromptLookup`. Rows run ahead of each
            other: ``tokens`` holds each row's tokens right-aligned, left-padded with -1. Compiled, it must be made
            of tensor operations (``PromptLookup`` is); ids outside the vocabulary raise an error naming it, with
            nothing of that round committed.
        buffer_len: history budget ``B`` of the replay rings (records folded into the checkpoint when a verify
            would not fit).
        per_row: every row keeps its own accepted count and ends on its own (the rounds of :mod:`.rounds`: a
            ``StaticCache``, a host read every few rounds). ``False``: every row commits the batch's smallest count and
            the attention caches drop the rest (eager only, a dynamic cache: the layout ``generate`` leaves).
        compile: run each round as one compiled function; default: on CUDA. ``backend`` / ``mode``:
            ``torch.compile``'s. On CUDA the compiled round is captured as one CUDA graph of its own and replayed
            (``mode="reduce-overhead"``'s CUDA-graph trees are not used: they would add guard checks and input
            copies to every round). Needs ``per_row``.
        eos_token_id / pad_token_id: as ``generate``'s (default: the model's generation config; ``eos_token_id=[]``:
            none): a row ends at its first end-of-sequence token, and its later positions hold ``pad_token_id``.
        do_sample / temperature / top_k / top_p: as ``generate``'s (unset ones from the model's generation config):
            drafts are accepted by the speculative sampling rule (:mod:`.sampling`), so every token is distributed
            as plain sampling's; the random draws come from torch's default generator (``torch.manual_seed``).
            Needs ``per_row``.
        max_cache_len: positions of the attention caches the rounds allocate (``per_row``; at least ``prompt +
            max_new_tokens + 2 * (num_draft + 1)``; default: that rounded up to a power of two or 1.5 times one,
            :func:`~.rounds.cache_positions`, so that calls with prompts and budgets of similar length and the same
            batch reuse one compiled round). The decode-attention rewrite reads only the filled positions;
            transformers' own attention reads every position of a static cache, so there this is also what each
            round's attention costs.
    Returns:
        :class:`SpeculativeOutput`; greedy, ``sequences`` equals ``model.generate(input_ids, max_new_tokens=...,
        do_sample=False)``'s. ``cache`` holds the SSM state after every fed token of each row, as ``generate``'s
        does (up to its end-of-sequence token: ``generate`` then feeds padding); with ``per_row`` its attention
        layers hold each row's tokens at the positions ``attention_mask`` marks.
    """
    max_new_tokens = _token_budget(max_new_tokens, input_ids.shape[0])
    if num_draft < 1:
        raise ValueError(f"generate_speculative: need num_draft >= 1, got {num_draft}")
    if not isinstance(max_new_tokens, int) and not per_row:
        raise ValueError("generate_speculative: one max_new_tokens per row needs per_row=True; per_row=False commits "
                         "the same tokens on every row")
    if compile and not per_row:
        raise ValueError("generate_speculative: compile=True runs per-row rounds; per_row=False is eager only")
    if max_cache_len is not None and not per_row:
        raise ValueError("generate_speculative: max_cache_len sizes the per-row rounds' static cache; per_row=False "
                         "grows a dynamic cache")
    if do_sample and not per_row:
        raise ValueError("generate_speculative: do_sample=True runs per-row rounds; per_row=False is greedy only")
    if per_row:                                      # one call of the generator (its buffers go with it)
        from .generator import SpeculativeGenerator
        return SpeculativeGenerator(model, num_draft=num_draft, draft=draft, buffer_len=buffer_len, compile=compile,
                                    backend=backend, mode=mode, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                    do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                    max_cache_len=max_cache_len)(input_ids, max_new_tokens)
    draft = draft or PromptLookup()
    eos, pad = _end_tokens(model, eos_token_id, pad_token_id)
    T = num_draft + 1
    with torch.no_grad():
        out = model(input_ids, use_cache=True)
        cache = output_cache(out)
        refuse_what_cannot_roll_back(cache, type(model).__name__)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)                    # [b, 1], emitted, not yet fed
        layers = _spec_layers(model, cache, buffer_len, T)
        ck, takes_positions = _step_kwargs(model)
        with _verify_forwards(layers):
            res = _rounds_batch_min(model, input_ids, tok, cache, layers, ck, takes_positions, max_new_tokens,
                                    num_draft, draft)
        _finish(layers)
    res.sequences = _end_at_eos(res.sequences, input_ids.shape[1], eos, pad)
    return res


def _token_budget(max_new_tokens, b: int) -> int | torch.Tensor:
    """``max_new_tokens`` checked: an int >= 1, or [b] ints >= 1 as a CPU int64 tensor."""
    per_row = torch.as_tensor(max_new_tokens)
    if per_row.dim() == 0 and not (per_row.is_floating_point() or per_row.dtype == torch.bool):
        if int(per_row) < 1:
            raise ValueError(f"generate_speculative: need max_new_tokens >= 1, got {int(per_row)}")
        return int(per_row)
    if per_row.dim() != 1 or per_row.shape[0] != b or per_row.is_floating_point() or per_row.dtype == torch.bool:
        raise ValueError(f"generate_speculative: max_new_tokens must be an int or {b} ints (one per row of input_ids), "
                         f"got {tuple(per_row.shape)} {per_row.dtype}")
    per_row = per_row.to(device="cpu", dtype=torch.long)
    if bool((per_row < 1).any()):
        raise ValueError(f"generate_speculative: need max_new_tokens >= 1 on every row, got {per_row.tolist()}")
    return per_row


def _round_compiler(backend: str, mode: str | None) -> Callable:
    """``torch.compile`` for the round function. With our backend the SSM pass is off for the round: every SSM mixer
    of a round is already a verify layer (the pass would only report the layers' own writes as state updates it
    leaves unchanged, once per layer), while the decode-attention rewrite still takes the verify windows.
    ``dynamic=False``: a round's shapes come from the batch and the cache's length alone (:mod:`.rounds`), and each
    such shape compiles a static graph of its own, with the same rewrites and kernels as the first, where
    automatic dynamic shapes would turn the second batch size into one graph of symbolic sizes."""
    if backend != "replayssm":
        return lambda fn: torch.compile(fn, backend=backend, mode=mode, dynamic=False)
    options = {**(torch._inductor.list_mode_options(mode) if mode else {}), "families": ()}
    return lambda fn: torch.compile(fn, backend=backend, options=options, dynamic=False)


def _end_tokens(model, eos_token_id, pad_token_id) -> tuple[list[int], int]:
    """(end-of-sequence ids, padding id) as ``generate`` resolves them from the arguments and the generation config."""
    cfg = getattr(model, "generation_config", None)
    eos = eos_token_id if eos_token_id is not None else getattr(cfg, "eos_token_id", None)
    eos = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    pad = pad_token_id if pad_token_id is not None else getattr(cfg, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return eos, int(pad)


def _sampling(model, temperature, top_k, top_p) -> Sampling:
    """The warpers ``generate(do_sample=True)`` applies: the arguments, else the model's generation config."""
    cfg = getattr(model, "generation_config", None)
    pick = (lambda arg, name, default: arg if arg is not None else getattr(cfg, name, None) or default)
    return Sampling(temperature=float(pick(temperature, "temperature", 1.0)), top_k=pick(top_k, "top_k", None),
                    top_p=pick(top_p, "top_p", None))


def _end_at_eos(sequences: torch.Tensor, prompt: int, eos: list[int], pad: int) -> torch.Tensor:
    """``pad`` after each row's first end-of-sequence token among its new tokens; the columns after the last row
    ended dropped (``generate`` stops there)."""
    if not eos:
        return sequences
    new = sequences[:, prompt:]
    is_eos = torch.isin(new, torch.tensor(eos, device=new.device)).long()
    after = (is_eos.cumsum(1) - is_eos) > 0                                  # past the row's first eos
    live = int((~after).sum(1).max()) if new.shape[1] else 0
    return torch.cat([sequences[:, :prompt], torch.where(after, pad, new)[:, :live]], dim=1)


def generate_rounds(model, input_ids: torch.Tensor, max_new_tokens: int | torch.Tensor, *, num_draft: int,
                    draft: Callable,
                    buffer_len: int, compiler: Callable | None, eos: list[int] | None = None,
                    pad: int = 0, layers_for: Callable | None = None, sampling: Sampling | None = None,
                    cuda_graph: bool = False, max_cache_len: int | None = None,
                    keep: dict | None = None) -> SpeculativeOutput:
    """:func:`generate_speculative` through :class:`~.rounds.Rounds`: prefill into a ``StaticCache`` sized for the
    rounds, then rounds until every row has its tokens; each round runs as ``compiler(rounds.step)`` (``None``:
    eagerly, the same code), and with ``cuda_graph`` (CUDA only) from the third round on as one CUDA graph replay.
    ``attention_mask`` of the result marks each row's valid cache positions.
    ``layers_for(model, cache, buffer_len, T)``: the SSM layers' speculative forms (default: the replay verify of
    each family; benchmarks pass their baselines'). ``max_new_tokens``: an int or [b] ints. ``max_cache_len``: the
    cache's positions (at least ``prompt + max_new_tokens + 2T``; default: that rounded up by
    :func:`~.rounds.cache_positions`).
    ``keep``: a dict that holds, between calls, the cache, layers, rounds and captured graph of the last call
    (:class:`~.generator.SpeculativeGenerator`'s). A call of the same batch and cache length prefills into the kept
    cache and replays the kept graph from its first round, with no warm-up rounds and no capture, where every tensor
    the graph reads is still where it was captured (checked by address after the prefill); otherwise it builds
    anew around the prefilled cache."""
    from transformers import StaticCache

    T = num_draft + 1
    b, prompt = input_ids.shape
    ck, _ = _step_kwargs(model)
    longest = int(torch.as_tensor(max_new_tokens).max())
    need = prompt + longest + 2 * T
    if max_cache_len is not None and max_cache_len < need:
        raise ValueError(f"generate_speculative: max_cache_len={max_cache_len} is too small: a {prompt}-token prompt, "
                         f"{longest} new tokens and rounds of T={T} need {need} positions (2T for the verify "
                         f"window and the rejected tail)")
    M = max_cache_len or cache_positions(need)
    key = (b, M, T, buffer_len, input_ids.device, next(model.parameters()).dtype)
    kept = keep.pop("kept", None) if keep is not None else None     # given back below once the call succeeds
    if kept is not None and kept.key != key:
        kept = None                                  # another shape: its buffers go before new ones are made
    cache = kept.cache if kept is not None else StaticCache(config=model.config, max_cache_len=M)
    sync = torch.cuda.synchronize if input_ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        if kept is not None:
            cache.reset()                            # zeroes the tensors, keeps them
        out = model(input_ids, use_cache=True, cache_position=torch.arange(prompt, device=input_ids.device),
                    **{ck: cache})
        last = out.logits[:, -1]
        first = (last.argmax(-1) if sampling is None else sampling.draw(sampling.probs(last)))[:, None]
        if hasattr(draft, "start"):                  # a proposer with state of its own (a draft model's cache)
            draft.start(input_ids, longest, num_draft)
        addresses = _addresses(cache, draft)
        reused = kept is not None and kept.addresses == addresses and kept.draft is draft
        finish_graph = None
        if reused:
            layers, rounds, step, graph = kept.layers, kept.rounds, kept.step, kept.graph
            finish_graph = kept.finish_graph
            cuda_graph = cuda_graph and kept.capturable          # a round that failed its capture is not retried
            rounds.restart(input_ids, first, max_new_tokens)
        else:
            layers = (layers_for or _spec_layers)(model, cache, buffer_len, T)
            rounds = Rounds(model, cache, layers, input_ids, first, max_new_tokens, num_draft, draft, eos, sampling)
            step = rounds.step if compiler is None else compiler(rounds.step)
            graph = None
        sync()
        t1 = t2 = time.perf_counter()
        warm = 0 if graph is not None else None      # rounds run before the first replay
        try:
            with _verify_forwards(layers):
                done, bad, remaining = rounds.status.tolist()
                ran = 0
                while not done:
                    # as many rounds as the furthest-behind row needs at best, queued without a host read between
                    for _ in range(max(1, -(-remaining // T))):
                        if graph is not None:
                            graph.replay()
                        elif cuda_graph and ran >= _WARM_ROUNDS:
                            graph = _capture(step, type(model).__name__)     # synchronises
                            if graph is None:                 # not capturable: compiled calls from here on
                                cuda_graph = False
                                step()
                            else:
                                t2, warm = time.perf_counter(), ran
                                graph.replay()
                        else:
                            step()
                        ran += 1
                    done, bad, remaining = rounds.status.tolist()        # the burst's one host read
                    if bad:
                        raise ReplayCompileError(
                            f"replay_compile.speculative: the draft source {rounds.draft_name} proposed token ids "
                            f"outside the vocabulary [0, {rounds.vocab}); nothing of that round or a later one was "
                            f"committed")
            sync()
            t3 = time.perf_counter()
        finally:
            finish_replayed = finish_graph is not None
            if finish_replayed:                              # the cache holds the true state, also after an error
                finish_graph.replay()
            else:
                _finish(layers)
    sync()
    t4 = time.perf_counter()
    counts = rounds.accepted()
    if keep is not None:
        # the call that captured the rounds captures the fold too: once, so a failed capture is not retried
        if graph is not None and not (reused and kept.graph is not None):
            finish_graph = _capture_finish(layers, graph, type(model).__name__)
        keep["kept"] = _Kept(key, cache, layers, rounds, step, graph, addresses, draft, capturable=cuda_graph,
                             finish_graph=finish_graph)
    timing = dict(prefill=t1 - t0, warmup=t2 - t1 if warm is not None else t3 - t1,
                  replay=t3 - t2 if warm is not None else 0.0, finish=t4 - t3,
                  replay_rounds=len(counts) - warm if warm is not None else 0,
                  replay_tokens=sum(map(sum, counts[warm:])) if warm is not None else 0, reused=float(reused),
                  finish_replayed=float(finish_replayed))
    return SpeculativeOutput(sequences=rounds.sequences(pad), cache=cache, rounds=len(counts), accepted=counts,
                             attention_mask=rounds.attention_mask(), timing=timing)


@dataclasses.dataclass
class _Kept:
    """What a generator keeps between calls of one shape (``key``: batch, cache length, T, history budget, device,
    the model's dtype): the cache and everything built around it, and the addresses of the tensors the captured
    graph reads in the cache and the proposer (:func:`_addresses`), which a reused call must find unchanged after
    its prefill. ``capturable``: False once the round failed its capture (the reason was logged then)."""

    key: tuple
    cache: object
    layers: list
    rounds: Rounds
    step: Callable
    graph: object
    addresses: list
    draft: object
    capturable: bool = True
    # the final fold as a CUDA graph (:func:`_capture_finish`), tried once, in the call that captured ``graph``
    finish_graph: object = None


def _addresses(cache, draft) -> list[int]:
    """The storage addresses of every tensor held by the cache's layers and by a stateful proposer and its cache, in
    a fixed order. A prefill that writes in place (transformers' static and linear-attention layers after
    ``reset``) leaves them as they were; one that allocates anew changes them, and a graph captured over the old
    ones must not be replayed."""
    holders = list(getattr(cache, "layers", []))
    draft_cache = getattr(draft, "cache", None)
    if draft_cache is not None:
        holders += [draft, *getattr(draft_cache, "layers", [])]
    out = []
    for holder in holders:
        for value in vars(holder).values():
            items = (value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple))
                     else [value])
            out += [t.data_ptr() for t in items if isinstance(t, torch.Tensor)]
    return out


# rounds run through the compiled step before one is captured: the first compiles, the second runs what compiling
# left lazy (cuBLAS workspaces, Triton's first launches), which a capture must not meet
_WARM_ROUNDS = 2


def _capture(step, model_name: str):
    """One round captured as a CUDA graph: it replays with a single launch, no guard checks and no input copies.
    Every tensor a round touches lives in the rounds, layers, caches and proposer, at fixed addresses. None, with
    the reason logged, where the round cannot be captured (transformers' grouped-matmul fallback for MoE layers
    copies from the host, for one); a failed capture has run nothing, so the round is still to run."""
    graph, reason = _graph_of(step)
    if graph is None:
        log.warning("replay_compile.speculative: the round of %s cannot be captured as a CUDA graph (%s); its rounds "
                    "run as compiled calls, with the host work of one per round", model_name, reason)
    return graph


def _graph_of(fn, pool=None):
    """``(graph, None)``: ``fn``'s device work captured as a CUDA graph (in ``pool``, default a pool of its own);
    ``(None, reason)`` where it cannot be captured (it synchronises or copies from the host)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
    except RuntimeError as err:
        torch.cuda.synchronize()
        return None, str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return graph, None


def _finish(layers) -> None:
    """Every SSM layer's ring folded into the cache's state, which then holds the true state
    (:meth:`SpecLayer.finish`)."""
    for layer in layers:
        layer.finish()


def _capture_finish(layers, rounds_graph, model_name: str):
    """The finish of every layer captured as one CUDA graph, for a kept generator's later calls: it folds the same
    rings into the same states, and its ~36 eager launches per layer cost the host 25 ms of a 223 ms batch-1 call
    (Qwen3.5-4B dims, 24 Gated DeltaNet layers, H100). Captured after this call's eager finish, which ran every
    kernel once (a capture runs nothing); in the rounds' memory pool: the rounds replay before the finish, and the
    finish leaves no tensor of its own alive. None, logged, where a layer's finish cannot be captured
    (:attr:`SpecLayer.folds_in_place`); the finish then stays eager."""
    eager = [layer.name for layer in layers if not layer.folds_in_place]
    if eager:
        log.info("replay_compile.speculative: the final fold of %s runs eagerly at the end of every call: %s fold "
                 "through a host read (a state that is not contiguous fp32, or a read copy)", model_name,
                 ", ".join(eager))
        return None
    graph, reason = _graph_of(lambda: _finish(layers), pool=rounds_graph.pool())
    if graph is None:
        log.info("replay_compile.speculative: the final fold of %s cannot be captured as a CUDA graph (%s); it runs "
                 "eagerly at the end of every call", model_name, reason)
    return graph


def _checked(drafts, b: int, k: int) -> torch.Tensor:
    if not isinstance(drafts, torch.Tensor) or tuple(drafts.shape) != (b, k):
        got = tuple(drafts.shape) if isinstance(drafts, torch.Tensor) else type(drafts).__name__
        raise ReplayCompileError(f"replay_compile.speculative: the draft proposer must return [b={b}, k={k}] token "
                                 f"ids, got {got}")
    return drafts


def _rounds_batch_min(model, input_ids, tok, cache, layers, ck, takes_positions, max_new, num_draft, draft):
    """Every row commits the batch's smallest accepted count; the attention caches drop the rejected tail."""
    tokens = torch.cat([input_ids, tok], dim=1)
    emitted, accepted = 1, []
    b = tokens.shape[0]
    while emitted < max_new:
        k = min(num_draft, max_new - emitted - 1)               # never feed past what generate would
        drafts = _checked(draft(tokens, k), b, k) if k else tok[:, :0]
        window = torch.cat([tok, drafts.to(tok)], dim=1)                      # [b, k + 1]
        fed = tokens.shape[1] - 1                                              # positions already in the cache
        pos = torch.arange(fed, fed + k + 1, device=window.device).expand(b, -1)
        extra = {"position_ids": pos} if takes_positions else {}
        pred = model(window, **{ck: cache}, use_cache=True, **extra).logits.argmax(-1)
        ok = (drafts == pred[:, :k]).int().cumprod(-1).sum(-1) if k else torch.zeros_like(tok[:, 0])
        n = int(ok.min()) + 1                                                  # same count on every row
        for layer in layers:
            layer.commit(n)
        _drop_attention_tail(cache, k + 1 - n)
        tokens = torch.cat([tokens, pred[:, :n]], dim=1)
        tok = pred[:, n - 1:n]
        emitted += n
        accepted.append([n] * b)
    return SpeculativeOutput(sequences=tokens, cache=cache, rounds=len(accepted), accepted=accepted)
