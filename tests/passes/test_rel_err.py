"""``passes.validate.rel_err``, the pass's numerical check: finite tensors take the fast path (two maxima), anything
with a NaN or an infinity the masked one; both must agree with a direct fp64 computation."""

import math

import pytest
import torch

from replay_compile.passes.validate import rel_err

nan, inf = float("nan"), float("inf")


@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_finite_matches_direct_fp64(chunk):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g)
    b = a + 1e-3 * torch.randn(1000, generator=g)
    want = float((a.double() - b.double()).abs().max() / b.double().abs().max())
    assert math.isclose(rel_err(a, b, chunk=chunk), want, rel_tol=1e-9)
    assert rel_err(a.view(10, 100), a.clone(), chunk=chunk) == 0.0
    assert rel_err(torch.zeros(5), torch.zeros(5), chunk=chunk) == 0.0


@pytest.mark.parametrize("chunk", [2, 1 << 22])
@pytest.mark.parametrize("a, b, want", [
    ([1.0, nan, 2.0], [1.0, nan, 2.0], 0.0),       # the same NaN places: compared on the rest
    ([1.0, nan, 2.0], [1.0, 2.0, 2.0], inf),       # a NaN where the other has a number
    ([1.0, 2.0, 2.0], [1.0, nan, 2.0], inf),
    ([1.0, inf, 2.0], [1.0, inf, 2.0], 0.0),       # the same infinity
    ([1.0, inf, 2.0], [1.0, -inf, 2.0], inf),      # opposite infinities
    ([1.0, inf, 2.0], [1.0, 5.0, 2.0], inf),
    ([nan], [nan], 0.0),                            # nothing finite to compare
    ([1.0, nan, 4.0], [1.0, nan, 2.0], 1.0),        # masked, then |4 - 2| / 2
])
def test_non_finite_values(a, b, want, chunk):
    got = rel_err(torch.tensor(a), torch.tensor(b), chunk=chunk)
    assert got == want or math.isclose(got, want, rel_tol=1e-9)


def test_sizes_must_match():
    assert rel_err(torch.zeros(3), torch.zeros(4)) == inf
    assert rel_err(torch.zeros(0), torch.zeros(0)) == 0.0
