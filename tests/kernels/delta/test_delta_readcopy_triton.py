"""Triton kernel of the delta-rule read-copy step against its reference, step by step (Triton interpreter on CPU;
compiled on a GPU): outputs, checkpoint, raw and replay rings, cursor every step; the copy of every flushing slot
equal byte for byte to the format's encoding of the kernel's checkpoint, the copy of every other slot untouched.
GDN and KDA, bf16 / fp8 / NVFP4 copies, padded and permuted rows, K not a power of two."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from replay_compile.kernels.delta_readcopy_reference import delta_replay_step_readcopy_reference  # noqa: E402
from replay_compile.kernels.delta_readcopy_triton import delta_replay_step_readcopy_triton  # noqa: E402
from replay_compile.quant.formats import FORMATS  # noqa: E402
from replay_compile.state import DeltaRingSpec  # noqa: E402
from replay_compile.testing.strategies import DeltaGeometry, delta_problem  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return float((a.double().cpu() - b.double().cpu()).abs().max() / (b.double().abs().max().cpu() + 1e-12))


def _enc(spec, rings):
    names = {"bf16": ("values",), "fp8_e4m3": ("values", "scale"), "nvfp4": ("codes", "block_scale", "tensor_scale"),
             "nvfp4_row": ("codes", "block_scale", "tensor_scale")}[spec.read_copy]
    return dict(zip(names, rings[5:8]))


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.slow
@pytest.mark.parametrize("kda, fmt, listed", [
    (False, "bf16", False), (False, "fp8_e4m3", False), (False, "nvfp4", False), (True, "fp8_e4m3", False),
    (True, "nvfp4", False),                                    # KDA x bf16: the GDN case's decode + KDA gates
    (False, "fp8_e4m3", True), (True, "nvfp4", True),          # one encode program walks the listed rows
    (False, "nvfp4_row", False), (True, "nvfp4_row", True)])   # tensor scale per row, encoded by the rows' launch
@pytest.mark.parametrize("block_v", [32, 16])                   # the default slice (V = 32: one), and two per row
def test_kernel_matches_reference_step_by_step(kda, fmt, listed, block_v, monkeypatch):
    import replay_compile.kernels.delta_readcopy_triton as drt
    monkeypatch.setitem(drt.TUNING, "BLOCK_V", block_v)
    if listed:
        monkeypatch.setitem(drt.TUNING, "flush_programs", 1)
    geom = DeltaGeometry(batch=3, HV=4, Hk=2, K=12, V=32, kda=kda)
    L, S = 4, 4
    steps = 2 * L + 3
    state0, seq = delta_problem(geom, steps, dtype=torch.float32, seed=5 + kda)
    state0 = torch.cat([state0, state0[:1] * 0.5])                       # S = 4 slots for 3 rows
    spec = DeltaRingSpec(geom.HV, geom.Hk, geom.K, geom.V, L, kda=kda, read_copy=fmt)
    st_k, st_r = state0.clone().to(DEV), state0.clone()
    rk, rr = spec.allocate(S, DEV), spec.allocate(S, "cpu")
    spec.sync_copy(st_k, rk)
    spec.sync_copy(st_r, rr)
    slot_sets = [[0, 1, 2], [2, -1, 1], [0, 3, -1]]
    n_flush = 0
    for t, inp in enumerate(seq):
        idx = torch.tensor(slot_sets[t % 3 if t >= 2 * L else 0], dtype=torch.int64)
        args = [inp[k].float() for k in ("q", "k", "v", "g", "beta")]
        before = rk[-1].clone().cpu()
        copy_before = [c.clone() for c in rk[5:8]]
        o_k = delta_replay_step_readcopy_triton(st_k, _enc(spec, rk), fmt, *rk[:5], rk[-1],
                                                *(a.to(DEV) for a in args), idx.to(DEV))
        o_r = delta_replay_step_readcopy_reference(st_r, _enc(spec, rr), fmt, *rr[:5], rr[-1], *args, idx)
        assert rel(o_k, o_r) < 1e-4, f"step {t}: o"
        assert rel(st_k, st_r) < 1e-5, f"step {t}: checkpoint"
        assert torch.equal(rk[-1].cpu(), rr[-1]), f"step {t}: cursor"
        for i in (1, 2, 3, 4):                                          # k, g, v, beta rings: copies of inputs
            assert torch.equal(rk[i].cpu(), rr[i]), f"step {t}: ring {i}"
        assert rel(rk[0], rr[0]) < 1e-4, f"step {t}: d ring"
        used = [s for s in idx.tolist() if s >= 0]
        flushed = [s for s in used if int(before[s]) == L - 1]
        n_flush += len(flushed)
        for s in range(S):
            got = [c[s] if c.dim() and c.shape[0] == S else c for c in rk[5:8]]
            if s in flushed:
                want = FORMATS[fmt].encode(st_k[s:s + 1].cpu())
                for name, c in _enc(spec, rk).items():
                    assert torch.equal(_bytes(c[s:s + 1].cpu()), _bytes(want.tensors[name])), f"step {t}: {name}"
            else:
                for a, b in zip(got, [c[s] if c.dim() and c.shape[0] == S else c for c in copy_before]):
                    assert torch.equal(_bytes(a), _bytes(b)), f"step {t}: copy of slot {s} changed"
    assert n_flush >= 4


@pytest.mark.parametrize("kda", [False, True])
def test_flush_of_a_full_window_matches_reference(kda):
    """L = 16 fills the window axis (BLOCK_L = 16): the exact flush applies the record in its last live slot, 14
    (the record loop runs BLOCK_L - 1 iterations). Outputs and checkpoint against the reference, every step."""
    geom = DeltaGeometry(batch=2, HV=2, Hk=1, K=8, V=16, kda=kda)
    L = 16
    state0, seq = delta_problem(geom, L + 1, dtype=torch.float32, seed=7 + kda)
    spec = DeltaRingSpec(geom.HV, geom.Hk, geom.K, geom.V, L, kda=kda, read_copy="fp8_e4m3")
    st_k, st_r = state0.clone().to(DEV), state0.clone()
    rk, rr = spec.allocate(2, DEV), spec.allocate(2, "cpu")
    spec.sync_copy(st_k, rk)
    spec.sync_copy(st_r, rr)
    for t, inp in enumerate(seq):
        args = [inp[k].float() for k in ("q", "k", "v", "g", "beta")]
        o_k = delta_replay_step_readcopy_triton(st_k, _enc(spec, rk), "fp8_e4m3", *rk[:5], rk[-1],
                                                *(a.to(DEV) for a in args))
        o_r = delta_replay_step_readcopy_reference(st_r, _enc(spec, rr), "fp8_e4m3", *rr[:5], rr[-1], *args)
        assert rel(o_k, o_r) < 1e-4, f"step {t}: o"
        assert rel(st_k, st_r) < 1e-5, f"step {t}: checkpoint"
    assert int(rk[-1][0].cpu()) == 1                 # one flush, then one record


def test_non_flush_rows_never_read_the_checkpoint():
    geom = DeltaGeometry(batch=2, HV=2, Hk=1, K=8, V=16, kda=False)
    L = 8
    state0, seq = delta_problem(geom, 3, dtype=torch.float32, seed=1)
    spec = DeltaRingSpec(geom.HV, geom.Hk, geom.K, geom.V, L, read_copy="fp8_e4m3")
    rk = spec.allocate(2, DEV)
    spec.sync_copy(state0.to(DEV), rk)
    nan = torch.full_like(state0, float("nan")).to(DEV)
    for inp in seq:
        o = delta_replay_step_readcopy_triton(nan, _enc(spec, rk), "fp8_e4m3", *rk[:5], rk[-1],
                                              *(inp[k].float().to(DEV) for k in ("q", "k", "v", "g", "beta")))
        assert bool(torch.isfinite(o).all())
    assert bool(torch.isnan(nan).all())


@pytest.mark.gpu
def test_cuda_op_runs_the_kernel(monkeypatch):
    """``replay_compile::delta_step_rc`` on CUDA tensors dispatches to the Triton kernel (counted), matching the
    reference on CPU over a flush."""
    import replay_compile.kernels.delta_readcopy_triton as kt

    calls = []
    real = kt.delta_replay_step_readcopy_triton
    monkeypatch.setattr(kt, "delta_replay_step_readcopy_triton", lambda *a: calls.append(1) or real(*a))
    geom = DeltaGeometry(batch=2, HV=4, Hk=2, K=16, V=32, kda=False)
    L = 4
    state0, seq = delta_problem(geom, L + 2, dtype=torch.float32, seed=3)
    spec = DeltaRingSpec(geom.HV, geom.Hk, geom.K, geom.V, L, kda=False, read_copy="fp8_e4m3")
    st_k, st_r = state0.clone().cuda(), state0.clone()
    rk, rr = spec.allocate(2, "cuda"), spec.allocate(2, "cpu")
    spec.sync_copy(st_k, rk)
    spec.sync_copy(st_r, rr)
    for t, inp in enumerate(seq):
        args = [inp[k].float() for k in ("q", "k", "v", "g", "beta")]
        o_k = torch.ops.replay_compile.delta_step_rc(st_k, *rk[:9], *(a.cuda() for a in args), None, "fp8_e4m3")
        o_r = delta_replay_step_readcopy_reference(st_r, _enc(spec, rr), "fp8_e4m3", *rr[:5], rr[-1], *args, None)
        assert rel(o_k, o_r) < 1e-4, f"step {t}: o"
        assert rel(st_k, st_r) < 1e-5, f"step {t}: checkpoint"
    assert len(calls) == len(seq)
