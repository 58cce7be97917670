"""Draft proposers for :func:`~replay_compile.speculative.generate_speculative`.

A proposer is any callable ``(tokens [b, n] int64, k) -> drafts [b, k] int64``: ``k`` guesses of the next tokens of
every row. Wrong guesses cost only verify work; the output never depends on them.
"""

from __future__ import annotations

import torch


class PromptLookup:
    """Prompt-lookup decoding: find the latest earlier occurrence of the last ``ngram`` tokens (falling back to
    shorter n-grams) and propose the ``k`` tokens that followed it; repeat the last token where nothing matches.

    Cheap and model-free; it pays on repetitive text (code edits, summaries quoting their source, structured output).
    """

    def __init__(self, ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= ngram:
            raise ValueError(f"PromptLookup: need 1 <= min_ngram <= ngram, got min_ngram={min_ngram}, ngram={ngram}")
        self.ngram, self.min_ngram = ngram, min_ngram

    def __call__(self, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """Drafts [b, k] for ``tokens`` [b, n]: tensor operations of fixed shape on ``tokens``' device, no host
        synchronisation (a compiled round or a CUDA graph can hold it). :meth:`reference` is the same rule, row by
        row in Python."""
        b, n_tok = tokens.shape
        last = torch.full((b, k), n_tok - 1, dtype=torch.long, device=tokens.device)
        if k == 0 or n_tok < 2:
            return tokens.gather(1, last[:, :k]) if n_tok else tokens.new_zeros((b, k))
        pick = last                                        # no match: repeat the last token
        found = torch.zeros(b, dtype=torch.bool, device=tokens.device)
        for n in range(min(self.ngram, n_tok - 1), self.min_ngram - 1, -1):     # longest n-gram first
            tail = tokens[:, n_tok - n:]                                         # [b, n]
            windows = tokens[:, :n_tok - 1].unfold(1, n, 1)                      # starts 0 .. n_tok - n - 1
            hit = (windows == tail[:, None, :]).all(-1)                          # [b, n_tok - n]
            starts = torch.arange(hit.shape[1], device=tokens.device)
            latest = torch.where(hit, starts, -1).amax(-1)                       # latest earlier occurrence
            take = ~found & (latest >= 0)
            follow = (latest[:, None] + n + torch.arange(k, device=tokens.device)).clamp(max=n_tok - 1)
            pick = torch.where(take[:, None], follow, pick)                      # short follow: repeat its last
            found |= take
        return tokens.gather(1, pick)

    def reference(self, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """The rule of :meth:`__call__`, row by row on the host (the oracle its tests compare against)."""
        rows = [self._row(seq, k) for seq in tokens.tolist()]
        return torch.tensor(rows, dtype=torch.long, device=tokens.device).reshape(tokens.shape[0], k)

    def _row(self, seq: list, k: int) -> list:
        n_tok = len(seq)
        for n in range(min(self.ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = seq[n_tok - n:]
            for start in range(n_tok - n - 1, -1, -1):          # latest earlier occurrence first
                if seq[start:start + n] == tail:
                    follow = seq[start + n:start + n + k]
                    if follow:
                        return (follow + [follow[-1]] * k)[:k]
        return [seq[-1]] * k
