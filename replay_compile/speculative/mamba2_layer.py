"""One HF Mamba-2 mixer in speculative mode: a verify forward over ``T`` tokens that never writes the SSM state.

While speculative generation runs, the mixer's ``forward`` is replaced by :meth:`SpecMamba2Layer.forward`, which
computes the same projections, causal conv, gates and norm as the HF decode path, but hands the SSM to
``replay_compile::mamba2_spec_verify``: outputs after each of the ``T`` tokens from the checkpoint (the cache's
recurrent state) plus the ring of committed records; the new records go to the ring after the history. Rollback of
rejected drafts is :meth:`commit` moving cursors; the conv state, a few columns, is advanced by the accepted
inputs only. :meth:`finish` folds the ring into the cache so it holds the true state again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.mamba2_reference import fold_terms, replay_materialize_reference
from ..kernels.mamba2_spec_reference import spec_verify_reference
from .base import SpecLayer, conv_window


class SpecMamba2Layer(SpecLayer):
    """Spec rings, cursors and the pending conv inputs of one mixer.

    Args:
        mixer: an HF Mamba-2 mixer (NemotronH, Mamba2, Bamba, Zamba2, GraniteMoeHybrid layout).
        cache: the HF cache after prefill (holds this layer's recurrent state [S, H, P, N] and conv state
            [S, conv_dim, K]).
        B: history budget (records kept before a verify flushes them into the checkpoint); T: max tokens per verify.
    """

    def __init__(self, name: str, mixer: torch.nn.Module, cache, B: int, T: int, read_format=None):
        super().__init__(name, mixer, cache, B, T, read_format)
        S, H, P, N = self.state.shape
        G, buf = mixer.n_groups, self.buf
        act_dtype = mixer.in_proj.weight.dtype
        dev = self.state.device
        self.x_ring = torch.zeros(S, H, buf, P, dtype=act_dtype, device=dev)
        self.dt_ring = torch.zeros(S, H, buf, dtype=torch.float32, device=dev)
        self.la_ring = torch.zeros(S, H, buf, dtype=torch.float32, device=dev)
        self.B_ring = torch.zeros(S, G, buf, N, dtype=act_dtype, device=dev)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """hidden_states [b, T, hidden] -> [b, T, hidden]; the cache is not written (see the module docstring)."""
        m = self.mixer
        b, T, _ = hidden_states.shape
        self._check_window(T)
        dtype = hidden_states.dtype
        H, P, G, N = m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size
        gate, xBC, dt = m.in_proj(hidden_states).split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        new = xBC.transpose(1, 2)                                               # [b, conv_dim, T]
        self.pending_conv = new
        conv = conv_window(self.conv_state, new, m.conv1d.weight, m.conv1d.bias).to(new.dtype)
        xBC = m.act(conv).transpose(1, 2) if hasattr(m, "act") else F.silu(conv).transpose(1, 2)
        x, Bm, Cm = torch.split(xBC, [m.intermediate_size, G * N, G * N], dim=-1)
        x = x.reshape(b, T, H, P)
        dt = F.softplus(dt + m.dt_bias.to(dt.dtype))                            # [b, T, H], as the decode step
        la = dt.float() * -torch.exp(m.A_log.float())
        y = self._ssm(x, dt.float(), la, Bm.reshape(b, T, G, N), Cm.reshape(b, T, G, N))
        y = (y + x.to(y.dtype) * m.D.to(y.dtype)[:, None]).to(dtype)
        y = m.norm(y.reshape(b, T, -1), gate)
        return m.out_proj(y.to(dtype))

    def _ssm(self, x, dt, la, B, C) -> torch.Tensor:
        """The SSM's outputs [b, T, H, P] fp32 (no skip term) for x [b, T, H, P], dt, la [b, T, H] fp32, B, C
        [b, T, G, N]: the verify op over checkpoint + ring; the cache is not written."""
        args = (self.state, self.x_ring, self.dt_ring, self.la_ring, self.B_ring, self.w, self.origin, self.is_flush,
                x, dt, la, B, C)
        if self.read_state is None:
            return torch.ops.replay_compile.mamba2_spec_verify(*args, self.slot_idx)
        # read-copy experiments run the reference (no kernel reads it yet)
        return spec_verify_reference(*args, slot_idx=self.slot_idx, read_state=self.read_state,
                                     read_format=self.read_format)

    @property
    def rings(self):
        return (self.x_ring, self.dt_ring, self.la_ring, self.B_ring)

    def _fold_terms(self, rings, w):
        """``S = exp(Σ_j la_j) S + Σ_j dt_j exp(Σ_{i>j} la_i) x_j B_jᵀ``: dec [S, H, 1, 1], XC [S, H, L, P], Bh [S, H,
        L, N]."""
        return fold_terms(*(r.float() for r in rings), w.long(), self.state.shape[1])

    def _fold(self, rings, w):
        return replay_materialize_reference(self.state, *rings, w)
