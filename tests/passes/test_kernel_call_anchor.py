"""The second Mamba-2 anchor: a decode step that launches mamba_ssm's state-update Triton kernel.

mamba_ssm is not a test dependency and a Triton kernel cannot be compiled without a GPU, so on CPU a stand-in
kernel with mamba_ssm's kernel name and parameter list (its body is ours: the ``TIE_HDIM`` decode step) is launched
by a wrapper shaped like ``selective_state_update``. Dynamo records user Triton kernels only when it believes
Triton usable, so the tests tell it so; it then records the same ``triton_kernel_wrapper_mutation`` launch it records
on a GPU (checked against the real mamba_ssm source on the H200: ``benchmarks/diag_mamba_ssm_form.py``). The pass's
numerical check runs the launch under Triton's interpreter. The last test runs the real kernel on a GPU when
mamba_ssm (or its source under ``.baselines/``) is importable.
"""

import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

import replay_compile  # noqa: E402
from replay_compile.config import (  # noqa: E402
    SUPPORTED_FAMILIES,  # Mamba-1 is opt-in
    ReplayConfig,
)
from replay_compile.passes.replay_pass import ReplaySSMPass  # noqa: E402

b, H, P, N, G, L = 2, 4, 8, 16, 2, 4


def _selective_scan_update_kernel(
    state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, out_ptr, state_batch_indices_ptr,
    batch, nheads, dim, dstate, nheads_ngroups_ratio,
    stride_state_batch, stride_state_head, stride_state_dim, stride_state_dstate,
    stride_x_batch, stride_x_head, stride_x_dim,
    stride_dt_batch, stride_dt_head, stride_dt_dim,
    stride_dt_bias_head, stride_dt_bias_dim,
    stride_A_head, stride_A_dim, stride_A_dstate,
    stride_B_batch, stride_B_group, stride_B_dstate,
    stride_C_batch, stride_C_group, stride_C_dstate,
    stride_D_head, stride_D_dim,
    stride_z_batch, stride_z_head, stride_z_dim,
    stride_out_batch, stride_out_head, stride_out_dim,
    DT_SOFTPLUS: tl.constexpr, TIE_HDIM: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_STATE_BATCH_INDICES: tl.constexpr,
    BLOCK_SIZE_DSTATE: tl.constexpr,
):
    # stand-in body (one program per row and head, the whole [dim, dstate] tile; dt and A read per element, so the
    # tied form (zero strides along dim / dstate) and the Mamba-1 form (a state of one head) both run)
    row = tl.program_id(1)
    h = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_SIZE_M)
    offs_n = tl.arange(0, BLOCK_SIZE_DSTATE)
    mm = offs_m < dim
    mn = offs_n < dstate
    s_ptrs = (state_ptr + row * stride_state_batch + h * stride_state_head + offs_m[:, None] * stride_state_dim
              + offs_n[None, :] * stride_state_dstate)
    s = tl.load(s_ptrs, mask=mm[:, None] & mn[None, :], other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x_batch + h * stride_x_head + offs_m * stride_x_dim, mask=mm, other=0.0)
    x = x.to(tl.float32)
    dt = tl.load(dt_ptr + row * stride_dt_batch + h * stride_dt_head + offs_m * stride_dt_dim, mask=mm,
                 other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h * stride_dt_bias_head + offs_m * stride_dt_bias_dim, mask=mm,
                      other=0.0).to(tl.float32)
    if DT_SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    a = tl.load(A_ptr + h * stride_A_head + offs_m[:, None] * stride_A_dim + offs_n[None, :] * stride_A_dstate,
                mask=mm[:, None] & mn[None, :], other=0.0).to(tl.float32)
    g = h // nheads_ngroups_ratio
    bv = tl.load(B_ptr + row * stride_B_batch + g * stride_B_group + offs_n * stride_B_dstate, mask=mn, other=0.0)
    cv = tl.load(C_ptr + row * stride_C_batch + g * stride_C_group + offs_n * stride_C_dstate, mask=mn, other=0.0)
    s = s * tl.exp(a * dt[:, None]) + (dt * x)[:, None] * bv.to(tl.float32)[None, :]
    tl.store(s_ptrs, s, mask=mm[:, None] & mn[None, :])
    out = tl.sum(s * cv.to(tl.float32)[None, :], axis=1)
    if HAS_D:
        out += x * tl.load(D_ptr + h * stride_D_head + offs_m * stride_D_dim, mask=mm, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + row * stride_z_batch + h * stride_z_head + offs_m * stride_z_dim, mask=mm, other=0.0)
        z = z.to(tl.float32)
        out = out * z * tl.sigmoid(z)
    tl.store(out_ptr + row * stride_out_batch + h * stride_out_head + offs_m * stride_out_dim, out, mask=mm)


# a real JITFunction even under TRITON_INTERPRET=1 (conftest): Dynamo records only those as kernel launches
KERNEL = triton.runtime.jit.JITFunction(_selective_scan_update_kernel)


def ssu(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, tie_hdim=True):
    """Shaped like mamba_ssm's ``selective_state_update`` (4-D state, 3-D x / dt): one launch, ``out`` returned."""
    out = torch.empty_like(x)
    zs = z.stride() if z is not None else (0, 0, 0)
    KERNEL[(1, state.shape[0], state.shape[1])](
        state, x, dt, dt_bias, A, B, C, D, z, out, None,
        state.shape[0], state.shape[1], state.shape[2], state.shape[3], state.shape[1] // B.shape[1],
        *state.stride(), *x.stride(), *dt.stride(), *(dt_bias.stride() if dt_bias is not None else (0, 0)),
        *A.stride(), *B.stride(), *C.stride(), *(D.stride() if D is not None else (0, 0)), *zs, *out.stride(),
        DT_SOFTPLUS=dt_softplus, TIE_HDIM=tie_hdim, BLOCK_SIZE_M=triton.next_power_of_2(state.shape[2]),
        HAS_DT_BIAS=dt_bias is not None, HAS_D=D is not None, HAS_Z=z is not None, HAS_STATE_BATCH_INDICES=False,
        BLOCK_SIZE_DSTATE=triton.next_power_of_2(state.shape[3]))
    return out


class KernelStep(torch.nn.Module):
    """A Mamba-2 decode step as transformers writes it when mamba_ssm is installed (per-head parameters expanded)."""

    def __init__(self, gate: bool, tie_hdim: bool = True, cloned: bool = False):
        super().__init__()
        self.cloned = cloned        # launched on a copy of the cache that is copied back (transformers >= 5.25)
        g = torch.Generator().manual_seed(1)
        self.A_log = torch.nn.Parameter(torch.rand(H, generator=g))
        self.D = torch.nn.Parameter(torch.randn(H, generator=g))
        self.dt_bias = torch.nn.Parameter(torch.randn(H, generator=g) * 0.5)
        self.gate, self.tie_hdim = gate, tie_hdim

    def forward(self, state, x, dt, B, C, z):
        A = -torch.exp(self.A_log.float())
        cache, state = state, (state.clone() if self.cloned else state)
        y = ssu(state, x, dt[:, :, None].expand(b, H, P), A[:, None, None].expand(H, P, N), B, C,
                D=self.D[:, None].expand(H, P), z=z if self.gate else None,
                dt_bias=self.dt_bias[:, None].expand(H, P), dt_softplus=True, tie_hdim=self.tie_hdim)
        if self.cloned:
            cache.copy_(state)
        return y * 1.5


def exact_step(mod, S, x, dt, B, C, z):
    """fp64 oracle of one step (in place on ``S``), from the module's parameters."""
    d = torch.nn.functional.softplus(dt.double() + mod.dt_bias.double())
    A = -torch.exp(mod.A_log.double())
    Bh = B.double().repeat_interleave(H // G, 1)
    Ch = C.double().repeat_interleave(H // G, 1)
    S.mul_(torch.exp(A * d)[..., None, None]).add_((d[..., None] * x.double())[..., None] * Bh[:, :, None, :])
    y = torch.einsum("bhpn,bhn->bhp", S, Ch) + mod.D.double()[:, None] * x.double()
    if mod.gate:
        y = y * z.double() * torch.sigmoid(z.double())
    return y * 1.5


def inputs(t):
    g = torch.Generator().manual_seed(100 + t)
    return (torch.randn(b, H, P, generator=g), torch.randn(b, H, generator=g), torch.randn(b, G, N, generator=g),
            torch.randn(b, G, N, generator=g), torch.randn(b, H, P, generator=g))


@pytest.fixture
def triton_visible_to_dynamo(monkeypatch):
    """Dynamo records user Triton launches only when ``has_triton()``; on a CPU-only machine it says no.

    These stand-in tests launch the kernel on CPU tensors, which needs Triton's interpreter from import time
    (conftest sets ``TRITON_INTERPRET=1`` only where there is no GPU); on a GPU machine the real-kernel test below
    covers the anchor instead (all three fail there on CPU tensors)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU stand-in of the kernel; on a GPU test_real_mamba_ssm_kernel_on_gpu runs the real kernel")
    import torch.utils._triton as ut

    monkeypatch.setattr(ut, "has_triton", lambda *a, **k: True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("gate, cloned", [(False, False), (True, False), (True, True)])
def test_kernel_launch_is_rewritten_and_tracks_the_exact_recurrence(triton_visible_to_dynamo, gate, cloned):
    mod = KernelStep(gate, cloned=cloned)
    cmod = torch.compile(mod, backend="replayssm", options={"buffer_len": L, "lower": "eager"})
    state = torch.randn(b, H, P, N)
    oracle = state.double().clone()
    replay_compile.clear_reports()
    with torch.no_grad():
        for t in range(2 * L + 2):
            y = cmod(state, *inputs(t))
            want = exact_step(mod, oracle, *inputs(t))
            torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5, msg=f"step {t}")
            if t % L == L - 1:                               # just flushed: the cache holds the true state
                torch.testing.assert_close(state.double(), oracle, rtol=1e-5, atol=1e-5, msg=f"step {t} state")
    rewrites = [w for r in replay_compile.reports() for w in r.rewrites]
    assert [w.form for w in rewrites] == ["mamba_ssm kernel"], [str(w) for w in rewrites]
    torch.testing.assert_close(replay_compile.materialize(state).double(), oracle, rtol=1e-5, atol=1e-5)


def _pass_on_captured_graph(mod):
    """Capture the step's FX graph with Dynamo and run the pass on it (without running the graph)."""
    captured = []

    def capture(gm, example_inputs):
        captured.append(ReplaySSMPass(ReplayConfig(buffer_len=L, lower="eager"))(gm, example_inputs))
        raise _Captured

    with pytest.raises(Exception) as info:
        torch.compile(mod, backend=capture, fullgraph=True)(torch.randn(b, H, P, N), *inputs(0))
    assert captured, info.value
    return captured[0]


class _Captured(Exception):
    pass


def test_an_untied_launch_is_left_unchanged_with_the_reason(triton_visible_to_dynamo):
    res = _pass_on_captured_graph(KernelStep(gate=False, tie_hdim=False))
    assert not res.rewrites
    assert any("TIE_HDIM=False" in s.reason for s in res.skipped), [str(s) for s in res.skipped]


def test_a_wrong_reading_of_the_launch_fails_the_numerical_check(triton_visible_to_dynamo, monkeypatch):
    """The check compares the launch itself (run under the interpreter) with the exact step the match describes:
    a match that drops dt's bias is caught and the layer left unchanged."""
    from replay_compile.passes import mamba2_kernel_call as kc

    real = kc.match

    def no_bias(node):
        m = real(node)
        m.dt = kc.Recipe(m.dt.sources[:1], lambda v: torch.nn.functional.softplus(v[:, :, 0].float()))
        m.la = kc.Recipe([m.la.sources[0], m.la.sources[1]],
                         lambda a, v: a[:, 0, 0].float() * torch.nn.functional.softplus(v[:, :, 0].float()))
        return m
    monkeypatch.setattr(kc, "match", no_bias)
    res = _pass_on_captured_graph(KernelStep(gate=True))
    assert not res.rewrites
    assert any("numerical check failed" in s.reason for s in res.skipped), [str(s) for s in res.skipped]


def _real_ssu():
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        return selective_state_update
    except Exception:  # noqa: BLE001 - not installed: its source under .baselines/ (carried to the GPU machine)
        import types
        root = os.path.join(os.path.dirname(__file__), "..", "..", ".baselines", "mamba_ssm")
        if not os.path.isdir(root):
            return None
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = [os.path.abspath(root)]
        sys.modules["mamba_ssm"] = pkg
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        return selective_state_update


@pytest.mark.gpu
def test_real_mamba_ssm_kernel_on_gpu():
    real = _real_ssu()
    if real is None:
        pytest.skip("mamba_ssm not importable (install it or carry its source in .baselines/)")
    mod = KernelStep(gate=True).cuda()

    def forward(state, x, dt, B, C, z):
        A = -torch.exp(mod.A_log.float())
        return real(state, x, dt[:, :, None].expand(b, H, P), A[:, None, None].expand(H, P, N), B, C,
                    D=mod.D[:, None].expand(H, P), z=z, dt_bias=mod.dt_bias[:, None].expand(H, P),
                    dt_softplus=True) * 1.5
    rewrites, _ = _decode_on_gpu(forward, {}, torch.randn(b, H, P, N), inputs,
                                 lambda S, *inp: exact_step(mod, S, *inp))
    assert [w.form for w in rewrites] == ["mamba_ssm kernel"], [str(w) for w in rewrites]


def _decode_on_gpu(forward, options, state, inputs_of, exact):
    """2L + 2 compiled steps of ``forward`` on a CUDA copy of ``state`` against ``exact`` on an fp64 oracle; returns
    the rewrites and the true state's error (``materialize``) at the end."""
    torch._dynamo.reset()
    cf = torch.compile(forward, backend="replayssm", options={"buffer_len": L, **options})
    state = state.cuda()
    oracle = state.double().clone()
    replay_compile.clear_reports()
    with torch.no_grad():
        for t in range(2 * L + 2):
            inp = [v.cuda() for v in inputs_of(t)]
            y = cf(state, *inp)
            want = exact(oracle, *inp)
            torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4, msg=f"step {t}")
    err = (replay_compile.materialize(state).double() - oracle).abs().max().item()
    return [w for r in replay_compile.reports() for w in r.rewrites], err


# -- Mamba-1: mamba_ssm's selective_state_update on a 3-D state (transformers' Mamba, Falcon-Mamba, Jamba) ----------

D1, N1 = 12, 6


def ssu_mamba1(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """Shaped like ``selective_state_update`` with 3-D inputs: one head, everything unsqueezed, dt untied."""
    out = ssu(state.unsqueeze(1), x.unsqueeze(1), dt.unsqueeze(1), A.unsqueeze(0), B.unsqueeze(1), C.unsqueeze(1),
              D=D.unsqueeze(0) if D is not None else None, z=z.unsqueeze(1) if z is not None else None,
              dt_bias=dt_bias.unsqueeze(0) if dt_bias is not None else None, dt_softplus=dt_softplus,
              tie_hdim=False)
    return out.squeeze(1)


class Mamba1KernelStep(torch.nn.Module):
    """A Mamba-1 decode step as transformers writes it when mamba_ssm is installed (5.25: on a clone copied back)."""

    def __init__(self, cloned: bool):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.A_log = torch.nn.Parameter(torch.rand(D1, N1, generator=g).log1p())
        self.D = torch.nn.Parameter(torch.randn(D1, generator=g))
        self.dt_bias = torch.nn.Parameter(torch.randn(D1, generator=g) * 0.5)
        self.cloned = cloned

    def forward(self, state, x, dt, B, C, z):
        cache, state = state, (state.clone() if self.cloned else state)
        y = ssu_mamba1(state, x, dt, -torch.exp(self.A_log.float()), B, C, D=self.D, z=z, dt_bias=self.dt_bias,
                       dt_softplus=True)
        if self.cloned:
            cache.copy_(state)
        return y * 1.5


def exact_mamba1(mod, S, x, dt, B, C, z):
    d = torch.nn.functional.softplus(dt.double() + mod.dt_bias.double())
    A = -torch.exp(mod.A_log.double())
    S.mul_(torch.exp(d[..., None] * A)).add_((d * x.double())[..., None] * B.double()[:, None, :])
    y = (S * C.double()[:, None, :]).sum(-1) + mod.D.double() * x.double()
    return y * z.double() * torch.sigmoid(z.double()) * 1.5


def inputs_mamba1(t):
    g = torch.Generator().manual_seed(300 + t)
    return (torch.randn(b, D1, generator=g), torch.randn(b, D1, generator=g), torch.randn(b, N1, generator=g),
            torch.randn(b, N1, generator=g), torch.randn(b, D1, generator=g))


@pytest.mark.parametrize("cloned", [False, True])
def test_mamba1_kernel_launch_is_rewritten_and_tracks_the_exact_recurrence(triton_visible_to_dynamo, cloned):
    mod = Mamba1KernelStep(cloned)
    cmod = torch.compile(mod, backend="replayssm", options={"buffer_len": L, "lower": "eager",
                                                            "families": SUPPORTED_FAMILIES})
    state = torch.randn(b, D1, N1)
    oracle = state.double().clone()
    replay_compile.clear_reports()
    with torch.no_grad():
        for t in range(2 * L + 2):
            y = cmod(state, *inputs_mamba1(t))
            want = exact_mamba1(mod, oracle, *inputs_mamba1(t))
            torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5, msg=f"step {t}")
            if t % L == L - 1:
                torch.testing.assert_close(state.double(), oracle, rtol=1e-5, atol=1e-5, msg=f"step {t} state")
    rewrites = [w for r in replay_compile.reports() for w in r.rewrites]
    assert [(w.form, w.family) for w in rewrites] == [("mamba_ssm kernel", "mamba1")], [str(w) for w in rewrites]
    torch.testing.assert_close(replay_compile.materialize(state).double(), oracle, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_real_mamba_ssm_mamba1_kernel_on_gpu():
    """mamba_ssm's own kernel called with 3-D Mamba-1 arguments (it unsqueezes the head dim itself), as transformers'
    Mamba / Falcon-Mamba / Jamba call it: rewritten, and the replay step tracks the exact recurrence through flushes."""
    real = _real_ssu()
    if real is None:
        pytest.skip("mamba_ssm not importable (install it or carry its source in .baselines/)")
    mod = Mamba1KernelStep(cloned=False).cuda()

    def forward(state, x, dt, B, C, z):
        return real(state, x, dt, -torch.exp(mod.A_log.float()), B, C, D=mod.D, z=z, dt_bias=mod.dt_bias,
                    dt_softplus=True) * 1.5
    rewrites, err = _decode_on_gpu(forward, {"families": SUPPORTED_FAMILIES}, torch.randn(b, D1, N1), inputs_mamba1,
                                   lambda S, *inp: exact_mamba1(mod, S, *inp))
    assert [(w.form, w.family) for w in rewrites] == [("mamba_ssm kernel", "mamba1")], [str(w) for w in rewrites]
    assert err < 1e-4, err
