"""One HF delta-rule layer (Gated DeltaNet, Kimi Delta Attention) in speculative mode: a verify forward over ``T``
tokens that never writes the recurrent state.

While speculative generation runs, the layer's ``forward`` is replaced by :meth:`SpecDeltaLayer.forward`, which
computes what the HF single-token decode path computes, for ``T`` tokens at once: projections, the causal conv over
``[conv state | T new inputs]``, the split into q, k, v, the gates (``beta = sigmoid(b)``; GDN
``g = -exp(A_log) softplus(a + dt_bias)`` per value head, KDA the forget gate's per-key-channel ``g``), the fp32
l2-normalisation and scaling of q and k the recurrent kernel does, and the gated RMSNorm and output projection. The
recurrent rule itself goes to ``replay_compile::delta_spec_verify``: outputs of the ``T`` tokens from the checkpoint
(the cache's recurrent state [S, HV, K, V], fp32) and the ring of committed records ``(d, k, g)``. Rollback of
rejected drafts is :meth:`~.base.SpecLayer.commit` moving cursors; the conv state is advanced by the accepted inputs
only. :meth:`~.base.SpecLayer.finish` folds the ring into the cache.

Layouts, as transformers 5.24 has them: value head ``h`` reads key head ``h // (HV // Hk)`` (the recurrent kernel
``repeat_interleave``-s q and k to ``HV`` heads), which is what the op assumes, so q and k are passed with their
``Hk`` key heads. The kernels l2-normalise q and k in fp32 after the conv, in two spellings: Qwen's
``x * rsqrt(Σx² + 1e-6)`` then ``q / sqrt(K)``, Kimi's ``x / sqrt(Σx² + 1e-6)`` then ``q * K^-0.5``; both are
mirrored. The cache keeps the recurrent state [S, HV, K, V] in fp32 whatever the model dtype (the conv state has the
model dtype); so do the rings here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..integrations.hf_modules import is_kimi_delta_attention
from ..kernels.delta_reference import delta_replay_materialize_reference, fold_terms
from ..kernels.delta_spec_reference import delta_spec_exact_fold, delta_spec_verify_reference
from .base import SpecLayer, conv_window


def _act(name: str):
    from transformers.activations import ACT2FN  # the models' own activation table
    return ACT2FN[name]


class SpecDeltaLayer(SpecLayer):
    """Spec rings, cursors and the pending conv inputs of one delta-rule layer.

    Args:
        mixer: an HF Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid) or Kimi Delta Attention
            (Kimi-Linear, Ling-3.0-Flash) module.
        cache: the HF cache after prefill (this layer's recurrent state [S, HV, K, V] and conv state
            [S, conv_dim, conv_kernel]).
        B: history budget; T: max tokens per verify.
    """

    def __init__(self, name: str, mixer: torch.nn.Module, cache, B: int, T: int, read_format=None):
        super().__init__(name, mixer, cache, B, T, read_format)
        self.kda = is_kimi_delta_attention(mixer)
        S, HV, K, V = self.state.shape
        Hk = HV if self.kda else mixer.num_k_heads
        dev, buf = self.state.device, self.buf
        # records in fp32: the HF recurrent rule runs entirely in fp32, whatever the model dtype
        self.d_ring = torch.zeros(S, HV, buf, V, dtype=torch.float32, device=dev)
        self.k_ring = torch.zeros(S, Hk, buf, K, dtype=torch.float32, device=dev)
        self.g_ring = torch.zeros((S, HV, buf) + ((K,) if self.kda else ()), dtype=torch.float32, device=dev)
        self.act = _act(mixer.activation)
        # with a read copy the raw inputs are kept too, so that flushes fold by the exact recurrence from the fp32
        # checkpoint (see delta_spec_verify_reference)
        if read_format is not None:
            self.v_ring = torch.zeros(S, HV, buf, V, dtype=torch.float32, device=dev)
            self.beta_ring = torch.zeros(S, HV, buf, dtype=torch.float32, device=dev)

    def _conv(self, mixed: torch.Tensor) -> torch.Tensor:
        """``causal_conv1d_update`` for ``T`` inputs at once, the conv state left alone: [b, C, T] -> [b, C, T]."""
        m = self.mixer
        self.pending_conv = mixed
        return self.act(conv_window(self.conv_state, mixed, m.conv1d.weight, m.conv1d.bias)).to(mixed.dtype)

    def forward(self, hidden_states: torch.Tensor, *args, attention_mask=None, **kwargs) -> torch.Tensor:
        """hidden_states [b, T, hidden] -> [b, T, hidden]; the cache is not written (see the module docstring)."""
        self._check_window(hidden_states.shape[1])
        if attention_mask is not None:                      # apply_mask_to_padding_states (None when unpadded)
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        return self._kda(hidden_states) if self.kda else self._gdn(hidden_states)

    def _verify(self, q, k, v, g, beta) -> torch.Tensor:
        args = (self.state, self.d_ring, self.k_ring, self.g_ring, self.w, self.origin, self.is_flush,
                q, k, v, g.float(), beta.float())
        if self.read_state is None:
            return torch.ops.replay_compile.delta_spec_verify(*args, self.slot_idx)
        return delta_spec_verify_reference(*args, slot_idx=self.slot_idx, read_state=self.read_state,
                                           read_format=self.read_format, v_ring=self.v_ring, beta_ring=self.beta_ring)

    def _gdn(self, h: torch.Tensor) -> torch.Tensor:
        m = self.mixer
        b, T, _ = h.shape
        if hasattr(m, "in_proj_qkvz"):                      # Qwen3-Next: q k v z / b a grouped per key head
            q, k, v, z, beta_in, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
            mixed = torch.cat([x.reshape(b, T, -1) for x in (q, k, v)], dim=-1).transpose(1, 2)
        elif hasattr(m, "g_proj"):                          # OLMo-Hybrid: separate projections, output gate g_proj
            mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1).transpose(1, 2)
            z = m.g_proj(h)
            beta_in, a = m.b_proj(h), m.a_proj(h)
        else:                                               # Qwen3.5 (dense and MoE)
            mixed = m.in_proj_qkv(h).transpose(1, 2)
            z = m.in_proj_z(h).reshape(b, T, -1, m.head_v_dim)
            beta_in, a = m.in_proj_b(h), m.in_proj_a(h)
        mixed = self._conv(mixed).transpose(1, 2)
        q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        dtype = q.dtype
        q, k = (x.reshape(b, T, -1, m.head_k_dim).float() for x in (q, k))
        v = v.reshape(b, T, -1, m.head_v_dim).float()
        beta = beta_in.sigmoid()
        if getattr(m, "allow_neg_eigval", False):           # OLMo-Hybrid: beta in (0, 2)
            beta = beta * 2.0
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        # torch_recurrent_gated_delta_rule: l2norm in fp32 (x * rsqrt(Σx² + eps)), then q / sqrt(K)
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        q = q / (q.shape[-1] ** 0.5)
        o = self._verify(q, k, v, g, beta).to(dtype)                               # [b, T, HV, V]
        norm, out = (m.o_norm, m.o_proj) if hasattr(m, "g_proj") else (m.norm, m.out_proj)
        o = norm(o.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
        return out(o.reshape(b, T, -1))

    def _kda(self, h: torch.Tensor) -> torch.Tensor:
        m = self.mixer
        b, T, _ = h.shape
        shape = (b, T, -1, m.head_dim)
        mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1).transpose(1, 2)
        q, k, v = torch.split(self._conv(mixed).transpose(1, 2), [m.qkv_dim] * 3, dim=-1)
        dtype = q.dtype
        q, k, v = (x.reshape(shape).float() for x in (q, k, v))
        g = m.forget_gate(h)                                                       # [b, T, H, K], fp32
        beta = torch.sigmoid(m.b_proj(h))
        # recurrent_kimi_delta_attention: l2norm in fp32 (x / sqrt(Σx² + eps)), then q * K^-0.5
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        q = q * (1 / (q.shape[-1] ** 0.5))
        o = self._verify(q, k, v, g, beta).to(dtype)
        gate = (m.g_proj(h) if hasattr(m, "g_proj") else m.g_b_proj(m.g_a_proj(h))).view(shape)
        return m.o_proj(m.o_norm(o, gate).reshape(b, T, -1))

    @property
    def rings(self):
        if self.read_state is not None:
            return (self.k_ring, self.g_ring, self.v_ring, self.beta_ring)
        return (self.d_ring, self.k_ring, self.g_ring)

    def _fold_terms(self, rings, w):
        """``S = exp(Σ_j g_j) ⊙ S + Σ_j (k_j ⊙ exp(E_j)) d_jᵀ``: dec [S, HV, 1 or K, 1], KE [S, HV, L, K], D [S, HV, L,
        V]."""
        return fold_terms(*rings, w.long(), self.state.shape[1], torch.float32)

    def _fold(self, rings, w):
        if self.read_state is None:
            return delta_replay_materialize_reference(self.state, *rings, w)
        zero = torch.zeros_like(w)                                     # rings are in logical order already
        return torch.stack([delta_spec_exact_fold(self.state, *rings, w, zero, s) for s in range(w.shape[0])])
