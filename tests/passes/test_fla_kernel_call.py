"""The delta-rule decode step as a launch of fla's recurrent kernels (what transformers runs when fla is installed).

fla is not a test dependency and its kernels need a GPU, so on CPU stand-in kernels with fla's kernel names,
parameter lists and ``triton.heuristics`` (their bodies are ours: the single-token step) are launched by wrappers
shaped like ``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda``: a fresh fp32 buffer for the final
state, which the caller copies into the cache. Dynamo records the launch it records on a GPU; the pass's numerical
check runs it under Triton's interpreter. The models' own mixers are then pointed at the wrappers, as
transformers' kernel hook points them at fla's functions.
"""

import os

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
tl = triton.language

import replay_compile  # noqa: E402
from replay_compile.config import ReplayConfig  # noqa: E402
from replay_compile.passes.replay_pass import ReplaySSMPass  # noqa: E402

b, H, HV, K, V, L = 2, 2, 4, 8, 6, 4


def fused_recurrent_gated_delta_rule_fwd_kernel(
    q, k, v, g, gk, gv, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
    IS_BETA_HEADWISE: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, USE_GATE_IN_KERNEL: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, APPLY_BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr,
):
    # stand-in body: one program per (sequence, value head), the whole [K, V] tile, [K, V] layout, T tokens
    i_nh = tl.program_id(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = o_k < K, o_v < V
    if STATE_V_FIRST:                               # the state tensors [.., V, K]; h held as [K, V] all the same
        p_h = i_nh * K * V + o_v[None, :] * K + o_k[:, None]
    else:
        p_h = i_nh * K * V + o_k[:, None] * V + o_v[None, :]
    h = tl.load(h0 + p_h, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
    for t in range(0, T):
        tok = i_n * T + t
        bq = tl.load(q + (tok * H + i_h) * K + o_k, mask=mk, other=0.0).to(tl.float32)
        bk = tl.load(k + (tok * H + i_h) * K + o_k, mask=mk, other=0.0).to(tl.float32)
        bv = tl.load(v + (tok * HV + i_hv) * V + o_v, mask=mv, other=0.0).to(tl.float32)
        if USE_QK_L2NORM_IN_KERNEL:
            bq = bq / tl.sqrt(tl.sum(bq * bq) + 1e-6)
            bk = bk / tl.sqrt(tl.sum(bk * bk) + 1e-6)
        bq = bq * scale
        bb = tl.load(beta + tok * HV + i_hv).to(tl.float32)
        if APPLY_BETA_SIGMOID:
            bb = tl.sigmoid(bb)
            if ALLOW_NEG_EIGVAL:
                bb = bb * 2
        if USE_G:
            bg = tl.load(g + tok * HV + i_hv).to(tl.float32)
            if USE_GATE_IN_KERNEL:
                if HAS_DT_BIAS:
                    bg = bg + tl.load(dt_bias + i_hv).to(tl.float32)
                bg = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * tl.where(bg > 20.0, bg, tl.log(1.0 + tl.exp(bg)))
            h = h * tl.exp(bg)
        if USE_GK:
            h = h * tl.exp(tl.load(gk + (tok * HV + i_hv) * K + o_k, mask=mk, other=0.0).to(tl.float32))[:, None]
        bv = bb * (bv - tl.sum(h * bk[:, None], 0))
        h = h + bk[:, None] * bv[None, :]
        tl.store(o + (tok * HV + i_hv) * V + o_v, tl.sum(h * bq[:, None], 0), mask=mv)
    tl.store(ht + p_h, h, mask=mk[:, None] & mv[None, :])


def fused_recurrent_kda_fwd_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, cu_seqlens, ssm_state_indices, num_accepted_tokens, lower_bound,
    scale: tl.constexpr, N, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, stride_init_state_token: tl.constexpr,
    stride_final_state_token: tl.constexpr, stride_indices_seq: tl.constexpr, stride_indices_tok: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, INPLACE_FINAL_STATE: tl.constexpr, IS_BETA_HEADWISE: tl.constexpr,
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr, IS_VARLEN: tl.constexpr, IS_CONTINUOUS_BATCHING: tl.constexpr,
    IS_SPEC_DECODING: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_GATE_IN_KERNEL: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, APPLY_BETA_SIGMOID: tl.constexpr,
    ALLOW_NEG_EIGVAL: tl.constexpr, STATE_V_FIRST: tl.constexpr, num_stages: tl.constexpr,
):
    # stand-in body: as above with a per-key-channel gate (KDA); dt_bias per [HV, K]
    i_nh = tl.program_id(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = o_k < K, o_v < V
    if STATE_V_FIRST:                               # the state tensors [.., V, K]; h held as [K, V] all the same
        p_h = i_nh * K * V + o_v[None, :] * K + o_k[:, None]
    else:
        p_h = i_nh * K * V + o_k[:, None] * V + o_v[None, :]
    h = tl.load(h0 + p_h, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
    for t in range(0, T):
        tok = i_n * T + t
        bq = tl.load(q + (tok * H + i_h) * K + o_k, mask=mk, other=0.0).to(tl.float32)
        bk = tl.load(k + (tok * H + i_h) * K + o_k, mask=mk, other=0.0).to(tl.float32)
        bv = tl.load(v + (tok * HV + i_hv) * V + o_v, mask=mv, other=0.0).to(tl.float32)
        if USE_QK_L2NORM_IN_KERNEL:
            bq = bq / tl.sqrt(tl.sum(bq * bq) + 1e-6)
            bk = bk / tl.sqrt(tl.sum(bk * bk) + 1e-6)
        bq = bq * scale
        bg = tl.load(g + (tok * HV + i_hv) * K + o_k, mask=mk, other=0.0).to(tl.float32)
        if USE_GATE_IN_KERNEL:
            if HAS_BIAS:
                bg = bg + tl.load(dt_bias + i_hv * K + o_k, mask=mk, other=0.0).to(tl.float32)
            a = tl.load(A_log + i_hv).to(tl.float32) if HAS_A else 1.0
            bg = -tl.exp(a) * tl.where(bg > 20.0, bg, tl.log(1.0 + tl.exp(bg)))
        h = h * tl.exp(bg)[:, None]
        bb = tl.load(beta + tok * HV + i_hv).to(tl.float32)
        if APPLY_BETA_SIGMOID:
            bb = tl.sigmoid(bb)
            if ALLOW_NEG_EIGVAL:
                bb = bb * 2
        bv = bb * (bv - tl.sum(h * bk[:, None], 0))
        h = h + bk[:, None] * bv[None, :]
        tl.store(o + (tok * HV + i_hv) * V + o_v, tl.sum(h * bq[:, None], 0), mask=mv)
    tl.store(ht + p_h, h, mask=mk[:, None] & mv[None, :])


# real JITFunctions under heuristics, as fla declares them (Dynamo records only JITFunction launches)
GDN_KERNEL = triton.heuristics({
    "USE_G": lambda a: a["g"] is not None, "USE_GK": lambda a: a["gk"] is not None,
    "USE_GV": lambda a: a["gv"] is not None, "USE_INITIAL_STATE": lambda a: a["h0"] is not None,
    "STORE_FINAL_STATE": lambda a: a["ht"] is not None, "IS_VARLEN": lambda a: a["cu_seqlens"] is not None,
    "USE_GATE_IN_KERNEL": lambda a: a["A_log"] is not None, "HAS_DT_BIAS": lambda a: a["dt_bias"] is not None,
})(triton.runtime.jit.JITFunction(fused_recurrent_gated_delta_rule_fwd_kernel))
KDA_KERNEL = triton.heuristics({
    "USE_INITIAL_STATE": lambda a: a["h0"] is not None, "STORE_FINAL_STATE": lambda a: a["ht"] is not None,
    "IS_VARLEN": lambda a: a["cu_seqlens"] is not None,
    "IS_CONTINUOUS_BATCHING": lambda a: a["ssm_state_indices"] is not None,
    "IS_SPEC_DECODING": lambda a: a["num_accepted_tokens"] is not None, "HAS_A": lambda a: a["A_log"] is not None,
    "HAS_BIAS": lambda a: a["dt_bias"] is not None, "USE_LOWER_BOUND": lambda a: a["lower_bound"] is not None,
})(triton.runtime.jit.JITFunction(fused_recurrent_kda_fwd_kernel))


def fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                     state_v_first=False, gk=None, **kwargs):
    """fla's GDN entry point (its arguments, one launch, a new fp32 final state; every tensor made contiguous, as
    fla's ``input_guard`` does)."""
    q, k, v, g, beta, initial_state = (x.contiguous() for x in (q, k, v, g, beta, initial_state))
    B_, T, H_, K_ = k.shape
    HV_, V_ = v.shape[2], v.shape[3]
    scale = K_ ** -0.5 if scale is None else scale
    o = torch.empty_like(v)
    final = (q.new_empty(B_, HV_, *((V_, K_) if state_v_first else (K_, V_)), dtype=torch.float32)
             if output_final_state else None)
    GDN_KERNEL[(B_ * HV_,)](
        q=q, k=k, v=v, g=g, gk=gk, gv=None, beta=beta, A_log=A_log if use_gate_in_kernel else None,
        dt_bias=dt_bias if use_gate_in_kernel else None, o=o, h0=initial_state, ht=final, cu_seqlens=None,
        scale=scale, T=T, H=H_, HV=HV_, K=K_, V=V_, BK=triton.next_power_of_2(K_), BV=triton.next_power_of_2(V_),
        IS_BETA_HEADWISE=beta.ndim != v.ndim, USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
        APPLY_BETA_SIGMOID=use_beta_sigmoid_in_kernel, ALLOW_NEG_EIGVAL=allow_neg_eigval,
        STATE_V_FIRST=state_v_first)
    return o, final


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, **kwargs):
    """fla's KDA entry point (``inplace_final_state=False``, as its public function launches it)."""
    q, k, v, g, beta, initial_state = (x.contiguous() for x in (q, k, v, g, beta, initial_state))
    B_, T, H_, K_ = k.shape
    HV_, V_ = v.shape[2], v.shape[3]
    scale = K_ ** -0.5 if scale is None else scale
    o = torch.zeros_like(v)
    final = (q.new_empty(B_, HV_, *((V_, K_) if state_v_first else (K_, V_)), dtype=torch.float32)
             if output_final_state else None)
    KDA_KERNEL[(B_ * HV_,)](
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, o=o, h0=initial_state, ht=final,
        cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None, lower_bound=None, scale=scale, N=B_, T=T,
        H=H_, HV=HV_, K=K_, V=V_, BK=triton.next_power_of_2(K_), BV=triton.next_power_of_2(V_),
        stride_init_state_token=initial_state.stride(0), stride_final_state_token=K_ * V_ * HV_,
        stride_indices_seq=1, stride_indices_tok=1, IS_BETA_HEADWISE=beta.ndim == v.ndim,
        USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel, INPLACE_FINAL_STATE=False,
        USE_GATE_IN_KERNEL=use_gate_in_kernel, APPLY_BETA_SIGMOID=use_beta_sigmoid_in_kernel,
        ALLOW_NEG_EIGVAL=allow_neg_eigval, STATE_V_FIRST=state_v_first, num_stages=1)
    return o, final


class FlaStep(torch.nn.Module):
    """A GDN or KDA decode step as transformers writes it with fla installed (the cache copies the final state)."""

    def __init__(self, kda: bool, gate_in_kernel: bool, beta_in_kernel: bool, T: int = 1,
                 state_v_first: bool = False, returns_state: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.A_log = torch.nn.Parameter(torch.rand(HV, generator=gen).log1p())
        self.dt_bias = torch.nn.Parameter(torch.randn(HV * K if kda else HV, generator=gen) * 0.3)
        self.kda, self.gate_in_kernel, self.beta_in_kernel = kda, gate_in_kernel, beta_in_kernel
        self.state_v_first, self.returns_state = state_v_first, returns_state

    def gate(self, a):
        bias = self.dt_bias.view(HV, K) if self.kda else self.dt_bias
        e = torch.exp(self.A_log)
        return -(e[:, None] if self.kda else e) * F.softplus(a.float() + bias)

    def forward(self, state, q, k, v, a, bl):
        g = a if self.gate_in_kernel else self.gate(a)
        beta = bl if self.beta_in_kernel else torch.sigmoid(bl)
        kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=self.gate_in_kernel, A_log=self.A_log, dt_bias=self.dt_bias,
                  use_beta_sigmoid_in_kernel=self.beta_in_kernel, state_v_first=self.state_v_first)
        fn = fused_recurrent_kda if self.kda else fused_recurrent_gated_delta_rule
        o, ht = fn(q, k, v, g=g, beta=beta, **kw)
        state.copy_(ht)
        return (o * 1.5, ht) if self.returns_state else o * 1.5


def exact_step(mod, S, q, k, v, a, bl):
    """fp64 oracle of one step (in place on ``S`` [b, HV, K, V]), fla's semantics."""
    q, k, v = q[:, 0].double(), k[:, 0].double(), v[:, 0].double()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(HV // H, 1), k.repeat_interleave(HV // H, 1)
    g = mod.double().gate(a[:, 0].double())
    mod.float()
    beta = torch.sigmoid(bl[:, 0].double())
    S.mul_(torch.exp(g)[..., None] if mod.kda else torch.exp(g)[..., None, None])
    d = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", S, k))
    S.add_(k[..., :, None] * d[..., None, :])
    return (torch.einsum("bhkv,bhk->bhv", S, q) * 1.5)[:, None]


def inputs(t, kda, T=1):
    gen = torch.Generator().manual_seed(100 + t)
    return (torch.randn(b, T, H, K, generator=gen), torch.randn(b, T, H, K, generator=gen),
            torch.randn(b, T, HV, V, generator=gen), torch.randn((b, T, HV, K) if kda else (b, T, HV), generator=gen),
            torch.randn(b, T, HV, generator=gen))


@pytest.fixture
def triton_visible_to_dynamo(monkeypatch):
    """Dynamo records user Triton launches only when ``has_triton()``, which says no on a CPU-only machine; the
    stand-ins run on CPU tensors through Triton's interpreter (set by conftest where there is no GPU)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU stand-ins of fla's kernels")
    import torch.utils._triton as ut

    monkeypatch.setattr(ut, "has_triton", lambda *a, **k: True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("kda, gate_in_kernel, beta_in_kernel, v_first", [
    (False, False, False, False), (False, True, True, False), (True, False, False, False), (True, True, True, False),
    (False, True, True, True), (True, True, True, True)])
def test_fla_launch_is_rewritten_and_tracks_the_exact_recurrence(triton_visible_to_dynamo, kda, gate_in_kernel,
                                                                 beta_in_kernel, v_first):
    """``v_first``: fla's ``state_v_first``, the cache tensor [b, HV, V, K], stepped through its transposed view; the
    true state in the cache's own layout after each flush and from ``materialize``."""
    mod = FlaStep(kda, gate_in_kernel, beta_in_kernel, state_v_first=v_first)
    cmod = torch.compile(mod, backend="replayssm", options={"buffer_len": L, "lower": "eager"})
    state = torch.randn(b, HV, V, K) if v_first else torch.randn(b, HV, K, V)
    kv = (lambda s: s.mT) if v_first else (lambda s: s)          # the oracle steps [b, HV, K, V]
    oracle = kv(state).double().clone()
    replay_compile.clear_reports()
    with torch.no_grad():
        for t in range(2 * L + 2):
            y = cmod(state, *inputs(t, kda))
            want = exact_step(mod, oracle, *inputs(t, kda))
            torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5, msg=f"step {t}")
            if t % L == L - 1:                               # just flushed: the cache holds the true state
                torch.testing.assert_close(kv(state).double(), oracle, rtol=1e-5, atol=1e-5, msg=f"step {t} state")
    rewrites = [w for r in replay_compile.reports() for w in r.rewrites]
    assert [(w.form, w.family, w.spec.transposed) for w in rewrites] == [("fla kernel", "kda" if kda else "gdn",
                                                                          v_first)], rewrites
    torch.testing.assert_close(kv(replay_compile.materialize(state)).double(), oracle, rtol=1e-5, atol=1e-5)


class _Captured(Exception):
    pass


def _pass_on_captured_graph(mod, kda=False, T=1):
    captured = []

    def capture(gm, example_inputs):
        captured.append(ReplaySSMPass(ReplayConfig(buffer_len=L, lower="eager"))(gm, example_inputs))
        raise _Captured

    with pytest.raises(Exception) as info:
        torch.compile(mod, backend=capture, fullgraph=True)(torch.randn(b, HV, K, V), *inputs(0, kda, T))
    assert captured, info.value
    return captured[0]


@pytest.mark.parametrize("case, reason, quiet", [
    (dict(T=3), "T=3 tokens", True),
    (dict(returns_state=True), "final state is also read", False),
])
def test_fla_launches_outside_the_contract_are_left_unchanged_with_the_reason(triton_visible_to_dynamo, case, reason,
                                                                               quiet):
    T = case.get("T", 1)
    res = _pass_on_captured_graph(FlaStep(False, False, False, **case), T=T)
    assert not res.rewrites
    assert [s.quiet for s in res.skipped if reason in s.reason] == [quiet], [str(s) for s in res.skipped]


def test_a_wrong_reading_of_the_launch_fails_the_numerical_check(triton_visible_to_dynamo, monkeypatch):
    """The check runs the launch itself (under the interpreter) beside the exact step the match describes: a match
    that forgets the kernel's q/k normalisation is caught and the layer left unchanged."""
    from replay_compile.passes import delta_kernel_call as fc

    real = fc.match

    def no_l2norm(node):
        m = real(node)
        m.k = fc.Recipe(m.k.sources, lambda x: x[:, 0].float())
        return m
    monkeypatch.setattr(fc, "match", no_l2norm)
    res = _pass_on_captured_graph(FlaStep(False, False, False))
    assert not res.rewrites
    assert any("numerical check failed" in s.reason for s in res.skipped), [str(s) for s in res.skipped]


# -- the models' own mixers, pointed at the stand-ins as transformers' kernel hook points them at fla --------------

_HOOKED = {"torch_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
           "recurrent_kimi_delta_attention": fused_recurrent_kda}


def _point_at_standins(monkeypatch, family: str) -> bool:
    """Route the family's recurrent step to the stand-in while Dynamo traces (eager runs keep transformers' own
    step: the stand-in kernels cannot run eagerly on CPU). Returns whether the family has such a hook."""
    import importlib

    try:
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return False
    hooked = False
    for name, standin in _HOOKED.items():
        orig = getattr(mod, name, None)
        if orig is None:
            continue

        def routed(*args, _orig=orig, _standin=standin, **kwargs):
            return _standin(*args, **kwargs) if torch.compiler.is_compiling() else _orig(*args, **kwargs)
        monkeypatch.setattr(mod, name, routed)
        hooked = True
    return hooked


# One family per mixer the hooks serve (GDN with grouped value heads, GDN, KDA, OLMo-Hybrid's GDN); the other delta
# families' mixers call the same two hooks with the same arguments.
_FAMILIES = {"qwen3_next": True, "qwen3_5": True, "kimi_linear": True, "olmo_hybrid": False}   # family: in 5.17


def _families():
    return [pytest.param(f, marks=[pytest.mark.hf] if old else []) for f, old in _FAMILIES.items()]


@pytest.mark.slow
@pytest.mark.parametrize("family", _families())
def test_models_decoding_through_fla_launches_match_eager(triton_visible_to_dynamo, monkeypatch, family):
    pytest.importorskip("transformers")
    from replay_compile.testing import check_equivalence
    from replay_compile.testing.hf_models import DELTA_FAMILY, available, make_inputs

    if not available(family):
        pytest.skip(f"{family} is not in this transformers")
    if not _point_at_standins(monkeypatch, family):
        pytest.skip(f"this transformers' {family} has no fla kernel hook")
    model = DELTA_FAMILY[family]()
    rep = check_equivalence(model, make_inputs(model), buffer_len=2)      # 5 steps: two flushes per layer
    assert rep.tokens_match, rep
    assert rep.max_logit_diff <= 1e-3 * rep.logit_scale, rep
    assert rep.states_compared > 0 and rep.max_state_diff < 1e-3, rep
    assert rep.rewrites and all(r.form == "fla kernel" for r in rep.rewrites), rep.rewrites
    assert not rep.skipped, rep.skipped


def _point_at_fla(monkeypatch, family: str) -> bool:
    """Route the family's recurrent step to fla's own function, as transformers' kernel hook does with fla
    installed (explicitly, so that the test does not depend on which transformers release routes how)."""
    import importlib

    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as gdn
    from fla.ops.kda import fused_recurrent_kda as kda

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    hooked = False
    for name, fn in (("torch_recurrent_gated_delta_rule", gdn), ("recurrent_kimi_delta_attention", kda)):
        if getattr(mod, name, None) is not None:
            monkeypatch.setattr(mod, name, lambda *a, _fn=fn, cu_seqlens=None, **kw: _fn(*a, **kw))
            hooked = True
    return hooked


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "kimi_linear", "glm5_next"])
def test_real_fla_kernels_on_gpu(monkeypatch, family):
    """fla's own kernels, eager and compiled: the rewrite must take their launches and decode exactly."""
    pytest.importorskip("fla")
    pytest.importorskip("transformers")
    from replay_compile.testing import check_equivalence
    from replay_compile.testing.hf_models import DELTA_FAMILY, available, make_inputs

    if not available(family):
        pytest.skip(f"{family} is not in this transformers")
    if not _point_at_fla(monkeypatch, family):
        pytest.skip(f"this transformers' {family} has no fla kernel hook")
    model = DELTA_FAMILY[family]().cuda()
    rep = check_equivalence(model, make_inputs(model).cuda(), buffer_len=2 if family == "glm5_next" else 4)
    assert rep.rewrites and all(r.form == "fla kernel" for r in rep.rewrites), (rep.rewrites, rep.skipped)
    assert rep.tokens_match, rep
    # eager runs fla's kernels, whose exp / softplus are approximate (ex2.approx, lg2.approx): 1.1-1.6e-3 of the
    # logit scale apart from the exact replay step on the H200 (Qwen3-Next, Kimi-Linear tiny configs)
    assert rep.max_logit_diff <= 5e-3 * rep.logit_scale, rep
    assert rep.states_compared > 0 and rep.max_state_diff < 5e-3, rep


@pytest.mark.gpu
def test_real_fla_state_v_first_on_gpu(monkeypatch):
    """fla's own GDN kernel with ``state_v_first`` (a [b, HV, V, K] cache): rewritten, exact through flushes."""
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule")
    monkeypatch.setitem(globals(), "fused_recurrent_gated_delta_rule", fla_gdn.fused_recurrent_gated_delta_rule)
    mod = FlaStep(False, True, True, state_v_first=True).cuda()
    torch._dynamo.reset()
    cmod = torch.compile(mod, backend="replayssm", options={"buffer_len": L})
    state = torch.randn(b, HV, V, K, device="cuda")
    oracle = state.mT.double().clone()
    replay_compile.clear_reports()
    with torch.no_grad():
        for t in range(2 * L + 2):
            inp = [x.cuda() for x in inputs(t, False)]
            y = cmod(state, *inp)
            want = exact_step(mod, oracle, *inp)
            torch.testing.assert_close(y.double(), want, rtol=2e-3, atol=2e-3, msg=f"step {t}")
    rewrites = [w for r in replay_compile.reports() for w in r.rewrites]
    assert [(w.form, w.spec.transposed) for w in rewrites] == [("fla kernel", True)], rewrites
    torch.testing.assert_close(replay_compile.materialize(state).mT.double(), oracle, rtol=2e-3, atol=2e-3)
