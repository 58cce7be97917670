"""A copy task that makes prompt-lookup speculative decoding measurable without trained checkpoints.

Random-weight models never repeat their prompt, so prompt lookup accepts nothing on them (1.00 tokens per verify
round, H200). A model briefly trained on ``phrase x reps`` sequences learns to continue a repeated phrase
(through its attention layers: an induction head), and then behaves on a repetitive prompt set the way prompt
lookup is meant for (code edits, quoting summaries): the benchmark measures real acceptance. Training is plain
next-token cross-entropy with AdamW on the model's own ``labels`` loss; the tiny NemotronH model of the tests copies
perfectly after ~400 steps (46 s on one CPU core).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Callable

import torch

# transformers' torch implementations of the chunked delta rules, which the models call through a wrapper that picks
# fla's kernels when fla is installed (or, in older releases, pick per layer at construction)
_TORCH_CHUNK_RULES = ("torch_chunk_gated_delta_rule",)
_LAYER_ATTRS = {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule"}


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


@contextlib.contextmanager
def torch_delta_rules(model):
    """Run ``model``'s chunked delta rules (Gated DeltaNet prefill and training) through transformers' torch
    implementations instead of fla's kernels while the block runs; restored afterwards. Needed to train on the H200:
    fla 0.6 refuses its gated-delta backward on Hopper with Triton < 3.7.1 (it computes wrong gradients there,
    fla #640; the device has Triton 3.6). Handles both transformers forms: a module-level wrapper that dispatches to
    fla (``functools.wraps``, so ``__wrapped__`` is the torch function) and a per-layer attribute chosen at
    construction; with the ``kernels`` package, a module that closes over the torch function. Yields the number of
    patches made (0: nothing to patch, e.g. a Mamba-2 model)."""
    patches = []
    modules = {sys.modules.get(type(m).__module__) for m in model.modules()} - {None}
    for mod in modules:
        for name in _TORCH_CHUNK_RULES:
            fn = getattr(mod, name, None)
            plain = _plain(fn, name) if fn is not None else None
            if plain is not None:
                patches.append((mod, name, fn))
                setattr(mod, name, plain)
    for m in model.modules():
        for attr, torch_name in _LAYER_ATTRS.items():
            plain = getattr(sys.modules.get(type(m).__module__), torch_name, None)
            if attr in vars(m) and plain is not None:
                patches.append((m, attr, vars(m)[attr]))
                setattr(m, attr, inspect.unwrap(plain))
    try:
        yield len(patches)
    finally:
        for obj, name, value in reversed(patches):
            setattr(obj, name, value)


def _plain(fn, name: str):
    """The plain torch function behind transformers' kernel-dispatching wrapper ``fn``, or None if ``fn`` is plain:
    a ``functools.wraps`` wrapper (``__wrapped__``), or, with the ``kernels`` package (transformers 5.25), a module
    whose ``forward`` calls the function it closes over unless a hub kernel was loaded for the model."""
    if inspect.unwrap(fn) is not fn:
        return inspect.unwrap(fn)
    if isinstance(fn, torch.nn.Module):
        for cell in getattr(type(fn).forward, "__closure__", None) or ():
            held = cell.cell_contents
            if inspect.isfunction(held) and held.__name__ == name:
                return inspect.unwrap(held)
    return None


def default_lr(model) -> float:
    """AdamW learning rate for the copy task: 3e-3 up to hidden size 512, ``3e-3 * sqrt(512 / hidden)`` above.
    Measured (CPU, NemotronH, 4 layers, phrases of 8 over 128 ids, batch 48): hidden 32 copies after ~400 steps and
    hidden 512 reaches 0.90 copy accuracy after 300 steps at 3e-3. A Nemotron-Nano-4B-sized model (hidden 3072) at
    3e-3 on phrases of 16 over 1000 ids, batch 32, stayed at chance for 600 steps (H200); the gentler rate
    at that width is a guess, which is why the benchmark retries at a third of it when a model does not learn."""
    hidden = getattr(model.config, "hidden_size", 512)
    return 3e-3 * min(1.0, (512 / hidden) ** 0.5)


def train_copy(model, steps: int, *, phrase_len: int = 16, reps: int = 4, vocab: int = 1000, batch: int = 32,
               lr: float | None = None, warmup: int = 50, clip: float = 1.0, target: float = 0.98,
               check_every: int = 50, autocast_dtype: torch.dtype | None = None, freeze_mlps: bool = False,
               checkpoint: bool | None = None, log: Callable[[str], None] | None = print) -> dict:
    """Train ``model`` (fp32 parameters) on the copy task for at most ``steps`` steps, stopping once
    :func:`copy_accuracy` reaches ``target``; leaves it in eval mode. ``vocab`` is capped at the model's vocabulary.
    AdamW at ``lr`` (default :func:`default_lr`) after a linear warmup of ``warmup`` steps, gradients clipped to
    norm ``clip``; delta rules through torch (:func:`torch_delta_rules`). ``autocast_dtype`` (e.g. bf16): forward
    passes, the accuracy checks included, under ``torch.autocast`` in that dtype, the parameters and optimizer
    state staying fp32 (a 4B-parameter model's fp32 matmuls run at a fraction of the tensor cores' rate).
    ``freeze_mlps``: the parameters of the MLP blocks (:func:`mlp_parameters`) stay as they are, without gradients or
    optimizer state: the copy is learned by the attention and recurrent mixers (an induction head), and a model of
    Qwen3.5-4B dims trains in ~50 GB instead of ~78 (4.84 G parameters, 2.26 G of them in MLPs; the tiny NemotronH
    and Qwen3.5 test models reach the same copy accuracy at the same step either way). ``checkpoint``: activation
    checkpointing per block (transformers' ``gradient_checkpointing_enable``; default: on CUDA, where the model
    supports it): the blocks' activations are recomputed in the backward instead of held (a Qwen3.5-4B-dims model at
    batch 48 ran an 80 GB card out of memory in the forward of transformers' torch chunked delta rule without it).
    Autocast keeps no cache of low-precision weight copies (``cache_enabled=False``): the cache would hold one of
    every weight for the whole step (~9.7 GB at 4.84 G parameters). Returns ``{"steps", "loss", "copy_acc", "lr",
    "trained_params"}``."""
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("train_copy: train the fp32 model, then convert it (AdamW on bf16 weights stalls)")
    vocab = min(vocab, model.config.vocab_size)
    lr = default_lr(model) if lr is None else lr
    gen = torch.Generator().manual_seed(0)
    fixed = {id(p) for p in mlp_parameters(model)} if freeze_mlps else set()
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in fixed]
    held = [p for p in model.parameters() if id(p) in fixed and p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(1, warmup)))
    loss, acc, step = float("nan"), 0.0, 0
    amp = (torch.autocast(_device(model).type, dtype=autocast_dtype, cache_enabled=False)
           if autocast_dtype is not None else contextlib.nullcontext())
    if checkpoint is None:
        checkpoint = _device(model).type == "cuda" and getattr(model, "supports_gradient_checkpointing", False)
    if checkpoint:
        _set_checkpointing(model, True)
    for p in held:                                 # no gradients, no optimizer state; given back below
        p.requires_grad_(False)
    model.train()
    try:
        with torch_delta_rules(model), amp:
            for step in range(1, steps + 1):
                ids = copy_batch(batch, phrase_len, reps, vocab, gen, _device(model))
                out = model(input_ids=ids, labels=ids)
                opt.zero_grad(set_to_none=True)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(params, clip)
                opt.step()
                sched.step()
                loss = float(out.loss.detach())
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
        if checkpoint:
            _set_checkpointing(model, False)
        for p in held:
            p.requires_grad_(True)
        del opt
    return dict(steps=step, loss=loss, copy_acc=acc, lr=lr, trained_params=sum(p.numel() for p in params))


def _set_checkpointing(model, on: bool) -> None:
    """Activation checkpointing per block on or off, non-reentrant (transformers from 5.2x spells it
    ``activation_checkpointing_*``, earlier versions ``gradient_checkpointing_*``)."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def mlp_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters of ``model``'s MLP blocks: modules whose class name ends as an MLP's or a mixture of experts'
    does (``Qwen3_5MLP``, ``NemotronHMLP``, ``KimiLinearMoE``, ``Qwen3_5MoeSparseMoeBlock`` with its router,
    ``...Experts``; never ``Qwen3_5MoeGatedDeltaNet`` or ``Qwen3_5MoeForCausalLM``), each parameter once."""
    seen, out = set(), []
    for m in model.modules():
        if type(m).__name__.endswith(("MLP", "Mlp", "MoE", "MoeBlock", "Experts")):
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def _device(model) -> torch.device:
    return next(model.parameters()).device
