"""What every SSM layer in speculative mode shares, whatever its family: the cache tensors it works on, the cursors
of its replay rings, the pending conv inputs of the last verify, and the commit / finish skeleton.

A family subclass (:mod:`.mamba2_layer`, :mod:`.delta_layer`) allocates its rings and provides ``forward`` (the
verify forward over ``T`` tokens; it leaves the window's conv inputs in ``pending_conv``), ``rings`` (its record
rings, ring axis 2) and ``_fold(rings, w)`` (the committed state of every slot from rings in logical order, for
:meth:`SpecLayer.finish`), and where it can ``_fold_terms(rings, w)``, which lets the finish fold in place.
"""

from __future__ import annotations

import torch

from ..errors import ReplayCompileError
from ..integrations.hf_modules import ssm_layer_states
from ..kernels import mamba2_spec_reference as ref
from ..passes.shifted_conv import shifted_conv1d


def fold_into(state: torch.Tensor, dec: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``state = dec ⊙ state + leftᵀ right`` per (slot, head), in place on a contiguous fp32 state [S, H, R, C]:
    ``dec`` [S, H, 1 or R, 1], ``left`` [S, H, L, R], ``right`` [S, H, L, C]. One scaling and one fp32 batched
    GEMM, with the matmul precision forced to "highest" for the call (TF32 would round the records to 10-bit
    mantissas) and restored after. ``dec = 1`` with zero terms leaves a slot bit-unchanged."""
    S, H, R, C = state.shape
    L = left.shape[2]
    st = state.view(S * H, R, C)
    st.mul_(dec.reshape(S * H, -1, 1))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        st.baddbmm_(left.reshape(S * H, L, R).transpose(1, 2), right.reshape(S * H, L, C))
    finally:
        torch.set_float32_matmul_precision(precision)


def conv_window(conv_state: torch.Tensor, new: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """The decode path's depthwise causal conv for ``T`` inputs at once, before the activation: conv state [b, C, K],
    new inputs [b, C, T], weight [C, 1, K], bias [C] or None -> [b, C, T] in ``weight``'s dtype, accumulated in fp32
    (fp64 for fp64) as ``F.conv1d`` does. Output ``t`` reads positions ``t + 1 .. t + K`` of ``[conv state | new]``.

    ``K`` shifted multiply-adds (:func:`~replay_compile.passes.shifted_conv.shifted_conv1d`) instead of
    ``F.conv1d``: Inductor fuses them with the concatenation into one elementwise kernel, where the depthwise
    convolution (``conv_depthwise2d_forward_kernel``) took 125 µs per layer for 29 MB at batch 256 (Qwen3.5-4B dims,
    ``T = 4``, H100): 3.0 ms of a round's 45."""
    seq = torch.cat([conv_state.to(new.dtype), new], dim=-1)                               # [b, C, K + T]
    return shifted_conv1d(seq[..., 1:], weight, bias)


class SpecLayer:
    """Cursors and pending conv inputs of one SSM layer; the cache's recurrent state is the checkpoint.

    Args:
        name: the module's qualified name (for messages); mixer: the HF module (has ``layer_idx``).
        cache: the HF cache after prefill (holds this layer's recurrent state [S, ...] and conv state
            [S, conv_dim, K]).
        B: history budget (records kept before a verify flushes them into the checkpoint); T: max tokens per verify.
        read_format: optional quantize-dequantize function of a read copy (read-copy experiments; reference path).
    """

    def __init__(self, name: str, mixer: torch.nn.Module, cache, B: int, T: int, read_format=None):
        self.name, self.mixer, self.B, self.T = name, mixer, B, T
        idx = mixer.layer_idx
        self.state, self.conv_state = ssm_layer_states(cache, idx)
        if self.state is None or self.conv_state is None:
            raise ReplayCompileError(f"replay_compile.speculative: {name}: the cache holds no state for layer {idx}; "
                                     f"prefill the prompt with this cache first.")
        self.buf = ref.spec_buf_len(B, T)
        dev = self.state.device
        S = self.state.shape[0]
        self.w = torch.zeros(S, dtype=torch.int32, device=dev)
        self.origin = torch.zeros(S, dtype=torch.int32, device=dev)
        self.is_flush = torch.zeros(S, dtype=torch.bool, device=dev)
        ref.spec_reset_reference(self.w, self.origin, self.is_flush, B, T)
        self.pending_conv: torch.Tensor | None = None          # [S, conv_dim, T] inputs of the last verify
        # [b] slot per row for the verify forward and commit (negative: the row sits this round out: its state,
        # rings and cursor are not touched); None: row i is slot i
        self.slot_idx: torch.Tensor | None = None
        # read-copy experiments: a low-precision read copy of the checkpoint (held decoded), written at each flush by
        # ``read_format`` (quantize-dequantize); the references then serve ordinary rows' outputs from it
        self.read_format = read_format
        self.read_state = None if read_format is None else read_format(self.state.float())

    def _check_window(self, T: int) -> None:
        if T > self.T:
            raise ReplayCompileError(f"replay_compile.speculative: {self.name}: {T} tokens in one verify, the rings "
                                     f"were sized for at most {self.T}")

    def commit(self, n) -> None:
        """Keep the first ``n`` tokens of the last verify: an int for every row, or [b] counts in 0..T per row (0: a
        row that sat the round out, its slot negative in :attr:`slot_idx`). Cursors move, the conv state advances by
        the accepted inputs only."""
        b = self.pending_conv.shape[0]
        dev = self.w.device
        n_acc = (n.to(device=dev, dtype=torch.int32) if isinstance(n, torch.Tensor)
                 else torch.full((b,), n, dtype=torch.int32, device=dev))
        # rows with nothing accepted stay put (slot -1); a where, not a branch: no host synchronisation
        base = self.slot_idx if self.slot_idx is not None else torch.arange(b, dtype=torch.int32, device=dev)
        slots = torch.where(n_acc == 0, -1, base.to(torch.int32))
        torch.ops.replay_compile.spec_commit(self.w, self.origin, self.is_flush, n_acc.clamp(min=1), self.B, self.T,
                                             slots)
        self._advance_conv(n_acc)

    def _advance_conv(self, n_acc: torch.Tensor) -> None:
        """The conv state after the first ``n_acc`` [b] inputs of the last verify (0: unchanged)."""
        b, C, _ = self.pending_conv.shape
        dev = self.w.device
        K = self.conv_state.shape[-1]
        seq = torch.cat([self.conv_state, self.pending_conv.to(self.conv_state.dtype)], dim=-1)     # [b, C, K + T]
        cols = n_acc.long()[:, None, None] + torch.arange(K, device=dev)                          # last K of K + n
        self.conv_state.copy_(torch.gather(seq, -1, cols.expand(b, C, K)))
        self.pending_conv = None

    rings: tuple = ()

    def _fold(self, rings, w: torch.Tensor) -> torch.Tensor:
        """[S, ...] committed states from ``rings`` whose first ``w`` records per slot are in logical order."""
        raise NotImplementedError

    def _fold_terms(self, rings, w: torch.Tensor):
        """``(dec, left, right)`` in fp32 with the folded state ``dec ⊙ S + leftᵀ right`` (:func:`fold_into`), from
        ``rings`` in logical order; ``None`` where the family has no such form."""
        return None

    @property
    def folds_in_place(self) -> bool:
        """Whether :meth:`finish` folds in place (:meth:`_fold_in_place`): device work only, no host read, so it can
        be captured in a CUDA graph."""
        return (self.read_state is None and self.state.dtype == torch.float32 and self.state.is_contiguous()
                and type(self)._fold_terms is not SpecLayer._fold_terms)

    def _fold_in_place(self, rings, w: torch.Tensor) -> bool:
        """Fold ``rings`` (logical order) into the cache's state in place (True): the family's
        :meth:`_fold_terms`, one scaling and one fp32 batched GEMM on the state itself, without the reference
        fold's state-sized temporaries. Declined (False, left to :meth:`_fold`) for a state that is not a contiguous
        fp32 tensor, a layer with a read copy, or a family without fold terms."""
        if not self.folds_in_place:
            return False
        terms = self._fold_terms(rings, w)
        if terms is None:
            return False
        fold_into(self.state, *terms)
        return True

    def finish(self) -> None:
        """Fold the committed history into the cache's state (it then holds the true state) and empty the ring.
        All slots at once: the rings are read in logical order (from each slot's origin) and folded by the
        vectorised replay materialisation."""
        order = (self.origin.long()[:, None] + torch.arange(self.buf, device=self.w.device)) & (self.buf - 1)
        logical = [torch.take_along_dim(r, order.view(order.shape[0], 1, self.buf, *([1] * (r.dim() - 3))), dim=2)
                   for r in self.rings]
        if not self._fold_in_place(logical, self.w):
            self.state.copy_(self._fold(logical, self.w).to(self.state.dtype))
        ref.spec_reset_reference(self.w, self.origin, self.is_flush, self.B, self.T)
