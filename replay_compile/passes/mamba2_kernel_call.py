"""The second Mamba-2 anchor: the decode step as a launch of mamba_ssm's Triton kernel.

When ``mamba_ssm`` (with ``causal_conv1d``, or through the kernel hub) is installed, transformers' Mamba-2 mixers
call ``mamba_ssm.ops.triton.selective_state_update`` instead of the PyTorch update. Dynamo records that function's
launch as one higher-order op which mutates the state and an output buffer in place::

    out = torch.empty_like(x)
    triton_kernel_wrapper_mutation(kernel_idx=k, constant_args_idx=c, grid=[...], kwargs={
        state_ptr: S, x_ptr: x, dt_ptr: dt, dt_bias_ptr: dt_bias, A_ptr: A, B_ptr: B, C_ptr: C, D_ptr: D,
        [z_ptr: z,] [state_batch_indices_ptr: idx,] out_ptr: out})

Tensor arguments are graph nodes; sizes, strides and constexprs (``DT_SOFTPLUS``, ``TIE_HDIM``, ``HAS_*``) are in
Dynamo's kernel side table. The kernel is recognised by its name ``_selective_scan_update_kernel`` and its
parameter names (no model or module names). Its semantics, in fp32 (``TIE_HDIM``: ``dt``, ``dt_bias`` and ``A``
constant along the head dim, as transformers passes them: expanded per-head values)::

    dt' = softplus(dt[..., 0] + dt_bias[:, 0])            (DT_SOFTPLUS; the bias only with HAS_DT_BIAS)
    S   = exp(A[:, 0, 0] dt') S + dt' x ⊗ B_g             (the state, written in place)
    out = S C_g + D x  [* z sigmoid(z)]                     (HAS_D, HAS_Z)

so the replay op gets ``x``, ``dt'``, ``la = A dt'``, ``B``, ``C``, and ``D``/``z`` stay as graph ops after it;
``out.copy_`` replaces the launch. Other forms are left unchanged with the reason: ``TIE_HDIM=False`` (a
per-channel ``dt``) and launches with ``state_batch_indices`` (serving engines' cache slots; transformers passes
none).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.proxy import GraphAppendingTracer, Proxy

from .graph_utils import dtype, is_static_int, module_path, shape
from .mamba2 import STATE_DTYPES, Mamba2Match, NoMatch, Recipe
from .triton_launch import kernel_call, launches

KERNEL = "_selective_scan_update_kernel"
_TENSOR_PARAMS = ("state_ptr", "x_ptr", "dt_ptr", "dt_bias_ptr", "A_ptr", "B_ptr", "C_ptr", "D_ptr", "z_ptr",
                  "out_ptr", "state_batch_indices_ptr")
_NEEDED = ("state_ptr", "x_ptr", "dt_ptr", "A_ptr", "B_ptr", "C_ptr", "out_ptr")


def anchors(gm: fx.GraphModule) -> list[fx.Node]:
    """Launches of a kernel named like mamba_ssm's state-update kernel."""
    return launches(gm, (KERNEL,))


@dataclasses.dataclass
class KernelCallMatch(Mamba2Match):
    """A :class:`~.mamba2.Mamba2Match` whose write and readout are one kernel launch (``copy_node`` and ``readout``
    are both the launch node); ``D``, ``z``, ``out`` and ``slot`` are the launch's other operands."""

    D: Optional[fx.Node] = None
    z: Optional[fx.Node] = None
    out: Optional[fx.Node] = None

    def finish(self, y, x, D, z):
        """``out`` from the readout ``y [b, H, P]`` (fp32): ``+ D x``, ``* z sigmoid(z)``; tensors or proxies."""
        if D is not None:
            y = y + x.to(y.dtype) * D.to(y.dtype)
        if z is not None:
            zf = z.to(y.dtype)
            y = y * (zf * torch.sigmoid(zf))
        return y

    def exact_out(self, new: torch.Tensor, c: dict, D, z, x) -> torch.Tensor:
        return self.finish(self.exact_readout(new, c), x, D, z)

    # the numerical check's view of a launch (shared with the other kernel-call anchors): the node holding the new
    # state once the launch ran (the kernel writes the cache itself), and the output the launch should write
    launch_new = property(lambda self: self.state)

    def launch_out(self, new: torch.Tensor, c: dict, value) -> torch.Tensor:
        return self.exact_out(new, c, value(self.D), value(self.z), c["x"])


def match(node: fx.Node) -> KernelCallMatch:
    jit, tensors, consts = kernel_call(node)
    args = {**consts, **tensors}
    missing = [p for p in _TENSOR_PARAMS if p not in args] + [p for p in _NEEDED if not isinstance(args.get(p),
                                                                                                 fx.Node)]
    if missing:
        raise NoMatch(f"a {KERNEL} launch without {sorted(set(missing))}: not the mamba_ssm signature we know")
    state = args["state_ptr"]
    layer = module_path(node, default=f"state input `{state.name}`")
    if state.op != "placeholder":
        raise NoMatch("the kernel's state is not a graph input (a cache tensor)")
    if not args.get("TIE_HDIM", False):
        raise NoMatch("TIE_HDIM=False: dt and A vary along the head dim, which the replay step does not take")
    st = shape(state)
    if st is None or len(st) != 4:
        raise NoMatch(f"state of shape {st}: expected [batch, heads, head_dim, state_dim]")
    b, H, P, N = st
    if dtype(state) not in STATE_DTYPES:
        raise NoMatch(f"state dtype {dtype(state)} is not supported")
    if not all(is_static_int(s) for s in (H, P, N)):
        raise NoMatch(f"state {tuple(st)}: head and state dims must be static")
    ratio = args.get("nheads_ngroups_ratio")
    if not isinstance(ratio, int) or ratio < 1 or H % ratio:
        raise NoMatch(f"nheads_ngroups_ratio {ratio!r} does not divide {H} heads")
    G = H // ratio
    x, dt, A, B, C = (args[k] for k in ("x_ptr", "dt_ptr", "A_ptr", "B_ptr", "C_ptr"))
    for name, node_, want in (("x", x, (H, P)), ("dt", dt, (H, P)), ("A", A, (H, P, N)), ("B", B, (G, N)),
                              ("C", C, (G, N))):
        s = shape(node_)
        if s is None or tuple(s[-len(want):]) != want:
            raise NoMatch(f"{name} of shape {s}: expected [..., {', '.join(map(str, want))}]")
    bias = args.get("dt_bias_ptr") if args.get("HAS_DT_BIAS", args.get("dt_bias_ptr") is not None) else None
    softplus = bool(args.get("DT_SOFTPLUS", False))

    def dt_fn(dt_v, *bias_v):
        d = dt_v[:, :, 0].float()
        if bias_v:
            d = d + bias_v[0][:, 0].float()
        return F.softplus(d) if softplus else d       # threshold 20, as the kernel's softplus

    dt_src = [dt] + ([bias] if isinstance(bias, fx.Node) else [])
    D = args.get("D_ptr") if args.get("HAS_D", args.get("D_ptr") is not None) else None
    z = args.get("z_ptr") if args.get("HAS_Z", args.get("z_ptr") is not None) else None
    if args.get("HAS_STATE_BATCH_INDICES", args.get("state_batch_indices_ptr") is not None):
        # the kernel writes 0 for a padding row (index < 0) before D and z; not mapped (nor tested) yet
        raise NoMatch("a launch with state_batch_indices (serving-engine cache slots) is not rewritten yet")
    slot = None
    x_dt = dtype(x)
    return KernelCallMatch(
        layer=layer, form="mamba_ssm kernel", copy_node=node, state=state, new=node, readout=node,
        H=H, P=P, N=N, G=G, Gc=G,
        la=Recipe([A] + dt_src, lambda a, *r: a[:, 0, 0].float() * dt_fn(*r)),
        dt=Recipe(dt_src, dt_fn), x=Recipe([x], lambda v: v), B=Recipe([B], lambda v: v), C=Recipe([C], lambda v: v),
        out_shape=tuple(shape(x)), out_dtype=x_dt, x_dtype=x_dt, B_dtype=dtype(B),
        rec_dtype=torch.float64 if dtype(state) == torch.float64 else torch.float32,
        D=D if isinstance(D, fx.Node) else None, z=z if isinstance(z, fx.Node) else None,
        out=args["out_ptr"], slot=slot if isinstance(slot, fx.Node) else None)


def apply(gm: fx.GraphModule, m: KernelCallMatch, rings: list[fx.Node], spec) -> fx.Node:
    """Replace the launch by the replay op, ``D``/``z`` as graph ops and ``out.copy_``; returns the op node."""
    graph = gm.graph
    tracer = GraphAppendingTracer(graph)
    node = m.copy_node
    with graph.inserting_before(node):
        vals = {k: r([Proxy(s, tracer) for s in r.sources]).node for k, r in m.recipes.items()}
        target, extra = spec.step_op
        op = graph.call_function(target, (m.state, *rings, *(vals[k] for k in m.op_keys), m.slot, *extra))
        op.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        op.meta["stack_trace"] = node.meta.get("stack_trace")
        p = (lambda n: Proxy(n, tracer) if n is not None else None)
        y = m.finish(Proxy(op, tracer), Proxy(vals["x"], tracer), p(m.D), p(m.z))
        Proxy(m.out, tracer).copy_(y)
    graph.erase_node(node)
    return op
