"""Drafts from a small causal LM with its own static KV cache, made of tensor operations of fixed shape so that a
compiled speculative round holds the draft model's forwards too (one graph, one CUDA graph replay per round).

Cache layout, as the target's in :mod:`.rounds`: each row's fed tokens sit compactly at ``[0, fed)`` of a
``StaticCache`` of ``M`` positions; a scratch region at the end takes ``T`` catch-up columns and ``k - 1`` draft
columns. A round of the proposer:

1. catch up: the target emitted ``a`` tokens per row since the draft last fed (``a`` in ``0 .. T``; 1 in the first
   round, 0 for a row that sits rounds out). The last ``T`` tokens of the row, right-aligned, go through one forward
   at the scratch's catch-up columns; the mask hides the ``T - a`` columns the draft already holds, and RoPE gets each
   valid column's true position. The last column's logits give draft 1.
2. ``k - 1`` single-token forwards at the draft columns give drafts 2 .. k.
3. commit: the ``a`` valid catch-up columns are copied to ``[fed, fed + a)`` of each row; ``fed += a``. The drafts'
   own keys stay in scratch and are forgotten: whichever of them the target accepts comes back as next round's
   catch-up.

So the proposer's state moves with the target's acceptance and never needs a rollback of its own; a draft model with
recurrent layers would (its state cannot drop the rejected drafts), so only attention-only models are taken.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import ReplayCompileError
from ..integrations.hf_modules import attention_layers, cache_kwarg, looks_like_ssm, write_at
from .rounds import cache_positions, copy_scratch


class DraftModel:
    """A proposer ``(tokens [b, n] right-aligned, left-padded with -1, k) -> drafts [b, k]`` backed by ``model``, a
    small attention-only HF causal LM sharing the target's tokenizer (its greedy choices are the drafts).

    :func:`~.generate.generate_speculative` calls :meth:`start` after the target's prefill (the draft model prefills
    the prompt into its own ``StaticCache``) and then the proposer once per round, inside the compiled round.
    """

    def __init__(self, model: torch.nn.Module):
        ssm = [name for name, m in model.named_modules() if looks_like_ssm(m)]
        if ssm:
            raise ReplayCompileError(
                f"replay_compile.speculative: DraftModel({type(model).__name__}): {ssm[0]} is a recurrent layer; a "
                f"draft model rolls back rejected drafts by cache position, which a recurrent state cannot. Use an "
                f"attention-only draft model.")
        self.model = model
        self.ck = cache_kwarg(model)
        if self.ck is None:
            raise ReplayCompileError(f"replay_compile.speculative: DraftModel({type(model).__name__}).forward takes "
                                     f"no cache argument")
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        self.__qualname__ = f"DraftModel({type(model).__name__})"            # the name errors give
        self.cache = None

    def start(self, input_ids: torch.Tensor, max_new_tokens: int, num_draft: int) -> None:
        """Prefill the prompt ``input_ids`` [b, prompt] into a ``StaticCache`` sized for the rounds: the last call's,
        reset, where batch, size and device match (its tensors stay where a captured round reads them), else a
        fresh one."""
        from transformers import StaticCache

        b, prompt = input_ids.shape
        dev = input_ids.device
        T, k = num_draft + 1, num_draft
        # sized as the target's cache is, so that calls of similar lengths share the compiled round
        M = cache_positions(prompt + max_new_tokens + T + k - 1)
        again = (self.cache is not None and (self.T, self.M, self.fed.shape[0], self.fed.device) == (T, M, b, dev))
        if again:
            self.cache.reset()
        else:
            self.T, self.k, self.scratch_len, self.M = T, k, T + k - 1, M
            self.cache = StaticCache(config=self.model.config, max_cache_len=M)
        with torch.no_grad():
            self.model(input_ids, use_cache=True, cache_position=torch.arange(prompt, device=dev),
                       **{self.ck: self.cache})
        self.attn = attention_layers(self.cache)
        if again:
            self.fed.fill_(prompt)
        else:
            self.fed = torch.full((b,), prompt, dtype=torch.long, device=dev)
            self.positions = torch.arange(M, device=dev)
            self.cols = torch.arange(T, device=dev)

    def _forward(self, ids, at: int, positions, mask) -> torch.Tensor:
        for layer in self.attn:
            write_at(layer, at)
        extra = {"position_ids": positions} if self.takes_positions else {}
        return self.model(ids, use_cache=True, attention_mask=mask, cache_position=self.positions[at:at + ids.shape[1]],
                          **{self.ck: self.cache}, **extra).logits[:, -1]

    def __call__(self, tokens: torch.Tensor, k: int) -> torch.Tensor:
        if self.cache is None:
            raise ReplayCompileError("replay_compile.speculative: DraftModel.start(input_ids, ...) was not called; "
                                     "generate_speculative does that")
        if k != self.k:
            raise ReplayCompileError(f"replay_compile.speculative: {self.__qualname__} was started for {self.k} "
                                     f"drafts per round, asked for {k}")
        b, width = tokens.shape
        T, M = self.T, self.M
        length = (tokens >= 0).sum(1)
        a = (length - self.fed).clamp(0, T)                           # tokens the draft has not fed yet
        window = tokens[:, width - T:] if width >= T else torch.cat(
            [tokens.new_full((b, T - width), -1), tokens], dim=1)
        valid = self.cols[None, :] >= (T - a)[:, None]                               # [b, T]
        pos = self.fed[:, None] + self.cols[None, :] - (T - a)[:, None]              # true positions of valid ones
        start = M - self.scratch_len
        held = self.positions[None, :] < self.fed[:, None]                           # [b, M]
        catch_up = torch.zeros_like(held).scatter(1, (start + self.cols)[None, :].expand(b, T), valid)
        mask = held | catch_up
        logits = self._forward(window.clamp(min=0), start, pos.clamp(min=0), mask.long())
        drafts = [logits.argmax(-1)]
        nxt = self.fed + a                                                           # the first draft's position
        for j in range(1, k):
            col = start + T + j - 1
            mask = mask.clone()
            mask[:, col] = True
            logits = self._forward(drafts[-1][:, None], col, (nxt + j - 1)[:, None], mask.long())
            drafts.append(logits.argmax(-1))
        # commit the catch-up columns; the invalid ones land on the last scratch position (rewritten every round)
        copy_scratch(self.attn, start, torch.where(valid, pos, M - 1))
        self.fed += a
        return torch.stack(drafts, dim=1)

    def reference(self, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """What :meth:`__call__` proposes, row by row with the draft model's own ``generate`` (the oracle its tests
        compare against; no cache of this proposer is touched)."""
        rows = []
        with torch.no_grad():
            for row in tokens:
                ids = row[row >= 0][None, :]
                # an explicit mask: generate would take ids equal to the padding id for padding
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                          min_new_tokens=k, do_sample=False, eos_token_id=[])
                rows.append(out[0, ids.shape[1]:])
        return torch.stack(rows)
