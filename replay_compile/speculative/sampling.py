"""Sampling in speculative rounds: the model's next-token distribution as ``generate`` warps it, and the speculative
sampling acceptance rule for drafts proposed as single tokens (a point mass: prompt lookup, a draft model's greedy
choice, any proposer of token ids).

With a draft ``d`` proposed with certainty, the rule of Leviathan et al. / Chen et al. (2023) reads: accept ``d``
with probability ``p(d)``; at the first rejection emit a token drawn from ``p`` with ``d`` removed and renormalised
(``max(0, p - q)`` for ``q`` the point mass at ``d``); when every draft is accepted, emit a token drawn from the
distribution after the last one. Each emitted token is then distributed exactly as plain sampling's, whatever the
drafts. Draws use exponential races (``argmax p / E``, ``E ~ Exp(1)``): tensor operations of fixed shape, no host
synchronisation, so a compiled round and a CUDA graph hold them.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Sampling:
    """``generate``'s warpers, in its order: ``temperature``, then ``top_k`` (0 or None: off), then ``top_p`` (1.0
    or None: off; the smallest set of most likely tokens whose probability reaches ``top_p``, at least one)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"sampling: temperature must be > 0, got {self.temperature} (greedy: do_sample=False)")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"sampling: top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"sampling: top_p must be in (0, 1], got {self.top_p}")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> [..., V] fp32 probabilities of the warped distribution."""
        x = logits.float() / self.temperature
        if self.top_k:
            kth = x.topk(min(self.top_k, x.shape[-1]), dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            sorted_x, order = x.sort(dim=-1)                                      # ascending, as generate's warper
            cum = sorted_x.softmax(-1).cumsum(-1)
            drop = cum <= 1 - self.top_p
            drop[..., -1] = False                                                 # the most likely one stays
            x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return x.softmax(-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per distribution: [..., V] -> [...] (an exponential race)."""
        return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


def accept(probs: torch.Tensor, drafts: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of one round.

    Args:
        probs: [b, T, V] the target's distributions after ``[last token, d_1 .. d_k]`` (``T = k + 1``).
        drafts: [b, k] the proposed tokens.
    Returns:
        ``(ok [b], tokens [b, T])``: drafts accepted per row, and the tokens to emit: ``tokens[:, :ok]`` the accepted
        drafts, ``tokens[:, ok]`` the token drawn after them (the rest is not to be read).
    """
    b, k = drafts.shape
    p_draft = probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)               # [b, k]
    ok = (torch.rand_like(p_draft) < p_draft).to(torch.int32).cumprod(-1).sum(-1)
    residual = probs.clone()
    residual[:, :k].scatter_(-1, drafts[..., None], 0.0)                            # p with the draft removed
    drawn = sampling.draw(residual)                                                  # [b, T], per position
    cols = torch.arange(k + 1, device=drafts.device)
    padded = torch.cat([drafts, drawn[:, k:]], dim=1)
    return ok, torch.where(cols[None, :] < ok[:, None], padded, drawn)
