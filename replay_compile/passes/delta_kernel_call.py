"""The delta-rule decode step as a launch of fla's recurrent Triton kernels (Gated DeltaNet and KDA).

With fla (``flash-linear-attention``) installed, transformers' Gated DeltaNet and KDA mixers (Qwen3-Next, Qwen3.5,
Kimi-Linear and the families built on them) call ``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda``
for a single-token step. Dynamo records each as one launch that reads the cache's state and writes the new state
into a fresh fp32 buffer, which the cache then copies into its own tensor::

    o  = torch.empty_like(v)                      (zeros_like for KDA)
    ht = q.new_empty(B, HV, K, V, dtype=float32)
    triton_kernel_wrapper_mutation(kernel_idx=k, constant_args_idx=c, grid=[...], kwargs={
        q: q, k: k, v: v, g: g, [gk: gk,] beta: beta, [A_log: A_log, dt_bias: dt_bias,] o: o, h0: S, ht: ht})
    S.copy_(ht)                                   (the cache's ``update_recurrent_state``)

The kernels are recognised by their names (``fused_recurrent_gated_delta_rule_fwd_kernel``,
``fused_recurrent_kda_fwd_kernel``) and parameter names; model and module names play no part. Their semantics for
one token, in fp32, with ``q``, ``k``, ``v``, ``beta`` of shapes ``[B, 1, H, K]``, ``[B, 1, H, K]``,
``[B, 1, HV, V]``, ``[B, 1, HV]``::

    q, k  = q / sqrt(|q|² + 1e-6), k / sqrt(|k|² + 1e-6)          (USE_QK_L2NORM_IN_KERNEL)
    q     = q * scale
    g     = -exp(A_log) * softplus(g + dt_bias)                      (USE_GATE_IN_KERNEL; KDA: dt_bias per [HV, K])
    beta  = sigmoid(beta) [* 2]                                      (APPLY_BETA_SIGMOID [, ALLOW_NEG_EIGVAL])
    S' = exp(g) S;  d = beta (v - S'ᵀk);  S = S' + k dᵀ;  o = Sᵀ q   (g per head, or per key channel: gk / KDA)

which is the replay op's step once ``q`` and ``k`` are normalised and scaled: the rewrite computes those in the
graph, calls ``delta_step`` on the cache's state itself, copies its output into ``o`` and drops the launch, the
buffer and the copy back. A ``state_v_first`` launch (the state laid out ``[B, HV, V, K]``, as serving engines'
GDN pools keep it) is stepped through the state's transposed view. Launches outside that contract are left
unchanged with the reason: several tokens (``T > 1``: a prefill or a verify), packed sequences (``cu_seqlens``),
state indices (serving engines' pools), a gate along V (``gv``), a beta per value channel, KDA's lower-bounded
gate.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.proxy import GraphAppendingTracer, Proxy

from .delta import DeltaMatch
from .graph_utils import dtype, is_static_int, module_path, op_name, real_users, shape, strip
from .mamba2 import STATE_DTYPES, NoMatch, Recipe
from .rewrite import erase_dead, insert_step
from .triton_launch import kernel_call, launches

KERNELS = {"fused_recurrent_gated_delta_rule_fwd_kernel": "gdn", "fused_recurrent_kda_fwd_kernel": "kda"}
_NEEDED = ("q", "k", "v", "beta", "o", "h0", "ht")


def anchors(gm: fx.GraphModule) -> list[fx.Node]:
    """Launches of fla's recurrent delta-rule kernels."""
    return launches(gm, tuple(KERNELS))


@dataclasses.dataclass
class FlaCallMatch(DeltaMatch):
    """A :class:`~.delta.DeltaMatch` whose step is one kernel launch (``copy_node`` and ``readout`` are both the
    launch): ``out`` is the output buffer it writes, ``final`` the buffer it writes the new state into and
    ``writeback`` the cache's copy of that buffer into the state (``None`` where the launch writes the state
    itself)."""

    out: Optional[fx.Node] = None
    final: Optional[fx.Node] = None
    writeback: Optional[fx.Node] = None

    launch_new = property(lambda self: self.final)

    def launch_out(self, new: torch.Tensor, c: dict, value) -> torch.Tensor:
        return self.exact_readout(new, c).reshape(self.out_shape)


def _source(n):
    """What a launch argument holds: through ``contiguous`` / ``to`` / ``float`` (fla's ``input_guard`` makes every
    argument contiguous; a launch is recorded as writing all its tensors, so :func:`strip` does not follow these)."""
    while isinstance(n, fx.Node) and op_name(n) in ("contiguous", "to", "float") and n.args:
        n = n.args[0]
    return n


def writeback_of(node: fx.Node) -> fx.Node | None:
    """The ``S.copy_(ht)`` that stores a launch's final-state buffer into the state it read (``None`` if absent)."""
    call = kernel_call(node)
    if call is None:
        return None
    ht, h0 = call[1].get("ht"), call[1].get("h0")
    if not isinstance(ht, fx.Node) or not isinstance(h0, fx.Node):
        return None
    state = _source(h0)
    for u in _value_users(ht):
        if op_name(u) == "copy_" and len(u.args) >= 2 and strip(u.args[1]) is ht and strip(u.args[0]) is state:
            return u
    return None


def _value_users(n: fx.Node) -> list[fx.Node]:
    """Users of ``n`` and of its casts (``ht.to(S.dtype)``), casts themselves excluded."""
    out = []
    for u in real_users(n):
        if op_name(u) in ("to", "float", "type_as", "contiguous") and u.args and u.args[0] is n:
            out.extend(_value_users(u))
        else:
            out.append(u)
    return out


def _token(name: str, node: fx.Node, want: tuple) -> None:
    s = shape(node)
    if s is None or len(s) != len(want) or tuple(s[1:]) != want[1:]:
        raise NoMatch(f"`{name}` of shape {None if s is None else tuple(s)}: expected [batch, "
                      f"{', '.join(map(str, want[1:]))}]")


def match(node: fx.Node) -> FlaCallMatch:
    """Describe one launch, or raise :class:`NoMatch` with what the launch does that the replay step does not."""
    jit, tensors, consts = kernel_call(node)
    name = jit.fn.__name__
    kda_kernel = KERNELS[name] == "kda"
    args = {**consts, **tensors}
    missing = [p for p in _NEEDED if not isinstance(args.get(p), fx.Node)]
    if missing:
        raise NoMatch(f"a {name} launch without {missing}: not a decode step that reads and stores the state")
    for p, why in (("cu_seqlens", "packed sequences (cu_seqlens)"),
                   ("ssm_state_indices", "state indices (a serving engine's pool)"),
                   ("num_accepted_tokens", "speculative state indices"),
                   ("gv", "a gate along the value dim (gv)"),
                   ("lower_bound", "a lower-bounded gate")):
        if args.get(p) is not None:
            raise NoMatch(f"a {name} launch with {why}, which the replay step does not take")
    T = args.get("T")
    if T != 1:
        raise NoMatch(f"a launch over T={T} tokens: not a single-token decode step")
    state = _source(args["h0"])
    if state.op != "placeholder":
        raise NoMatch("the kernel's initial state is not a graph input (a cache tensor)")
    st = shape(state)
    if st is None or len(st) != 4:
        raise NoMatch(f"state of shape {st}: expected [batch, value heads, key dim, value dim]")
    v_first = bool(args.get("STATE_V_FIRST", False))
    b, HV, K, V = (st[0], st[1], st[3], st[2]) if v_first else st
    if dtype(state) not in STATE_DTYPES:
        raise NoMatch(f"state dtype {dtype(state)} is not supported")
    if not all(is_static_int(s) for s in (HV, K, V)):
        raise NoMatch(f"state {tuple(st)}: head and state dims must be static")
    q, k, v, beta, o, ht = (args[p] for p in ("q", "k", "v", "beta", "o", "ht"))
    H = shape(k)[2] if shape(k) is not None and len(shape(k)) == 4 else None
    if not isinstance(H, int) or H < 1 or HV % H:
        raise NoMatch(f"key heads of `k` {shape(k)} do not divide the state's {HV} value heads")
    _token("q", q, (b, 1, H, K))
    _token("k", k, (b, 1, H, K))
    _token("v", v, (b, 1, HV, V))
    _token("o", o, (b, 1, HV, V))
    if tuple((shape(beta) or ())[1:]) != (1, HV):
        raise NoMatch(f"`beta` of shape {shape(beta)}: expected one beta per head [batch, 1, {HV}] (a beta per "
                      f"value channel is not a rank-1 update the replay op takes)")

    if ht is not state:
        wb = writeback_of(node)
        if wb is None:
            raise NoMatch("the kernel's final state is not copied back into the state it read")
        extra = [u for u in _value_users(ht) if u is not node and u is not wb]
        if extra:
            raise NoMatch(f"the kernel's final state is also read by `{extra[0].name}`: the replay step keeps no "
                          "such copy")
        if real_users(wb):
            raise NoMatch("the result of the state write is used")
    else:
        wb = None
    for u in real_users(state):
        if u is not node and u is not wb and not (op_name(u) in ("contiguous", "to") and
                                                 set(real_users(u)) <= {node}):
            raise NoMatch(f"the state is also read by `{u.name}` ({op_name(u)}): that read would see the "
                          "checkpoint, not the state")

    # the gate: per head (g, GDN) or per key channel (gk, or KDA's g)
    g_node, gk_node = args.get("g"), args.get("gk")
    per_key = kda_kernel or gk_node is not None
    if not kda_kernel and isinstance(g_node, fx.Node) and isinstance(gk_node, fx.Node):
        raise NoMatch("a launch with both a per-head and a per-key-channel gate, which the replay op does not take")
    gate = gk_node if (not kda_kernel and gk_node is not None) else g_node
    if not isinstance(gate, fx.Node):
        raise NoMatch(f"a {name} launch without a gate")
    _token("gate", gate, (b, 1, HV, K) if per_key else (b, 1, HV))
    in_kernel = bool(args.get("USE_GATE_IN_KERNEL", False)) and not (not kda_kernel and gk_node is not None)
    A_log, bias = args.get("A_log"), args.get("dt_bias")
    g_src = [gate]
    if in_kernel:
        if kda_kernel and args.get("lower_bound") is not None:
            raise NoMatch("KDA's lower-bounded gate is not taken yet")
        if not kda_kernel and not isinstance(A_log, fx.Node):
            raise NoMatch("a gate computed in the kernel without A_log")
        g_src += [n for n in (A_log, bias) if isinstance(n, fx.Node)]
    has_A, has_bias = isinstance(A_log, fx.Node), isinstance(bias, fx.Node)

    def g_fn(gv, *rest):
        x = gv[:, 0].float()
        if not in_kernel:
            return x
        rest = list(rest)
        a = rest.pop(0).float() if has_A else None
        if has_bias:
            bv = rest.pop(0).float()
            x = x + (bv.reshape(HV, K) if per_key else bv.reshape(HV))
        e = torch.exp(a) if a is not None else torch.exp(torch.ones((), dtype=x.dtype, device=x.device))
        e = e.reshape(HV, 1) if per_key and a is not None else e
        return -e * F.softplus(x)                       # threshold 20, as fla's softplus

    l2 = bool(args.get("USE_QK_L2NORM_IN_KERNEL", False))
    scale = args.get("scale")
    if not isinstance(scale, (int, float)):
        raise NoMatch(f"scale {scale!r} is not a constant")
    sigmoid = bool(args.get("APPLY_BETA_SIGMOID", False))
    neg = bool(args.get("ALLOW_NEG_EIGVAL", False))

    def qk(x, s):
        x = x[:, 0].float()
        if l2:
            x = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        return x * s if s != 1.0 else x

    def beta_fn(x):
        x = x[:, 0].float()
        if sigmoid:
            x = torch.sigmoid(x)
            if neg:
                x = x * 2
        return x

    rec = torch.float64 if dtype(state) == torch.float64 else torch.float32
    return FlaCallMatch(
        layer=module_path(node, default=f"state input `{state.name}`"), form="fla kernel", copy_node=node,
        state=state, new=node, readout=node, old=state,
        HV=HV, Hk=H, Hq=H, K=K, V=V, kda=per_key,
        q=Recipe([q], lambda x: qk(x, float(scale))), k=Recipe([k], lambda x: qk(x, 1.0)),
        v=Recipe([v], lambda x: x[:, 0]), g=Recipe(g_src, g_fn), beta=Recipe([beta], beta_fn),
        out_shape=tuple(shape(o)), out_dtype=dtype(o), k_dtype=torch.float32, rec_dtype=rec,
        out=o, final=ht, writeback=wb, transposed=v_first)


def apply(gm: fx.GraphModule, m: FlaCallMatch, rings: list[fx.Node], spec) -> fx.Node:
    """Replace the launch by the replay op and ``o.copy_``; drop the copy back and the buffer. Returns the op."""
    graph = gm.graph
    tracer = GraphAppendingTracer(graph)
    node = m.copy_node
    with graph.inserting_before(node):
        op, _ = insert_step(graph, tracer, m, rings, spec)
        Proxy(m.out, tracer).copy_(Proxy(op, tracer).reshape(m.out_shape))
    roots = list(node.all_input_nodes)
    graph.erase_node(node)
    if m.writeback is not None:
        roots += m.writeback.all_input_nodes
        graph.erase_node(m.writeback)
    erase_dead(graph, [r for r in roots if r is not m.state])     # the buffer and its cast
    return op
