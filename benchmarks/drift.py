"""Drift of low-precision SSM states over a long generation, on CPU or GPU.

    python benchmarks/drift.py --out bench-results/drift [--tokens 4096] [--formats fp8_e4m3,nvfp4] [--device cuda]
        [--checkpoints fp16,fp8_e4m3]

A small hybrid (the test suite's tiny NemotronH, Mamba-2, or ``--model qwen3_5``, Gated DeltaNet; fp32, decays
slowed so that the state carries information over hundreds of tokens) greedily generates ``--tokens`` tokens in
fp32: the reference distribution ``p_fp32`` at every position. Each variant then decodes the *same* tokens (teacher
forcing, so positions line up) and we record ``KL(p_variant ‖ p_fp32)`` and top-1 agreement per position:

* ``quantized/<fmt>`` — the baseline: the recurrent state is stored in ``fmt`` after every step (quantize-dequantize
  in place), so every step's rounding feeds the recurrence;
* ``replay/<fmt>`` — ReplaySSM with a read copy in ``fmt``: the checkpoint and the recurrence stay fp32, the copy
  is rewritten from the fp32 checkpoint at each flush (every ``--buffer-len`` tokens) and serves the outputs of the
  steps in between; its rounding never enters the state (for the delta rule, whose stored corrected values depend
  on the state, flushes re-run the exact recurrence over the raw inputs from the fp32 checkpoint);
* ``replay/fp32`` — the control: the replay path with an exact copy (KL must be ~0);
* ``ckpt-sr/<fmt>``, ``ckpt-rn/<fmt>`` (``--checkpoints``, fp16 / fp8_e4m3) — a *quantized checkpoint*: the state is
  rounded to ``fmt`` only at each flush (every ``--buffer-len`` tokens; the steps in between are exact from the
  rounded checkpoint, as the replay step computes them), stochastically (``sr``) or to nearest (``rn``): the
  memory-capacity option, whose rounding does enter the recurrence, once per flush instead of every step.

Writes ``drift.csv`` (per position), ``drift_summary.csv`` and, with matplotlib, ``drift_kl.png``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time

import torch


def build_model(family: str, device, seed=0, decay=0.995):
    """A tiny test-suite model (``nemotron_h``: Mamba-2 hybrid; ``qwen3_5``: Gated DeltaNet hybrid) with every
    head's per-token decay set near ``decay`` (long memory: the stock random models forget within a few tokens)."""
    from replay_compile.testing.hf_models import DELTA_FAMILY, MAMBA2_FAMILY

    model = {**MAMBA2_FAMILY, **DELTA_FAMILY}[family](seed=seed).to(device).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log") and hasattr(m, "dt_bias"):
                # Mamba-2: la = -exp(A_log) softplus(dt + dt_bias); GDN: g = -exp(A_log) softplus(a + dt_bias);
                # at a typical step softplus(dt_bias) this makes exp(la) = decay
                dt = torch.nn.functional.softplus(m.dt_bias.float())
                m.A_log.copy_(torch.log(-math.log(decay) / dt).to(m.A_log.dtype))
    return model


class _Decoder:
    """Prefill, then one token per step on the model's own cache (explicit positions where the forward takes them;
    the signature is read once, not per token)."""

    def __init__(self, model, prompt):
        from replay_compile.integrations.hf_modules import output_cache
        from replay_compile.speculative.generate import _step_kwargs

        out = model(prompt, use_cache=True)
        self.model, self.cache = model, output_cache(out)
        self.ck, self.takes_positions = _step_kwargs(model)
        self.fed = prompt.shape[1]
        self.first = out.logits[:, -1].float().log_softmax(-1)         # after the prompt

    def step(self, tok):
        """Feed one token [1]; the next token's log-probabilities [1, vocab]."""
        extra = {"position_ids": torch.tensor([[self.fed]], device=tok.device)} if self.takes_positions else {}
        out = self.model(tok.view(1, 1), **{self.ck: self.cache}, use_cache=True, **extra)
        self.fed += 1
        return out.logits[:, -1].float().log_softmax(-1)


def _ssm_layers(model):
    """(name, module, spec-layer class) of every SSM layer."""
    from replay_compile.integrations.hf_modules import is_gated_deltanet, is_kimi_delta_attention, is_mamba2_mixer
    from replay_compile.speculative.delta_layer import SpecDeltaLayer
    from replay_compile.speculative.mamba2_layer import SpecMamba2Layer

    out = []
    for name, m in model.named_modules():
        if is_mamba2_mixer(m):
            out.append((name, m, SpecMamba2Layer))
        elif is_gated_deltanet(m) or is_kimi_delta_attention(m):
            out.append((name, m, SpecDeltaLayer))
    return out


def _ssm_states(model, cache):
    from replay_compile.integrations.hf_modules import ssm_layer_states

    return [ssm_layer_states(cache, m.layer_idx)[0] for _, m, _ in _ssm_layers(model)]


@torch.no_grad()
def decode(model, prompt, tokens, variant: str, qdq, buffer_len: int):
    """log-probabilities [n, vocab] of the next token after each fed token (prompt's last, then ``tokens`` but the
    last), the model run as ``variant`` (``fp32``, ``quantized`` or ``replay``)."""
    from replay_compile.speculative.generate import _verify_forwards

    dec = _Decoder(model, prompt)
    logps = [dec.first]
    layers, stored = [], []
    flushed = []
    if variant == "quantized":
        stored = _ssm_states(model, dec.cache)
        for s in stored:
            s.copy_(qdq(s))
    elif variant.startswith("ckpt"):
        flushed = _ssm_states(model, dec.cache)
    elif variant == "replay":
        layers = [cls(name, m, dec.cache, buffer_len, 1, read_format=qdq) for name, m, cls in _ssm_layers(model)]
    with _verify_forwards(layers):
        for tok in tokens[:-1]:
            logps.append(dec.step(tok))
            for layer in layers:
                layer.commit(1)
            for s in stored:                       # the baseline: the state stored quantized after every step
                s.copy_(qdq(s))
            if flushed and (dec.fed - prompt.shape[1]) % buffer_len == 0:
                for i, s in enumerate(flushed):   # quantized checkpoint: rounded at the flush only
                    s.copy_(qdq(s, seed=dec.fed * 1009 + i))
    return torch.cat(logps)


@torch.no_grad()
def reference_run(model, prompt, n: int):
    """fp32 greedy generation of ``n`` tokens: (tokens [n], log-probabilities [n, vocab])."""
    dec = _Decoder(model, prompt)
    logp = dec.first
    toks, logps = [], []
    for _ in range(n):
        logps.append(logp)
        toks.append(logp.argmax(-1))
        logp = dec.step(toks[-1])
    return torch.cat(toks), torch.cat(logps)


def kl(logp_var, logp_ref):
    """KL(p_var ‖ p_ref) per position, in nats."""
    return (logp_var.exp() * (logp_var - logp_ref)).sum(-1).clamp_min(0)


def run(tokens: int, formats, buffer_len: int, device: str, seed: int = 0, family: str = "nemotron_h",
        checkpoints=()):
    """Every variant; returns (per-position rows, summary rows)."""
    from replay_compile.quant.formats import quantize_dequantize
    from replay_compile.quant.stochastic import quantize_checkpoint

    model = build_model(family, device, seed)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.config.vocab_size, (1, 16), generator=g).to(device)
    toks, ref = reference_run(model, prompt, tokens)
    variants = [("replay", "fp32")] + [(v, f) for f in formats for v in ("quantized", "replay")]
    variants += [(v, f) for f in checkpoints for v in ("ckpt-rn", "ckpt-sr")]
    per_pos, summary = {}, []
    for variant, fmt in variants:
        if variant.startswith("ckpt"):
            qdq = (lambda x, seed, f=fmt, sr=variant == "ckpt-sr": quantize_checkpoint(x, f, stochastic=sr, seed=seed)
                   .to(x.dtype))
        else:
            qdq = (lambda x: x.clone()) if fmt == "fp32" else (lambda x, f=fmt: quantize_dequantize(x.float(), f))
        t0 = time.perf_counter()
        lp = decode(model, prompt, toks, variant, qdq, buffer_len)
        k = kl(lp, ref)
        top1 = (lp.argmax(-1) == ref.argmax(-1)).float()
        name = f"{variant}/{fmt}"
        per_pos[name] = k
        summary.append(dict(variant=name, tokens=tokens, mean_kl=float(k.mean()), max_kl=float(k.max()),
                            top1_agree=float(top1.mean()), seconds=time.perf_counter() - t0))
        print(f"{name:22} mean KL {summary[-1]['mean_kl']:.3e}  max KL {summary[-1]['max_kl']:.3e}  "
              f"top-1 agree {summary[-1]['top1_agree']:.4f}", flush=True)
    return per_pos, summary


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--formats", default="fp8_e4m3,nvfp4")
    ap.add_argument("--buffer-len", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="nemotron_h", help="nemotron_h (Mamba-2) or qwen3_5 (Gated DeltaNet)")
    ap.add_argument("--checkpoints", default="",
                    help="quantized-checkpoint variants to add, e.g. fp16,fp8_e4m3 (rounded at each flush, "
                         "nearest and stochastic)")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    per_pos, summary = run(args.tokens, [f for f in args.formats.split(",") if f], args.buffer_len, args.device,
                           family=args.model, checkpoints=[c for c in args.checkpoints.split(",") if c])
    names = list(per_pos)
    with open(os.path.join(args.out, "drift.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["position"] + names)
        for i in range(args.tokens):
            w.writerow([i] + [f"{float(per_pos[n][i]):.6e}" for n in names])
    with open(os.path.join(args.out, "drift_summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    win = max(1, args.tokens // 64)
    for n in names:
        k = per_pos[n].cpu()
        smooth = torch.nn.functional.avg_pool1d(k.view(1, 1, -1), win, stride=1).flatten() if k.numel() >= win else k
        ax.plot(smooth.numpy(), label=n)
    ax.set_yscale("log")
    ax.set_xlabel("position")
    ax.set_ylabel(f"KL(p_variant ‖ p_fp32), mean over {win} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "drift_kl.png"), dpi=120)


if __name__ == "__main__":
    main()
