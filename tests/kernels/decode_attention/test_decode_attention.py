"""Decode attention: the reference against PyTorch's SDPA over ``repeat_kv``-expanded heads (what transformers runs),
in float64; the Triton kernel against the reference (under ``TRITON_INTERPRET=1`` on CPU, compiled on a GPU); the
op's argument checks.

The mask is what decode sees: a static cache whose first ``filled`` positions of each row hold tokens (rows filled
to different lengths, as speculative rounds and padded batches leave them), optionally with holes (left padding),
as a boolean mask or an additive float one; for a window of ``T`` tokens (a speculative verify) the window sits at
the cache's last ``T`` positions, each token seeing the ones before it (one mask row per token), or a mask shared by
the window's tokens.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_compile.kernels.decode_attention_reference import decode_attention_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def repeat_kv(x, G):
    b, KV, S, d = x.shape
    return x[:, :, None].expand(b, KV, G, S, d).reshape(b, KV * G, S, d)


def sdpa(q, k, v, mask, scale):
    """transformers' compiled path: expanded heads, SDPA with the mask."""
    G = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G),
                                                            attn_mask=mask[:, None], scale=scale)


def problem(b, H, KV, S, dk, dv, dtype, seed, float_mask=False, holes=False, batch_mask=True, T=1, causal=True):
    """``(q [b, H, T, dk], k, v, mask [b or 1, T or 1, S])``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, H, T, dk, generator=g, dtype=torch.float64)
    k = torch.randn(b, KV, S, dk, generator=g, dtype=torch.float64)
    v = torch.randn(b, KV, S, dv, generator=g, dtype=torch.float64)
    rows = b if batch_mask else 1
    filled = torch.randint(0 if T > 1 else 1, S - T + 2, (rows,), generator=g)
    pos = torch.arange(S)
    mask = (pos[None, :] < filled[:, None])[:, None, :]                          # [rows, 1, S]
    if holes:
        mask = mask & (torch.rand(mask.shape, generator=g) > 0.3)
        mask[..., 0] = True
    if T > 1:
        window = pos >= S - T
        tok = torch.arange(T)[:, None] if causal else torch.full((1, 1), T - 1)
        mask = (mask & ~window) | (window & (pos - (S - T) <= tok))[None]       # [rows, T or 1, S]
    if float_mask:
        bias = torch.randn(mask.shape, generator=g, dtype=torch.float64)
        mask = torch.where(mask, bias, float("-inf"))
    # unfilled positions hold what an earlier round left: huge values that must never leak in
    live = (mask if mask.dtype == torch.bool else mask > float("-inf")).any(1)
    k = torch.where(live[:, None, :, None], k, 1e4)
    return [t.to(dtype) if t.dtype == torch.float64 else t for t in (q, k, v)] + \
        [mask.to(dtype) if mask.dtype == torch.float64 else mask]


def reference(q, k, v, mask, scale):
    return decode_attention_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(),
                                      mask.cpu() if mask.dtype == torch.bool else mask.cpu().double(), scale)


@settings(max_examples=30)
@given(b=st.integers(1, 3), KV=st.integers(1, 3), G=st.sampled_from([1, 2, 4, 5]), T=st.sampled_from([1, 2, 4]),
       S=st.integers(5, 40), dk=st.sampled_from([4, 16, 24]), dv=st.sampled_from([4, 16, 8]),
       float_mask=st.booleans(), holes=st.booleans(), causal=st.booleans(), seed=st.integers(0, 99))
def test_reference_equals_sdpa_over_expanded_heads(b, KV, G, T, S, dk, dv, float_mask, holes, causal, seed):
    q, k, v, mask = problem(b, KV * G, KV, S, dk, dv, torch.float64, seed, float_mask, holes, T=T, causal=causal)
    scale = dk ** -0.5
    torch.testing.assert_close(decode_attention_reference(q, k, v, mask, scale), sdpa(q, k, v, mask, scale),
                               rtol=1e-10, atol=1e-10)


def test_a_query_with_nothing_to_attend_to_gets_zeros():
    q, k, v, mask = problem(2, 4, 2, 8, 16, 16, torch.float64, 0)
    mask[1] = False
    out = decode_attention_reference(q, k, v, mask, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0
    fmask = torch.where(mask, 0.0, float("-inf")).double()
    assert torch.equal(decode_attention_reference(q, k, v, fmask, 0.25), out)


triton = pytest.importorskip("triton")

from replay_compile.kernels import decode_attention_triton as kt  # noqa: E402


@settings(max_examples=12)
@given(b=st.integers(1, 3), KV=st.integers(1, 2), G=st.sampled_from([1, 3, 4]), T=st.sampled_from([1, 1, 3, 4]),
       S=st.integers(5, 150), dk=st.sampled_from([16, 24]), dv=st.sampled_from([16, 8]), float_mask=st.booleans(),
       holes=st.booleans(), batch_mask=st.booleans(), causal=st.booleans(), seed=st.integers(0, 99))
def test_kernel_matches_the_reference(b, KV, G, T, S, dk, dv, float_mask, holes, batch_mask, causal, seed):
    """fp32 (IEEE dots): the split counts the interpreter's 4 "SMs" choose, masks of every kind, windows."""
    q, k, v, mask = problem(b, KV * G, KV, S, dk, dv, torch.float32, seed, float_mask, holes, batch_mask, T, causal)
    q, k, v, mask = (t.to(DEV) for t in (q, k, v, mask))
    out = kt.decode_attention_triton(q, k, v, mask, dk ** -0.5)
    torch.testing.assert_close(out.cpu().double(), reference(q, k, v, mask, dk ** -0.5), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("block, n_split, per", [(16, 1, 13), (16, 5, 3), (32, 2, 4), (64, 4, 1)])
@pytest.mark.parametrize("T", [1, 4])
def test_every_launch_configuration_covers_the_positions(block, n_split, per, T):
    """Tiles narrower and wider than the cache, splits (the combine launch) with and without kept positions, the
    kept extent starting and ending inside a tile: the same result under every configuration."""
    S = 200
    q, k, v, mask = problem(3, 8, 2, S, 16, 16, torch.float32, 7, holes=True, T=T)
    mask[0, :, :37] = False                                 # left padding: the extent starts inside a tile
    q, k, v, mask = (t.to(DEV) for t in (q, k, v, mask))
    cfg = kt.LaunchConfig(block, n_split, per, 4, 2)                    # n_split * per * block >= S
    out = kt.decode_attention_triton(q, k, v, mask, 0.25, config=cfg)
    torch.testing.assert_close(out.cpu().double(), reference(q, k, v, mask, 0.25), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_in_half_precision_stays_within_its_rounding(dtype):
    q, k, v, mask = problem(3, 8, 2, 200, 32, 32, dtype, 3, holes=True, T=2)
    q, k, v, mask = (t.to(DEV) for t in (q, k, v, mask))
    out = kt.decode_attention_triton(q, k, v, mask, 32 ** -0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), reference(q, k, v, mask, 32 ** -0.5), rtol=2e-2, atol=2e-2)


def test_split_configuration_covers_every_position_once():
    """Splits x tiles cover [0, S) with no split left empty, for the batch sizes where splitting happens."""
    for b in (1, 2, 5, 64, 256):
        for S in (1, 63, 64, 65, 1040, 8200):
            c = kt.launch_config(b, 8, S, 16, 128, torch.device("cpu"))
            assert c.n_split * c.tiles_per_split * c.block >= S > (c.n_split - 1) * c.tiles_per_split * c.block, \
                (b, S, c)


@pytest.mark.parametrize("T", [1, 3])
def test_only_kept_positions_are_read(T):
    """Keys and values at positions no query keeps are NaN: any read of them would poison the output."""
    q, k, v, mask = problem(2, 4, 2, 130, 16, 16, torch.float32, 5, holes=True, T=T)
    dead = ~mask.any(1)[:, None, :, None]
    k, v = k.masked_fill(dead, float("nan")), v.masked_fill(dead, float("nan"))
    out = kt.decode_attention_triton(*(t.to(DEV) for t in (q, k, v, mask)), 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), reference(q, k.nan_to_num(), v.nan_to_num(), mask, 0.25),
                               rtol=2e-5, atol=2e-5)


def test_op_checks_name_the_argument_before_running():
    from replay_compile.ops.decode_attention import decode_attention

    q, k, v, mask = problem(2, 4, 2, 8, 16, 16, torch.float32, 0)
    with pytest.raises(ValueError, match=r"mask must be \[b=2 or 1, T=1 or 1, S=8\]"):
        decode_attention(q, k, v, mask[..., :5], 0.25)
    with pytest.raises(ValueError, match=r"q must be \[b, H, T, dk\]"):
        decode_attention(q[:, :, 0], k, v, mask, 0.25)
    with pytest.raises(ValueError, match="3 key/value heads"):
        decode_attention(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1), mask, 0.25)
    with pytest.raises(ValueError, match="share a dtype"):
        decode_attention(q, k.half(), v.half(), mask, 0.25)
    with pytest.raises(ValueError, match="mask must be bool"):
        decode_attention(q, k, v, mask.int(), 0.25)
    torch.testing.assert_close(decode_attention(q, k, v, mask, 0.25), decode_attention_reference(q, k, v, mask, 0.25))
