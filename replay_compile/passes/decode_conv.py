"""Decode conv: the depthwise causal convolution of a decode step (or a short verify window) rewritten into shifted
multiply-adds that Inductor fuses into one elementwise kernel.

What is found (in Dynamo's graph): a ``conv1d`` (``F.conv1d``, ``nn.Conv1d``) or ``convolution`` call whose input
is ``[b, C, L]`` with static ``C`` and ``L``, whose weight is depthwise ``[C, 1, K]`` with ``groups == C`` and ``K
<= MAX_TAPS``, with stride 1, dilation 1, zero padding of any width (``0``: transformers' ``causal_conv1d_update``
over ``[conv state | new input]``; ``K - 1``: its ``causal_conv1d_fn`` over a few tokens; ``"valid"``,
``"same"``), a bias of ``[C]`` or none, input, weight, bias and output of one floating dtype (not so under
autocast: the convolution would run in another dtype), and a static output length of at most ``MAX_LENGTH``. That
is every SSM layer's conv-state update in a decode step or a speculative verify window; prefill convolutions are
longer and stay with cuDNN / aten. Everything else is left as it is, with the reason logged at debug.

Why: under ``torch.compile`` the depthwise convolution stays a separate aten / cuDNN launch, which at decode sizes
takes about 10x the time its bytes need (H100, batch 256, Qwen3.5-4B dims: ~51 µs per layer for ~16 MB). The shifted
multiply-adds (:mod:`.shifted_conv`, accumulated in fp32, rounded once to the convolution's dtype) fuse with the
concatenation before them.

Checked: the rewrite itself, on a graph of one convolution with the match's sizes, padding, bias and dtype, against
``F.conv1d`` in float64 before the first rewrite of each configuration; a configuration that fails is left
unchanged with the difference logged.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .decode_rewrite import NotRewritten, rewrite_each
from .graph_utils import dtype as dtype_of
from .graph_utils import is_static_int, module_path, op_name, shape
from .shifted_conv import accumulation_dtype, shifted_taps

MAX_TAPS = 8            # kernel widths of SSM convolutions (4 in the released models)
MAX_LENGTH = 16         # output positions: a decode step's or a verify window's; longer ones are prefills
_CONV = ("conv1d", "convolution")
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# the parameters of each spelling in order, with their defaults (None: required)
_PARAMS = {
    "conv1d": (("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0), ("dilation", 1),
               ("groups", 1)),
    "convolution": (("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0),
                    ("dilation", 1), ("transposed", False), ("output_padding", 0), ("groups", 1)),
}


class NotDecodeConv(NotRewritten):
    """Why a convolution is left unchanged."""


@dataclasses.dataclass(frozen=True)
class ConvMatch:
    conv: fx.Node
    x: fx.Node              # [b, C, L]
    weight: fx.Node         # [C, 1, K]
    bias: fx.Node | None    # [C] or None
    channels: int
    taps: int
    length: int             # L
    padding: tuple[int, int]
    dtype: torch.dtype
    layer: str

    @property
    def out_length(self) -> int:
        return self.length + self.padding[0] + self.padding[1] - self.taps + 1

    def config(self) -> tuple:
        return self.channels, self.taps, self.length, self.padding, self.dtype, self.bias is not None


def conv_calls(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and op_name(n) in _CONV]


def _params(n: fx.Node) -> dict:
    """The call's arguments by name, positional or keyword."""
    return {name: n.args[i] if len(n.args) > i else n.kwargs.get(name, default)
            for i, (name, default) in enumerate(_PARAMS[op_name(n)])}


def _single(value, what: str) -> int:
    """An int or a one-element sequence of ints (``nn.Conv1d`` passes ``(1,)``), else :class:`NotDecodeConv`."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not is_static_int(value):
        raise NotDecodeConv(f"{what}={value!r}")
    return value


def _padding(value, taps: int) -> tuple[int, int]:
    if value == "valid":
        return 0, 0
    if value == "same":                 # stride 1, dilation 1: K - 1 zeros, the extra one on the right
        return (taps - 1) // 2, taps - 1 - (taps - 1) // 2
    p = _single(value, "padding")
    if p < 0:
        raise NotDecodeConv(f"padding={p}")
    return p, p


def match(n: fx.Node) -> ConvMatch:
    """The decode conv of convolution call ``n``, or :class:`NotDecodeConv` with the reason."""
    p = _params(n)
    x, w = p["input"], p["weight"]
    if p.get("transposed", False) is not False:
        raise NotDecodeConv("a transposed convolution")
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node):
        raise NotDecodeConv("an input or weight that is not a graph tensor")
    sx, sw = shape(x), shape(w)
    if sx is None or len(sx) != 3:
        raise NotDecodeConv(f"an input of shape {sx}, not [b, C, L]")
    if sw is None or len(sw) != 3 or not all(is_static_int(s) for s in sw):
        raise NotDecodeConv(f"a weight of shape {sw}, not a static [C, 1, K]")
    C, one, K = sw
    if one != 1 or p["groups"] != C or not statically_known_true(sx[1] == C):     # decided without a guard
        raise NotDecodeConv(f"not depthwise: weight {sw}, groups={p['groups']}, input {sx}")
    if K > MAX_TAPS:
        raise NotDecodeConv(f"{K} taps, more than {MAX_TAPS}")
    stride, dilation = _single(p["stride"], "stride"), _single(p["dilation"], "dilation")
    if stride != 1 or dilation != 1:
        raise NotDecodeConv(f"stride={stride}, dilation={dilation}")
    L = sx[2]
    if not is_static_int(L):
        raise NotDecodeConv(f"an input of dynamic length {L}")
    pads = _padding(p["padding"], K)
    bias = p["bias"]
    if bias is not None and (not isinstance(bias, fx.Node) or shape(bias) != (C,)):
        raise NotDecodeConv(f"a bias of shape {shape(bias)}, not [{C}]")
    dts = [dtype_of(x), dtype_of(w), dtype_of(n)] + ([dtype_of(bias)] if bias is not None else [])
    if len(set(dts)) != 1 or dts[0] not in _FLOAT:
        raise NotDecodeConv(f"input / weight / output (/ bias) of dtypes {dts}: not one floating dtype "
                            f"(autocast runs the convolution in another dtype)")
    m = ConvMatch(n, x, w, bias, C, K, L, pads, dts[0], module_path(n))
    if not 1 <= m.out_length <= MAX_LENGTH:
        raise NotDecodeConv(f"{m.out_length} output positions, more than a decode step or a verify window "
                            f"({MAX_LENGTH})")
    return m


def _insert(graph: fx.Graph, m: ConvMatch) -> fx.Node:
    """Write :func:`~.shifted_conv.shifted_taps` into ``graph`` in place of ``m.conv`` (it runs on FX proxies, so
    its calls become nodes). Returns the output node."""
    n = m.conv
    tracer = fx.proxy.GraphAppendingTracer(graph)
    before = set(graph.nodes)
    with graph.inserting_before(n):
        w = fx.Proxy(m.weight, tracer).reshape(m.channels, m.taps)
        bias = fx.Proxy(m.bias, tracer) if m.bias is not None else None
        out = shifted_taps(fx.Proxy(m.x, tracer), w, bias, m.padding, m.taps, m.out_length,
                           accumulation_dtype(m.dtype), m.dtype).node
    for new in graph.nodes:
        if new not in before:                   # the layer's nodes, for logs and reports
            for key in ("nn_module_stack", "stack_trace"):
                if key in n.meta:
                    new.meta[key] = n.meta[key]
    n.replace_all_uses_with(out)
    graph.erase_node(n)
    return out


_CHECKED: dict[tuple, str | None] = {}


def check(m: ConvMatch) -> str | None:
    """None if the rewrite of ``m``'s configuration equals ``F.conv1d`` (float64, on inputs rounded to ``m.dtype``)
    on a small instance, else the difference."""
    key = m.config()
    if key not in _CHECKED:
        _CHECKED[key] = _check(m)
    return _CHECKED[key]


def _check(m: ConvMatch) -> str | None:
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    b = graph.placeholder("b") if m.bias is not None else None
    conv = graph.call_function(torch.conv1d, (x, w, b), {"padding": m.padding[0], "groups": m.channels})
    graph.output(conv)
    _insert(graph, dataclasses.replace(m, conv=conv, x=x, weight=w, bias=b))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, m.channels, m.length, generator=g), torch.randn(m.channels, 1, m.taps, generator=g)]
    if m.bias is not None:
        args.append(torch.randn(m.channels, generator=g))
    args = [a.to(m.dtype) for a in args]
    exact = [a.double() for a in args]
    want = F.conv1d(F.pad(exact[0], m.padding), *exact[1:], groups=m.channels)
    got = gm(*args)
    if got.dtype != m.dtype or got.shape != want.shape:
        return f"{got.dtype} {tuple(got.shape)} where F.conv1d gives {m.dtype} {tuple(want.shape)}"
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3}.get(m.dtype, 1e-2)
    err = float((got.double() - want).abs().max())
    return None if err <= tol * (1 + float(want.abs().max())) else f"max difference {err:.3g} from F.conv1d"


def rewrite(gm: fx.GraphModule, cuda_only: bool = True) -> tuple[list[ConvMatch], list[tuple[str, str]]]:
    """Rewrite every decode conv of ``gm``'s graph in place (``cuda_only``: those on CUDA tensors). Returns the
    rewritten matches and ``(layer, reason)`` for the convolutions left unchanged."""
    return rewrite_each(gm, conv_calls(gm.graph), match, check, _insert, tensor=lambda m: m.x, cuda_only=cuda_only,
                        noun="convolution", cpu_reason="not on CUDA (auto rewrites CUDA graphs)",
                        describe=lambda m: f"depthwise conv ({m.channels} channels, {m.taps} taps, {m.out_length} "
                                           f"output positions) -> {m.taps} shifted multiply-adds")
