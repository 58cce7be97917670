"""A copy task that makes prompt-lookup speculative decoding measurable without trained checkpoints.

Random-weight models never repeat their prompt, so prompt lookup accepts nothing on them (1.00 tokens per verify
round, H200 session 5). A model briefly trained on ``phrase x reps`` sequences learns to continue a repeated phrase
(through its attention layers: an induction head), and then behaves on a repetitive prompt set the way prompt
lookup is meant for (code edits, quoting summaries): the benchmark measures real acceptance. Training is plain
next-token cross-entropy with AdamW on the model's own ``labels`` loss; the tiny NemotronH model of the tests copies
perfectly after ~400 steps (46 s on one CPU core).
"""

from __future__ import annotations

from typing import Callable

import torch


def copy_batch(n: int, phrase_len: int = 16, reps: int = 4, vocab: int = 1000, generator=None,
               device="cpu") -> torch.Tensor:
    """``[n, phrase_len * reps]`` token ids: a random phrase of ids ``3 .. vocab-1`` (0-2 are pad / bos / eos in
    the models here) repeated ``reps`` times per row."""
    phrase = torch.randint(3, vocab, (n, phrase_len), generator=generator)
    return phrase.repeat(1, reps).to(device)


@torch.no_grad()
def copy_accuracy(model, n: int = 64, phrase_len: int = 16, reps: int = 4, vocab: int = 1000, seed: int = 1) -> float:
    """Share of the tokens after the first repetition that the model predicts (argmax, teacher forcing) on held-out
    phrases: 1.0 means it continues every repeated phrase exactly."""
    ids = copy_batch(n, phrase_len, reps, vocab, torch.Generator().manual_seed(seed), _device(model))
    logits = model(input_ids=ids).logits
    pred = logits[:, phrase_len - 1:-1].argmax(-1)
    return float((pred == ids[:, phrase_len:]).float().mean())


def train_copy(model, steps: int, *, phrase_len: int = 16, reps: int = 4, vocab: int = 1000, batch: int = 32,
               lr: float = 3e-3, target: float = 0.98, check_every: int = 50,
               log: Callable[[str], None] | None = print) -> dict:
    """Train ``model`` (fp32 parameters) on the copy task for at most ``steps`` steps, stopping once
    :func:`copy_accuracy` reaches ``target``; leaves it in eval mode. ``vocab`` is capped at the model's vocabulary.
    Returns ``{"steps", "loss", "copy_acc"}``."""
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("train_copy: train the fp32 model, then convert it (AdamW on bf16 weights stalls)")
    vocab = min(vocab, model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss, acc, step = float("nan"), 0.0, 0
    try:
        for step in range(1, steps + 1):
            ids = copy_batch(batch, phrase_len, reps, vocab, gen, _device(model))
            out = model(input_ids=ids, labels=ids)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            loss = float(out.loss)
            if step % check_every == 0 or step == steps:
                model.eval()
                acc = copy_accuracy(model, phrase_len=phrase_len, reps=reps, vocab=vocab)
                model.train()
                if log:
                    log(f"copy task step {step}: loss {loss:.3f}, copy accuracy {acc:.3f}")
                if acc >= target:
                    break
    finally:
        model.eval()
        del opt
    return dict(steps=step, loss=loss, copy_acc=acc)


def _device(model) -> torch.device:
    return next(model.parameters()).device
