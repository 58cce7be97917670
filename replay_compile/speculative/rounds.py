"""Speculative rounds with fixed shapes and no host synchronisation, so that one round compiles into one graph (and,
on CUDA, replays as one CUDA graph the caller captures).

A round proposes ``k`` drafts per row on the device (:class:`~.drafts.PromptLookup`), verifies ``[last token, d_1 ..
d_k]`` in one forward of the model (SSM layers through their verify ops, :mod:`.mamba2_layer` / :mod:`.delta_layer`),
accepts per row the drafts that match the model's own greedy choices (sampling: those the speculative sampling rule
keeps, :mod:`.sampling`), and commits: SSM layers move cursors, conv states advance by the accepted inputs,
attention caches keep the accepted keys and values.

Attention caches. A ``StaticCache`` of ``M`` positions holds each row's accepted tokens compactly at ``[0, fed)``
(``fed``: tokens of the row already in the cache) and a scratch window at ``[M - T, M)``. Every verify writes its
``T`` keys and values into the scratch window (``cache_position`` is the same every round), attends to ``[0, fed)``
and the window causally (the attention mask), and the commit copies the window to ``[fed, fed + T)`` of each row;
positions past a row's new ``fed`` hold rejected entries that the mask hides and the next commit overwrites. RoPE
positions are per row (``position_ids = fed + t``). So the cache needs ``prompt + max_new + 2T`` positions whatever
the acceptance, and every tensor shape is the same every round.

Shapes across calls. A round's tensors take their sizes from the batch and the cache's ``M`` alone, never from the
prompt's length or the token budget (those are per-row tensors: :attr:`Rounds.limit`), and :func:`cache_positions`
rounds ``M`` up to a few sizes per doubling. So calls with the same batch and prompts and budgets of similar length
reuse one compiled round; ``torch.compile`` recompiles only for a new batch size or a new ``M``.

Rows that have all their tokens, or emitted an end-of-sequence token, sit the remaining rounds out: their slot is -1
for the SSM layers (nothing of their state is read or written) and nothing of theirs is committed. Drafts are checked
on the device: an id outside the vocabulary makes the round (and any later one) commit nothing and the host raise an
error naming the draft source. The host reads back one small tensor (every row done, a bad draft, the tokens still
to come) after a burst of rounds: as many as the furthest-behind row needs at best (every draft accepted), so that
it waits only a few times per generation and queues a burst's rounds ahead of the device.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import ReplayCompileError
from ..integrations.hf_modules import attention_layers, cache_kwarg, write_at
from .base import SpecLayer
from .sampling import Sampling, accept

# what a cache layer may hold for the speculative rounds to roll it back: attention keys and values (and a static
# layer's position counter), and the conv / recurrent states of the SSM layers they verify
# (transformers 5.25's linear-attention layers also count their tokens, `cumulative_length_linear`: the verify
# forwards bypass the layer's updates, so the count stays what the prefill left, as the states' history does)
_ROLLED_BACK = {"keys", "values", "cumulative_length", "conv_states", "recurrent_states", "cumulative_length_linear"}


def refuse_what_cannot_roll_back(cache, model_name: str) -> None:
    """Raise, naming the layer, for cache layers the rounds cannot roll back: sliding-window attention (it keeps only
    its last positions and places new keys by its own rule), and any layer holding tensors beyond attention keys
    and values and SSM states (Qwen4-Exp's indexed attention keeps indexer keys beside its keys: dropping only the
    keys of rejected drafts would leave theirs, silently). transformers' assisted generation crops such layers
    itself, so the error points there."""
    advice = ("; use model.generate(..., prompt_lookup_num_tokens=k) or assistant_model= (transformers' assisted "
              "generation, batch 1) for this model")
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if getattr(layer, "is_sliding", False):
            raise ReplayCompileError(f"replay_compile.speculative: {model_name} has sliding-window attention (cache "
                                     f"layer {i}, {type(layer).__name__}), which the speculative rounds cannot roll "
                                     f"back{advice}")
        extra = sorted(k for k, v in vars(layer).items() if k not in _ROLLED_BACK and _holds_tensors(v))
        if extra:
            raise ReplayCompileError(f"replay_compile.speculative: {model_name}'s cache layer {i} "
                                     f"({type(layer).__name__}) holds {extra} beside its keys and values, which the "
                                     f"speculative rounds do not roll back{advice}")


def _holds_tensors(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return any(isinstance(x, torch.Tensor) for x in items)


def cache_positions(need: int) -> int:
    """The static cache's positions for rounds that need ``need`` (``prompt + max_new + 2T``): the smallest of 64,
    96, 128, 192, .. (a power of two or 1.5 times one) that holds them. The compiled round specialises on the
    cache's length, so lengths between two of these sizes share one compilation; the padding is at most half the
    need, and costs no attention reads where the decode-attention rewrite skips masked positions (transformers'
    SDPA reads them: pass ``max_cache_len`` to ``generate_speculative`` for an exact size)."""
    size = 64
    while size < need:
        size = size * 3 // 2 if size & (size - 1) == 0 else size // 3 * 4
    return size


def copy_scratch(attn: list, start: int, dest: torch.Tensor) -> None:
    """Copy the ``T`` scratch positions ``[start, start + T)`` of every static attention layer in ``attn`` to each
    row's positions ``dest`` [b, T] (a commit of the keys and values a forward wrote to the scratch)."""
    for layer in attn:
        for t in (layer.keys, layer.values):
            torch.ops.replay_compile.copy_positions(t, start, dest)


class Rounds:
    """The state of greedy speculative rounds over one batch, and :meth:`step`, one round.

    Args:
        model: the HF model (its SSM mixers already routed to the layers' verify forwards by the caller).
        cache: a ``StaticCache`` of ``M >= prompt + max_new + 2T`` positions holding the prefilled prompt.
        layers: the spec layers of ``model`` (cursors, rings, conv inputs).
        input_ids: [b, prompt]; first: [b, 1] the token the prefill emitted (not yet fed).
        max_new: tokens to emit per row (``first`` included): an int, or [b] ints, one per row; num_draft: ``k``,
            ``T = k + 1``; draft: a proposer
            ``(tokens [b, n] right-aligned, left-padded with -1, k) -> [b, k]`` made of tensor operations.
        sampling: None for greedy rounds (drafts accepted while they match the argmax), else the distribution to
            sample from, drafts accepted by the speculative sampling rule (:mod:`.sampling`).
    """

    def __init__(self, model, cache, layers: list[SpecLayer], input_ids: torch.Tensor, first: torch.Tensor,
                 max_new: int | torch.Tensor, num_draft: int, draft, eos: list[int] | None = None,
                 sampling: Sampling | None = None):
        b, prompt = input_ids.shape
        dev = input_ids.device
        longest = int(torch.as_tensor(max_new).max())
        self.model, self.cache, self.layers, self.draft, self.sampling = model, cache, layers, draft, sampling
        self.draft_name = getattr(draft, "__qualname__", None) or type(draft).__name__
        self.vocab = model.get_input_embeddings().num_embeddings
        self.eos = None if not eos else torch.tensor(list(eos), dtype=torch.long, device=dev)
        self.b, self.k, self.T = b, num_draft, num_draft + 1
        self.ck = cache_kwarg(model)
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        self.attn = attention_layers(cache)
        refuse_what_cannot_roll_back(cache, type(model).__name__)
        need = prompt + longest + 2 * self.T
        # the attention layers' own length (a hybrid cache may report max_cache_len -1: transformers 5.17's Zamba2)
        self.M = self.attn[0].keys.shape[2] if self.attn else cache_positions(need)
        if self.attn and self.M < need:
            raise ValueError(f"replay_compile.speculative: the StaticCache holds {self.M} positions; speculative "
                             f"rounds of T={self.T} after a {prompt}-token prompt for {longest} new tokens need {need}")
        # token columns, sized by M alone (>= prompt + longest + T); the last one takes writes of rejected tokens
        W = self.M - self.T
        self.tokens = torch.empty((b, W), dtype=torch.long, device=dev)
        self.length = torch.empty(b, dtype=torch.long, device=dev)          # tokens per row, the last one unfed
        # the length at which each row has all its tokens: a tensor, so the compiled round does not specialise on
        # the prompt's length or the budget
        self.limit = torch.empty(b, dtype=torch.long, device=dev)
        # rows that emitted an end-of-sequence token (the prefill's included)
        self.finished = torch.empty(b, dtype=torch.bool, device=dev)
        self.rows = torch.arange(b, device=dev)
        self.cols = torch.arange(W, device=dev)
        self.window_cols = torch.arange(self.T, device=dev)
        self.positions = torch.arange(max(self.M, 1), device=dev)
        self.scratch = torch.arange(self.M - self.T, self.M, device=dev)            # the verify's cache positions
        # a round that met a draft out of the vocabulary: this and every later round commits nothing (rounds run in
        # bursts between host reads)
        self.bad = torch.empty((), dtype=torch.bool, device=dev)
        # tokens each row emitted per round (0: the row sat it out), written on the device; at most one round per
        # emitted token, plus the rounds a burst runs after the last row is done (recorded in the last line); sized by
        # W (>= longest + 1), not by the budget, as every shape of a round is
        self.max_rounds = W
        self.history = torch.empty(self.max_rounds + 1, b, dtype=torch.int32, device=dev)
        self.round = torch.empty((), dtype=torch.long, device=dev)
        # [every row done, a bad draft met, the most tokens a row still has to emit]: what the host reads
        self.status = torch.empty(3, dtype=torch.long, device=dev)
        self.restart(input_ids, first, max_new)

    def restart(self, input_ids: torch.Tensor, first: torch.Tensor, max_new: int | torch.Tensor) -> None:
        """Start a generation over this batch and cache, every buffer written in place (a graph captured over them
        replays the new generation; the constructor starts the first one): ``input_ids`` [b, prompt] prefilled into
        the cache, ``first`` [b, 1] its first token, ``max_new`` as in the constructor."""
        b, prompt = input_ids.shape
        per_row = torch.as_tensor(max_new, dtype=torch.long).to(self.tokens.device).expand(b)
        need = prompt + int(per_row.max()) + 2 * self.T
        if b != self.b or need > self.M:
            raise ValueError(f"replay_compile.speculative: rounds of batch {self.b} and {self.M} cache positions "
                             f"cannot restart for batch {b} needing {need}")
        self.prompt = prompt
        self.tokens.fill_(-1)
        self.tokens[:, :prompt] = input_ids
        self.tokens[:, prompt] = first[:, 0]
        self.length.fill_(prompt + 1)
        self.limit.copy_(prompt + per_row)
        if self.eos is not None:
            self.finished.copy_(torch.isin(first[:, 0], self.eos))
        else:
            self.finished.zero_()
        self.bad.zero_()
        self.history.zero_()
        self.round.zero_()
        self._update_status()

    def attention_mask(self) -> torch.Tensor:
        """[b, M]: each row's accepted tokens and the scratch window."""
        fed = (self.length - 1)[:, None]
        return ((self.positions[None, :] < fed) | (self.positions[None, :] >= self.M - self.T)).to(torch.long)

    def step(self) -> None:
        """One round, on the device only: the tokens each row emitted go to :attr:`history`, and :attr:`status` says
        whether every row is done, whether a draft was out of the vocabulary (then nothing of that round or any
        later one was committed), and how many tokens the furthest-behind row still has to emit. A round after
        every row is done changes nothing."""
        b, T, k = self.b, self.T, self.k
        W = self.tokens.shape[1]
        # each row's tokens right-aligned, left-padded with -1, for the proposer
        src = self.cols[None, :] - (W - self.length)[:, None]
        view = torch.where(src >= 0, self.tokens.gather(1, src.clamp(min=0)), -1)
        drafts = self.draft(view, k)
        if (not isinstance(drafts, torch.Tensor) or tuple(drafts.shape) != (b, k) or drafts.is_floating_point()
                or drafts.is_complex() or drafts.dtype == torch.bool):
            got = f"{tuple(drafts.shape)} {drafts.dtype}" if isinstance(drafts, torch.Tensor) else type(drafts).__name__
            raise ReplayCompileError(f"replay_compile.speculative: the draft source {self.draft_name} must return "
                                     f"[b={b}, k={k}] integer token ids, got {got}")
        drafts = drafts.to(device=self.tokens.device, dtype=torch.long)
        self.bad |= ((drafts < 0) | (drafts >= self.vocab)).any()
        bad = self.bad
        drafts = drafts.clamp(0, self.vocab - 1)     # never an out-of-range embedding lookup; nothing is committed
        last = self.tokens.gather(1, (self.length - 1)[:, None])
        window = torch.cat([last, drafts], dim=1)                                    # [b, T]
        fed = self.length - 1
        pos = fed[:, None] + self.window_cols[None, :]          # [b, T] the window's positions (RoPE and cache)
        remaining = self.limit - self.length
        active = (remaining > 0) & ~self.finished & ~bad
        slots = torch.where(active, self.rows, -1).to(torch.int32)
        for layer in self.layers:                    # the verify forward and the commit see the same slots
            layer.slot_idx = slots
        for layer in self.attn:                      # the window's keys go to the scratch positions
            write_at(layer, self.M - T)
        extra = {"position_ids": pos} if self.takes_positions else {}
        logits = self.model(window, **{self.ck: self.cache}, attention_mask=self.attention_mask(),
                            cache_position=self.scratch, use_cache=True, **extra).logits
        ok, pred = self.accept(logits, drafts)
        n = torch.minimum(ok.long() + 1, remaining)
        if self.eos is not None:                     # a row ends at its first end-of-sequence token
            first_eos = torch.where(torch.isin(pred, self.eos), self.window_cols[None, :], T).amin(-1)
            ends = active & (first_eos < n)
            n = torch.where(ends, first_eos + 1, n)
            self.finished |= ends
        n = torch.where(active, n, 0)
        for layer in self.layers:
            layer.commit(n)
            layer.slot_idx = None
        copy_scratch(self.attn, self.M - T, pos)
        keep = self.window_cols[None, :] < n[:, None]
        at = torch.where(keep, pos + 1, W - 1)                   # token columns: one past the fed positions
        self.tokens.scatter_(1, at, torch.where(keep, pred, -1))
        self.length += n
        self.history.index_copy_(0, self.round.clamp(max=self.max_rounds)[None], n.to(torch.int32)[None])
        self.round += 1
        self._update_status()

    def accept(self, logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The round's acceptance: logits [b, T, vocab] of the verify, drafts [b, k] -> (``ok`` [b], drafts accepted,
        ``pred`` [b, T], the tokens the row emits from: ``pred[:, :ok]`` are the accepted drafts, ``pred[:, ok]`` the
        model's own token after them). Greedy: the drafts that match the model's argmax; sampling: the speculative
        sampling rule (:func:`.sampling.accept`)."""
        if self.sampling is None:
            pred = logits.argmax(-1)
            return (drafts == pred[:, :self.k]).to(torch.int32).cumprod(-1).sum(-1), pred
        return accept(self.sampling.probs(logits), drafts, self.sampling)

    def _update_status(self) -> None:
        remaining = torch.where(self.finished, 0, self.limit - self.length)
        self.status.copy_(torch.stack([(remaining <= 0).all().long(), self.bad.long(), remaining.amax()]))

    def accepted(self) -> list[list[int]]:
        """Per round in which some row took part, the tokens each row emitted (one host read)."""
        ran = int(self.round.clamp(max=self.max_rounds))
        return [r for r in self.history[:ran].tolist() if any(r)]

    def sequences(self, pad: int) -> torch.Tensor:
        """[b, prompt + longest] prompt and emitted tokens, ``pad`` after a row's last one (``generate``'s layout:
        it stops when every row has ended)."""
        longest = int((self.length - self.prompt).max())
        out = self.tokens[:, :self.prompt + longest]
        return torch.where(out < 0, pad, out)
