"""Stochastic rounding of quantized checkpoints (fp16, fp8 e4m3 with row scales): neighbours only, unbiased,
exact values kept, deterministic per key, and the reason it exists: round-to-nearest stalls on small increments."""

import pytest
import torch

from replay_compile.quant.stochastic import element_keys, quantize_checkpoint, sr_e4m3_rows, sr_fp16, uniform_from_key


def _neighbours_fp16(x):
    rn = x.to(torch.float16)
    bits = rn.view(torch.int16)
    lo = torch.where(rn.float().abs() > x.abs(), bits - 1, bits).view(torch.float16).float()
    hi = (torch.where(rn.float().abs() > x.abs(), bits - 1, bits) + 1).view(torch.float16).float()
    return lo, hi


def test_uniforms_are_in_unit_interval_and_spread():
    u = uniform_from_key(torch.arange(100_000))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005


def test_fp16_rounds_to_a_neighbour_and_keeps_exact_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-6, 4, 4096)
    out = sr_fp16(x, uniform_from_key(element_keys(x.shape, 1))).float()
    lo, hi = _neighbours_fp16(x)
    assert bool(((out == lo) | (out == hi)).all())
    exact = x.to(torch.float16).float()
    assert torch.equal(sr_fp16(exact, torch.rand(4096, generator=g)).float(), exact)
    assert torch.equal(sr_fp16(torch.zeros(3), torch.rand(3)).float(), torch.zeros(3))


@pytest.mark.parametrize("fmt", ["fp16", "fp8_e4m3"])
def test_unbiased_over_many_keys(fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 32, generator=g)
    n = 2000
    draws = torch.stack([quantize_checkpoint(x, fmt, seed=s) for s in range(n)])
    rn_err = (quantize_checkpoint(x, fmt, stochastic=False) - x).abs().max()
    mean_err = (draws.mean(0) - x).abs().max()
    # each draw is off by at most one ulp (<= 2 x the nearest-rounding error); the mean of n draws by ~ulp/sqrt(n)
    if fmt == "fp16":                     # (fp8's step differs per element through the row scale)
        assert float((draws - x).abs().max()) <= 2 * float(rn_err) + 1e-7
    assert float(mean_err) < 6 * float(rn_err) / n ** 0.5 + 1e-7, (float(mean_err), float(rn_err))


def test_fp8_values_are_neighbours_on_the_scaled_grid():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 64, generator=g)
    vals, scale = sr_e4m3_rows(x, uniform_from_key(element_keys(x.shape, 3)))
    q = x / scale[:, None]
    v = vals.float()
    # v is representable (it is an e4m3 value) and no other e4m3 value lies strictly between v and q
    grid = torch.arange(0, 0x7F, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.cat([-grid.flip(0), grid]).unique()
    between = ((grid[None, None, :] > torch.minimum(v, q)[..., None]) &
               (grid[None, None, :] < torch.maximum(v, q)[..., None])).any(-1)
    assert not bool(between.any())
    assert torch.allclose(scale, x.abs().amax(-1) / 448.0)


def test_deterministic_per_seed_and_fresh_across_seeds():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    for fmt in ("fp16", "fp8_e4m3"):
        a, b, c = (quantize_checkpoint(x, fmt, seed=s) for s in (5, 5, 6))
        assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("fmt", ["fp16", "fp8_e4m3"])
def test_nearest_rounding_stalls_where_stochastic_tracks(fmt):
    """A state that grows by a quarter of an ulp per flush: round-to-nearest never moves, stochastic rounding
    follows the exact value on average."""
    base = torch.full((256, 16), 1.0)
    base[:, 0] = 2.0          # a fixed row max: fp8 scale 2/448, so 1.0 sits at 224 where the e4m3 step is 16
    ulp = 2.0 ** -10 if fmt == "fp16" else 16 * 2.0 / 448
    inc = torch.full_like(base, ulp / 4)
    inc[:, 0] = 0.0
    s_rn, s_sr = base.clone(), base.clone()
    for k in range(200):
        s_rn = quantize_checkpoint(s_rn + inc, fmt, stochastic=False)
        s_sr = quantize_checkpoint(s_sr + inc, fmt, seed=k)
    inc = ulp / 4
    col = slice(1, None)
    assert torch.equal(s_rn[:, col], base[:, col]), "round-to-nearest was expected to stall"
    growth = float((s_sr[:, col] - base[:, col]).mean())
    assert abs(growth - 200 * inc) < 0.15 * 200 * inc, (growth, 200 * inc)


def test_bad_format_is_named():
    with pytest.raises(ValueError, match="checkpoint format 'nvfp4' unsupported"):
        quantize_checkpoint(torch.zeros(2, 2), "nvfp4")
