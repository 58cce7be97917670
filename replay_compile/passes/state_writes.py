"""How a graph writes a cache tensor, before any family's matcher looks at it.

Two questions every family shares:

* **Clone write-backs.** A step that must not update the cache in place before it is done clones the state, updates
  the clone, then copies it back (transformers 5.25 and later, for every Mamba-2 mixer)::

      T = S.clone()                      # reads of T here are reads of S
      T.copy_(S * dA + dBx)              # or a kernel launch that updates T in place
      y = readout(...)
      S.copy_(T)                         # the write-back

  :func:`forward_clone_writebacks` moves the update onto ``S`` itself (``S.copy_(S * dA + dBx)``, the kernel
  launched on ``S``) and drops the clone and the write-back, which is what the matchers know, wherever doing so
  provably changes no value the graph reads; otherwise it leaves the graph alone and says why.

* **Is this write a recurrence?** :func:`why_not_a_step` tells the writes that are plainly not a recurrent-state
  step (a reset, a shift of a KV or convolution window, a scan over several tokens) from the ones that are, so a
  state update the pass cannot rewrite is reported loudly and the rest quietly; :func:`computed_writes` finds the
  writes no ``copy_`` anchor covers (in place, through a view, at indexed rows) whose value is computed from the
  state.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .broadcast import FULL, BroadcastAnalysis
from .graph_utils import ALIASING, METADATA, aliases, flatten, is_call, op_name, shape, state_inputs, strip, writers


def _readers(nodes: set[fx.Node]) -> list[fx.Node]:
    """Calls that take one of ``nodes`` as an operand (views among ``nodes`` excluded)."""
    return [u for a in nodes for u in a.users if u not in nodes]


def _refusal(wb: fx.Node, clone: fx.Node, writes: list[fx.Node], order: dict) -> str | None:
    """Why ``wb = S.copy_(clone)``, with ``clone = S.clone()`` written by ``writes``, cannot be folded into
    in-place updates of ``S``."""
    state = wb.args[0]
    first, at_wb = min(order[w] for w in writes), order[wb]
    if any(order[w] > at_wb for w in writes):
        return f"`{clone.name}` is written again after it is copied back into the state"
    other = [w for w in writes if not (op_name(w) == "copy_" and w.args[0] is clone) and not is_launch(w)]
    if other:
        names = ", ".join(f"`{w.name}` ({op_name(w)})" for w in other)
        return (f"`{clone.name}` is updated in place by {names}; only a copy_ of the new value into it or a kernel "
                f"launch on it is followed")
    mine = aliases(clone)
    if any(u.op == "output" for u in _readers(mine)):
        return f"`{clone.name}` is also an output of the graph"
    state_writers = set(writers(state))
    for u in _readers(aliases(state)):
        if u is clone or u is wb:
            continue
        if order[clone] < order[u] < at_wb and u in state_writers:
            return f"the state is written by `{u.name}` while `{clone.name}` holds a copy of it"
        if first < order[u] < at_wb:
            return (f"the state is read by `{u.name}` ({op_name(u)}) after `{clone.name}` is updated and before it "
                    f"is copied back: it would see the new value instead of the old one")
    if any(order[w] > at_wb for w in state_writers) and any(order[u] > at_wb for u in _readers(mine)):
        return f"`{clone.name}` is read after the state is written again"
    return None


def is_launch(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)


def forward_clone_writebacks(graph: fx.Graph) -> tuple[list[str], dict[fx.Node, str]]:
    """Fold every ``T = S.clone(); <in-place updates of T>; S.copy_(T)`` of ``graph`` into updates of ``S``.

    Only where no value the graph reads changes: ``S`` is neither read nor written between the first update of
    ``T`` and the write-back (until then ``T`` and ``S`` hold the same values), ``T`` is not written after the
    write-back nor returned. ``T``'s uses become uses of ``S``, then the write-back ``S.copy_(S)`` and the clone
    are erased; ``T.copy_(v)`` becomes ``S.copy_(v)``, a launch that updated ``T`` updates ``S``.

    Returns the names of the states forwarded, and for each write-back left alone (the copy node, which stays in
    the graph) the reason.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    done, refused = [], {}
    for wb in list(graph.nodes):
        if op_name(wb) != "copy_" or len(wb.args) < 2 or wb.kwargs:
            continue
        state, clone = wb.args[0], wb.args[1]
        if not (isinstance(state, fx.Node) and is_call(clone, "clone") and clone.args and clone.args[0] is state):
            continue
        writes = writers(clone)
        if not writes:
            continue            # S.copy_(S.clone()): a no-op the matchers already see through
        why = _refusal(wb, clone, writes, order)
        if why is not None:
            refused[wb] = why
            continue
        clone.replace_all_uses_with(state)          # also turns the write-back into S.copy_(S)
        wb.replace_all_uses_with(state)
        graph.erase_node(wb)
        graph.erase_node(clone)
        done.append(state.name)
    return done, refused


# ops that read only the shape, dtype and device of their first operand
_SHAPE_OF_FIRST = METADATA | {"zeros_like", "empty_like", "ones_like", "full_like", "rand_like", "randn_like",
                              "new_zeros", "new_ones", "new_empty", "new_full"}
_SCANS = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}
# ops that move or select values without computing new ones
DATA_MOVES = ALIASING | {"clone", "cat", "concat", "concatenate", "stack", "roll", "flip", "index_select",
                          "gather", "take_along_dim", "pad", "constant_pad_nd", "setitem", "copy_", "index_copy_",
                          "index_copy", "index_put_", "index_put", "scatter", "scatter_", "masked_fill",
                          "masked_fill_", "where"} | _SHAPE_OF_FIRST


def _value_inputs(n: fx.Node) -> list[fx.Node]:
    """The nodes ``n``'s value is made of: its operands, and what is written into it in place afterwards."""
    out = list(n.all_input_nodes)
    if op_name(n) in _SHAPE_OF_FIRST and n.args and isinstance(n.args[0], fx.Node):
        out.remove(n.args[0])
    for w in writers(n):
        out.extend(x for x in w.all_input_nodes if x is not n)
    return out


def computes_from(state: fx.Node, value) -> bool:
    """Whether the value ``value`` written into ``state`` (or into rows of it) is computed from the state by more
    than moving its values around: a step of a recurrence, as opposed to a cache filled or shifted."""
    if not isinstance(value, fx.Node):
        return False
    from_state = _computed_from(state, _ancestors(state, value))
    return bool(from_state) and not all(op_name(x) in DATA_MOVES for x in from_state)


def _ancestors(state: fx.Node, value: fx.Node) -> dict[fx.Node, list]:
    """``value``'s ancestors (not through ``state``) and their value inputs."""
    inputs: dict[fx.Node, list] = {}
    todo = [value]
    while todo:
        x = todo.pop()
        if x in inputs or x is state:
            continue
        inputs[x] = _value_inputs(x)
        todo.extend(inputs[x])
    return inputs


def why_not_a_step(state: fx.Node, value) -> str | None:
    """Why writing ``value`` into ``state`` (the state, or the rows of a pool it was gathered as) is plainly not a
    recurrent-state step, or None if it may be one.

    Not a recurrence: ``value`` does not depend on ``state`` (a reset, an initialisation); ``value`` is made from
    ``state`` by data movement alone (a KV cache or convolution window shifted, concatenated or indexed); ``value``
    comes out of a scan over a sequence axis (``cumsum`` and kin: a prefill or chunked scan, which writes the state
    once per forward).
    """
    if not isinstance(value, fx.Node):
        return "the state is filled with a constant (a reset)"
    inputs = _ancestors(state, value)
    if any(op_name(x) in _SCANS for x in inputs):
        return "the value written comes out of a scan over several tokens (a prefill or chunked scan)"
    from_state = _computed_from(state, inputs)
    if not from_state and value.op != "placeholder":
        return "the value written does not depend on the state (a reset or an initialisation)"
    if from_state and all(op_name(x) in DATA_MOVES for x in from_state):
        return "the value written is the state moved or indexed, not updated (a KV or convolution window)"
    return None


def _computed_from(state: fx.Node, inputs: dict[fx.Node, list]) -> set[fx.Node]:
    """The nodes of ``inputs`` (node -> value inputs, a closed set of ancestors) whose value depends on ``state``.

    A fixed point in graph order: in-place writes make edges that point backwards (and cycles, ``T.copy_(T * a)``),
    which a further sweep picks up."""
    order = {n: i for i, n in enumerate(state.graph.nodes)}
    nodes = sorted(inputs, key=order.__getitem__)
    hit: set[fx.Node] = set()
    grew = True
    while grew:
        grew = False
        for x in nodes:
            if x not in hit and any(i is state or i in hit for i in inputs[x]):
                hit.add(x)
                grew = True
    return hit


def _written_values(w: fx.Node) -> list:
    """The operands whose values the in-place write ``w`` stores (all but the destination and the indices)."""
    name = op_name(w)
    if name == "setitem" and len(w.args) == 3:
        return [w.args[2]]
    if name in ("index_copy_", "index_copy") and len(w.args) == 4:
        return [w.args[3]]
    if name in ("index_put_", "index_put") and len(w.args) >= 3:
        return [w.args[2]]
    if name in ("scatter_", "scatter"):
        return [a for a in w.args[3:]] + [v for k, v in w.kwargs.items() if k in ("src", "value")]
    return [a for a in w.args[1:]] + list(w.kwargs.values())


def computed_writes(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """State-shaped graph inputs written in place other than by a ``copy_`` of the whole state, with a value
    computed from the state itself: an in-place op the canonical form did not absorb, a write through a view, a
    pool written at indexed rows (``pool[slot] = f(pool[slot])``, ``index_copy_``). Writes that only move or index
    other values (a KV cache filled at its positions) and kernel launches (their own anchor) are not among them.
    Returns input -> its writes."""
    out = {}
    for s in state_inputs(graph):
        ws = [w for w in writers(s) if not is_launch(w)]
        if any(op_name(w) not in DATA_MOVES or any(computes_from(s, v) for v in _written_values(w)) for w in ws):
            out[s] = ws
    return out


def _view_base(n) -> fx.Node | None:
    """The graph input that ``n`` is (or is a slice of: ``S[:, h]``, as Zamba writes each head), else ``None``."""
    while isinstance(n, fx.Node) and op_name(n) in ("getitem", "select", "narrow", "view", "float", "to"):
        n = n.args[0]
    return n if isinstance(n, fx.Node) and n.op == "placeholder" else None


def _per_channel_step(p: fx.Node, target: fx.Node, value) -> bool:
    """``value`` reads ``exp(·) * old + update``: the old state (``p`` or a slice or cast of it, or a clone of it
    written in place before) times a factor computed through ``exp`` with one entry per (channel, state) of the
    written ``target``, plus another term."""
    def is_old(f) -> bool:
        f = strip(f)
        if is_call(f, "clone") and f.args:
            f = f.args[0]
        return _view_base(f) is p

    def has_exp(f) -> bool:
        seen, todo = set(), [f]
        while todo:
            x = todo.pop()
            if not isinstance(x, fx.Node) or x in seen or x.op == "placeholder":
                continue
            seen.add(x)
            if op_name(x) == "exp":
                return True
            todo.extend(x.all_input_nodes)
        return False

    bx = BroadcastAnalysis()

    def per_entry(f) -> bool:
        """A decay of its own along both last dims (channel and state): shaped [..., C, N] and not provably constant
        along either (transformers' Mamba-2 step expands its per-head dt and A to [H, P, N]: constant there)."""
        fs, ts = shape(f), shape(target)
        if not (fs is not None and ts is not None and len(fs) >= 2 and len(ts) >= 2
                and tuple(fs[-2:]) == tuple(ts[-2:]) and 1 not in tuple(ts[-2:])):
            return False
        rep = bx.rep(f)
        return FULL not in rep[-2:]

    terms = flatten(value, "add")
    for t in terms:
        factors = flatten(t, "mul")
        if len(terms) == 2 and any(is_old(f) for f in factors) and any(
                has_exp(f) and per_entry(f) for f in factors if not is_old(f)):
            return True
    return False


def per_channel_recurrences(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """``{state: write}`` of floating-point graph inputs ``[batch, (heads,) channels, states]`` updated as
    ``S.copy_(exp(·) * S + update)`` (or a slice of S per head) with a decay of their own for every (channel, state)
    entry, directly or through a clone written in place and copied back: Mamba-1's recurrence (Zamba writes it head
    by head). A per-head decay (Mamba-2, a normaliser) broadcasts along the last dims and is not one; nor is a
    convolution window shifted into its state (it multiplies nothing)."""
    out = {}
    for w in graph.nodes:
        if op_name(w) != "copy_" or len(w.args) < 2 or not isinstance(w.args[0], fx.Node):
            continue
        p = _view_base(w.args[0])
        v = p.meta.get("example_value") if p is not None else None
        if p in out or not (isinstance(v, torch.Tensor) and v.dim() in (3, 4) and v.is_floating_point()):
            continue
        value = w.args[1]
        if is_call(value, "clone") and value.args and value.args[0] is w.args[0]:
            inner = [u for u in value.users if op_name(u) == "copy_" and u.args[0] is value]
            value = inner[-1].args[1] if inner else value
        if isinstance(value, fx.Node) and _per_channel_step(p, w.args[0], value):
            out[p] = w
    return out


def returned_recurrences(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """``{state: value}`` of floating-point graph inputs (3-D or 4-D) never written in the graph whose next value
    ``decay * S + update`` is returned instead (the caller stores the new tensor in its cache in place of the old
    one, as MiniMax's cache list does)."""
    out_node = next((n for n in graph.nodes if n.op == "output"), None)
    if out_node is None:
        return {}
    leaves = [a for a in torch.utils._pytree.tree_flatten(out_node.args)[0] if isinstance(a, fx.Node)]
    found = {}
    for p in graph.nodes:
        v = p.meta.get("example_value") if p.op == "placeholder" else None
        if not (isinstance(v, torch.Tensor) and v.dim() in (3, 4) and v.is_floating_point()) or writers(p):
            continue
        for o in leaves:
            o_ = strip(o)
            if o_ is p or not isinstance(o_, fx.Node):
                continue
            terms = flatten(o_, "add")
            if len(terms) == 2 and any(any(strip(f) is p for f in flatten(t, "mul")) for t in terms) \
                    and any(not computes_from(p, t) for t in terms):
                found[p] = o
                break
    return found


def write_returned_in_place(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Turn each :func:`returned_recurrences` step into the in-place form the matchers read: ``S.copy_(new)`` right
    after ``new``, and the graph returns ``S`` where it returned ``new``. The caller's cache then keeps storing the
    same tensor, whose replay state lives as long as it does. Only where ``new`` has the state's shape and dtype
    (so the stored tensor is unchanged but for its identity). Returns ``{state: the copy_ node}``; a state the
    rewrite then does not take is put back by :func:`undo_write_in_place`."""
    out_node = next((n for n in graph.nodes if n.op == "output"), None)
    done = {}
    leaves = torch.utils._pytree.tree_flatten(out_node.args)[0] if out_node is not None else []
    for p, o in returned_recurrences(graph).items():
        pv, ov = p.meta.get("example_value"), o.meta.get("example_value")
        if not (isinstance(ov, torch.Tensor) and ov.shape == pv.shape and ov.dtype == pv.dtype) \
                or any(a is p for a in leaves):
            continue
        with graph.inserting_after(o):
            cp = graph.call_method("copy_", (p, o))
        cp.meta["example_value"] = pv
        cp.meta["nn_module_stack"] = o.meta.get("nn_module_stack", {})
        cp.meta["stack_trace"] = o.meta.get("stack_trace")
        out_node.args = torch.utils._pytree.tree_map(lambda a: p if a is o else a, out_node.args)
        done[p] = cp
    return done


def undo_write_in_place(graph: fx.Graph, state: fx.Node, cp: fx.Node) -> None:
    """Put back what :func:`write_returned_in_place` changed for ``state``: return the value written, drop the copy."""
    out_node = next(n for n in graph.nodes if n.op == "output")
    value = cp.args[1]
    out_node.args = torch.utils._pytree.tree_map(lambda a: value if a is state else a, out_node.args)
    graph.erase_node(cp)
