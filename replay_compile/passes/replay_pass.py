"""The ReplaySSM graph pass: find every SSM state update, check it, rewrite it, report it.

``ReplaySSMPass(config)(gm, example_inputs)`` mutates ``gm`` and returns a :class:`PassResult` with one
:class:`Rewrite` per rewritten layer (and the :class:`Site` the runner needs to feed its rings) and one
:class:`Skip` per state write left alone, with the reason. Each rewrite logs one line and bumps
``torch._dynamo.utils.counters["replay_compile"][family]``; each skip logs one line.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import inspect
import logging
from typing import Sequence

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from .._logging import log, timed_phase
from ..config import ReplayConfig
from ..errors import ReplayCompileError
from . import anchors as anchor_mod
from . import broadcast, canonical, delta, graph_utils, mamba1, mamba2, rewrite, state_writes, triton_launch, validate
from . import delta_kernel_call as fla_call
from . import mamba2_kernel_call as kernel_call
from .delta import DeltaMatcher
from .graph_utils import shape
from .mamba2 import Mamba2Matcher, NoMatch

PER_CHANNEL = ("a state [batch, (heads,) channels, states] updated as exp(dt A) S + update with a decay per "
               "(channel, state) (Mamba-1's recurrence), in a form the Mamba-1 rewrite does not read")


OPT_IN = ("family 'mamba1' is not enabled: it is opt-in (options={'families': ('mamba2', 'gdn', 'kda', 'mamba1')}); "
          "its replay step measured 1.05-1.15x the exact step at batch 256-512 on an H200 and slower below batch 64 "
          "(docs/design/mamba1.md)")


@dataclasses.dataclass(frozen=True)
class Rewrite:
    layer: str
    family: str
    form: str
    spec: object            # Mamba2RingSpec or DeltaRingSpec
    detail: str = ""

    def __str__(self):
        return f"{self.layer}: {self.family} [{self.form}] {self.detail}".rstrip()


@dataclasses.dataclass(frozen=True)
class Skip:
    layer: str
    reason: str
    quiet: bool = False     # a write that is plainly not a recurrent-state step (state_writes.why_not_a_step)

    def __str__(self):
        return f"{self.layer}: left unchanged: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Site:
    """What the runner needs for one rewritten layer: which input is the state, its ring layout, and whether the
    state is a pool whose rows the step picks by slot."""

    state_index: int
    spec: object
    layer: str
    pooled: bool = False


@dataclasses.dataclass
class PassResult:
    """What the pass did to one graph. ``ops_before``/``ops_after`` count canonical op names (for tests/explain)."""

    gm: fx.GraphModule | None = None
    rewrites: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    sites: list = dataclasses.field(default_factory=list)
    fake_inputs: list = dataclasses.field(default_factory=list)
    ops_before: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ops_after: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    returns_state: bool = False     # a stepped state is returned for the caller to store (a returned next state)
    attention: list = dataclasses.field(default_factory=list)   # layers whose decode attention was rewritten
    convs: list = dataclasses.field(default_factory=list)       # layers whose depthwise conv was rewritten
    note: str = ""                  # why the graph as a whole was left to the lowering

    def __repr__(self) -> str:
        parts = [f"{len(self.rewrites)} rewritten", f"{len(self.skipped)} left unchanged"]
        if self.attention:
            parts.append(f"{len(self.attention)} decode attention")
        if self.convs:
            parts.append(f"{len(self.convs)} decode conv")
        lines = [f"PassResult({', '.join(parts)})"] + [f"  {x}" for x in self.rewrites + self.skipped]
        return "\n".join(lines + [f"  {layer}: decode attention" for layer in self.attention]
                         + [f"  {layer}: depthwise conv as shifted multiply-adds" for layer in self.convs])


def graph_device(example_inputs: Sequence) -> str:
    """``"cuda"`` when any tensor input of the graph is on CUDA, else the first tensor input's device type."""
    types = [x.device.type for x in example_inputs if isinstance(x, torch.Tensor)]
    return "cuda" if "cuda" in types else (types[0] if types else "cpu")


def count_ops(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(graph_utils.op_name(n) for n in gm.graph.nodes if n.op.startswith("call"))


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph, sharing its parameters and Dynamo metadata."""
    graph = fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for old, new in env.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    for attr in ("_param_name_to_source",):
        if hasattr(gm, attr):
            setattr(new_gm, attr, getattr(gm, attr))
    return new_gm


class ReplaySSMPass:
    """Rewrites recurrent-state updates into ReplaySSM ops. Stateless apart from its config."""

    def __init__(self, config: ReplayConfig):
        self.config = config

    def uuid(self) -> str:
        """Changes whenever the pass's code or config does (for FX graph caches)."""
        h = hashlib.sha256(repr(self.config).encode())
        for mod in (anchor_mod, broadcast, canonical, delta, fla_call, graph_utils, mamba1, mamba2, kernel_call,
                    rewrite, state_writes, triton_launch, validate):
            h.update(inspect.getsource(mod).encode())
        return h.hexdigest()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence) -> PassResult:
        """Rewrite a copy of ``gm`` (Dynamo keeps using the original graph); the copy is ``result.gm``."""
        res = PassResult(gm=gm)
        res.ops_before = res.ops_after = count_ops(gm)
        families = set(self.config.families)
        if not self.config.enabled or not families & {"mamba2", "gdn", "kda", "mamba1"}:
            return res
        delta_on = bool(families & {"gdn", "kda"})
        if not (anchor_mod.find(gm.graph) or state_writes.computed_writes(gm.graph)
                or (families & {"mamba2", "mamba1"} and kernel_call.anchors(gm))
                or (delta_on and fla_call.anchors(gm))
                or state_writes.per_channel_recurrences(gm.graph) or anchor_mod.find_pools(gm.graph, 3)
                or ("mamba2" in families and state_writes.returned_recurrences(gm.graph))):
            self._report_returned(res, gm)
            if not res.skipped:
                log.info("replay_compile: no recurrent-state update in this graph of %d operations (attention-only "
                         "code, or a piece between graph breaks): lowered as plain torch.compile would",
                         sum(res.ops_before.values()))
            return res
        gm = copy_graph_module(gm)
        # a state whose next value is returned (MiniMax's cache list stores it in place of the old tensor): read as
        # an in-place write, the graph returning the state itself; put back below where it is not rewritten
        in_place = state_writes.write_returned_in_place(gm.graph) if "mamba2" in families else {}
        forwarded, refused = state_writes.forward_clone_writebacks(gm.graph)
        if forwarded:
            log.debug("replay_compile: updates of cloned states moved onto %s", ", ".join(forwarded))
        spelt = canonical.canonicalize(gm.graph)
        if spelt:
            log.debug("replay_compile: %s", "; ".join(spelt))
        if forwarded or spelt or in_place:
            gm.recompile()
        m2, dm = Mamba2Matcher(gm), DeltaMatcher(gm)
        matches = []
        anchors = anchor_mod.find(gm.graph)
        fla_launches = fla_call.anchors(gm) if delta_on else []
        # the cache's copy of an fla launch's final state: matched (or skipped) with its launch below
        fla_writebacks = {fla_call.writeback_of(n) for n in fla_launches} - {None}
        # Mamba-1's shape of update: the reason given where the matchers find none (a Mamba-2 update written with
        # dt and A expanded over the head and state dims looks the same by shape, and is matched)
        per_channel = state_writes.per_channel_recurrences(gm.graph)
        for a in anchors:
            cp = a.write
            if cp in fla_writebacks:
                continue
            layer = graph_utils.module_path(cp, default=f"state input `{a.state.name}`")
            try:
                if cp in refused:
                    raise NoMatch(f"the state is updated in a copy that is then copied back, and the update cannot "
                                  f"be moved onto the state: {refused[cp]}")
                if graph_utils.real_users(cp):
                    raise NoMatch("the result of the state write is used")
                matches.append(self._match(a, m2, dm, families))
            except NoMatch as e:
                if a.state in per_channel:
                    self._skip(res, layer, PER_CHANNEL)
                    continue
                why = None if cp in refused or a.old is None else state_writes.why_not_a_step(a.old, a.value)
                if a.state in in_place:
                    e = f"its next value is returned as a new tensor for the cache to store; read as an in-place " \
                        f"write of the state, {e}"
                self._skip(res, layer, why or str(e), quiet=why is not None)
        anchored = {a.state for a in anchors}
        for state, w in per_channel.items():            # Mamba-1: whole 3-D states, or 4-D ones head by head
            rank = len(shape(state) or ())
            whole = w.args[0] is state and rank == 3
            if state in anchored or not (whole or (w.args[0] is not state and rank == 4)):
                continue
            anchored.add(state)
            layer = graph_utils.module_path(w, default=f"state input `{state.name}`")
            try:
                if "mamba1" not in families:
                    self._skip(res, layer, f"{PER_CHANNEL}: {OPT_IN}", quiet=True)
                    continue
                if whole:
                    matches.append(mamba1.match(state, w))
                else:
                    matches.extend(mamba1.match_heads(state))
            except NoMatch as e:
                self._skip(res, layer, f"{PER_CHANNEL}: {e}")
        for a in anchor_mod.find_pools(gm.graph, 3):      # Mamba-1 slot pools [slots, D, N]
            if a.state in anchored:
                continue
            anchored.add(a.state)
            layer = graph_utils.module_path(a.write, default=f"state input `{a.state.name}`")
            try:
                if a.why:
                    raise NoMatch(a.why)
                m = mamba1.match(a.state, a.write, old=a.old, value=a.value, slot=a.slot)
                if "mamba1" not in families:
                    self._skip(res, layer, f"{PER_CHANNEL}: {OPT_IN}", quiet=True)
                    continue
                matches.append(m)
            except NoMatch as e:
                why = None if a.old is None else state_writes.why_not_a_step(a.old, a.value)
                self._skip(res, layer, why or str(e), quiet=why is not None)
        self._report_other_writes(res, gm, anchored | set(per_channel))
        self._report_per_channel(res, per_channel, anchored)
        self._report_returned(res, gm)
        refused_clones = {wb.args[1] for wb in refused}
        mamba_ssm_calls = kernel_call.anchors(gm) if families & {"mamba2", "mamba1"} else []
        for mod, call in [(kernel_call, c) for c in mamba_ssm_calls] + [(fla_call, c) for c in fla_launches]:
            if mod is kernel_call and refused_clones & set(call.all_input_nodes):
                continue            # it updates a cloned state: skipped above, at its write-back, with the reason
            try:                    # mamba_ssm's or fla's kernel, launched
                m = mod.match(call)
                if m.family not in families:
                    if m.family == "mamba1":
                        self._skip(res, m.layer, OPT_IN, quiet=True)
                        continue
                    raise NoMatch(f"a {m.family} update, but family {m.family!r} is not enabled")
                matches.append(m)
            except NoMatch as e:
                self._skip(res, graph_utils.module_path(call, default=f"`{call.name}`"), str(e),
                           quiet=str(e).startswith("a launch over T="))
        if matches and self.config.validate:
            with timed_phase("replay_compile.validate"):
                failed = validate.validate(gm, example_inputs, matches)
            for m in [m for m in matches if id(m) in failed]:
                self._skip(res, m.layer, failed[id(m)])
            matches = [m for m in matches if id(m) not in failed]
        taken = {m.state for m in matches}
        for s, cp in in_place.items():
            if s not in taken:
                state_writes.undo_write_in_place(gm.graph, s, cp)
        res.returns_state = bool(taken & set(in_place))
        if log.isEnabledFor(logging.DEBUG) and matches:
            log.debug("replay_compile: graph before rewrite:\n%s", gm.code)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # a state stepped head by head (Zamba) validates head by head, and a head that fails leaves the others
        # without their step: such a state is rewritten whole or not at all
        headed = collections.Counter(m.state for m in matches if getattr(m, "head", None) is not None)
        for m in [m for m in matches if getattr(m, "head", None) is not None and headed[m.state] != m.heads]:
            matches.remove(m)
            self._skip(res, m.layer, f"head {m.head} of {m.heads}: another head of this state did not pass, and "
                                     f"a state is stepped whole or not at all", quiet=True)
        head_rings: dict = {}                           # state -> the ring placeholders its heads share
        for i, m in enumerate(matches):
            read_copy = self.config.read_copy
            if read_copy and m.family not in self.config.read_copy_families:
                log.info("replay_compile: %s: reads its checkpoint exactly (read_copy=%r applies to %s layers; add "
                         "%r to read_copy_families for this one)", m.layer, read_copy,
                         ", ".join(self.config.read_copy_families) or "no", m.family)
                read_copy = None
            spec = rewrite.ring_spec(m, self.config.buffer_len, read_copy)
            shared = getattr(m, "head", None) is not None and m.state in head_rings
            rings = head_rings[m.state] if shared else rewrite.add_ring_placeholders(gm, m, spec, i)
            if getattr(m, "head", None) is not None:
                head_rings[m.state] = rings
            if isinstance(m, (kernel_call.KernelCallMatch, kernel_call.Mamba1KernelCallMatch)):
                kernel_call.apply(gm, m, rings, spec)
            elif isinstance(m, fla_call.FlaCallMatch):
                fla_call.apply(gm, m, rings, spec)
            else:
                rewrite.apply(gm, m, rings, spec)
            if not shared:
                res.fake_inputs.extend(r.meta["example_value"] for r in rings)
                res.sites.append(Site(placeholders.index(m.state), spec, m.layer, pooled=m.slot is not None))
            rw = Rewrite(m.layer, m.family, m.form, spec, m.describe(spec))
            res.rewrites.append(rw)
            counters["replay_compile"][m.family] += 1
            log.info("replay_compile: rewrote %s", rw)
        if not matches:
            return res              # res.gm is still the graph Dynamo gave us: nothing rewritten, nothing changed
        res.gm = gm
        gm.graph.lint()
        gm.recompile()
        res.ops_after = count_ops(gm)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("replay_compile: graph after rewrite:\n%s", gm.code)
        return res

    @staticmethod
    def _match(a, m2: Mamba2Matcher, dm: DeltaMatcher, families: set):
        """Mamba-2 first, then the delta rule; the reason given for a miss is the one of the matcher that got
        further (a delta rule fails the Mamba-2 matcher with ``NoMatch.STATE_DEPENDENT``)."""
        err = None
        if "mamba2" in families:
            try:
                return m2.match(a)
            except NoMatch as e:
                err = e
        if families & {"gdn", "kda"}:
            try:
                m = dm.match(a)
                if m.family not in families:
                    err = NoMatch(f"a {m.family} update, but family {m.family!r} is not enabled")
                else:
                    return m
            except NoMatch as e:
                if err is None or err.code in (NoMatch.STATE_DEPENDENT, NoMatch.OTHER_READOUT_DIM):
                    err = e
        raise err

    def _report_returned(self, res: PassResult, gm: fx.GraphModule) -> None:
        for state, value in state_writes.returned_recurrences(gm.graph).items():
            self._skip(res, graph_utils.module_path(value, default=f"state input `{state.name}`"),
                       f"the state's next value ({value.name}) is returned as a new tensor, which the cache stores in "
                       f"place of the old one, instead of being written into the cache's tensor: the replay step keeps "
                       f"its checkpoint and records with the cache's own tensor, so a state replaced every step "
                       f"cannot be served")

    def _report_per_channel(self, res: PassResult, per_channel: dict, anchored: set) -> None:
        for state, w in per_channel.items():
            if state in anchored:
                continue                                # matched, or reported at its anchor
            self._skip(res, graph_utils.module_path(w, default=f"state input `{state.name}`"), PER_CHANNEL)

    def _report_other_writes(self, res: PassResult, gm: fx.GraphModule, anchored: set) -> None:
        """Every computed write of a state that no anchor covers is reported (and raises under ``strict``)."""
        for s, ws in state_writes.computed_writes(gm.graph).items():
            if s in anchored:
                continue
            names = ", ".join(f"`{w.name}` ({graph_utils.op_name(w)})" for w in ws[:4])
            indexed = any(graph_utils.op_name(w) in ("setitem", "index_copy_", "index_put_", "scatter_")
                          for w in ws)
            self._skip(res, graph_utils.module_path(ws[0], default=f"state input `{s.name}`"),
                       f"written in place by {names}"
                       + (", at positions chosen by an index, which the pass does not read as a state update (it "
                          "reads a slot pool's rows: one 1-D integer `slot` along dim 0, gathered once by "
                          "`pool[slot]` / `index_select(0, slot)` and written back at the same slots)" if indexed
                          else ", which the pass does not read as a state update (it reads `S.copy_(decay * S + "
                               "update)`, and chains of mul_ / add_ / sub_ / div_ / addcmul_ on S itself)"))

    def _skip(self, res: PassResult, layer: str, reason: str, quiet: bool = False) -> None:
        sk = Skip(layer, reason, quiet)
        res.skipped.append(sk)
        counters["replay_compile"]["skipped"] += 1
        if self.config.strict and not quiet:
            raise ReplayCompileError(
                f"replay_compile (strict): layer {layer}: {reason}. The state update was found but cannot be "
                f"rewritten; run without strict=True to leave it unchanged, or report the model.")
        (log.info if quiet else log.warning)("replay_compile: %s", sk)
