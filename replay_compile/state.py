"""Replay state: the ring buffers and device cursor that sit beside each cache state tensor.

One :class:`ReplayState` per cache state tensor (the checkpoint). It is created the first time a compiled graph
steps that tensor and is shared by every graph that steps it afterwards (recompiles, prefill and decode graphs,
several ``generate`` calls), because it is keyed by the tensor itself, not by the graph. A new cache object has new
tensors and so gets fresh rings: nothing stale can leak from one cache to the next.

Between flushes the cache tensor holds the *checkpoint*, not the current state. A cache whose states are
:class:`~replay_compile.replay_tensor.ReplayTensor`s (``generate``'s, or any after :func:`protect`) makes that
invisible by itself: the wrapper carries this replay state and folds it in before any other use. For plain state
tensors three rules apply:

* a write to the cache by anyone else (``cache.reset()``, a new prefill) bumps the tensor's version counter; the
  next step sees it and drops the held records (the new contents are the truth);
* every graph compiled by our backend flushes states it reads but does not step (a prefill continuing from the
  cache);
* :func:`flush` makes the cache hold the true state; the HF integration calls it where transformers reads the cache
  outside compiled code (end of ``generate``, ``reorder_cache`` for beam search, cropping, batch selection).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Iterator, Optional

import torch

from ._logging import log
from .errors import ReplayCompileError
from .replay_tensor import ReplayTensor, checkpoint_of, same_view


@dataclasses.dataclass(frozen=True)
class Mamba2RingSpec:
    """Sizes and dtypes of one layer's rings. ``G``: B groups; ``L``: buffer length; ``read_copy``: a read-copy
    format (``"bf16"``, ``"fp8_e4m3"``, ``"nvfp4"``) whose storage sits beside the rings, or None (exact reads).
    ``transposed``: the cache tensor is laid out ``[S, H, N, P]`` (MiniMax's ``K^T V`` state, read out as ``q @ S``);
    the ops see it as ``state.mT``, a view, so the cache keeps its own layout and nothing is copied."""

    H: int
    P: int
    N: int
    G: int
    L: int
    x_dtype: torch.dtype
    B_dtype: torch.dtype
    rec_dtype: torch.dtype = torch.float32
    read_copy: Optional[str] = None
    transposed: bool = False

    @property
    def family(self) -> str:
        return "mamba2"

    def op_view(self, state: torch.Tensor) -> torch.Tensor:
        """The cache tensor as the ops take it, ``[S, H, P, N]``."""
        return state.mT if self.transposed else state

    @property
    def ring_names(self) -> tuple[str, ...]:
        copy = ("copy0", "copy1", "copy2") if self.read_copy else ()
        return ("x_ring", "dt_ring", "la_ring", "B_ring", *copy, "cursor")

    @property
    def step_op(self):
        """The step op the rewrite inserts, and the arguments it takes after ``slot_idx``."""
        if self.read_copy:
            return torch.ops.replay_compile.mamba2_step_rc.default, (self.read_copy,)
        return torch.ops.replay_compile.mamba2_step.default, ()

    def allocate(self, slots, device) -> tuple:
        """Zeroed (x_ring, dt_ring, la_ring, B_ring[, copy0, copy1, copy2], cursor) for ``slots`` sequences; the
        copy storage (:func:`~replay_compile.ops.mamba2_readcopy.allocate_copy`) only with ``read_copy``."""
        z = lambda shape, dt: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        copy = ()
        if self.read_copy:
            from .ops.mamba2_readcopy import allocate_copy
            copy = allocate_copy(self.read_copy, (slots, self.H, self.P, self.N), device)
        return (z((slots, self.H, self.L, self.P), self.x_dtype), z((slots, self.H, self.L), self.rec_dtype),
                z((slots, self.H, self.L), self.rec_dtype), z((slots, self.G, self.L, self.N), self.B_dtype),
                *copy, z((slots,), torch.int32))

    def core(self, rings: tuple) -> tuple:
        """(x_ring, dt_ring, la_ring, B_ring, cursor): what the flush / materialize ops take."""
        return (*rings[:4], rings[-1])

    def flush(self, state: torch.Tensor, rings: tuple, slots: torch.Tensor | None = None) -> None:
        """Fold the held records of every slot, or of ``slots`` [n], into ``state`` (their cursors to 0) and
        rewrite the read copy."""
        torch.ops.replay_compile.mamba2_flush(self.op_view(state), *self.core(rings), slots)
        self.sync_copy(state, rings)

    def materialize(self, state: torch.Tensor, rings: tuple) -> torch.Tensor:
        """The true state, out of place, in the cache tensor's own layout."""
        out = torch.ops.replay_compile.mamba2_materialize(self.op_view(state), *self.core(rings))
        return out.mT.contiguous() if self.transposed else out

    def sync_copy(self, state: torch.Tensor, rings: tuple) -> None:
        """Rewrite the read copy from the checkpoint (which holds the true state: at bind, reset, after a flush)."""
        if self.read_copy:
            from .ops.mamba2_readcopy import encode_copy
            encode_copy(self.read_copy, self.op_view(state), rings[4:7])

    def nbytes_per_slot(self) -> int:
        es = lambda d: torch.empty((), dtype=d).element_size()  # noqa: E731
        copy = 0
        if self.read_copy:
            from .quant.formats import FORMATS
            copy = FORMATS[self.read_copy].nbytes((1, self.H, self.P, self.N))
        return self.H * self.L * (self.P * es(self.x_dtype) + 2 * es(self.rec_dtype)) + \
            self.G * self.L * self.N * es(self.B_dtype) + 4 + copy


@dataclasses.dataclass(frozen=True)
class Mamba1RingSpec:
    """Sizes of one Mamba-1 layer's rings (:mod:`replay_compile.kernels.mamba1_reference`): ``D`` channels, ``N``
    state entries per channel, ``L`` the buffer length. ``heads``: a state ``[S, heads, D, N]`` stepped head by head
    (Zamba), one ring set per head (``u_ring [S, heads, L, D]``, ``A_keep [heads, D, N]``, ``cursor [heads, S]``,
    the ops given ``ring[:, h]``, ``A_keep[h]``, ``cursor[h]``); 0 for a plain ``[S, D, N]`` state."""

    D: int
    N: int
    L: int
    rec_dtype: torch.dtype = torch.float32
    read_copy: Optional[str] = None     # not offered for Mamba-1: always None
    heads: int = 0

    family = property(lambda self: "mamba1")
    ring_names = property(lambda self: ("u_ring", "dt_ring", "B_ring", "A_keep", "cursor"))
    step_op = property(lambda self: (torch.ops.replay_compile.mamba1_step.default, ()))

    def allocate(self, slots, device) -> tuple:
        """Zeroed (u_ring [S, L, D], dt_ring [S, L, D], B_ring [S, L, N], A_keep [D, N], cursor [S]); with
        ``heads``, a head dim after the slots (before them for ``A_keep`` and the cursor)."""
        z = lambda shape: torch.zeros(shape, dtype=self.rec_dtype, device=device)  # noqa: E731
        hd = (self.heads,) if self.heads else ()
        return (z((slots, *hd, self.L, self.D)), z((slots, *hd, self.L, self.D)), z((slots, *hd, self.L, self.N)),
                z((*hd, self.D, self.N)), torch.zeros((*hd, slots), dtype=torch.int32, device=device))

    def head(self, state: torch.Tensor, rings: tuple, h: int) -> tuple:
        """Head ``h``'s state and rings, as the ops take them (views)."""
        u, dt, B, A_keep, cursor = rings
        return (state[:, h], u[:, h], dt[:, h], B[:, h], A_keep[h], cursor[h])

    def sync_copy(self, state: torch.Tensor, rings: tuple) -> None:
        pass

    def flush(self, state: torch.Tensor, rings: tuple, slots: torch.Tensor | None = None) -> None:
        for args in ([self.head(state, rings, h) for h in range(self.heads)] if self.heads else [(state, *rings)]):
            torch.ops.replay_compile.mamba1_flush(*args, slots)

    def materialize(self, state: torch.Tensor, rings: tuple) -> torch.Tensor:
        if self.heads:
            return torch.stack([torch.ops.replay_compile.mamba1_materialize(*self.head(state, rings, h))
                                for h in range(self.heads)], dim=1)
        return torch.ops.replay_compile.mamba1_materialize(state, *rings)

    def nbytes_per_slot(self) -> int:
        es = torch.empty((), dtype=self.rec_dtype).element_size()
        return max(self.heads, 1) * (self.L * (2 * self.D + self.N) * es + 4)


@dataclasses.dataclass(frozen=True)
class DeltaRingSpec:
    """Sizes and dtypes of one delta-rule layer's rings (Gated DeltaNet, or KDA when ``kda``)."""

    HV: int
    Hk: int
    K: int
    V: int
    L: int
    d_dtype: torch.dtype = torch.float32
    k_dtype: torch.dtype = torch.float32
    kda: bool = False
    rec_dtype: torch.dtype = torch.float32
    read_copy: Optional[str] = None     # read-copy format; with it the raw v / beta rings are kept for exact flushes
    transposed: bool = False            # the cache tensor is [S, HV, V, K] (fla's state_v_first); the ops take .mT

    @property
    def family(self) -> str:
        return "kda" if self.kda else "gdn"

    def op_view(self, state: torch.Tensor) -> torch.Tensor:
        """The cache tensor as the ops take it, ``[S, HV, K, V]``."""
        return state.mT if self.transposed else state

    @property
    def ring_names(self) -> tuple[str, ...]:
        if self.read_copy:
            return ("d_ring", "k_ring", "g_ring", "v_ring", "beta_ring", "copy0", "copy1", "copy2", "cursor")
        return ("d_ring", "k_ring", "g_ring", "cursor")

    @property
    def step_op(self):
        if self.read_copy:
            return torch.ops.replay_compile.delta_step_rc.default, (self.read_copy,)
        return torch.ops.replay_compile.delta_step.default, ()

    def allocate(self, slots, device) -> tuple:
        """Zeroed (d_ring [S, HV, L, V], k_ring [S, Hk, L, K], g_ring [S, HV, L(, K)], cursor [S]) for ``slots``;
        with ``read_copy`` also v_ring [S, HV, L, V], beta_ring [S, HV, L] and the copy's three storage tensors
        before the cursor."""
        z = lambda shape, dt: torch.zeros(shape, dtype=dt, device=device)  # noqa: E731
        g_shape = (slots, self.HV, self.L) + ((self.K,) if self.kda else ())
        extra = ()
        if self.read_copy:
            from .ops.mamba2_readcopy import allocate_copy
            extra = (z((slots, self.HV, self.L, self.V), self.d_dtype), z((slots, self.HV, self.L), self.rec_dtype),
                     *allocate_copy(self.read_copy, (slots, self.HV, self.K, self.V), device))
        return (z((slots, self.HV, self.L, self.V), self.d_dtype), z((slots, self.Hk, self.L, self.K), self.k_dtype),
                z(g_shape, self.rec_dtype), *extra, z((slots,), torch.int32))

    def sync_copy(self, state: torch.Tensor, rings: tuple) -> None:
        if self.read_copy:
            from .ops.mamba2_readcopy import encode_copy
            encode_copy(self.read_copy, self.op_view(state), rings[5:8])

    def flush(self, state: torch.Tensor, rings: tuple, slots: torch.Tensor | None = None) -> None:
        """Fold the held records of every slot, or of ``slots`` [n], into ``state`` (their cursors to 0); with a
        read copy exactly from the raw rings, the copy rewritten."""
        state = self.op_view(state)
        if self.read_copy:
            torch.ops.replay_compile.delta_flush_rc(state, *rings, self.read_copy, slots)
        else:
            torch.ops.replay_compile.delta_flush(state, *rings, slots)

    def materialize(self, state: torch.Tensor, rings: tuple) -> torch.Tensor:
        """The true state, out of place, in the cache tensor's own layout."""
        state = self.op_view(state)
        if self.read_copy:
            out = torch.ops.replay_compile.delta_materialize_rc(state, *rings[:5], rings[-1])
        else:
            out = torch.ops.replay_compile.delta_materialize(state, *rings)
        return out.mT.contiguous() if self.transposed else out

    def nbytes_per_slot(self) -> int:
        es = lambda d: torch.empty((), dtype=d).element_size()  # noqa: E731
        n = self.L * (self.HV * self.V * es(self.d_dtype) + self.Hk * self.K * es(self.k_dtype) +
                      self.HV * (self.K if self.kda else 1) * es(self.rec_dtype)) + 4
        if self.read_copy:
            from .quant.formats import FORMATS
            n += self.L * self.HV * (self.V * es(self.d_dtype) + es(self.rec_dtype)) + \
                FORMATS[self.read_copy].nbytes((1, self.HV, self.K, self.V))
        return n


def tensor_version(t: torch.Tensor) -> int | None:
    """The in-place version counter, or None where torch does not track it (inference-mode tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


class ReplayState:
    """Rings + cursor of one cache state tensor. See the module docstring for the invariants."""

    def __init__(self, state: torch.Tensor, spec, layer: str):
        self.family = spec.family
        self.spec = spec
        self.layer = layer
        self._state = weakref.ref(state)
        self.rings = spec.allocate(state.shape[0], state.device)
        spec.sync_copy(state, self.rings)
        self.version = tensor_version(state)
        self.dirty = False          # host-side: a step ran since the last flush/reset (no device sync needed)
        self.steps = 0              # host-side count of compiled steps (for reports; no device sync)
        self.owners: set[int] = set()
        self.pooled = False         # a pool whose rows a step picks by slot (rows of other sequences hold records)

    @property
    def state(self) -> torch.Tensor | None:
        return self._state()

    @property
    def cursor(self) -> torch.Tensor:
        return self.rings[-1]

    def _mode(self):
        """Inference mode where the state or its rings were made in it: writing them in place is then allowed only
        inside inference mode, and a fold or reset called from outside it (the user's own code after a decode under
        ``torch.inference_mode()``) must still complete, never stop halfway."""
        st = self.state
        inference = any(t.is_inference() for t in (st, *self.rings) if t is not None)
        return torch.inference_mode() if inference else contextlib.nullcontext()

    def reset(self) -> None:
        """Drop the held records: the cache tensor is the truth again (after an external write)."""
        with self._mode():
            self.cursor.zero_()
            st = self.state
            if st is not None:
                self.spec.sync_copy(st, self.rings)
        self.dirty = False
        if st is not None:
            self.version = tensor_version(st)

    def flush(self, slots: torch.Tensor | None = None) -> None:
        """Fold held records into the cache tensor (it then holds the true state): of every slot, or of ``slots``
        [n] only (a read or write of those rows; the other rows keep their records).

        If the tensor was written by someone else since our last step (a reset, a new prefill), its contents are the
        truth and the held records belong to the old sequence: they are dropped, never folded into the new contents.
        """
        st = self.state
        if st is None or not self.dirty:
            return
        self.check_external_write(st)
        if not self.dirty:
            return
        with self._mode():
            self.spec.flush(st, self.rings, slots)
        self.dirty = slots is not None     # other slots may still hold records
        self.version = tensor_version(st)

    def materialize(self) -> torch.Tensor:
        """The true current state, out of place; the cache and rings are not touched."""
        st = self.state
        return self.spec.materialize(st, self.rings)

    def check_external_write(self, st: torch.Tensor) -> None:
        """Reset after a write by someone else (its contents are the truth). A slot pool that holds records is
        the exception: a write of some of its slots moves the same version counter as a write of all of them, and
        dropping every slot's records would silently lose the other sequences' last steps, so it raises instead."""
        v = tensor_version(st)
        if v is not None and self.version is not None and v != self.version:
            if self.pooled and self.dirty:
                raise ReplayCompileError(
                    f"replay_compile: layer {self.layer}: its state pool {tuple(st.shape)} was written outside the "
                    f"compiled step while its slots held replay records, and a plain tensor cannot tell which slots "
                    f"were written. Wrap the pool once, `pool = replay_compile.ReplayTensor(pool)` (a write of some "
                    f"slots then folds just those slots first), or call `replay_compile.flush(pool)` before writing "
                    f"it; `replay_compile.reset(pool)` takes the pool's present contents as the truth.")
            log.debug("replay_compile: %s: cache written outside the compiled step; replay state reset", self.layer)
            self.reset()


_BY_ID: dict[int, ReplayState] = {}
# Bumped whenever a tensor's replay state is created or replaced: a runner's cached bindings (backend.ReplayRunner)
# are valid only while it is unchanged.
_GENERATION = [0]


def whole_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of all of (``t[:]``, ``t.view(t.shape)``), else ``t``: a cache that hands the step
    a fresh alias of its state each call still has one replay state."""
    base = t._base
    return base if base is not None and same_view(t, base) else t


def generation() -> int:
    return _GENERATION[0]


def lookup(t: torch.Tensor) -> ReplayState | None:
    """The replay state of cache tensor ``t`` (a plain state tensor, or a ``ReplayTensor``), or None."""
    if isinstance(t, ReplayTensor):
        return t.replay
    t = whole_base(t)
    rs = _BY_ID.get(id(t))
    return rs if rs is not None and rs.state is t else None


def bind(t: torch.Tensor, spec, layer: str) -> ReplayState:
    """The replay state of ``t``, created (zeroed rings, cursor 0) on first use. For a ``ReplayTensor`` the state is
    kept on the wrapper as well as registered for its checkpoint."""
    if isinstance(t, ReplayTensor):
        t.replay = bind(t.checkpoint, spec, layer)
        return t.replay
    t = whole_base(t)
    rs = lookup(t)
    if rs is not None:
        if rs.spec == spec:
            return rs
        # a recompile with another buffer length or dtype: fold what the old rings hold, then start new ones
        rs.flush()
    rs = ReplayState(t, spec, layer)
    key = id(t)
    _BY_ID[key] = rs
    _GENERATION[0] += 1

    def _drop(_ref, key=key, rs=rs, by_id=_BY_ID):     # by_id bound here: module globals are gone at exit
        if by_id.get(key) is rs:
            del by_id[key]
        rs.rings = ()       # the cache tensor is gone: free its rings even where a runner still holds this state

    rs._finalizer = weakref.ref(t, _drop)
    return rs


def registered() -> bool:
    return bool(_BY_ID)


def all_states() -> Iterator[ReplayState]:
    return iter([rs for rs in _BY_ID.values() if rs.state is not None])


def _tensors_in(obj: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth <= 0:
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth - 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth - 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for v in vars(obj).values():
            yield from _tensors_in(v, depth - 1)


def states_of(obj: Any = None) -> list[ReplayState]:
    """Replay states belonging to ``obj``: a state tensor, a cache object (any container of state tensors), a
    model (states stepped by graphs compiled from it), or None for all."""
    if obj is None:
        return list(all_states())
    if isinstance(obj, torch.nn.Module):
        ids = {id(p) for p in obj.parameters()}
        return [rs for rs in all_states() if rs.owners & ids]
    out, seen = [], set()
    for t in _tensors_in(obj):
        rs = lookup(t)
        if rs is not None and id(rs) not in seen:
            seen.add(id(rs))
            out.append(rs)
    return out


def flush(obj: Any = None) -> int:
    """Make the cache hold the true state. ``obj``: model, cache object, state tensor, or None (everything).

    Returns the number of replay states that held records and were folded.
    """
    n = 0
    for rs in states_of(obj):
        if rs.dirty:
            rs.flush()
            n += 1
    return n


def reset(obj: Any = None) -> int:
    """Drop held records without folding them (the cache tensor becomes the truth as it stands)."""
    states = states_of(obj)
    for rs in states:
        rs.reset()
    return len(states)


def materialize(t: torch.Tensor) -> torch.Tensor:
    """The true current state of cache tensor ``t``, as a new plain tensor, without changing anything. Records held
    from before a write that bypassed the compiled step (the version counter moved) are not folded into the new
    contents: the contents are the truth."""
    rs = lookup(t)
    base = checkpoint_of(t)
    if rs is None or not rs.dirty:
        return base.clone()
    rs.check_external_write(base)
    return base.clone() if not rs.dirty else rs.materialize()


def protect(obj: Any) -> int:
    """Make every recurrent state held by ``obj`` (a transformers cache, or any object whose ``layers[i].
    recurrent_states`` dicts hold the states) a :class:`~replay_compile.replay_tensor.ReplayTensor`, so that any
    later read or write of it, by any path, sees or makes the current state. ``generate`` does this by itself from
    its first decode step; call it for a cache stepped in a hand-written loop, after the prefill. Returns the number
    of states wrapped."""
    from .integrations.hf import protect as protect_cache

    return protect_cache(obj)
