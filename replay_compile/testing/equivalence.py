"""Check a model compiled with ``backend="replayssm"`` against the same model run eagerly.

:func:`check_equivalence` runs greedy ``generate`` twice on the *same* model (eager, then with ``model.forward``
compiled), for at least ``2L + 1`` new tokens (so at least two flushes happen), and compares tokens, logits at every
step up to the first token difference, and the final cache state (which the transformers integration flushes when
``generate`` returns). It works for transformers causal LMs and for any module with the same ``generate`` contract.
``replay-compile verify`` is the command-line face of it.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .. import backend as _backend
from .. import state as replay_state
from ..passes.validate import rel_err


@dataclasses.dataclass
class EquivalenceReport:
    steps: int
    buffer_len: int
    tokens_match: bool
    first_token_mismatch: int | None
    max_logit_diff: float
    logit_scale: float
    max_state_diff: float
    states_compared: int
    rewrites: list
    skipped: list
    flushes_per_layer: int
    eager_seconds: float
    compiled_seconds: float
    logit_rtol: float
    state_rtol: float
    teacher_forced: bool = False
    backend: str = "replayssm"
    baseline: tuple | None = None       # (backend, its relative logit difference, its state difference)

    @property
    def passed(self) -> bool:
        return (self.tokens_match and (bool(self.rewrites) or self.backend != "replayssm")
                and self.max_logit_diff <= self.logit_rtol * max(self.logit_scale, 1.0)
                and self.max_state_diff <= self.state_rtol)

    def summary(self) -> str:
        per_layer: dict = {}
        for r in self.rewrites:
            per_layer.setdefault(str(r), 0)
            per_layer[str(r)] += 1
        lines = [f"rewrites: {len(per_layer)} layer(s) in {len(self.rewrites)} graph rewrite(s)"]
        lines += [f"  {r}  ({k} graph{'s' if k > 1 else ''})" for r, k in per_layer.items()]
        if self.skipped:
            lines.append(f"left unchanged: {len(self.skipped)} state write(s)")
            lines += [f"  {s}" for s in self.skipped]
        mism = "" if self.tokens_match else f" (first difference at step {self.first_token_mismatch})"
        tokens = (f"tokens: {self.steps}, eager's fed to the compiled model (teacher-forced: in low precision a "
                  f"near-tie of the argmax flips with any change of rounding, plain torch.compile's too)"
                  if self.teacher_forced else
                  f"tokens: {self.steps} generated, {'identical' if self.tokens_match else 'DIFFERENT'} to eager{mism}")
        lines += [
            tokens,
            f"logits: max |diff| {self.max_logit_diff:.3g} (logit scale {self.logit_scale:.3g}, "
            f"tolerance {self.logit_rtol:g} relative)",
            f"state after generate: max relative diff {self.max_state_diff:.3g} over {self.states_compared} "
            f"tensor(s) (tolerance {self.state_rtol:g})",
            *([f"tolerances: twice what {self.baseline[0]} departs from eager (logits {self.baseline[1]:.3g} of the "
               f"largest, state {self.baseline[2]:.3g}), at least {LOW_PRECISION_RTOL:g}"] if self.baseline else []),
            f"flushes: {self.flushes_per_layer} per layer (L={self.buffer_len})",
            f"time: eager {self.eager_seconds:.2f}s, compiled (incl. compile) {self.compiled_seconds:.2f}s",
            "PASS" if self.passed else "FAIL",
        ]
        return "\n".join(lines)


def _cache_tensors(cache) -> list[torch.Tensor]:
    return [t for t in replay_state._tensors_in(cache, depth=5) if t.dim() >= 3 and t.is_floating_point()]


class _Forced:
    """A logits processor that makes ``generate`` emit ``sequences``' tokens (the raw logits it returns are the
    model's own)."""

    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tok = self.sequences[:, input_ids.shape[1]].to(scores.device)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, tok[:, None], 0.0)


# bf16 / fp16: the tolerances are twice what plain torch.compile's own run departs from eager (teacher-forced, same
# tokens), and at least this. On the embedded models (initialised wide, for numerically demanding tests) plain
# torch.compile's bf16 logits already depart from eager's by 5% of the largest logit (Bamba), so no fixed tolerance
# both passes it and means something.
LOW_PRECISION_RTOL = 1e-2


def check_equivalence(model, input_ids: torch.Tensor, *, max_new_tokens: int | None = None, buffer_len: int = 16,
                      options: dict | None = None, logit_rtol: float | None = None, state_rtol: float | None = None,
                      teacher_forced: bool | None = None, backend: str = "replayssm",
                      baseline: str | None = "inductor", **generate_kwargs) -> EquivalenceReport:
    """Greedy-decode ``model`` eagerly and compiled with ``backend="replayssm"``; compare.

    Args:
        model: a transformers-style model with ``generate`` and ``forward``. Its ``forward`` is compiled for the
            second run and restored afterwards.
        input_ids: [batch, prompt_len] prompt.
        max_new_tokens: tokens to generate; default and minimum ``2 * buffer_len + 1``.
        buffer_len, options: the backend's ``buffer_len`` and further ``options``.
        logit_rtol: tolerance on the max logit difference, relative to the largest logit magnitude (default 1e-3
            in fp32, :data:`LOW_PRECISION_RTOL` in bf16 / fp16).
        state_rtol: tolerance on the final cache tensors (relative to each tensor's largest magnitude; same
            defaults).
        teacher_forced: feed the compiled run eager's tokens, so that logits are compared at every step and the
            final states after the same tokens (default: for bf16 / fp16 models, where a near-tie of the argmax
            flips with any change of rounding); otherwise the compiled run picks its own tokens, which must equal
            eager's.
        backend: ``"replayssm"``, or another torch.compile backend to hold to the same check (``"inductor"``).
        baseline: in bf16 / fp16, the backend whose own departure from eager sets the tolerances (twice it, at least
            :data:`LOW_PRECISION_RTOL`); None: the given / default tolerances alone.
    """
    low = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
    teacher_forced = low if teacher_forced is None else teacher_forced
    logit_rtol = (LOW_PRECISION_RTOL if low else 1e-3) if logit_rtol is None else logit_rtol
    state_rtol = (LOW_PRECISION_RTOL if low else 1e-3) if state_rtol is None else state_rtol
    steps = max(max_new_tokens or 0, 2 * buffer_len + 1)
    base = None
    if low and baseline and baseline != backend:
        base = check_equivalence(model, input_ids, max_new_tokens=steps, buffer_len=buffer_len, teacher_forced=True,
                                 backend=baseline, baseline=None, logit_rtol=logit_rtol, state_rtol=state_rtol,
                                 **generate_kwargs)
        logit_rtol = max(logit_rtol, 2 * base.max_logit_diff / max(base.logit_scale, 1.0))
        state_rtol = max(state_rtol, 2 * base.max_state_diff)
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
              return_dict_in_generate=True, **generate_kwargs)
    t0 = time.perf_counter()
    with torch.no_grad():
        ref = model.generate(input_ids, **kw)
    t1 = time.perf_counter()
    _backend.clear_reports()
    original = model.forward
    # CPU graphs are rewritten here too (by default they are left to the lowering): this checks the rewrite
    opts = {"buffer_len": buffer_len, "devices": ("cpu", "cuda"), **(options or {})} if backend == "replayssm" \
        else options
    model.forward = torch.compile(original, backend=backend, options=opts)
    if teacher_forced:
        from transformers import LogitsProcessorList
        kw["logits_processor"] = LogitsProcessorList([_Forced(ref.sequences)])
    try:
        with torch.no_grad():
            out = model.generate(input_ids, **kw)
    finally:
        model.forward = original
    t2 = time.perf_counter()
    replay_state.flush(out.past_key_values)

    n = min(ref.sequences.shape[1], out.sequences.shape[1])
    diff = (ref.sequences[:, :n] != out.sequences[:, :n]).any(0).nonzero()
    prompt = input_ids.shape[1]
    first = int(diff[0]) - prompt if diff.numel() else None
    upto = len(ref.logits) if first is None else first + 1
    max_logit = max((float((a.double() - b.double()).abs().max()) for a, b in
                     zip(ref.logits[:upto], out.logits[:upto])), default=0.0)
    scale = max((float(a.abs().max()) for a in ref.logits[:upto]), default=0.0)
    ref_t, out_t = _cache_tensors(ref.past_key_values), _cache_tensors(out.past_key_values)
    pairs = [(a, b) for a, b in zip(out_t, ref_t) if a.shape == b.shape]
    state_diff = (max((rel_err(a, b) for a, b in pairs if a.numel()), default=float("inf")) if first is None
                  else float("inf"))
    reps = _backend.reports()
    stepped = list({id(rs): rs for rs in map(replay_state.lookup, out_t) if rs is not None}.values())
    return EquivalenceReport(
        steps=steps, buffer_len=buffer_len, tokens_match=first is None and ref.sequences.shape == out.sequences.shape,
        first_token_mismatch=first, max_logit_diff=max_logit, logit_scale=scale, max_state_diff=state_diff,
        states_compared=len(pairs), rewrites=[r for rep in reps for r in rep.rewrites],
        skipped=[s for rep in reps for s in rep.skipped if not s.quiet],
        flushes_per_layer=max((rs.steps // buffer_len for rs in stepped), default=0),
        eager_seconds=t1 - t0, compiled_seconds=t2 - t1, logit_rtol=logit_rtol, state_rtol=state_rtol,
        teacher_forced=teacher_forced, backend=backend,
        baseline=None if base is None else (baseline, base.max_logit_diff / max(base.logit_scale, 1.0),
                                            base.max_state_diff))
