"""The ``replayssm`` torch.compile backend.

``torch.compile(model, backend="replayssm", mode=..., options={...})`` runs :class:`ReplaySSMPass` on each Dynamo
graph, lowers the result (Inductor by default, honouring ``mode`` and the options that are not ours) and wraps it in
a :class:`ReplayRunner`, which feeds each rewritten layer the rings of the cache tensor it is handed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import weakref
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from . import ops  # noqa: F401 - registers the custom ops
from . import state as replay_state
from ._logging import log, timed_phase
from .config import ReplayConfig, env_flag
from .passes import decode_attention, decode_conv
from .passes.replay_pass import PassResult, ReplaySSMPass, copy_graph_module, graph_device
from .replay_tensor import ReplayTensor, checkpoint_of

_REPORTS: collections.deque = collections.deque(maxlen=256)


def reports() -> list[PassResult]:
    """What the pass did to each graph compiled by this backend (most recent last; the last 256 graphs)."""
    return list(_REPORTS)


def clear_reports() -> None:
    _REPORTS.clear()


def layer_verdicts(results: Sequence[PassResult] | None = None) -> dict[str, tuple[str, str]]:
    """One verdict per layer over the graphs of ``results`` (default: :func:`reports`), each layer once however
    many graphs held it: ``{layer: (verdict, detail)}``, verdict ``"rewritten"``, ``"left unchanged"`` (with the
    reason), ``"not a recurrence"`` (resets, window shifts, multi-token scans such as prefill: never rewritten by
    design) or ``"decode attention"``. A layer rewritten in one graph is rewritten."""
    verdicts: dict = {}
    for rep in reports() if results is None else results:
        for rw in rep.rewrites:
            verdicts[rw.layer] = ("rewritten", f"{rw.family} [{rw.form}] {rw.detail}".rstrip())
        for sk in rep.skipped:
            if sk.layer in verdicts and verdicts[sk.layer][0] == "rewritten":
                continue
            if sk.quiet:
                verdicts.setdefault(sk.layer, ("not a recurrence", sk.reason))
            else:
                verdicts[sk.layer] = ("left unchanged", sk.reason)
        for layer in rep.attention:
            verdicts.setdefault(layer, ("decode attention", "replay_compile::decode_attention"))
    return verdicts


def summary(results: Sequence[PassResult] | None = None) -> str:
    """:func:`layer_verdicts` as a table, one row per layer, and a count of the rewritten ones."""
    import re

    verdicts = layer_verdicts(results)
    notes = sorted({r.note for r in (reports() if results is None else results) if r.note})
    if not verdicts:
        return "\n".join(notes or ["replay_compile: no recurrent-state update or decode attention found in the "
                                    "compiled graphs"])

    def key(name):
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
    width = max(len(k) for k in verdicts)
    rows = [f"{layer:<{width}}  {v:<16}  {d}" for layer, (v, d) in sorted(verdicts.items(), key=lambda kv: key(kv[0]))]
    n = sum(v == "rewritten" for v, _ in verdicts.values())
    ssm = sum(v != "decode attention" for v, _ in verdicts.values())
    return "\n".join(rows + [f"{n} of {ssm} state-writing layers rewritten"] + notes)


class ReplayRunner:
    """Calls the compiled graph with the ring tensors of the cache states it steps.

    Per call, for every rewritten layer: find (or create) the replay state of the cache tensor passed in, reset it
    if the tensor was written by someone else since our last step, and append its rings to the arguments. States
    this graph reads without stepping them are flushed first, so it sees the true state. When the same tensors come
    back unwritten (a decode loop), the last call's states are reused without looking them up (:meth:`_fast_path`).

    A cache state that is a :class:`~replay_compile.replay_tensor.ReplayTensor` reaches the compiled graph as its
    checkpoint (``wrapped_idxs``): the graph was lowered for plain tensors, so the wrapper costs nothing per step
    beyond one attribute read, and a wrapper this graph does not step is folded first like any other read state.
    """

    def __init__(self, compiled, result: PassResult, reader_idxs: list[int], wrapped_idxs: list[int] = ()):
        self.compiled = compiled
        self.sites = list(result.sites)
        self.rewrites = list(result.rewrites)
        self.skipped = list(result.skipped)
        self.reader_idxs = reader_idxs
        self.wrapped_idxs = list(wrapped_idxs)
        stepped = {s.state_index for s in self.sites}
        self.wrapped_readers = [i for i in self.wrapped_idxs if i not in stepped]
        self.returns_state = bool(result.returns_state)

    def __call__(self, *args):
        fast = self._fast_path(args) if self._generation == replay_state.generation() else None
        states, extra = fast if fast is not None else self._bind(args)
        if self.reader_idxs and replay_state.registered():
            for rs in self._reader_states(args):
                if rs.dirty:
                    rs.flush()
        for i in self.wrapped_readers:
            args[i].fold()
        # only a graph that returns a stepped state needs the wrappers back (the decode hot path otherwise)
        wrappers = {} if self.wrapped_idxs and self.returns_state else None
        if self.wrapped_idxs:
            args = list(args)
            for i in self.wrapped_idxs:
                if wrappers is not None:
                    wrappers[id(args[i].checkpoint)] = args[i]
                args[i] = args[i].checkpoint
        try:
            out = self.compiled(*args, *extra)     # Dynamo calls backends' results unboxed, so do we
        finally:
            # also when the step raised (an interrupt, an out-of-memory error in a later layer): the layers whose
            # op ran have written their own state, which must not be taken for an outside write at the next step
            for i, rs in states:
                rs.version = replay_state.tensor_version(args[i])
                rs.dirty = True
        for _, rs in states:
            rs.steps += 1
        if wrappers:
            # a state returned for the cache to store (written in place, returned as itself) goes back as the
            # wrapper it came in as: the cache keeps holding its ReplayTensor
            out = type(out)(wrappers.get(id(o), o) for o in out)
        return out

    def _bind(self, args) -> tuple[list, list]:
        """The slow path: find (or create) each site's replay state and reset it after an external write; remember
        ``[(arg index, replay state)]`` for :meth:`_fast_path`. Returns them and the ring arguments."""
        extra, states = [], []
        # the parameters of the call, not of the example inputs: one compiled graph serves every instance of a
        # model class, and flush(model) finds a state through the model that stepped it
        owners = {id(a) for a in args if isinstance(a, torch.nn.Parameter)}
        for site in self.sites:
            st = args[site.state_index]
            rs = replay_state.lookup(st)
            if rs is None or rs.spec != site.spec:
                rs = replay_state.bind(st, site.spec, site.layer)
            rs.pooled = rs.pooled or site.pooled
            rs.check_external_write(checkpoint_of(st))
            rs.owners |= owners
            extra.extend(rs.rings)
            states.append((site.state_index, rs))
        # held strongly, but a state whose cache tensor died has dropped its rings (state.bind): a finished
        # generation's rings are not kept alive here
        self._bound = states
        self._generation = replay_state.generation()
        return states, extra

    def _fast_path(self, args) -> tuple[list, list] | None:
        """The states and ring arguments of the last call again, if every site gets the tensor it was bound to,
        unwritten since our last step, and no replay state was created or replaced since (a decode loop hands the
        same cache tensors every step: ~0.4 µs per layer of host time instead of ~0.9 on a CPU of CI's class)."""
        extra = []
        for i, rs in self._bound:
            t = args[i]
            if type(t) is ReplayTensor:
                if t.replay is not rs:
                    return None
                t = t.checkpoint
            if rs._state() is not t or replay_state.tensor_version(t) != rs.version:
                return None
            extra += rs.rings
        return self._bound, extra

    def _reader_states(self, args) -> list:
        """The replay states of the inputs this graph may read without stepping them (:func:`_reader_idxs`). The
        last call's answer while the very same objects come back and no replay state was created or replaced since:
        a decode loop hands its attention and conv caches back every step, and looking each up (40 at Qwen3.5-4B
        dims) was half of this runner's host time per call (H100 host, cProfile, batch 1)."""
        gen = replay_state.generation()
        refs = self._reader_refs
        if gen == self._reader_generation and len(refs) == len(self.reader_idxs) and \
                all(r() is args[i] for r, i in zip(refs, self.reader_idxs)):
            return self._readers
        readers = [rs for i in self.reader_idxs if (rs := replay_state.lookup(args[i])) is not None]
        self._reader_refs = [weakref.ref(args[i]) for i in self.reader_idxs]
        self._reader_generation, self._readers = gen, readers
        return readers

    _bound: list = []
    _generation = -1
    _reader_refs: list = []
    _reader_generation = -1
    _readers: list = []


def _inductor_has(option: str) -> bool:
    """Whether this torch's Inductor config has ``option`` (a patch it lacks would fail the compile)."""
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config, option)


def _reader_idxs(example_inputs: Sequence, result: PassResult) -> list[int]:
    """Plain inputs that may be cache states the graph reads without stepping (wrapped states are known exactly)."""
    stepped = {s.state_index for s in result.sites}
    return [i for i, t in enumerate(example_inputs)
            if isinstance(t, torch.Tensor) and not isinstance(t, (torch.nn.Parameter, ReplayTensor)) and t.dim() >= 3
            and t.is_floating_point() and i not in stepped]


def _unwrap_inputs(gm: fx.GraphModule, example_inputs: list,
                   result: PassResult) -> tuple[fx.GraphModule, list, list[int]]:
    """Make the graph take each ``ReplayTensor`` input as its checkpoint: the placeholder's example value becomes
    the checkpoint's (fake, in Dynamo's fake mode), keeping its static-address mark for CUDA graphs. Returns the
    graph, the inputs to lower it with and the indices of the wrapped inputs."""
    idxs = [i for i, t in enumerate(example_inputs) if isinstance(t, ReplayTensor)]
    if not idxs:
        return gm, example_inputs, idxs
    if not result.sites:            # the pass returned Dynamo's own graph: change a copy
        gm = copy_graph_module(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = torch._guards.detect_fake_mode()
    inputs = list(example_inputs)
    for i in idxs:
        ckpt = inputs[i].checkpoint
        if fake_mode is not None:
            # a fresh fake with static sizes, not ``from_tensor(ckpt)``: Dynamo already fakified the checkpoint as
            # the wrapper's inner tensor, possibly with symbolic sizes, and the fake mode would return that one
            with fake_mode:
                ckpt = torch.empty_strided(ckpt.shape, ckpt.stride(), dtype=ckpt.dtype, device=ckpt.device)
        inputs[i] = ckpt
        node = placeholders[i]
        node.meta["example_value"] = ckpt
        node.meta["tensor_dict"] = {**node.meta.get("tensor_dict", {}),
                                    "_dynamo_static_input_type": "unguarded"}
        if "val" in node.meta:
            node.meta["val"] = ckpt
    gm.recompile()
    return gm, inputs, idxs


def _lower(gm: fx.GraphModule, example_inputs: list, cfg: ReplayConfig, mode: str | None, lower_opts: dict):
    if cfg.lower == "eager":
        return gm.forward
    if cfg.lower in ("piecewise", "tensorrt"):
        from .piecewise import lower_piecewise
        if mode and mode != "default":
            log.info("replay_compile: mode=%r is not applied to the %s lowering (no CUDA graphs across pieces)",
                     mode, cfg.lower)
        return lower_piecewise(gm, example_inputs, cfg.lower)
    from torch._inductor.compile_fx import compile_fx

    patches: dict[str, Any] = {}
    if mode and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode))
    patches.update(lower_opts)
    with _cache_tagged():
        return compile_fx(gm, example_inputs, config_patches=patches or None)


@contextlib.contextmanager
def _cache_tagged():
    """Inductor's and AOTAutograd's caches key on the graph, which holds our ops, not the kernels inlined from behind
    them (ops/library.py): add :func:`~replay_compile.ops.library.inline_cache_tag` to their key while we compile."""
    cconfig = getattr(torch.compiler, "config", None)
    if cconfig is None or not hasattr(cconfig, "cache_key_tag"):
        yield
        return
    from .ops.library import inline_cache_tag

    with cconfig.patch(cache_key_tag=f"{cconfig.cache_key_tag}{inline_cache_tag()}"):
        yield


def _install_integrations() -> None:
    if "transformers" in sys.modules:
        from .integrations import hf

        hf.install()


def _rewrite_decode(result: PassResult, original: fx.GraphModule, name: str, rewrite_pass, calls, setting: str,
                    field: str) -> None:
    """The decode rewrite ``name`` (:mod:`.passes.decode_attention`, :mod:`.passes.decode_conv`: ``calls(graph)``
    finds its candidates, ``rewrite_pass(gm, cuda_only=...)`` rewrites them) on a copy of Dynamo's graph as the SSM
    pass does; the rewritten layers go to ``result.<field>`` and the ``replay_compile/<name>`` counter."""
    if not calls(result.gm.graph):
        return
    gm = result.gm if result.gm is not original else copy_graph_module(original)
    done, _ = rewrite_pass(gm, cuda_only=setting == "auto")
    if done:
        result.gm = gm
        setattr(result, field, [m.layer for m in done])
        counters["replay_compile"][name] += len(done)


def replayssm_backend(gm: fx.GraphModule, example_inputs: Sequence, mode: str | None = None,
                      options: dict | None = None):
    """torch.compile backend: rewrite SSM state updates into ReplaySSM ops, then lower."""
    cfg, lower_opts = ReplayConfig.from_options(options)
    # torch.compile refuses mode= together with options=, so a mode may also travel inside options
    mode = lower_opts.pop("mode", None) or mode
    _install_integrations()
    device = graph_device(example_inputs)
    if device not in cfg.devices:                     # config.DEFAULT_DEVICES says why
        result = PassResult(gm=gm, note=f"a graph on {device}: left to the lowering (devices={cfg.devices}; on CPU "
                                        f"the rewritten step runs the ops' PyTorch reference, slower than plain "
                                        f"torch.compile: add '{device}' to options['devices'] to rewrite it anyway)")
        log.info("replay_compile: %s", result.note)
    else:
        with timed_phase("replay_compile.ReplaySSMPass"):
            result = ReplaySSMPass(cfg)(gm, example_inputs)
    for name, rewrite_pass, calls, setting, field in (
            ("decode_attention", decode_attention.rewrite, decode_attention.attention_calls, cfg.decode_attention,
             "attention"),
            ("decode_conv", decode_conv.rewrite, decode_conv.conv_calls, cfg.decode_conv, "convs")):
        if cfg.enabled and setting != "off":
            with timed_phase(f"replay_compile.{name}"):
                _rewrite_decode(result, gm, name, rewrite_pass, calls, setting, field)
    _REPORTS.append(dataclasses.replace(result, gm=None, fake_inputs=[]))
    gm = result.gm
    if result.sites and env_flag("REPLAY_COMPILE_COMBO_KERNELS", True) \
            and _inductor_has("combo_kernels"):
        # Our step kernel reads q, k, v, gates as materialised tensors, where plain Inductor fuses their
        # computation into its own recurrence kernel: a GDN layer gets ~5 small prologue kernels of different sizes
        # instead. At batch 1 in default mode (no CUDA graphs) the step is host-bound and each launch costs ~10-20
        # µs; Inductor's combo kernels launch such independent kernels as one (H200, Qwen3.5-4B dims, 8 layers,
        # bs1: 0.90x -> 0.97x of plain torch.compile; Mamba-2 1.28x -> 1.52x). A user's own setting wins.
        lower_opts.setdefault("combo_kernels", True)
    gm, inputs, wrapped = _unwrap_inputs(gm, list(example_inputs), result)
    compiled = _lower(gm, inputs + result.fake_inputs, cfg, mode, lower_opts)
    readers = _reader_idxs(example_inputs, result)
    if not result.sites and not readers and not wrapped:
        return compiled
    log.debug("replay_compile: graph with %d rewrites, %d skipped, %d possible state readers, %d wrapped states",
              len(result.rewrites), len(result.skipped), len(readers), len(wrapped))
    return ReplayRunner(compiled, result, readers, wrapped)
