"""``ReplayTensor``: a cache state tensor that carries its replay state, so that no path can read or write it wrongly.

Between flushes the checkpoint is not the current state; the current state is the checkpoint folded with the records
held in the rings. A ``ReplayTensor`` wraps the checkpoint (``.checkpoint``, the tensor the cache allocated) together
with its :class:`~replay_compile.state.ReplayState` (rings, cursor), and every operation on it goes through
``__torch_dispatch__``:

* a whole-tensor overwrite (``copy_``, ``zero_``, ``fill_``: a reset, a new prefill) drops the held records and then
  writes the checkpoint: the new contents are the truth;
* any other operation first folds the held records into the checkpoint (cursor to 0) and then runs on it, so a read
  sees the current state and a write (of the whole tensor or of some rows) lands on it;
* slots are independent: selecting or slicing slots along dim 0 (``t[i]``, ``t[a:b]``, as a server does to reuse a
  slot) folds only those slots' records and gives a plain view of them; the other slots keep their records;
* an alias of the whole tensor (``detach``, ``.data``, ``t[:]``, ``view`` of the same shape) is another
  ``ReplayTensor`` over the same replay state; any other partial view is a plain view of the folded checkpoint;
* ``copy.deepcopy``, pickling and ``torch.save`` see the current state, as a plain tensor.

The decode step compiled by this library never sees the wrapper: its runner hands the graph the checkpoint and the
rings (``backend.ReplayRunner``), so the compiled step costs what it cost on a plain tensor. Dynamo traces the
wrapper like a plain tensor (a traceable subclass: no graph break). Another Inductor-based backend is refused when
AOTAutograd traces the wrapper, since its graph would read the checkpoint. An eager fallback (Dynamo's recompile
limit, ``set_stance("force_eager")``) or Dynamo's ``eager`` backend folds on the first read: slower, never wrong.

Limit: a plain view or NumPy array taken from a ``ReplayTensor`` aliases the checkpoint as it was when taken; read
it at once, or take it again after later compiled steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from .errors import ReplayCompileError

_INNER = ["checkpoint"]
_aten = torch.ops.aten
_OVERWRITES = {_aten.copy_.default, _aten.zero_.default, _aten.fill_.Scalar, _aten.fill_.Tensor}
_ALIASES = {_aten.detach.default, _aten.alias.default, _aten.view.default, _aten.slice.Tensor,
            _aten._unsafe_view.default, _aten.expand.default, _aten.reshape.default}


class ReplayTensor(torch.Tensor):
    """A cache state (checkpoint + replay state) that folds itself before any operation but the replay step's.

    Args:
        checkpoint: the cache's state tensor, e.g. [B, H, P, N] (Mamba-2) or [B, HV, K, V] (delta rule).
        replay: its :class:`~replay_compile.state.ReplayState`, or None until a compiled step binds one.
    """

    @staticmethod
    def __new__(cls, checkpoint: torch.Tensor, replay=None):
        if isinstance(checkpoint, ReplayTensor):
            raise TypeError("ReplayTensor: the checkpoint is already a ReplayTensor")
        return torch.Tensor._make_wrapper_subclass(cls, checkpoint.shape, strides=checkpoint.stride(),
                                                   storage_offset=checkpoint.storage_offset(),
                                                   dtype=checkpoint.dtype, device=checkpoint.device,
                                                   requires_grad=False)

    def __init__(self, checkpoint: torch.Tensor, replay=None):
        self.checkpoint = checkpoint
        self._replay = replay

    @property
    def replay(self):
        """The replay state: the one given, or the one a compiled step bound to the checkpoint since (through this
        wrapper or an alias of it)."""
        if self._replay is None:
            from .state import lookup

            self._replay = lookup(self.checkpoint)
        return self._replay

    @replay.setter
    def replay(self, rs) -> None:
        self._replay = rs

    # -- the replay state ------------------------------------------------------------------------------------------

    def fold(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Fold the held records into the checkpoint, which then holds the current state; of the slots ``rows``
        [n] only, if given (the other slots keep their records). Returns the checkpoint."""
        rs = self.replay
        if rs is not None and rs.dirty:
            rs.flush(None if rows is None else rows.to(rs.cursor.device))
        return self.checkpoint

    def holds_records(self) -> bool:
        """Whether records may be held beside the checkpoint (host-side: no device synchronisation)."""
        rs = self.replay
        return rs is not None and rs.dirty

    def drop(self) -> None:
        """Forget the held records: the checkpoint is about to be overwritten and becomes the truth."""
        if self.replay is not None:
            self.replay.reset()

    # -- traceable subclass protocol -------------------------------------------------------------------------------

    def __tensor_flatten__(self):
        # The checkpoint only, with no metadata: Dynamo guards on this on every call, so it must be cheap and must
        # not change when a compiled step binds rings (that would recompile every decode graph once more). The
        # rings never enter a graph through the wrapper: the runner of a graph compiled by this library hands the
        # graph the checkpoint and the rings itself (backend.ReplayRunner); any other backend is refused in
        # __torch_dispatch__ when AOTAutograd traces the wrapper.
        return _INNER, None

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx, outer_size, outer_stride):
        return ReplayTensor(inner["checkpoint"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _functionalizing():
            raise ReplayCompileError(
                f"replay_compile: a cache state that carries replay records (a ReplayTensor) reached a graph being "
                f"compiled by a backend other than 'replayssm' ({func}). That graph would read the checkpoint, not "
                f"the current state. Compile the model with backend='replayssm', or give that backend a cache whose "
                f"states are plain tensors (replay_compile.flush the cache, then copy its states out).")
        dst = args[0] if args else None
        if func in _OVERWRITES and isinstance(dst, ReplayTensor):
            if func is _aten.copy_.default and isinstance(args[1], ReplayTensor):
                if args[1].replay is dst.replay and dst.replay is not None:
                    return dst              # a copy onto itself or an alias of itself: nothing changes
                src = args[1].fold()
            else:
                src = args[1] if len(args) > 1 else None
            dst.drop()                 # every element is written (a copy_ source broadcasts): records are stale
            func(dst.checkpoint, *([src] if src is not None else []), *args[2:], **kwargs)
            dst._synced()
            return dst
        if func in _ALIASES and isinstance(dst, ReplayTensor):
            view = func(dst.checkpoint, *args[1:], **kwargs)
            if isinstance(view, torch.Tensor) and same_view(view, dst.checkpoint):
                # the same elements: the same checkpoint object and replay state, nothing to fold (a view made
                # here would carry no autograd view link to the checkpoint, so it could not be told apart)
                return ReplayTensor(dst.checkpoint, dst.replay)
            if dst.holds_records():                     # a part of it: a plain view of the current state
                dst.fold(_rows(func, args, dst.shape[0]))
            return view
        if func is _aten.select.int and isinstance(dst, ReplayTensor):
            if dst.holds_records():                         # one slot: only its records are folded
                dst.fold(_rows(func, args, dst.shape[0]))
            return func(dst.checkpoint, *args[1:], **kwargs)
        wrappers: list[ReplayTensor] = []

        def unwrap(t: ReplayTensor) -> torch.Tensor:
            wrappers.append(t)
            return t.fold()

        out = func(*tree_map_only(ReplayTensor, unwrap, args), **tree_map_only(ReplayTensor, unwrap, kwargs))
        for w in wrappers:
            w._synced()
        return out

    def _synced(self) -> None:
        """The checkpoint was just folded or written by us: it holds the truth at its current version."""
        rs = self.replay
        if rs is not None:
            from .state import tensor_version

            rs.version = tensor_version(self.checkpoint)

    # -- Python-level escapes --------------------------------------------------------------------------------------

    def numpy(self, *args, **kwargs):
        return self.fold().numpy(*args, **kwargs)

    def tolist(self):
        return self.fold().tolist()

    def __deepcopy__(self, memo):
        return self.fold().clone()

    def __reduce_ex__(self, protocol):
        return self.fold().__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents=None):
        held = 0 if self.replay is None else self.replay.steps
        return f"ReplayTensor({self.fold()!r}, stepped={held})"


def _rows(func, args, n: int) -> torch.Tensor | None:
    """The slots (dim 0 indices) a ``select`` / ``slice`` of a state reaches, or None (a view across slots)."""
    dim = args[1] if len(args) > 1 else 0
    if dim not in (0, -len(args[0].shape)):
        return None
    if func is _aten.select.int:
        return torch.tensor([args[2] % n])
    if func is _aten.slice.Tensor:
        start, end, step = (list(args[2:5]) + [None, None, 1])[:3]
        return torch.arange(n)[slice(start, end, step)]
    return None


def _functionalizing() -> bool:
    """Whether AOTAutograd is tracing (its functionalization mode is active). Graphs compiled by this library never
    get there with a ``ReplayTensor``: the backend hands AOTAutograd the checkpoint instead."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None


def same_view(out: torch.Tensor, base: torch.Tensor) -> bool:
    """``out`` aliases all of ``base`` element for element (same storage, offset, shape and strides)."""
    try:
        return (out.shape == base.shape and out.stride() == base.stride()
                and out.storage_offset() == base.storage_offset()
                and out.untyped_storage().data_ptr() == base.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):     # fake / functional tensors while tracing: not an alias we track
        return False


def checkpoint_of(t: Any) -> Any:
    """The checkpoint a ``ReplayTensor`` wraps; anything else unchanged."""
    return t.checkpoint if isinstance(t, ReplayTensor) else t
