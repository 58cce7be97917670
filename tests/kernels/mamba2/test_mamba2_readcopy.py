"""Mamba-2 ReplaySSM step with a low-precision read copy: the Triton kernel against its reference, the
reference against ``replay_step_reference``.

* The kernel's decode helpers reproduce ``FORMATS[fmt].decode`` bit for bit, and its flush encoders
  ``FORMATS[fmt].encode`` bit for bit (crafted rounding ties, e4m3 subnormals, zero blocks, -0).
* Step by step over flushes, with random cursors, padded rows and permuted slots: from the same pre-step state the
  kernel and the reference give the same outputs (rtol 1e-5: both decode the same copy), checkpoints, rings and
  cursors; after a flush the kernel's copy is exactly the encoding of its checkpoint, the reference's copy agrees
  within the format's bound, and slots that did not flush keep their copy bit for bit.
* The initial copy encodes a *different* state than the checkpoint, so a flush that read the copy, or a read that
  used the checkpoint, shows; a NaN checkpoint shows that non-flush rows never read it.
* With a bf16 checkpoint and a bf16 copy (the copy is then the checkpoint exactly), the read-copy reference equals
  ``replay_step_reference`` exactly.

Runs under ``TRITON_INTERPRET=1`` on CPU (conftest), on CUDA tensors where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from replay_compile.kernels import mamba2_readcopy_triton as kt  # noqa: E402
from replay_compile.kernels.mamba2_readcopy_reference import (  # noqa: E402
    decode_slots,
    init_read_copy,
    replay_step_readcopy_reference,
)
from replay_compile.kernels.mamba2_readcopy_triton import decode_read_copy_triton, replay_step_readcopy_triton  # noqa: E402
from replay_compile.kernels.mamba2_reference import replay_step_reference  # noqa: E402
from replay_compile.quant.formats import FORMATS, Encoded, NVFP4Format  # noqa: E402
from replay_compile.testing.strategies import Mamba2Geometry  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FMTS = ("bf16", "fp8_e4m3", "nvfp4", "nvfp4_row")


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as comparable integers (float8 has no ``==`` on CPU; -0 vs 0 and NaNs compare by bits)."""
    t = t.detach().contiguous().cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def copy_equal(a: Encoded, b: Encoded, slots=None) -> bool:
    sel = (lambda t: t) if slots is None else (lambda t: t[slots] if t.dim() else t)  # noqa: E731
    return all(torch.equal(bits(sel(a[k].cpu())), bits(sel(b[k].cpu()))) for k in a.keys())


def rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).abs().max() / (b.double().abs().max().cpu() + 1e-30))


def quant_bound(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |decode(encode(x)) - x| (formats.py's bounds), x [S, H, P, N] fp32."""
    a = x.abs()
    if fmt == "bf16":
        return 2.0 ** -8 * a
    if fmt == "fp8_e4m3":
        scale = a.amax(-1, keepdim=True) / 448
        return 2.0 ** -4 * a + 2.0 ** -10 * scale
    N = x.shape[-1]
    nb = -(-N // 16)
    blocks = torch.nn.functional.pad(a, (0, nb * 16 - N)).reshape(*x.shape[:-1], nb, 16).amax(-1)
    s_g = a.reshape(x.shape[0], -1).amax(-1) / 2688
    floor = 2.0 ** -10 * 6 * s_g.reshape(-1, 1, 1, 1)       # blocks whose e4m3 scale is subnormal or zero
    return (blocks * 17 / 96).repeat_interleave(16, -1)[..., :N] + floor


def random_rings(S, H, P, N, G, L, gen, dev):
    """Finite random ring contents (la <= 0) and random cursors in [0, L-1]."""
    r = lambda *s: torch.randn(*s, generator=gen).to(dev)  # noqa: E731
    x_ring, B_ring = r(S, H, L, P), r(S, G, L, N)
    dt_ring = (0.05 + torch.rand(S, H, L, generator=gen)).to(dev)
    la_ring = torch.log(0.3 + 0.7 * torch.rand(S, H, L, generator=gen)).to(dev)
    cursor = torch.randint(0, L, (S,), generator=gen, dtype=torch.int32).to(dev)
    return [x_ring, dt_ring, la_ring, B_ring, cursor]


def random_token(b, H, P, N, G, Gc, gen, dev):
    r = lambda *s: torch.randn(*s, generator=gen).to(dev)  # noqa: E731
    return dict(x=r(b, H, P), dt=(0.05 + torch.rand(b, H, generator=gen)).to(dev),
                la=torch.log(0.3 + 0.7 * torch.rand(b, H, generator=gen)).to(dev), B=r(b, G, N), C=r(b, Gc, N))


def random_slots(b, S, gen, pad=0.25):
    """``b`` distinct slots of ``S`` in random order, each row padded (-1) with probability ``pad``."""
    slots = torch.randperm(S, generator=gen)[:b]
    keep = torch.rand(b, generator=gen) >= pad
    return torch.where(keep, slots, torch.full_like(slots, -1)).to(torch.int32)


def random_state(S, H, P, N, gen, dev):
    """Rows whose magnitudes span several decades (exercises per-row and per-block scales)."""
    return (torch.randn(S, H, P, N, generator=gen) * torch.exp(2 * torch.randn(S, H, P, 1, generator=gen))).to(dev)


# ----------------------------------------------------------------------------------------------------------------
# decode / encode exactness
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(3, 2, 19, 37), (2, 1, 3, 5)])
def test_kernel_decode_is_the_format_decode_bit_for_bit(fmt, shape):
    """(3, 2, 19, 37): P over two BLOCK_P tiles, odd N, 3 nvfp4 blocks (the last partial); (2, 1, 3, 5): one
    partial nvfp4 block (NB = 1)."""
    g = torch.Generator().manual_seed(0)
    S, H, P, N = shape
    st = random_state(S, H, P, N, g, "cpu")
    st[0, 0, 0] = 0.0                              # a zero row
    st[1, 0, 1, :3] = -0.0
    st[-1, -1, :, 16:32] *= 1e-7                   # nvfp4 blocks with subnormal / zero e4m3 scales
    copy = init_read_copy(st.to(DEV), fmt)
    ref = FORMATS[fmt].decode(copy)
    assert torch.equal(bits(decode_read_copy_triton(copy, fmt)), bits(ref))
    # a plain dict of the storage tensors works the same
    assert torch.equal(bits(decode_read_copy_triton(dict(copy.tensors), fmt, st.shape)), bits(ref))


def _tie_state(dev):
    """A state [2, 2, 3, 32] full of rounding ties for the three formats (flushed unchanged: see the test)."""
    g = torch.Generator().manual_seed(1)
    st = torch.randn(2, 2, 3, 32, generator=g)
    fp8_row = [448.0, 1.0625, -1.0625, 1.1875, 432.0, -432.0, 2 ** -10, 1.5 * 2 ** -9, -2 ** -10, 2 ** -6 - 2 ** -11,
               3 * 2 ** -10, 0.0, 208.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8)]
    st[0, 0, 0, :16] = torch.tensor(fp8_row)                       # scale 1: the values themselves are the ties
    st[0, 0, 0, 16:] = torch.tensor(fp8_row) * 0.5                 # (bf16 ties too: 1 + 2^-8, 1 + 3 * 2^-8)
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    st[0, 0, 1, :16] = torch.tensor([6.0] + mids + [-m for m in mids] + [0.0])    # s_g = 1, s_b = 1: e2m1 ties
    st[0, 0, 1, 16:] = torch.tensor([3.0] + [m / 2 for m in mids] + [-m / 2 for m in mids] + [0.1])  # s_b = 0.5
    st[0, 0, 2, :16] = 0.0                                         # a zero block
    st[0, 0, 2, 16:] = torch.randn(16, generator=g) * 0.01        # a block with a subnormal e4m3 scale
    st[0, 1, 0, :16] = torch.randn(16, generator=g) * 1e-6        # a block whose e4m3 scale rounds to 0
    st[0, 1, 2, 0] = 2688.0                                        # slot 0's amax: s_g = 2688 / 2688 = 1
    st[1] = 0.0                                                    # slot 1: all zeros (s_g = 1, scale 1)
    return st.to(dev)


@triton.jit
def _e2m1_code_kernel(y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(y_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, kt._e2m1_code(y).to(tl.int32), mask=offs < n)


def test_kernel_e2m1_rounding_is_the_format_rounding():
    """The kernels' e2m1 rounding (one rounding on the grid's spacing) gives ``e2m1_encode``'s code on every
    midpoint, the fp32 neighbours of every midpoint and grid value, both signs, zeros, saturation and a dense
    sweep of [0, 8)."""
    from replay_compile.quant.formats import e2m1_encode
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 6.5, 100.0,
                        3e38])
    near = torch.cat([pts, torch.nextafter(pts, torch.tensor(float("inf"))),
                      torch.nextafter(pts, torch.tensor(0.0))])
    y = torch.cat([near, -near, torch.linspace(0, 8, 4097), -torch.linspace(0, 8, 4097), torch.tensor([-0.0])])
    out = torch.empty(y.shape, dtype=torch.int32, device=DEV)
    _e2m1_code_kernel[(triton.cdiv(y.numel(), 1024),)](y.to(DEV), out, y.numel(), BLOCK=1024)
    want = e2m1_encode(y).to(torch.int32)
    bad = (out.cpu() != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(y[i]), int(out[i]), int(want[i])) for i in bad[:8]]


@pytest.mark.parametrize("fmt", FMTS)
def test_flush_encode_is_exact_on_rounding_ties(fmt):
    """A flush with dt = 0 and la = 0 leaves the checkpoint as it was; its copy must be the format's encoding of it,
    byte for byte, on a state built from rounding ties. fp8 is rounded by the hardware conversion where the kernel is
    compiled for sm_89+ (:func:`hw_fp8_cast`; under the interpreter by the software path)."""
    st = _tie_state(DEV)
    S, H, P, N = st.shape
    L = 3
    rings = [torch.zeros(S, H, L, P, device=DEV), torch.zeros(S, H, L, device=DEV), torch.zeros(S, H, L, device=DEV),
             torch.zeros(S, 1, L, N, device=DEV), torch.full((S,), L - 1, dtype=torch.int32, device=DEV)]
    tok = dict(x=torch.zeros(S, H, P, device=DEV), dt=torch.zeros(S, H, device=DEV), la=torch.zeros(S, H, device=DEV),
               B=torch.zeros(S, 1, N, device=DEV), C=torch.ones(S, 1, N, device=DEV))
    copy = FORMATS[fmt].allocate(st.shape, device=DEV)             # zeros: every byte must be rewritten
    state = st.clone()
    replay_step_readcopy_triton(state, copy, fmt, *rings, **tok)
    assert torch.equal(bits(state), bits(st + 0.0))                # -0 + 0 = +0, nothing else changes
    assert copy_equal(copy, FORMATS[fmt].encode(state.cpu()))
    assert torch.equal(rings[-1].cpu(), torch.zeros(S, dtype=torch.int32))
    # the reference does the same
    copy_r, state_r = FORMATS[fmt].allocate(st.shape), st.cpu().clone()
    rings_r = [r.cpu().clone() for r in rings[:4]] + [torch.full((S,), L - 1, dtype=torch.int32)]
    replay_step_readcopy_reference(state_r, copy_r, fmt, *rings_r, **{k: v.cpu() for k, v in tok.items()})
    assert copy_equal(copy_r, copy)


# ----------------------------------------------------------------------------------------------------------------
# the step: kernel vs reference
# ----------------------------------------------------------------------------------------------------------------
GEOMS = [  # (geometry with batch b, slots S, L, BLOCK_P)
    (Mamba2Geometry(3, 2, 20, 19, 1, 2), 3, 3, 16),       # two P tiles (the nvfp4 slot amax spans programs), odd N
    (Mamba2Geometry(3, 4, 5, 32, 2, 1), 5, 4, 16),        # more slots than rows, two nvfp4 blocks, G = 2
    (Mamba2Geometry(2, 2, 4, 6, 1, 1), 2, 2, 16),         # N < 16: one partial nvfp4 block, L = 2
    (Mamba2Geometry(2, 3, 9, 24, 1, 3), 3, 3, 16),        # N % 16 = 8: nvfp4 words with a half block
]


def _clone_all(state, copy, rings):
    return state.clone(), copy.clone(), [r.clone() for r in rings]


# the defaults (flush rows listed and walked by fixed grids, one tl.dot fold, the copy pass forming the window from
# the window launch's per-record weights, nvfp4 codes read as int32 words and decoded two at a time where N % 8 == 0,
# nvfp4's flush by the fp32 step's fold gathering the slot amax row by row and its encode writing words), the same
# with one program walking them all, the flush launch on other tiles / warps, a 4-warp nvfp4 encode launch with the
# copy pass on 32-row tiles, one encode program per SM and 1-warp folds
STEP_VARIANTS = ["pre", "pre:flush_programs=1,", "pre:FLUSH_P=32,flush_warps=4,", "pre:enc_warps=4,APPLY_P=32,",
                 "pre:enc_per_sm=1,fold_warps=1,"]
# knobs of nvfp4's per-slot flush only (the fold, the encode launch): the other formats would rerun "pre"
NVFP4_FLUSH_ONLY = {"pre:enc_per_sm=1,fold_warps=1,"}


@pytest.mark.parametrize("fmt,variant", [(f, v) for v in STEP_VARIANTS for f in FMTS
                                         if v not in NVFP4_FLUSH_ONLY or f == "nvfp4"])
@pytest.mark.parametrize("gi", range(len(GEOMS)))
def test_kernel_matches_reference_step_by_step(fmt, gi, variant):
    geom, S, L, block_p = GEOMS[gi]
    b, H, P, N, G, Gc = geom.batch, geom.H, geom.P, geom.N, geom.G, geom.Gc
    g = torch.Generator().manual_seed(10 + gi)
    state = random_state(S, H, P, N, g, DEV)
    # the copy encodes another state: flushes must fold the checkpoint, reads must use the copy
    copy = init_read_copy(state * 0.5 + 0.1, fmt)
    rings = random_rings(S, H, P, N, G, L, g, DEV)
    n_flush = n_read = 0
    with kt.tuned(f"{variant}{'' if ':' in variant else ':'}BLOCK_P={block_p},APPLY_P={block_p}"):
        for t in range(2 * L + 2):
            idx = random_slots(b, S, g).to(DEV)
            tok = random_token(b, H, P, N, G, Gc, g, DEV)
            st_r, cp_r, rg_r = _clone_all(state, copy, rings)
            cp_before = copy.clone()
            cur = rings[-1].clone()
            y = replay_step_readcopy_triton(state, copy, fmt, *rings, **tok, slot_idx=idx)
            y_r = replay_step_readcopy_reference(st_r, cp_r, fmt, *rg_r, **tok, slot_idx=idx)

            used = [s for s in idx.tolist() if s >= 0]
            flushed = [s for s in used if int(cur[s]) == L - 1]
            n_flush += len(flushed)
            n_read += len(used) - len(flushed)
            assert rel(y, y_r) < 1e-5, f"step {t}: y"
            assert torch.count_nonzero(y[idx.cpu() < 0]) == 0, f"step {t}: padded rows"
            assert rel(state, st_r) < 1e-5, f"step {t}: checkpoint"
            assert torch.equal(rings[-1], rg_r[-1]), f"step {t}: cursor"
            for k in range(4):
                assert torch.equal(rings[k], rg_r[k]), f"step {t}: ring {k}"
            keep = [s for s in range(S) if s not in flushed]
            if keep:                                                   # slots that did not flush: untouched
                assert copy_equal(copy, cp_before, keep), f"step {t}: copy of a slot that did not flush"
            if flushed:
                fl = torch.tensor(flushed)
                # exact: the kernel's copy is the format's encoding of the kernel's checkpoint
                assert copy_equal(Encoded(fmt, copy.shape, {k: v.cpu()[fl] for k, v in copy.tensors.items()}),
                                  FORMATS[fmt].encode(state.cpu()[fl])), f"step {t}: copy vs encode(checkpoint)"
                # bounded: the reference's copy (of its own, 1e-7-close checkpoint) decodes within the format's bound
                dk = decode_slots(fmt, copy.to("cpu"), fl)
                dr = decode_slots(fmt, cp_r.to("cpu"), fl)
                sk = state.cpu()[fl]
                bound = 2 * quant_bound(fmt, sk) + 1e-5 * sk.abs().max()
                assert bool(((dk - dr).abs() <= bound).all()), f"step {t}: copy vs reference copy"
    assert n_flush >= 2 and n_read >= 4, (n_flush, n_read)


@pytest.mark.parametrize("fmt", FMTS)
def test_non_flush_rows_never_read_the_checkpoint(fmt):
    """A NaN checkpoint: non-flush steps (no flush within the run) give finite outputs, those of
    ``replay_step_reference`` run on the decoded copy, and leave checkpoint and copy alone."""
    g = torch.Generator().manual_seed(7)
    S, H, P, N, L = 3, 2, 5, 19, 8
    good = random_state(S, H, P, N, g, DEV)
    copy = init_read_copy(good, fmt)
    copy0 = copy.clone()
    state = torch.full_like(good, float("nan"))
    rings = random_rings(S, H, P, N, 1, L, g, DEV)
    rings[-1].copy_(torch.tensor([0, 2, 4], dtype=torch.int32))
    proxy = FORMATS[fmt].decode(copy).to(DEV)
    rings_p = [r.clone() for r in rings]
    for t in range(3):
        idx = random_slots(3, S, g, pad=0.0).to(DEV)
        tok = random_token(3, H, P, N, 1, 1, g, DEV)
        y = replay_step_readcopy_triton(state, copy, fmt, *rings, **tok, slot_idx=idx)
        y_p = replay_step_reference(proxy, *rings_p, **tok, slot_idx=idx)
        assert bool(torch.isfinite(y).all()), f"step {t}"
        assert rel(y, y_p) < 1e-5, f"step {t}"
    assert bool(torch.isnan(state).all()) and copy_equal(copy, copy0)


@pytest.mark.parametrize("fmt", FMTS)
def test_reference_reads_the_copy_and_flushes_the_checkpoint(fmt):
    """The reference alone, over flushes, against ``replay_step_reference`` run on the two states it is made of:
    non-flush rows equal a run on the decoded copy, flush rows a run on the checkpoint."""
    g = torch.Generator().manual_seed(3)
    S, H, P, N, L, b = 4, 2, 3, 16, 3, 4
    state = random_state(S, H, P, N, g, "cpu")
    copy = init_read_copy(state + 1.0, fmt)
    rings = random_rings(S, H, P, N, 1, L, g, "cpu")
    for t in range(2 * L):
        idx = random_slots(b, S, g)
        tok = random_token(b, H, P, N, 1, 1, g, "cpu")
        cur = rings[-1].clone()
        proxy = FORMATS[fmt].decode(copy)
        st_f, rg_r, rg_f = state.clone(), [r.clone() for r in rings], [r.clone() for r in rings]
        y = replay_step_readcopy_reference(state, copy, fmt, *rings, **tok, slot_idx=idx)
        y_r = replay_step_reference(proxy, *rg_r, **tok, slot_idx=idx)
        y_f = replay_step_reference(st_f, *rg_f, **tok, slot_idx=idx)
        for row, s in enumerate(idx.tolist()):
            if s < 0:
                assert torch.count_nonzero(y[row]) == 0
            elif int(cur[s]) == L - 1:
                assert torch.equal(y[row], y_f[row]) and torch.equal(state[s], st_f[s])
                assert copy_equal(copy, FORMATS[fmt].encode(state), [s])
            else:
                assert torch.equal(y[row], y_r[row]), f"step {t} row {row}"
        for k in range(5):
            assert torch.equal(rings[k], rg_f[k])


def test_reference_with_an_exact_copy_is_replay_step_reference():
    """bf16 checkpoint + bf16 copy: the copy holds the checkpoint exactly, before and after every flush, so the
    read-copy reference must give exactly what ``replay_step_reference`` gives, over flushes."""
    g = torch.Generator().manual_seed(5)
    S, H, P, N, G, Gc, L, b = 5, 4, 3, 6, 2, 4, 3, 4
    state = random_state(S, H, P, N, g, "cpu").to(torch.bfloat16)
    copy = init_read_copy(state, "bf16")
    rings = random_rings(S, H, P, N, G, L, g, "cpu")
    st2, rg2 = state.clone(), [r.clone() for r in rings]
    flushes = 0
    for t in range(3 * L):
        idx = random_slots(b, S, g)
        tok = random_token(b, H, P, N, G, Gc, g, "cpu")
        flushes += sum(1 for s in idx.tolist() if s >= 0 and int(rings[-1][s]) == L - 1)
        y = replay_step_readcopy_reference(state, copy, "bf16", *rings, **tok, slot_idx=idx)
        y2 = replay_step_reference(st2, *rg2, **tok, slot_idx=idx)
        assert torch.equal(y, y2), f"step {t}: {rel(y, y2)}"
        assert torch.equal(bits(state), bits(st2))
        assert torch.equal(bits(copy["values"]), bits(state))
        assert all(torch.equal(a, c) for a, c in zip(rings, rg2))
    assert flushes >= 3


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_checkpoint_copy_encodes_the_stored_value(state_dtype, fmt):
    """bf16 / fp16 (stochastically rounded) checkpoints: the copy encodes the checkpoint as stored (nvfp4: its slot
    amax gathered by the fp32 step's fold from the stored values, then the word encode)."""
    g = torch.Generator().manual_seed(11)
    S, H, P, N, L = 2, 2, 5, 16, 2
    state = random_state(S, H, P, N, g, DEV).to(state_dtype)
    copy = init_read_copy(state, fmt)
    rings = random_rings(S, H, P, N, 1, L, g, DEV)
    for t in range(3):
        tok = random_token(S, H, P, N, 1, 1, g, DEV)
        st_r, cp_r, rg_r = _clone_all(state, copy, rings)
        y = replay_step_readcopy_triton(state, copy, fmt, *rings, **tok)
        y_r = replay_step_readcopy_reference(st_r, cp_r, fmt, *rg_r, **tok)
        assert rel(y, y_r) < 1e-5
        assert rel(state.float(), st_r.float()) < 1e-2
        assert copy_equal(copy, FORMATS[fmt].encode(state.cpu())), f"step {t}"


@pytest.mark.parametrize("interp", ["1", "true"])
def test_hardware_fp8_rounding_only_where_compiled(interp, monkeypatch):
    """The hardware e4m3 conversion is used only in compiled kernels on sm_89+: never on CPU tensors, never under
    the interpreter (whose cast rounds half-up), whatever non-zero value ``TRITON_INTERPRET`` has."""
    assert not kt.hw_fp8_cast(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    assert not kt.hw_fp8_cast(torch.device("cuda"))          # decided before any device query


def test_argument_checks():
    st = torch.zeros(2, 1, 3, 16, device=DEV)
    rings = random_rings(2, 1, 3, 16, 1, 2, torch.Generator().manual_seed(0), DEV)
    tok = random_token(2, 1, 3, 16, 1, 1, torch.Generator().manual_seed(0), DEV)
    with pytest.raises(ValueError, match="tensor_scale_dims"):
        fmt2 = NVFP4Format(tensor_scale_dims=2)
        replay_step_readcopy_triton(st, fmt2.allocate(st.shape, device=DEV), fmt2, *rings, **tok)
    with pytest.raises(ValueError, match="expected"):
        replay_step_readcopy_triton(st, FORMATS["fp8_e4m3"].allocate((2, 1, 3, 8), device=DEV), "fp8_e4m3",
                                    *rings, **tok)
    with pytest.raises(ValueError, match="format"):
        replay_step_readcopy_reference(st, FORMATS["bf16"].allocate(st.shape, device=DEV), "nvfp4", *rings, **tok)
