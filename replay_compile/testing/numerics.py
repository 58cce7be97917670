"""Precision budgets for the replay steps: a result is judged against the error the exact fp32 step makes.

A replay step reorders the recurrence's arithmetic (decays summed over a window instead of applied one by one), so
it cannot match the exact fp32 step bit for bit; what it must do is stay as close to the truth (the fp64 recurrence)
as that step does. :func:`check_within_budget` allows 10x the exact fp32 step's error, with a floor of a few fp32
ulps of the result's scale for the steps where the exact fp32 error happens to vanish.
"""

from __future__ import annotations

import torch

# a few fp32 ulps of the result's scale: the error allowed before "10x the exact fp32 step's" is measured
ULP_FLOOR = 1e-6


def rel_err(a: torch.Tensor, truth: torch.Tensor) -> float:
    """max |a - truth| / max |truth| (in fp64, on the CPU)."""
    a, truth = a.double().cpu(), truth.double().cpu()
    return float((a - truth).abs().max() / (truth.abs().max() + 1e-30))


def check_within_budget(result: torch.Tensor, truth: torch.Tensor, exact32: torch.Tensor, what: str) -> None:
    """Assert ``result`` is finite and within 10x the relative error of ``exact32`` (both against ``truth``)."""
    assert torch.isfinite(result.cpu()).all(), f"{what}: non-finite result where the exact step is finite"
    budget = 10 * max(rel_err(exact32, truth), ULP_FLOOR)
    got = rel_err(result, truth)
    assert got <= budget, f"{what}: error {got:.3g} > 10x the exact fp32 step's ({budget / 10:.3g})"


def with_extremes(seq: list, key: str, frac: float, value: float, seed: int) -> list:
    """``seq`` (per-step input dicts) with a fraction ``frac`` of the entries of ``seq[t][key]`` replaced by
    ``value`` (a log-decay of -1e5, -inf, ...), seeded."""
    gen = torch.Generator().manual_seed(seed)
    for inp in seq:
        hit = torch.rand(inp[key].shape, generator=gen) < frac
        inp[key] = torch.where(hit, torch.tensor(value, dtype=inp[key].dtype), inp[key])
    return seq


class Fp32Recurrence:
    """The exact recurrence run in fp32 from ``state0`` (a copy): the error budget of :func:`check_within_budget`.

    ``fn(state, *inputs)`` is the family's exact step (in place on ``state``, returns the output); ``keys`` name the
    inputs of each step's dict in order.
    """

    def __init__(self, state0: torch.Tensor, fn, keys: tuple):
        self.state, self._fn, self._keys = state0.clone(), fn, keys

    def step(self, inp: dict) -> torch.Tensor:
        return self._fn(self.state, *(inp[k] for k in self._keys))
