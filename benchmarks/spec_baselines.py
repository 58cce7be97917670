"""The per-draft snapshot baseline of speculative decoding for SSM layers, as engines do it without replay.

For a verify of ``T`` tokens, each sequence owns ``T + 1`` state slots: the committed state sits in slot ``src``;
one kernel reads it once, steps through the ``T`` tokens in registers and writes the state after every token to the
other ``T`` slots (``(src + 1 + t) % (T + 1)``), plus the outputs. Accepting ``n`` tokens is an index move,
``src <- (src + n) % (T + 1)``: no copy. This is the strongest form of the method (vLLM's spec-decode path for GDN,
``ssm_state_indices`` of shape [N, T + 1], works this way): one state read and ``T`` state writes per verify, against
replay's one read and a write every few verifies. State memory: ``T + 1`` states per sequence.

Both kernels are fp32 recurrences written for the benchmark (the libraries' single-token kernels would need a state
copy per draft, which is slower still); their outputs are checked against our verify op at the start of every
benchmark point, and against the exact recurrences in tests/kernels/test_spec_baselines.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mamba2_snapshot_kernel(
    pool_ptr, src_ptr, x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, y_ptr,
    P, N, T, heads_per_g,
    s_pb, s_ps, s_ph, s_pp, s_pn,           # pool [b, T+1, H, P, N]
    s_xb, s_xt, s_xh, s_xp,                 # x [b, T, H, P]
    s_db, s_dt, s_dh,                       # dt, la [b, T, H] (same strides)
    s_bb, s_bt, s_bg, s_bn,                 # B, C [b, T, G, N] (same strides)
    s_yb, s_yt, s_yh, s_yp,                 # y [b, T, H, P]
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_p = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    g = h // heads_per_g
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < P, offs_n < N
    tile = mask_p[:, None] & mask_n[None, :]
    src = tl.load(src_ptr + row).to(tl.int64)
    e = offs_p[:, None] * s_pp + offs_n[None, :] * s_pn
    S = tl.load(pool_ptr + row * s_pb + src * s_ps + h * s_ph + e, mask=tile, other=0.0)
    for t in range(BLOCK_T):
        if t < T:
            x = tl.load(x_ptr + row * s_xb + t * s_xt + h * s_xh + offs_p * s_xp, mask=mask_p, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + row * s_db + t * s_dt + h * s_dh)
            la = tl.load(la_ptr + row * s_db + t * s_dt + h * s_dh)
            Bv = tl.load(B_ptr + row * s_bb + t * s_bt + g * s_bg + offs_n * s_bn, mask=mask_n,
                         other=0.0).to(tl.float32)
            Cv = tl.load(C_ptr + row * s_bb + t * s_bt + g * s_bg + offs_n * s_bn, mask=mask_n,
                         other=0.0).to(tl.float32)
            S = tl.exp(la) * S + (dt * x)[:, None] * Bv[None, :]
            tl.store(y_ptr + row * s_yb + t * s_yt + h * s_yh + offs_p * s_yp, tl.sum(S * Cv[None, :], axis=1),
                     mask=mask_p)
            dst = (src + 1 + t) % (T + 1)
            tl.store(pool_ptr + row * s_pb + dst * s_ps + h * s_ph + e, S, mask=tile)


@triton.jit
def _gdn_snapshot_kernel(
    pool_ptr, src_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    K, V, T, v_per_k,
    s_pb, s_ps, s_ph, s_pk, s_pv,           # pool [b, T+1, HV, K, V]
    s_qb, s_qt, s_qh, s_qk,                 # q, k [b, T, Hk, K] (same strides)
    s_vb, s_vt, s_vh, s_vv,                 # v [b, T, HV, V]
    s_gb, s_gt, s_gh,                       # g, beta [b, T, HV] (same strides)
    s_ob, s_ot, s_oh, s_ov,                 # o [b, T, HV, V]
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    hk = h // v_per_k
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < K, offs_v < V
    tile = mask_k[:, None] & mask_v[None, :]
    src = tl.load(src_ptr + row).to(tl.int64)
    e = offs_k[:, None] * s_pk + offs_v[None, :] * s_pv
    S = tl.load(pool_ptr + row * s_pb + src * s_ps + h * s_ph + e, mask=tile, other=0.0)
    for t in range(BLOCK_T):
        if t < T:
            q = tl.load(q_ptr + row * s_qb + t * s_qt + hk * s_qh + offs_k * s_qk, mask=mask_k,
                        other=0.0).to(tl.float32)
            k = tl.load(k_ptr + row * s_qb + t * s_qt + hk * s_qh + offs_k * s_qk, mask=mask_k,
                        other=0.0).to(tl.float32)
            v = tl.load(v_ptr + row * s_vb + t * s_vt + h * s_vh + offs_v * s_vv, mask=mask_v, other=0.0).to(tl.float32)
            a = tl.exp(tl.load(g_ptr + row * s_gb + t * s_gt + h * s_gh))
            beta = tl.load(beta_ptr + row * s_gb + t * s_gt + h * s_gh)
            S = a * S
            d = beta * (v - tl.sum(S * k[:, None], axis=0))
            S = S + k[:, None] * d[None, :]
            tl.store(o_ptr + row * s_ob + t * s_ot + h * s_oh + offs_v * s_ov, tl.sum(S * q[:, None], axis=0),
                     mask=mask_v)
            dst = (src + 1 + t) % (T + 1)
            tl.store(pool_ptr + row * s_pb + dst * s_ps + h * s_ph + e, S, mask=tile)


def mamba2_snapshot_step(pool, src, x, dt, la, B, C):
    """pool [b, T+1, H, P, N] fp32 (committed state in slot ``src`` [b]); x [b, T, H, P]; dt, la [b, T, H] fp32;
    B, C [b, T, G, N] (same layout). Writes the state after token t to slot (src + 1 + t) % (T + 1); returns
    y [b, T, H, P] fp32 (no D skip term, as our verify op)."""
    b, T, H, P = x.shape
    N, G = pool.shape[-1], B.shape[2]
    assert dt.stride() == la.stride() and B.stride() == C.stride()
    y = torch.empty(b, T, H, P, device=x.device, dtype=torch.float32)
    bp = 16
    _mamba2_snapshot_kernel[(triton.cdiv(P, bp), b, H)](
        pool, src, x, dt, la, B, C, y, P, N, T, H // G, *pool.stride(), *x.stride(), *dt.stride(), *B.stride(),
        *y.stride(), BLOCK_T=triton.next_power_of_2(T), BLOCK_P=bp, BLOCK_N=max(16, triton.next_power_of_2(N)),
        num_warps=4)
    return y


def gdn_snapshot_step(pool, src, q, k, v, g, beta):
    """pool [b, T+1, HV, K, V] fp32 (committed state in slot ``src`` [b]); q, k [b, T, Hk, K] (normalised, q scaled);
    v [b, T, HV, V]; g, beta [b, T, HV] fp32. Writes the state after token t to slot (src + 1 + t) % (T + 1);
    returns o [b, T, HV, V] fp32."""
    b, T, HV, V = v.shape
    K, Hk = q.shape[-1], q.shape[2]
    assert q.stride() == k.stride() and g.stride() == beta.stride()
    o = torch.empty(b, T, HV, V, device=v.device, dtype=torch.float32)
    bv = 32 if V > 16 else 16
    _gdn_snapshot_kernel[(triton.cdiv(V, bv), b, HV)](
        pool, src, q, k, v, g, beta, o, K, V, T, HV // Hk, *pool.stride(), *q.stride(), *v.stride(), *g.stride(),
        *o.stride(), BLOCK_T=triton.next_power_of_2(T), BLOCK_K=max(16, triton.next_power_of_2(K)), BLOCK_V=bv,
        num_warps=4)
    return o


def snapshot_commit(src, n_accepted, T: int):
    """Accept ``n_accepted`` [b] tokens: the committed state is now the snapshot after token n - 1."""
    src.copy_((src + n_accepted) % (T + 1))


# --- the same baseline inside whole-model speculative rounds -------------------------------------------------------
# Custom ops so that a compiled round (torch.compile, CUDA graphs) holds the snapshot kernels as it holds our verify
# ops, and layers that put them where the replay verify sits: the rounds, the conv-state and attention bookkeeping,
# the draft proposal and the compilation are then the same on both sides, and only the SSM state handling differs.

def _alike(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a``, ``b`` with equal strides: each kernel indexes such a pair with one set of strides."""
    return (a, b) if a.stride() == b.stride() else (a.contiguous(), b.contiguous())


@torch.library.custom_op("replay_bench::mamba2_snapshot_step", mutates_args=("pool",))
def _mamba2_snapshot_op(pool: torch.Tensor, src: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, la: torch.Tensor,
                        B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    return mamba2_snapshot_step(pool, src, x, *_alike(dt, la), *_alike(B, C))


@_mamba2_snapshot_op.register_fake
def _(pool, src, x, dt, la, B, C):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("replay_bench::gdn_snapshot_step", mutates_args=("pool",))
def _gdn_snapshot_op(pool: torch.Tensor, src: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    q, k = _alike(q, k)
    return gdn_snapshot_step(pool, src, q, k, v, *_alike(g, beta))


@_gdn_snapshot_op.register_fake
def _(pool, src, q, k, v, g, beta):
    return v.new_empty(v.shape, dtype=torch.float32)


class _Snapshots:
    """Per-draft snapshot state of one SSM layer: a pool [S, T + 1, *state] in the cache state's dtype, the committed
    state in slot ``src`` [S]; commit moves ``src``, finish copies the committed slot back to the cache."""

    def _start_pool(self):
        S = self.state.shape[0]
        self.pool = self.state.new_zeros((S, self.T + 1) + tuple(self.state.shape[1:]))
        self.pool[:, 0] = self.state
        self.src = torch.zeros(S, dtype=torch.int32, device=self.state.device)

    def commit(self, n):
        n_acc = n.to(device=self.src.device, dtype=torch.int32)          # 0 for rows that sat the round out
        self.src.copy_((self.src + n_acc) % (self.T + 1))
        self._advance_conv(n_acc)

    def finish(self):
        rows = torch.arange(self.state.shape[0], device=self.state.device)
        self.state.copy_(self.pool[rows, self.src.long()])


def snapshot_layers(model, cache, B: int, T: int):
    """``generate_rounds``' ``layers_for``: every Mamba-2 mixer / Gated DeltaNet layer of ``model`` verifying through
    the snapshot kernels (no rings; ``B`` unused)."""
    from replay_compile.integrations.hf_modules import is_gated_deltanet, is_mamba2_mixer
    from replay_compile.speculative.base import SpecLayer
    from replay_compile.speculative.delta_layer import SpecDeltaLayer, _act
    from replay_compile.speculative.mamba2_layer import SpecMamba2Layer

    class SnapshotMamba2(_Snapshots, SpecMamba2Layer):
        def __init__(self, name, mixer):
            SpecLayer.__init__(self, name, mixer, cache, B, T)
            self._start_pool()

        def _ssm(self, x, dt, la, Bm, Cm):
            return torch.ops.replay_bench.mamba2_snapshot_step(self.pool, self.src, x, dt, la, Bm, Cm)

    class SnapshotGDN(_Snapshots, SpecDeltaLayer):
        def __init__(self, name, mixer):
            SpecLayer.__init__(self, name, mixer, cache, B, T)
            self.kda, self.read_state = False, None
            self.act = _act(mixer.activation)
            self._start_pool()

        def _verify(self, q, k, v, g, beta):
            return torch.ops.replay_bench.gdn_snapshot_step(self.pool, self.src, q, k, v, g.float(), beta.float())

    layers = []
    for name, m in model.named_modules():
        if is_mamba2_mixer(m):
            layers.append(SnapshotMamba2(name, m))
        elif is_gated_deltanet(m):
            layers.append(SnapshotGDN(name, m))
    return layers
