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

from .graph_utils import dtype, is_static_int, module_path, op_name, shape
from .mamba1 import Mamba1Match
from .mamba2 import STATE_DTYPES, Mamba2Match, NoMatch, Recipe
from .rewrite import insert_step
from .triton_launch import kernel_call, launches

KERNEL = "_selective_scan_update_kernel"
_TENSOR_PARAMS = ("state_ptr", "x_ptr", "dt_ptr", "dt_bias_ptr", "A_ptr", "B_ptr", "C_ptr", "D_ptr", "z_ptr",
                  "out_ptr", "state_batch_indices_ptr")
_NEEDED = ("state_ptr", "x_ptr", "dt_ptr", "A_ptr", "B_ptr", "C_ptr", "out_ptr")


def anchors(gm: fx.GraphModule) -> list[fx.Node]:
    """Launches of a kernel named like mamba_ssm's state-update kernel."""
    return launches(gm, (KERNEL,))


def _skip_and_gate(y, x, D, z):
    """mamba_ssm's epilogue on the readout ``y`` (fp32): ``+ D x`` (HAS_D), ``* z sigmoid(z)`` (HAS_Z)."""
    if D is not None:
        y = y + x.to(y.dtype) * D.to(y.dtype)
    if z is not None:
        zf = z.to(y.dtype)
        y = y * (zf * torch.sigmoid(zf))
    return y


@dataclasses.dataclass
class KernelCallMatch(Mamba2Match):
    """A :class:`~.mamba2.Mamba2Match` whose write and readout are one kernel launch (``copy_node`` and ``readout``
    are both the launch node); ``D``, ``z``, ``out`` and ``slot`` are the launch's other operands."""

    D: Optional[fx.Node] = None
    z: Optional[fx.Node] = None
    out: Optional[fx.Node] = None

    def finish(self, y, x, D, z):
        """``out`` from the readout ``y [b, H, P]`` (fp32): ``+ D x``, ``* z sigmoid(z)``; tensors or proxies."""
        return _skip_and_gate(y, x, D, z)

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
    if _mamba1_launch(state):
        return match_mamba1(node, args, layer)
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


def _mamba1_launch(state) -> bool:
    """mamba_ssm's Mamba-1 form: a 3-D state ``[b, D, N]`` launched as ``state.unsqueeze(1)`` (one head)."""
    if op_name(state) != "unsqueeze" or not state.args or not isinstance(state.args[0], fx.Node):
        return False
    base, dim = state.args[0], (state.args[1] if len(state.args) > 1 else state.kwargs.get("dim"))
    return base.op == "placeholder" and dim == 1 and shape(base) is not None and len(shape(base)) == 3


@dataclasses.dataclass
class Mamba1KernelCallMatch(Mamba1Match):
    """A Mamba-1 step launched as mamba_ssm's kernel on a one-head view of the 3-D state: write and readout are the
    launch; ``D``, ``z``, ``out`` its other operands (``out`` [b, 1, D])."""

    D_: Optional[fx.Node] = None
    z: Optional[fx.Node] = None
    out: Optional[fx.Node] = None
    x: Optional[Recipe] = None

    view: Optional[fx.Node] = None          # the launch's one-head view of the state

    # the node holding the new state after the launch: the view (the state itself may be freed by then)
    launch_new = property(lambda self: self.view)

    def finish(self, y, x, D, z):
        """``out`` from the readout ``y [b, D]``: ``+ D x``, ``* z sigmoid(z)``, the head dim put back."""
        return _skip_and_gate(y, x, D, z).unsqueeze(1)

    def launch_out(self, new: torch.Tensor, c: dict, value) -> torch.Tensor:
        D = value(self.D_)
        z = value(self.z)
        return self.finish(self.exact_readout(new, c), c["x"], None if D is None else D[0],
                           None if z is None else z[:, 0])

    @property
    def recipes(self) -> dict:
        return {**super().recipes, "x": self.x}


def match_mamba1(node: fx.Node, args: dict, layer: str) -> Mamba1KernelCallMatch:
    """The launch's Mamba-1 step: ``dt' = softplus(dt + dt_bias)``, ``u = dt' x``, ``A [D, N]``, ``B``, ``C``."""
    state = args["state_ptr"].args[0]
    b, D, N = shape(state)
    if dtype(state) not in STATE_DTYPES:
        raise NoMatch(f"state dtype {dtype(state)} is not supported")
    if not (is_static_int(D) and is_static_int(N)):
        raise NoMatch(f"state {tuple(shape(state))}: channel and state dims must be static")
    if args.get("nheads_ngroups_ratio") != 1:
        raise NoMatch("a one-head Mamba-1 launch with B/C groups is not a form mamba_ssm makes")
    x, dt, A, B, C = (args[k] for k in ("x_ptr", "dt_ptr", "A_ptr", "B_ptr", "C_ptr"))
    for name, node_, want in (("x", x, (1, D)), ("dt", dt, (1, D)), ("A", A, (1, D, N)), ("B", B, (1, N)),
                              ("C", C, (1, N))):
        s = shape(node_)
        if s is None or tuple(s[-len(want):]) != want:
            raise NoMatch(f"{name} of shape {s}: expected [..., {', '.join(map(str, want))}]")
    if args.get("HAS_STATE_BATCH_INDICES", args.get("state_batch_indices_ptr") is not None):
        raise NoMatch("a launch with state_batch_indices (serving-engine cache slots) is not rewritten yet")
    bias = args.get("dt_bias_ptr") if args.get("HAS_DT_BIAS", args.get("dt_bias_ptr") is not None) else None
    softplus = bool(args.get("DT_SOFTPLUS", False))

    def dt_fn(dt_v, *bias_v):
        d = dt_v[:, 0].float()
        if bias_v:
            d = d + bias_v[0][0].float()
        return F.softplus(d) if softplus else d

    dt_src = [dt] + ([bias] if isinstance(bias, fx.Node) else [])
    Dp = args.get("D_ptr") if args.get("HAS_D", args.get("D_ptr") is not None) else None
    z = args.get("z_ptr") if args.get("HAS_Z", args.get("z_ptr") is not None) else None
    x_dt = dtype(x)
    return Mamba1KernelCallMatch(
        layer=layer, form="mamba_ssm kernel", copy_node=node, state=state, new=node, readout=node,
        old=args["state_ptr"], D=D, N=N,
        u=Recipe([x] + dt_src, lambda xv, *r: (xv[:, 0].float() * dt_fn(*r)).contiguous()),
        dt=Recipe(dt_src, lambda *r: dt_fn(*r).contiguous()), A=Recipe([A], lambda v: v[0].float().contiguous()),
        B=Recipe([B], lambda v: v[:, 0].float().contiguous()), C=Recipe([C], lambda v: v[:, 0].float().contiguous()),
        out_shape=tuple(shape(args["out_ptr"])), out_dtype=x_dt,
        rec_dtype=torch.float64 if dtype(state) == torch.float64 else torch.float32,
        D_=Dp if isinstance(Dp, fx.Node) else None, z=z if isinstance(z, fx.Node) else None, out=args["out_ptr"],
        x=Recipe([x], lambda v: v[:, 0]), view=args["state_ptr"])


def apply(gm: fx.GraphModule, m: KernelCallMatch, rings: list[fx.Node], spec) -> fx.Node:
    """Replace the launch by the replay op, ``D``/``z`` as graph ops and ``out.copy_``; returns the op node."""
    graph = gm.graph
    tracer = GraphAppendingTracer(graph)
    node = m.copy_node
    with graph.inserting_before(node):
        op, vals = insert_step(graph, tracer, m, rings, spec)
        p = (lambda n: Proxy(n, tracer) if n is not None else None)
        if isinstance(m, Mamba1KernelCallMatch):         # one-head views: D [1, D], z [b, 1, D]
            Dv, zv = p(m.D_), p(m.z)
            y = m.finish(Proxy(op, tracer), Proxy(vals["x"], tracer), None if Dv is None else Dv[0],
                         None if zv is None else zv[:, 0])
        else:
            y = m.finish(Proxy(op, tracer), Proxy(vals["x"], tracer), p(m.D), p(m.z))
        Proxy(m.out, tracer).copy_(y)
    graph.erase_node(node)
    return op
