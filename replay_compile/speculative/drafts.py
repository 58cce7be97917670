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
        rows = [self._row(seq, k) for seq in tokens.tolist()]
        return torch.tensor(rows, dtype=torch.long, device=tokens.device)

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
