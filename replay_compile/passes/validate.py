"""Numerical check of matches before the graph is rewritten.

The original graph is run once, eagerly, on the example inputs the backend received (up to its last checked state
write or readout: nothing after it can change a check), with two changes that keep it side-effect free: each matched
state input is replaced by a random tensor (so the decay term is exercised even when the cache is still zero) and
every other input the graph writes in place is copied before its first write (so the user's caches are never
touched). While it runs, each match's recipes cut the compact tensors out of the live values and the exact step is
recomputed from them; the new state and the readout must agree with what the graph computed.
A wrong reading of the dataflow (a misplaced group, a decay that is not per head, a stray factor) shows up as an
O(1) relative error; rounding differences stay far below the tolerance.

Under tensor parallelism the graph also holds DTensor conversions and collectives (the all-reduce after a row-wise
projection). The check must not run those: it runs on one rank, at compile time, and a collective that only some
ranks enter hangs them all. So it runs on local shards: DTensor inputs are replaced by their local tensors,
``from_local`` / ``to_local`` / a shape-preserving ``redistribute`` become the identity, and functional collectives
become local stand-ins of the right shape. The values reaching the SSM update are then plausible rather than exact,
which is all the check needs: it compares the rewrite with the original on the same values.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .anchors import written_value
from .graph_utils import VIEW_LIKE, is_inplace, op_name


def tolerance(m) -> float:
    return 5e-2 if m.low_precision() else 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 22) -> float:
    """max |a - b| / max |b| over the finite elements; inf unless both have the same non-finite values at the same
    places (NaN where the other has NaN, the same infinities).

    Computed in fp64 over flat chunks of ``chunk`` elements, so checking a large state (a whole batch's checkpoint
    at compile time) costs a few fp64 temporaries of one chunk, not of the whole tensor. The usual case (both all
    finite: both maxima come out finite) takes two reductions per chunk, kept on the device, and two
    synchronisations; only tensors with a non-finite value go through the masked comparison (a bs64 CPU validation
    of 8 Mamba-2 layers spent 6.2 of its 7.9 s in the masked path).
    """
    a, b = a.reshape(-1), b.reshape(-1)
    if a.numel() != b.numel():
        return float("inf")
    if a.numel() == 0:
        return 0.0
    num = den = torch.zeros((), dtype=torch.float64, device=b.device)
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk].double(), b[i:i + chunk].double()
        num = torch.maximum(num, (x - y).abs().max())       # NaN / inf here iff either chunk holds a non-finite
        den = torch.maximum(den, y.abs().max())               # value (max and maximum propagate NaN)
    num, den = float(num), float(den)
    if math.isfinite(num) and math.isfinite(den):
        return num / (den + 1e-12)
    return _rel_err_masked(a, b, chunk)


def _rel_err_masked(a: torch.Tensor, b: torch.Tensor, chunk: int) -> float:
    """:func:`rel_err` for flat tensors where a NaN or an infinity is present: compare their positions first."""
    num, den, any_finite = 0.0, 0.0, False
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk].double(), b[i:i + chunk].double()
        fx_, fy = torch.isfinite(x), torch.isfinite(y)
        if not torch.equal(fx_, fy) or not torch.equal(torch.isnan(x), torch.isnan(y)) \
                or not torch.equal(x[torch.isinf(x)], y[torch.isinf(y)]):
            return float("inf")
        if fx_.any():
            any_finite = True
            x, y = x[fx_], y[fy]
            num = max(num, float((x - y).abs().max()))
            den = max(den, float(y.abs().max()))
    return num / (den + 1e-12) if any_finite else 0.0


def _inplace_root(n: fx.Node) -> fx.Node | None:
    t = n.args[0] if n.args else None
    while isinstance(t, fx.Node) and op_name(t) in VIEW_LIKE | {"transpose", "permute", "select", "narrow"}:
        t = t.args[0]
    return t if isinstance(t, fx.Node) and t.op == "placeholder" else None


_COLLECTIVE_IDENTITY = {"all_reduce", "all_reduce_", "wait_tensor", "broadcast", "broadcast_"}


def _is_dtensor(value) -> bool:
    return type(value).__name__ == "DTensor" and callable(getattr(value, "to_local", None))


def _makes_dtensor(n: fx.Node) -> bool:
    """A node that may turn a plain tensor into a DTensor (``DTensor.from_local``, ``distribute_tensor``)."""
    return n.op == "call_function" and any(k in _target_text(n.target) for k in ("from_local", "distribute_tensor",
                                                                                "DTensor"))


def _local(value):
    """The local shard of a DTensor (anything else unchanged)."""
    if _is_dtensor(value):
        return value.to_local()
    return value


def _target_text(target) -> str:
    """Name and repr of a call target: Dynamo may record ``DTensor.from_local`` as a function or as a
    ``functools.partial`` of it (no ``__name__``), depending on the torch version."""
    return f"{getattr(target, '__qualname__', '')} {getattr(target, '__name__', '')} {target}"


def _collective_free(n: fx.Node, args, kwargs):
    """``(True, value)`` when ``n`` is a DTensor conversion or a collective, run locally; else ``(False, None)``."""
    target = n.target
    name = getattr(target, "__name__", str(target))
    if n.op == "call_method" and target in ("to_local", "redistribute", "full_tensor"):
        return True, _local(args[0])
    if n.op != "call_function":
        return False, None
    first = _local(args[0]) if args else None
    if isinstance(first, torch.Tensor) and any(k in _target_text(target) for k in ("from_local", "to_local",
                                                                                   "redistribute")):
        return True, first
    ns = getattr(target, "namespace", None)          # OpOverload(Packet)s: "_c10d_functional"
    if not isinstance(ns, str):
        ns = str(getattr(target, "__module__", ""))   # torch.distributed._functional_collectives.all_reduce
    if "c10d_functional" not in ns and "_functional_collectives" not in ns:
        return False, None
    base = name.split(".")[0]
    t = args[0]
    if base in _COLLECTIVE_IDENTITY:
        return True, t
    if base in ("all_gather_into_tensor", "all_gather_tensor"):
        world = next((a for a in list(args[1:]) + list(kwargs.values()) if isinstance(a, int)), 1)
        return True, torch.cat([t] * world, dim=0)
    if base in ("reduce_scatter_tensor",):
        world = next((a for a in list(args[2:]) + list(kwargs.values()) if isinstance(a, int)), 1)
        return True, t.chunk(world, dim=0)[0].clone()
    return False, None


class _RandomState:
    """A recurrent state's random stand-in, made on first use: the run then holds one layer's state (and its
    reference) at a time, not every layer's at once."""

    def __init__(self, like: torch.Tensor, seed: int):
        self.shape, self.device, self.dtype, self.seed = tuple(like.shape), like.device, like.dtype, seed

    def make(self) -> torch.Tensor:
        # drawn on the state's own device: a bs512 Mamba-2 2.7B layer is 1.3 GB of fp32, seconds per layer with
        # the CPU generator (H200: compile 32.5 s vs 14.3 s plain at bs512, 8 Mamba-2 layers)
        try:
            g = torch.Generator(device=self.device).manual_seed(self.seed)
            out = torch.randn(self.shape, generator=g, dtype=torch.float32, device=self.device)
        except RuntimeError:                         # a device without its own generator
            g = torch.Generator(device="cpu").manual_seed(self.seed)
            out = torch.randn(self.shape, generator=g, dtype=torch.float32).to(self.device)
        return out.to(self.dtype)


class _Checker(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, matches: Sequence, dtensors: bool = True):
        super().__init__(gm, garbage_collect_values=True)
        self.matches = list(matches)
        # a kernel-call match's write and readout are one launch: checked around it (_run_kernel_call)
        self.by_call = {m.copy_node: m for m in matches if getattr(m, "out", None) is not None}
        self.by_copy = {m.copy_node: m for m in matches if m.copy_node not in self.by_call}
        self.by_readout = {m.readout: m for m in matches if m.readout not in self.by_call}
        # a slot pool's old rows are a gather, freed after its last use (the decay): kept for the reference
        self.by_old = {m.old: m for m in matches if m.old is not None and m.old is not m.state}
        self.olds: dict = {}
        self.need: dict[fx.Node, list] = {}
        for m in matches:
            for key, r in m.recipes.items():
                for s in r.sources:
                    self.need.setdefault(s, []).append((m, key))
        self.stash: dict = {}
        self.compact: dict = {id(m): {} for m in matches}
        self.ref_new: dict = {}
        self.errors: dict = {id(m): [] for m in matches}
        self.inputs: set[int] = set()
        self.current: fx.Node | None = None
        self.unused: list[fx.Node] = []
        # every check has run once its match's state write and readout have: the rest of the graph (later
        # attention layers, the final norm, the LM head) need not run
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        checked = [n for m in matches for n in (m.copy_node, getattr(m, "readout", None)) if n in order]
        self.last = max((order[n] for n in checked), default=len(order))
        self.order = order
        # whether a DTensor can reach an op (from the inputs or a node that makes one): where none can, the per-node
        # unwrapping of every argument (a tenth of the check's host time) is skipped
        self.dtensors = dtensors

    def run_node(self, n: fx.Node):
        if self.order[n] > self.last:
            return None
        for u in self.unused:                          # results nobody reads (an in-place op's alias of its input)
            self.env.pop(u, None)
        self.unused = [n] if not n.users and n.op != "output" else []
        for a in n.all_input_nodes:                    # states are made when their first user runs
            v = self.env.get(a)
            if isinstance(v, _RandomState):
                self.env[a] = v.make()
                self.inputs.add(id(self.env[a]))
        if n in self.by_copy:
            self._check_new(self.by_copy[n], n)
        if is_inplace(n) and n not in self.by_copy:
            self._copy_on_write(n)
        self.current = n
        if n in self.by_call:
            return self._run_kernel_call(self.by_call[n], n)
        if n.op in ("call_function", "call_method"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            local, out = _collective_free(n, args, kwargs)
            if not local:       # no DTensor reaches an op: it would dispatch (and communicate) as a DTensor
                if self.dtensors:
                    args, kwargs = pytree.tree_map(_local, (args, kwargs))
                out = getattr(self, n.op)(n.target, args, kwargs)
        else:
            out = super().run_node(n)
        if n.op == "placeholder" and isinstance(out, torch.Tensor):
            self.inputs.add(id(out))
        for m, key in self.need.get(n, ()):
            self._collect(m, key, n, out)
        if n in self.by_old:
            self.olds[id(self.by_old[n])] = out
        if n in self.by_readout:
            self._check_readout(self.by_readout[n], out)
        return out

    def _run_kernel_call(self, m, n: fx.Node):
        """A Triton kernel launch that is a match's state write and readout: the exact new state and output from
        the compact tensors first (the launch mutates the state), then the launch, then both compared."""
        ref = self._reference(m)
        if isinstance(ref, str):
            self.errors[id(m)].extend([ref, ref])
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        value = lambda node: self.env[node] if node is not None else None  # noqa: E731
        want = None if isinstance(ref, str) else m.launch_out(ref, self.compact[id(m)], value)
        _launch(n, kwargs)
        if want is not None:
            self.errors[id(m)].append(("new state", rel_err(self.env[m.launch_new].reshape(ref.shape), ref)))
            self.errors[id(m)].append(("readout", rel_err(self.env[m.out], want)))
            self._done(m)
        return None

    def _copy_on_write(self, n: fx.Node):
        target = self.env.get(n.args[0]) if isinstance(n.args[0], fx.Node) else None
        if isinstance(target, torch.Tensor) and id(target) in self.inputs:
            clone = target.clone()
            for k, v in list(self.env.items()):
                if v is target:
                    self.env[k] = clone

    def _collect(self, m, key, node, value):
        r = m.recipes[key]
        slot = self.stash.setdefault((id(m), key), {})
        slot[node] = value
        if all(s in slot for s in r.sources):
            self.compact[id(m)][key] = r([slot[s] for s in r.sources])
            del self.stash[(id(m), key)]

    def _reference(self, m):
        """The exact new state from the compact tensors and the (random) state, computed once; the state write and
        the readout may come in either order (transformers' GDN reads out before it writes the cache)."""
        if id(m) not in self.ref_new:
            c = self.compact[id(m)]
            missing = set(m.new_keys) - set(c)
            if missing:
                return f"could not evaluate {sorted(missing)} before the state write or readout"
            old = self.olds.pop(id(m)) if id(m) in self.olds else self.env[m.state]
            self.ref_new[id(m)] = m.exact_new(old, c)
        return self.ref_new[id(m)]

    def _done(self, m):
        """Both checks of ``m`` ran: drop its reference state (one full state per layer otherwise kept)."""
        if len(self.errors[id(m)]) >= 2:
            self.ref_new.pop(id(m), None)

    def _check_new(self, m, cp: fx.Node):
        ref = self._reference(m)
        if isinstance(ref, str):
            self.errors[id(m)].append(ref)
            return
        self.errors[id(m)].append(("new state", rel_err(self.env[written_value(cp)], ref)))
        self._done(m)

    def _check_readout(self, m, out: torch.Tensor):
        ref = self._reference(m)
        if isinstance(ref, str) or not set(m.recipes) <= set(self.compact[id(m)]):
            self.errors[id(m)].append(ref if isinstance(ref, str) else "readout operands could not be evaluated")
            return
        y = m.exact_readout(ref, self.compact[id(m)])
        self.errors[id(m)].append(("readout", rel_err(out.reshape(y.shape), y)))
        self._done(m)


def _launch(n: fx.Node, kwargs: dict) -> None:
    """Run a Triton-kernel launch node; on CPU tensors through Triton's interpreter (the compiled kernel needs a
    GPU; CPU tests of the kernel-call anchor validate this way)."""
    tensors = [v for v in kwargs["kwargs"].values() if isinstance(v, torch.Tensor)]
    if not tensors or tensors[0].device.type != "cpu":
        n.target(**kwargs)
        return
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.interpreter import InterpretedFunction

    from .triton_launch import heuristic_values, jit_function

    kernel = kernel_side_table.get_kernel(kwargs["kernel_idx"])
    consts = kernel_side_table.get_constant_args(kwargs["constant_args_idx"])
    args = {**kwargs["kwargs"], **consts}
    args.update(heuristic_values(kernel, args))
    jit = jit_function(kernel)
    # a kernel parameter named like a launch option (fla's ``num_stages``) is taken by the launcher, not recorded
    args.update({p: 1 for p in jit.arg_names if p not in args and p in ("num_stages", "num_warps", "num_ctas")})
    grid = kwargs["grid"][0]
    InterpretedFunction(jit.fn)[tuple(grid)](**args)


def _concrete(a):
    """Dynamo hands symbolic sizes as SymInts; the check runs on their example (hint) values."""
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return a.node.hint
    return a


def validate(gm: fx.GraphModule, example_inputs: Sequence, matches: Sequence) -> dict[int, str]:
    """Run the check; return ``{id(match): reason}`` for the matches that failed (empty: all good)."""
    if not matches:
        return {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return {id(m): "example inputs do not line up with the graph's inputs" for m in matches}
    dtensors = any(_is_dtensor(a) for a in example_inputs) or any(_makes_dtensor(n) for n in gm.graph.nodes)
    args = [_local(_concrete(a)) for a in example_inputs]
    if any(a is None for a in args):
        return {id(m): "a symbolic size has no concrete example value" for m in matches}
    pos = {p: i for i, p in enumerate(placeholders)}
    for i, m in enumerate(matches):
        args[pos[m.state]] = _RandomState(args[pos[m.state]], seed=i)
    # inputs written through a view cannot be redirected lazily: copy them up front
    for n in gm.graph.nodes:
        if is_inplace(n) and n not in {m.copy_node for m in matches}:
            root = _inplace_root(n)
            if root is not None and root is not n.args[0] and isinstance(args[pos[root]], torch.Tensor):
                args[pos[root]] = args[pos[root]].clone()
    checker = _Checker(gm, matches, dtensors)
    # inputs go in through the environment (not run()'s argument tuple) so that each is freed after its last use
    env = dict(zip(placeholders, args))
    del args
    checker.inputs.update(id(v) for v in env.values() if isinstance(v, torch.Tensor))
    # graph inputs that are recipe sources themselves (x, B of a launch; a state whose rows a shared decay is
    # expanded over: its random stand-in has the shape)
    for node, value in env.items():
        if isinstance(value, (torch.Tensor, _RandomState)):
            for m, key in checker.need.get(node, ()):
                checker._collect(m, key, node, value)
    with torch.no_grad():
        try:
            # the output node is skipped too (its inputs may not have run): no output processing
            checker.run(initial_env=env, enable_io_processing=False)
        except Exception as e:  # noqa: BLE001 - any failure means we cannot vouch for the rewrite
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            at = checker.current
            where = f" (at `{at.name}` = {at.op} {_target_text(at.target).strip()[:120]})" if at is not None else ""
            return {id(m): f"validation run failed: {type(e).__name__}: {first}{where}" for m in matches}
    failed = {}
    for m in matches:
        tol = tolerance(m)
        msgs = []
        for e in checker.errors[id(m)]:
            if isinstance(e, str):
                msgs.append(e)
            elif not e[1] <= tol:
                msgs.append(f"{e[0]} differs by {e[1]:.3g} (relative, tolerance {tol:g})")
        if len(checker.errors[id(m)]) < 2 and not msgs:
            msgs.append("the state write or the readout did not run")
        if msgs:
            failed[id(m)] = "numerical check failed: " + "; ".join(msgs)
    return failed
