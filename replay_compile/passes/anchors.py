"""Anchors: the writes of a recurrent state that a matcher starts from, for every family.

Two forms are anchors:

* **a whole state** ``S.copy_(v)``, ``S`` a graph input shaped like a state (4-D, floating point): the decode step
  of a cache that holds one row per sequence of the batch (transformers' caches);
* **a slot pool** ``pool[slot] = v`` (``setitem``), ``pool.index_copy_(0, slot, v)`` or
  ``pool.index_put_((slot,), v)``, with the old rows read by one gather of the same slots, ``pool[slot]`` or
  ``pool.index_select(0, slot)``: the form of a serving engine's state pool, where row ``i`` of the batch owns slot
  ``slot[i]`` of a pool sized for every sequence the engine holds (continuous batching).

The matchers read the recurrence from :attr:`Anchor.old` (the old rows, ``[b, H, P, N]``) and :attr:`Anchor.value`;
the rewrite passes the whole pool and ``slot`` to the replay op, whose rings are sized for the pool's slots.
Negative slots are padding rows for the op: nothing is read or written for them and their output is zero, as in
serving engines' kernels. (Eager indexing would wrap ``-1`` to the pool's last slot, which pools that pad with ``-1``
keep free for that purpose; the rewrite leaves it untouched.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from .graph_utils import dtype, is_state_input, op_name, real_users, shape, strip


@dataclasses.dataclass(frozen=True)
class Anchor:
    """One write of a state-shaped graph input that may be a recurrence step.

    Attributes:
        write: the writing node (``copy_``, ``setitem``, ``index_copy_``, ``index_put_``).
        state: the graph input written: the state ``[b, H, P, N]`` or the pool ``[slots, H, P, N]``.
        old: the node whose value is the old state of the batch's rows (``state`` itself, or the gather).
        value: the value written (``[b, H, P, N]``).
        slot: ``[b]`` integer slots of the rows in a pool, or None.
        why: where the write is a pool write that cannot be read as a step, the reason (``old`` is then None).
    """

    write: fx.Node
    state: fx.Node
    old: fx.Node | None
    value: Any
    slot: fx.Node | None = None
    why: str | None = None


def written_value(w: fx.Node) -> Any:
    """The value an anchor's write stores."""
    name = op_name(w)
    if name == "setitem":
        return w.args[2]
    if name == "index_copy_":
        return w.args[3]
    if name == "index_put_":
        return w.args[2]
    return w.args[1]


def _pool_write(n: fx.Node, dims: int = 4) -> tuple[fx.Node, fx.Node] | None:
    """(pool, slot) of a write of whole rows chosen by a 1-D integer index along dim 0 of a ``dims``-D floating-point
    graph input, else None."""
    name = op_name(n)
    if not n.args or not isinstance(n.args[0], fx.Node) or not is_state_input(n.args[0], dims):
        return None
    idx = None
    if name == "setitem" and len(n.args) == 3:
        idx = n.args[1]
    elif name == "index_copy_" and len(n.args) == 4 and n.args[1] == 0:
        idx = n.args[2]
    elif name == "index_put_" and len(n.args) >= 3 and not (n.args[3] if len(n.args) > 3
                                                           else n.kwargs.get("accumulate", False)):
        idx = n.args[1]
    if isinstance(idx, (tuple, list)) and len(idx) == 1:
        idx = idx[0]
    if not isinstance(idx, fx.Node) or len(shape(idx) or ()) != 1:
        return None
    dt = dtype(idx)
    if dt is None or dt.is_floating_point or dt.is_complex or str(dt) == "torch.bool":
        return None
    return n.args[0], idx


def _gathers(pool: fx.Node, slot: fx.Node) -> list[fx.Node]:
    """Reads of ``pool`` at rows ``slot``: ``pool[slot]`` and ``pool.index_select(0, slot)``."""
    out = []
    for u in real_users(pool):
        name = op_name(u)
        if name == "getitem" and len(u.args) == 2 and u.args[0] is pool:
            idx = u.args[1]
            idx = idx[0] if isinstance(idx, (tuple, list)) and len(idx) == 1 else idx
            if isinstance(idx, fx.Node) and strip(idx) is strip(slot):
                out.append(u)
        elif name == "index_select" and u.args[0] is pool and len(u.args) >= 3 and u.args[1] == 0 \
                and isinstance(u.args[2], fx.Node) and strip(u.args[2]) is strip(slot):
            out.append(u)
    return out


def _pool_anchor(w: fx.Node, pool: fx.Node, slot: fx.Node) -> Anchor:
    value = written_value(w)
    gathers = _gathers(pool, slot)
    why = None
    if len(gathers) != 1:
        why = (f"a state pool written at rows `{slot.name}`, but its old rows are read {len(gathers)} times by "
               f"`pool[{slot.name}]` / `index_select` (expected once)")
    else:
        others = [u for u in real_users(pool) if u is not w and u is not gathers[0]]
        if others:
            names = ", ".join(f"`{u.name}` ({op_name(u)})" for u in others[:3])
            why = (f"a state pool written at rows `{slot.name}` is also read or written by {names}: rewriting "
                   f"would expose the checkpoint")
    return Anchor(write=w, state=pool, old=None if why else gathers[0], value=value, slot=slot, why=why)


def find_pools(graph: fx.Graph, dims: int) -> list[Anchor]:
    """The slot-pool anchors of ``dims``-D pools (3: Mamba-1's ``[slots, D, N]``), in graph order."""
    out = []
    for n in graph.nodes:
        pw = _pool_write(n, dims)
        if pw is not None:
            out.append(_pool_anchor(n, *pw))
    return out


def find(graph: fx.Graph) -> list[Anchor]:
    """Every anchor of ``graph`` in graph order."""
    out = []
    for n in graph.nodes:
        if op_name(n) == "copy_" and n.args and isinstance(n.args[0], fx.Node) and is_state_input(n.args[0]):
            out.append(Anchor(write=n, state=n.args[0], old=n.args[0], value=n.args[1]))
            continue
        pw = _pool_write(n)
        if pw is not None:
            out.append(_pool_anchor(n, *pw))
    return out
