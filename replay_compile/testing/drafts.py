"""Draft sources for tests and benchmarks of speculative decoding, made of tensor operations (so that they compile
into a round): the true continuation, optionally with a deterministic share of mistakes."""

from __future__ import annotations

import torch


def known_continuation(sequences: torch.Tensor, wrong_every: int = 0, pad: int = 3):
    """A proposer ``(tokens [b, n], k) -> [b, k]`` that drafts each row's next tokens from ``sequences`` [b, m] (the
    reference output, prompt included; ``pad`` past its end). Rows come right-aligned and left-padded with -1, so a
    row's position is its count of real tokens ``n_r``. ``wrong_every > 0``: draft ``j`` of row ``r`` is wrong where
    ``(r + n_r + j) % wrong_every == 0`` (rows then accept different counts and run ahead of each other)."""
    seq = torch.cat([sequences, sequences.new_full((sequences.shape[0], 8), pad)], dim=1)
    span = int(seq.max()) + 1 - pad                      # wrong drafts stay in [pad, largest id]

    def propose(tokens: torch.Tensor, k: int) -> torch.Tensor:
        n = (tokens >= 0).sum(1)
        at = n[:, None] + torch.arange(k, device=tokens.device)[None, :]
        good = seq.to(tokens.device).gather(1, at.clamp(max=seq.shape[1] - 1))
        if not wrong_every:
            return good
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        return torch.where((rows + at) % wrong_every == 0, (good + 1 - pad) % span + pad, good)
    return propose


def tiny_draft_model(vocab_size: int = 128, seed: int = 0) -> torch.nn.Module:
    """A 2-layer random-weight Llama (attention only, grouped KV heads) to serve as a draft model for the tiny test
    models of :mod:`.hf_models` (same vocabulary), fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def shadowed(draft, shadow, log: list):
    """A proposer that returns ``draft``'s proposals while running ``shadow`` (a stateful proposer such as a
    :class:`~replay_compile.speculative.DraftModel`) on the same inputs and logging ``(tokens, shadow's drafts)``
    per round: the target's acceptance then follows ``draft`` (all, some or none of a round), and ``shadow``'s
    bookkeeping is checked under every acceptance pattern ``draft`` produces."""
    def propose(tokens: torch.Tensor, k: int) -> torch.Tensor:
        log.append((tokens.clone(), shadow(tokens, k).clone()))
        return draft(tokens, k)
    propose.start = shadow.start
    return propose
