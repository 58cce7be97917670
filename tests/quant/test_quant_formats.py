"""Read-copy storage formats (replay_compile.quant.formats): error bounds, exactness, layouts, slot writes.

The bounds are derived independently of the implementation (see each ``assert_*_bound``); the recipe's scales are
recomputed here from the input; the nibble layout is checked against bytes built by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from replay_compile.quant import (
    E2M1_VALUES,
    FORMATS,
    Encoded,
    NVFP4Format,
    e2m1_decode,
    e2m1_encode,
    get_format,
    pack_nibbles,
    quantize_dequantize,
    unpack_nibbles,
)

NAMES = sorted(FORMATS)
F32_SLACK = 2.0 ** -22  # fp32 rounding of the scaled value and of the decode product, relative


# ----------------------------------------------------------------------------------------------------------------
# Bounds (each derived from the format's definition, not from the code under test)
# ----------------------------------------------------------------------------------------------------------------
def assert_bf16_bound(x, dec):
    # round-to-nearest-even to 8 significant bits: |err| <= half an ulp <= 2^-8 |x| (normal range)
    err = (dec - x).abs()
    assert bool((err <= 2.0 ** -8 * x.abs()).all()), f"bf16 max rel err {float((err / x.abs()).nan_to_num().max())}"


def assert_fp8_bound(x, enc, dec):
    amax = x.abs().amax(-1)
    scale = enc["scale"]
    # recipe: scale = amax / 448 (zero rows: any positive scale, values zero)
    nz = amax > 0
    torch.testing.assert_close(scale[nz] * 448, amax[nz], rtol=2 ** -22, atol=0)
    assert bool((scale > 0).all()) and bool(torch.isfinite(scale).all())
    # e4m3: 3 mantissa bits -> half ulp <= 2^-4 |y| for normals (|y| >= 2^-6); subnormal spacing 2^-9 -> 2^-10
    s = scale.unsqueeze(-1)
    err = (dec - x).abs()
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * s + F32_SLACK * x.abs()
    assert bool((err <= bound).all()), f"fp8 worst err/bound {float((err / bound).max())}"
    # and the brief's coarse per-row bound
    assert bool((err <= 2.0 ** -4 * amax.unsqueeze(-1) * (1 + F32_SLACK)).all())


def _half_spacing_e2m1(y):
    # grid {0, .5, 1, 1.5, 2, 3, 4, 6}: spacing 0.5 on [0, 2], 1 on [2, 4], 2 on [4, 6]
    return torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))


def nvfp4_expected_scales(x, tensor_scale_dims=1):
    """The recipe's scales computed here (fp32): s_g per group, s_b (as e4m3) per 16-value block."""
    k = tensor_scale_dims
    C = x.shape[-1]
    nb = -(-C // 16)
    amax_g = x.abs().reshape(*x.shape[:k], -1).amax(-1)
    s_g = amax_g / 2688.0
    s_g = torch.where(s_g > 0, s_g, torch.ones_like(s_g))
    xp = torch.cat([x, x.new_zeros(*x.shape[:-1], nb * 16 - C)], -1).reshape(*x.shape[:-1], nb, 16)
    amax_b = xp.abs().amax(-1)
    s_g_b = s_g.reshape(tuple(s_g.shape) + (1,) * (amax_b.dim() - s_g.dim()))     # k = -1: per row
    s_b = (amax_b / (6.0 * s_g_b)).clamp(max=448.0).to(torch.float8_e4m3fn)
    return s_g, s_b, amax_b, s_g_b


def assert_nvfp4_bound(x, enc, dec, tensor_scale_dims=1):
    C = x.shape[-1]
    s_g, s_b, amax_b, s_g_b = nvfp4_expected_scales(x, tensor_scale_dims)
    # the stored scales are the recipe's
    torch.testing.assert_close(enc["tensor_scale"], s_g, rtol=0, atol=0)
    assert torch.equal(enc["block_scale"].view(torch.uint8), s_b.view(torch.uint8)), "block scales differ from recipe"
    eff_b = s_b.float() * s_g_b
    eff = eff_b.repeat_interleave(16, -1)[..., :C]
    ax = x.abs()
    err = (dec - x).abs()
    # per element: half the e2m1 spacing at |x|/s, times s = s_b * s_g; above 6: the saturation error |x| - 6 s
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))
    y = ax / safe
    bound = torch.where(y <= 6, eff * _half_spacing_e2m1(y), ax - 6 * eff) + F32_SLACK * ax
    ok = torch.where(eff > 0, err <= bound, dec == 0)
    assert bool(ok.all()), f"nvfp4 worst err/bound {float((err / bound)[eff > 0].max())}"
    # a block whose scale underflowed e4m3 held only values <= 2^-10 * 6 * s_g
    under = (eff == 0) & (ax > 0)
    if under.any():
        lim = (6 * 2.0 ** -10 * s_g.reshape(tuple(s_g.shape) + (1,) * (x.dim() - s_g.dim()))).expand_as(ax)
        assert bool((ax[under] <= lim[under] * (1 + F32_SLACK)).all())
    # relative to the block amax, where the exact block scale is an e4m3 normal: s <= amax_b/6 * 17/16
    normal = (amax_b / (6 * s_g_b) >= 2.0 ** -6).repeat_interleave(16, -1)[..., :C].expand_as(ax)
    lim_b = (amax_b * 17 / 96).repeat_interleave(16, -1)[..., :C]
    assert bool((err <= lim_b * (1 + 4 * F32_SLACK))[normal].all())


def assert_bound(name, x, enc, dec):
    x = x.float()
    if name == "bf16":
        assert_bf16_bound(x, dec)
    elif name == "fp8_e4m3":
        assert_fp8_bound(x, enc, dec)
    else:
        assert_nvfp4_bound(x, enc, dec, FORMATS[name].tensor_scale_dims)


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
def make_data(kind, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "normal":
        return x
    if kind == "heavy":  # log-normal magnitudes over ~10 decades, random signs
        return x.sign() * torch.exp(3 * torch.randn(shape, generator=g))
    if kind == "zeros_in_rows":
        x[..., ::3] = 0
        x[..., 1, :] = 0  # a whole row
        if x.dim() >= 3:
            x[0] = 0      # a whole slot
        return x
    if kind == "huge_one":  # one element per row 1e6x the rest
        x[..., x.shape[-1] // 2] = 1e6
        return x
    if kind == "tiny_blocks":  # blocks far below the group amax: subnormal / underflowing e4m3 block scales
        x = x * torch.logspace(0, -9, x.shape[-2]).unsqueeze(-1)
        return x
    raise KeyError(kind)


KINDS = ["normal", "heavy", "zeros_in_rows", "huge_one", "tiny_blocks"]
SHAPES = [(3, 2, 5, 128), (2, 4, 20), (2, 3, 7), (2, 6, 1), (2, 3, 33)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_round_trip_bounds(name, kind, shape):
    f = FORMATS[name]
    x = make_data(kind, shape, seed=hash((kind, shape)) % 1000)
    enc = f.encode(x)
    spec = f.storage_spec(x.shape)
    assert set(enc.keys()) == set(spec)
    for k, (s, d) in spec.items():
        assert tuple(enc[k].shape) == tuple(s) and enc[k].dtype == d, k
    dec = f.decode(enc)
    assert dec.shape == x.shape and dec.dtype == torch.float32
    assert bool(torch.isfinite(dec).all())
    assert_bound(name, x, enc, dec)


@pytest.mark.parametrize("name", NAMES)
def test_sign_symmetry_and_input_dtypes(name):
    f = FORMATS[name]
    x = make_data("normal", (2, 3, 40), seed=1)
    d = quantize_dequantize(x, name)
    assert torch.equal(quantize_dequantize(-x, name), -d)
    for dt in (torch.bfloat16, torch.float16):
        xd = x.to(dt)
        out = f.decode(f.encode(xd), dtype=dt)
        assert out.dtype == dt
        assert_bound(name, xd.float(), f.encode(xd), f.decode(f.encode(xd)))
    assert quantize_dequantize(x.to(torch.bfloat16), name).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------------------
# Exactness on the grid
# ----------------------------------------------------------------------------------------------------------------
def test_bf16_exact_on_grid():
    x = make_data("heavy", (2, 3, 17)).to(torch.bfloat16).float()
    assert torch.equal(quantize_dequantize(x, "bf16"), x)


def _all_e4m3_values():
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)]  # 254 values (0x7F and 0xFF are NaN)


@pytest.mark.parametrize("k", [-20, 0, 7])
def test_fp8_exact_on_grid(k):
    v = _all_e4m3_values()  # includes +-448, so amax = 448 and scale = 2^k exactly
    x = torch.stack([v, v.flip(0), -v]) * 2.0 ** k
    enc = FORMATS["fp8_e4m3"].encode(x)
    assert torch.equal(enc["scale"], torch.full((3,), 2.0 ** k))
    assert torch.equal(FORMATS["fp8_e4m3"].decode(enc), x)


@pytest.mark.parametrize("k", [-30, 0, 5])
def test_nvfp4_exact_on_grid(k):
    # slot amax 2688 * 2^k  ->  s_g = 2^k exactly; block scales chosen e4m3-representable (normal and subnormal)
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]))  # 15 values
    grid16 = torch.cat([grid, torch.tensor([6.0])])                       # 16: amax of each block is 6 * s_b
    block_scales = [448.0, 1.0, 0.25, 3.5, 2.0 ** -6, 2.0 ** -9, 13.0, 0.4375]
    row = torch.cat([grid16.roll(i) * sb for i, sb in enumerate(block_scales)])  # C = 128
    x = torch.stack([row, row.flip(0)]).reshape(1, 2, 128) * 2.0 ** k
    f = FORMATS["nvfp4"]
    enc = f.encode(x)
    assert torch.equal(enc["tensor_scale"], torch.tensor([2.0 ** k]))
    assert enc["block_scale"][0, 0].float().tolist() == block_scales
    assert torch.equal(f.decode(enc), x)
    # the codes too: value v * s_b -> code of v
    codes = unpack_nibbles(enc["codes"], 128)[0, 0, :16]
    assert torch.equal(e2m1_decode(codes), grid16)


# ----------------------------------------------------------------------------------------------------------------
# e2m1 rounding and nibble packing
# ----------------------------------------------------------------------------------------------------------------
def _e2m1_oracle(y):
    """Nearest of the 8 magnitudes by brute force; a tie goes to the even index; saturate; sign bit from signbit."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    d = (y.double().abs().clamp(max=6).unsqueeze(-1) - mags).abs()  # above 6: nearest is 6
    best = d.min(-1, keepdim=True).values
    cand = d == best
    even = cand & (torch.arange(8) % 2 == 0)
    idx = torch.where(even.any(-1), even.float().argmax(-1), cand.float().argmax(-1))
    return (idx | (torch.signbit(y).long() << 3)).to(torch.uint8)


def test_e2m1_rounding_matches_oracle():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    pts = torch.tensor(list(E2M1_VALUES) + mids + [6.5, 7.0, 100.0, 1e30, 0.0, 2.0 ** -140], dtype=torch.float32)
    dense = torch.linspace(0, 8, 4001)
    eps = torch.tensor([m * s for m in mids for s in (1 - 2 ** -20, 1 + 2 ** -20)])
    y = torch.cat([pts, dense, eps])
    y = torch.cat([y, -y])
    assert torch.equal(e2m1_encode(y), _e2m1_oracle(y))
    # ties: to the even code
    ties = e2m1_encode(torch.tensor(mids))
    assert ties.tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert e2m1_decode(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_encode(torch.tensor([-0.0, -0.1, 0.0])).tolist() == [8, 8, 0]


def test_nibble_layout_by_hand():
    codes = torch.tensor([[0x1, 0x2, 0x3, 0x4, 0xF, 0x8, 0x7]], dtype=torch.uint8)  # odd length
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x8F, 0x07]]  # low nibble = even index; odd tail's high nibble 0
    assert torch.equal(unpack_nibbles(packed, 7), codes)
    # decode storage built by hand: block scale 1, tensor scale 2
    enc = Encoded("nvfp4", torch.Size([1, 1, 7]), {
        "codes": torch.tensor([[[0x21, 0x43, 0x8F, 0x07]]], dtype=torch.uint8),
        "block_scale": torch.ones(1, 1, 1).to(torch.float8_e4m3fn),
        "tensor_scale": torch.tensor([2.0])})
    out = FORMATS["nvfp4"].decode(enc)
    assert out.tolist() == [[[1.0, 2.0, 3.0, 4.0, -12.0, -0.0, 12.0]]]
    # and encode writes exactly those bytes back: s_g = 12/2688, block scale 448 -> s = 2 (to fp32 rounding);
    # -0.0 keeps its sign bit (code 8), as the hardware conversion does
    enc2 = FORMATS["nvfp4"].encode(out)
    assert enc2["codes"].tolist() == [[[0x21, 0x43, 0x8F, 0x07]]]


def test_nvfp4_block_boundaries_and_padding():
    # one big value in block 1 of a row of 20: block 0 and block 1 (4 values + 12 padding) get their own scales
    x = torch.zeros(1, 1, 20)
    x[..., :16] = 1.0
    x[..., 17] = 6.0
    enc = FORMATS["nvfp4"].encode(x)
    assert enc["block_scale"].shape == (1, 1, 2) and enc["codes"].shape == (1, 1, 10)
    s_g = float(enc["tensor_scale"])
    assert s_g == pytest.approx(6.0 / 2688, rel=1e-7)
    bs = enc["block_scale"][0, 0].float().tolist()
    assert bs[1] == 448.0 and bs[0] == torch.tensor(448.0 / 6).to(torch.float8_e4m3fn).float().item()
    torch.testing.assert_close(FORMATS["nvfp4"].decode(enc), x, rtol=2 ** -4, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# Special inputs
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_zeros_and_constant_rows(name):
    f = FORMATS[name]
    z = torch.zeros(2, 3, 19)
    enc = f.encode(z)
    for t in enc.tensors.values():
        assert bool(torch.isfinite(t.float()).all())
    assert torch.equal(f.decode(enc), z)
    c = torch.full((2, 3, 19), -3.7)
    c[1] = 1e-3
    dc = f.decode(f.encode(c))
    assert_bound(name, c, f.encode(c), dc)
    assert bool((dc[0] == dc[0, 0, 0]).all()) and bool((dc[1] == dc[1, 0, 0]).all())  # constant rows stay constant


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_raises(name, bad):
    x = torch.randn(2, 3, 16)
    x[1, 2, 5] = bad
    with pytest.raises(ValueError, match=name):
        FORMATS[name].encode(x)
    store = FORMATS[name].allocate((2, 3, 16))
    before = {k: v.clone() for k, v in store.tensors.items()}
    with pytest.raises(ValueError, match=name):
        FORMATS[name].encode_into(store, x[1:], index=[1])
    assert all(torch.equal(before[k].view(torch.uint8), v.view(torch.uint8)) for k, v in store.tensors.items())


def test_bf16_overflow_raises_and_extremes():
    with pytest.raises(ValueError, match="bf16.*overflow"):
        FORMATS["bf16"].encode(torch.tensor([[3.4e38]]))
    # fp8/nvfp4 handle the fp32 extremes (scales stay finite)
    x = torch.tensor([[3.4e38, -1.0, 1e-30, 0.0] * 4])
    for name in ("fp8_e4m3", "nvfp4"):
        f = FORMATS[name]
        enc = f.encode(x.unsqueeze(0) if name == "nvfp4" else x)
        dec = f.decode(enc)
        assert bool(torch.isfinite(dec).all())
        assert_bound(name, x.unsqueeze(0) if name == "nvfp4" else x, enc, dec)


def test_get_format_and_errors():
    assert get_format("nvfp4") is FORMATS["nvfp4"]
    with pytest.raises(ValueError, match="unknown read-copy format"):
        get_format("int4")
    with pytest.raises(ValueError, match="floating"):
        FORMATS["fp8_e4m3"].encode(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="nvfp4"):
        FORMATS["nvfp4"].encode(torch.ones(16))  # needs a slot dim for the per-slot tensor scale
    with pytest.raises(ValueError, match="cannot decode"):
        FORMATS["bf16"].decode(FORMATS["nvfp4"].encode(torch.ones(1, 16)))


# ----------------------------------------------------------------------------------------------------------------
# Storage, sizes, slot-wise writes
# ----------------------------------------------------------------------------------------------------------------
def test_bytes_per_value():
    assert FORMATS["bf16"].bytes_per_value(128) == 2
    assert FORMATS["fp8_e4m3"].bytes_per_value(128) == 1 + 4 / 128
    assert FORMATS["nvfp4"].bytes_per_value(128) == 0.5 + 1 / 16
    assert FORMATS["nvfp4"].bytes_per_value(33) == (17 + 3) / 33
    shape = (4, 8, 64, 128)
    assert FORMATS["nvfp4"].bytes_per_value(shape) == pytest.approx(0.5 + 1 / 16 + 4 * 4 / math.prod(shape))
    assert NVFP4Format(tensor_scale_dims=2).nbytes(shape) == math.prod(shape) * 9 // 16 + 4 * 32
    for name in NAMES:
        f = FORMATS[name]
        st_ = f.allocate((3, 2, 5, 33))
        assert st_.nbytes == f.nbytes((3, 2, 5, 33))
        assert torch.equal(f.decode(st_), torch.zeros(3, 2, 5, 33))  # fresh storage decodes to zeros
        assert f.nbytes((3, 2, 5, 33)) == f.row_nbytes(33) * 30 + (12 if name == "nvfp4" else 0)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32 if t.element_size() == 4
                                                                      else torch.int16)


@pytest.mark.parametrize("name", NAMES + ["nvfp4_per_head"])
@pytest.mark.parametrize("index_kind", ["tensor", "list", "mask", "slice", "int"])
def test_encode_into_writes_only_selected_slots(name, index_kind):
    f = NVFP4Format(tensor_scale_dims=2) if name == "nvfp4_per_head" else FORMATS[name]
    shape = (6, 3, 4, 20)
    x0 = make_data("normal", shape, seed=2)
    x1 = make_data("heavy", shape, seed=3)
    store = f.allocate(shape)
    f.encode_into(store, x0)
    before = store.clone()
    sel = [4, 1, 3]
    index = {"tensor": torch.tensor(sel), "list": sel,
             "mask": torch.tensor([i in sel for i in range(6)]), "slice": slice(1, 5, 2), "int": 3}[index_kind]
    if index_kind == "mask":
        sel = sorted(sel)
    elif index_kind == "slice":
        sel = [1, 3]
    elif index_kind == "int":
        sel = [3]
    xin = x1[3] if index_kind == "int" else x1[sel]
    f.encode_into(store, xin, index)
    full = f.encode(x1)  # scales are slot-local: a slot's encoding does not depend on other slots
    others = [i for i in range(6) if i not in sel]
    for k in store.keys():
        assert torch.equal(_bits(store[k][sel]), _bits(full[k][sel])), k
        assert torch.equal(_bits(store[k][others]), _bits(before[k][others])), k
    dec = f.decode(store)
    assert torch.equal(dec[sel], f.decode(full)[sel])
    assert torch.equal(dec[others], f.decode(f.encode(x0))[others])


def test_encode_into_errors():
    f = FORMATS["fp8_e4m3"]
    store = f.allocate((4, 2, 8))
    with pytest.raises(ValueError, match="shape"):
        f.encode_into(store, torch.randn(2, 2, 8), index=[0])
    with pytest.raises(ValueError, match="out of range"):
        f.encode_into(store, torch.randn(1, 2, 8), index=[4])
    with pytest.raises(ValueError, match="storage is in format"):
        FORMATS["bf16"].encode_into(store, torch.randn(4, 2, 8))
    g = NVFP4Format(tensor_scale_dims=0)
    gs = g.allocate((4, 2, 16))
    assert gs["tensor_scale"].shape == ()
    g.encode_into(gs, torch.randn(4, 2, 16))  # whole-tensor write is fine
    with pytest.raises(ValueError, match="slot by slot"):
        g.encode_into(gs, torch.randn(1, 2, 16), index=[0])
    f.encode_into(store, torch.randn(0, 2, 8), index=[])  # no slots: no-op


# ----------------------------------------------------------------------------------------------------------------
# Property test
# ----------------------------------------------------------------------------------------------------------------
@st.composite
def states(draw):
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 40)))
    n = math.prod(shape)
    mags = draw(st.lists(st.floats(-30, 30), min_size=n, max_size=n))  # log2 magnitudes
    signs = draw(st.lists(st.sampled_from([-1.0, 0.0, 1.0]), min_size=n, max_size=n))
    x = torch.tensor(signs) * torch.exp2(torch.tensor(mags))
    return x.reshape(shape)


@given(x=states(), name=st.sampled_from(NAMES))
def test_property_round_trip_bound(x, name):
    f = FORMATS[name]
    enc = f.encode(x)
    dec = f.decode(enc)
    assert bool(torch.isfinite(dec).all())
    assert_bound(name, x, enc, dec)
    assert torch.equal(quantize_dequantize(-x, name), -dec)
