"""The verify forwards' causal conv over ``[conv state | T inputs]`` equals the decode path's ``F.conv1d``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replay_compile.speculative.base import conv_window


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("T", [1, 4])
def test_conv_window_equals_the_depthwise_conv(dtype, tol, bias, T):
    g = torch.Generator().manual_seed(T)
    b, C, K = 3, 24, 4
    state = torch.randn(b, C, K, generator=g).to(dtype)
    new = torch.randn(b, C, T, generator=g).to(dtype)
    w = torch.randn(C, 1, K, generator=g).to(dtype)
    bb = torch.randn(C, generator=g).to(dtype) if bias else None
    seq = torch.cat([state, new], dim=-1)
    want = F.conv1d(seq.double(), w.double(), None if bb is None else bb.double(), groups=C)[..., -T:]
    got = conv_window(state, new, w, bb)
    assert got.dtype == dtype and got.shape == (b, C, T)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
