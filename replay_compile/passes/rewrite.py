"""Apply a match (:class:`~.mamba2.Mamba2Match`, :class:`~.delta.DeltaMatch`): replace the state write and its
readout with one replay op.

Before::

    new = S * exp(a) + dt * B * x ;  S.copy_(new) ;  y = bmm(new.view(...), C.view(...))

After::

    y = replay_compile.mamba2_step(S, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, None)
          .to(y.dtype).reshape(y.shape)

(with ``read_copy``: ``replay_compile.mamba2_step_rc(S, x_ring, dt_ring, la_ring, B_ring, copy0, copy1, copy2,
cursor, x, dt, la, B, C, None, fmt)``, the copy's storage as three more placeholders)

(likewise ``replay_compile.delta_step(S, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, None)`` for GDN/KDA).
The rings and cursor enter the graph as new placeholders appended after the existing ones; the backend's runner
passes the right tensors for the cache state it is given. Nodes that only fed the removed write/readout are erased.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx
from torch.fx.proxy import GraphAppendingTracer, Proxy

from .. import ops  # noqa: F401 - registers torch.ops.replay_compile
from .graph_utils import is_inplace


def ring_spec(m, L: int, read_copy: str | None = None):
    """The match's ring spec, with the read-copy format if one is configured."""
    spec = m.ring_spec(L)
    return dataclasses.replace(spec, read_copy=read_copy) if read_copy else spec


def _fake_rings(m, spec) -> tuple:
    """Fake ring tensors whose slot count is the state's own (possibly symbolic) batch size. A ``ReplayTensor``
    state's fake is a wrapper around a fake checkpoint: the fake mode is the checkpoint's."""
    from ..replay_tensor import checkpoint_of

    sv = checkpoint_of(m.state.meta["example_value"])
    mode = getattr(sv, "fake_mode", None)
    if mode is None:
        return spec.allocate(sv.shape[0], sv.device)
    with mode:
        return spec.allocate(sv.shape[0], sv.device)


def add_ring_placeholders(gm: fx.GraphModule, m, spec, index: int) -> list[fx.Node]:
    graph = gm.graph
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    fakes = _fake_rings(m, spec)
    out = []
    with graph.inserting_after(last):
        names = spec.ring_names
        assert len(names) == len(fakes), (names, len(fakes))
        for name, fake in reversed(list(zip(names, fakes))):
            ph = graph.placeholder(f"replay{index}_{name}")
            ph.meta["example_value"] = fake
            ph.meta["val"] = fake
            # AOT autograd expects every Dynamo placeholder to carry a source; None marks one created by a pass.
            ph._dynamo_source = None
            # Rings live as long as their cache tensor and never move: static inputs for CUDA graphs (no copy-in).
            ph.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
            out.append(ph)
    return list(reversed(out))


def erase_dead(graph: fx.Graph, roots: list) -> None:
    """Erase nodes that fed only removed nodes (pure ops only; in-place writes are never erased)."""
    todo, erased = [r for r in roots if isinstance(r, fx.Node)], set()
    while todo:
        n = todo.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method") or is_inplace(n):
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
        todo.extend(inputs)


def insert_step(graph: fx.Graph, tracer, m, rings: list[fx.Node], spec=None) -> tuple[fx.Node, dict]:
    """At the graph's insertion point: the match's compact tensors (its recipes, by key) and the step op that takes
    them (``spec`` picks it: with a read copy ``mamba2_step_rc`` and its format; else the match's own op)."""
    vals = {key: r([Proxy(s, tracer) for s in r.sources]).node for key, r in m.recipes.items()}
    target, extra = spec.step_op if spec is not None else (m.op, ())
    # a [b, H, N, P] state is stepped through its transposed view: the cache keeps its layout, nothing is copied
    state = Proxy(m.state, tracer).transpose(-2, -1).node if getattr(m, "transposed", False) else m.state
    head = getattr(m, "head", None)
    if head is not None:                # one head of a state stepped head by head: its slices of state and rings
        sel = lambda n, d: Proxy(n, tracer).select(d, head).node  # noqa: E731
        state = sel(m.state, 1)
        rings = [sel(r, 1) for r in rings[:3]] + [sel(r, 0) for r in rings[3:]]
    op = graph.call_function(target, (state, *rings, *(vals[k] for k in m.op_keys), m.slot, *extra))
    op.meta["nn_module_stack"] = m.copy_node.meta.get("nn_module_stack", {})
    op.meta["stack_trace"] = m.copy_node.meta.get("stack_trace")
    return op, vals


def apply(gm: fx.GraphModule, m, rings: list[fx.Node], spec=None) -> fx.Node:
    """Rewrite one match in place; returns the op node. ``spec`` (the ring spec) picks the op: with a read copy,
    ``mamba2_step_rc`` and its format argument; without one, the match's own op."""
    graph = gm.graph
    tracer = GraphAppendingTracer(graph)
    with graph.inserting_before(m.readout):
        op, _ = insert_step(graph, tracer, m, rings, spec)
        y = Proxy(op, tracer).to(m.out_dtype).reshape(m.out_shape).node
    m.readout.replace_all_uses_with(y)
    roots = list(m.readout.all_input_nodes) + list(m.copy_node.all_input_nodes)
    graph.erase_node(m.readout)
    graph.erase_node(m.copy_node)
    erase_dead(graph, [r for r in roots if r is not m.readout and r is not m.copy_node])
    return op
