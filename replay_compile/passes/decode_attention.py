"""Decode attention: ``scaled_dot_product_attention`` of a few new tokens over a cache (one for a decode step, the
last token and its drafts for a speculative verify), rewritten into ``replay_compile::decode_attention`` so that each
key/value head is read once, over its filled positions only.

What is found (by dataflow, in Dynamo's graph): a ``scaled_dot_product_attention`` call whose query is ``[b, H, T,
dk]`` with ``T <= MAX_TOKENS`` and whose keys and values are a cache's ``[b, KV, S, d]`` tensors, either as they are
(``H == KV``, or ``enable_gqa=True``) or expanded to ``H`` heads the way transformers' ``repeat_kv`` does (``x[:, :,
None].expand(b, KV, G, S, d).reshape(b, KV * G, S, d)``, or ``repeat_interleave(x, G, dim=1)``): query head ``h``
reads key/value head ``h // G``; the cache's length may be symbolic (a dynamic cache). The mask is None or ``[b or
1, 1, T or 1, S]`` (shared by the heads), boolean or additive; no dropout, not ``is_causal`` (a window's causal
order is in its mask). transformers' eager attention is found too: ``matmul(dropout(softmax(matmul(q, k.transpose(2,
3)) * scale + mask).to(dtype)), v)`` over the same expanded keys and values, with no other reader of the
probabilities (a model that outputs its attention weights keeps them), no dropout and no other term (soft-capping,
sinks). Every call that is not this is left as it is, with its reason logged at debug (prefill graphs and other
attention are not decode attention, so nothing is said at info).

Why: under ``torch.compile``, transformers expands the grouped key/value heads with ``repeat_kv`` (a copy of the
whole static cache into ``H`` heads) and SDPA then reads the copy over every static position: on the H200 at batch
256 with a 1,040-position cache this was 58-67% of a hybrid model's rewritten decode step (Nemotron-Nano-4B and
Qwen3.5-4B dimensions, full depth). The op reads the cache itself.

Checked: the op against SDPA over ``repeat_kv``-expanded heads on a small instance of each matched configuration
(heads, head dims, dtype, mask kind, scale) before the first rewrite of that configuration; a configuration that
fails is left unchanged with the difference logged.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .decode_rewrite import NotRewritten, rewrite_each
from .graph_utils import dtype as dtype_of
from .graph_utils import example, module_path, op_name, shape

_SDPA = ("scaled_dot_product_attention", "_scaled_dot_product_attention")
MAX_TOKENS = 16         # a decode step or a speculative window; longer queries are prefills, left to SDPA


def max_query_rows(dv: int) -> int:
    """Query rows (``G * T``) one program of the kernel holds: its float32 accumulator is ``rows x dv``."""
    return 64 if dv <= 128 else 32
# side-effect-free ops that may feed the replaced attention only (repeat_kv's expansion, eager's chain): erased
# with it
_FEEDERS = ("reshape", "view", "expand", "getitem", "unsqueeze", "repeat_interleave", "matmul", "bmm", "transpose",
            "mul", "div", "add", "softmax", "dropout", "to", "float", "type", "contiguous")


class NotDecodeAttention(NotRewritten):
    """Why an attention call is left unchanged."""


@dataclasses.dataclass(frozen=True)
class AttentionMatch:
    sdpa: fx.Node
    q: fx.Node
    k: fx.Node              # the cache's keys [b, KV, S, dk]
    v: fx.Node              # the cache's values [b, KV, S, dv]
    mask: fx.Node | None    # [b or 1, 1, T or 1, S] or None
    scale: float
    heads: int
    tokens: int
    kv_heads: int
    positions: int | torch.SymInt
    dk: int
    dv: int
    dtype: torch.dtype
    mask_dtype: torch.dtype | None
    layer: str
    mask_rows: int = 1

    def config(self) -> tuple:
        return (self.heads, self.tokens, self.mask_rows, self.kv_heads, self.dk, self.dv, self.dtype, self.mask_dtype,
                self.scale)


def sdpa_calls(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and op_name(n) in _SDPA]


_MATMUL = ("matmul", "bmm")
_PASS_THROUGH = ("to", "float", "type", "contiguous")     # casts between the softmax and the second matmul


def _strip(n, names) -> fx.Node:
    while isinstance(n, fx.Node) and op_name(n) in names and n.args:
        n = n.args[0]
    return n


def _is_dropout_off(n: fx.Node) -> bool:
    p = _arg(n, 1, "p", 0.5)
    training = _arg(n, 2, "training", True)
    return op_name(n) == "dropout" and (p == 0 or training is False)


def _probabilities(n) -> fx.Node | None:
    """The softmax behind the first operand of a second attention matmul (through casts and a dropout that is
    off), else None."""
    while isinstance(n, fx.Node):
        if op_name(n) == "softmax":
            return n
        if op_name(n) in _PASS_THROUGH or _is_dropout_off(n):
            n = n.args[0]
            continue
        return None
    return None


def eager_calls(graph: fx.Graph) -> list[fx.Node]:
    """Second matmuls of eager attention (probabilities @ values): their first operand is a softmax's output."""
    return [n for n in graph.nodes if n.op == "call_function" and op_name(n) in _MATMUL and len(n.args) == 2
            and _probabilities(n.args[0]) is not None]


def attention_calls(graph: fx.Graph) -> list[fx.Node]:
    return sdpa_calls(graph) + eager_calls(graph)


def _arg(n: fx.Node, index: int, name: str, default=None):
    if len(n.args) > index:
        return n.args[index]
    return n.kwargs.get(name, default)


def _sizes(n: fx.Node) -> tuple:
    """The size arguments of ``expand`` / ``reshape`` / ``view`` (given as varargs or one sequence)."""
    sizes = n.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    return tuple(sizes)


def _full(idx) -> bool:
    return idx == slice(None)


def _same(a, b) -> bool:
    """Shapes equal for every value of their symbolic sizes (a dynamic cache's positions, a dynamic batch), decided
    without adding a guard."""
    return a is not None and b is not None and len(a) == len(b) and all(statically_known_true(x == y)
                                                                       for x, y in zip(a, b))


def _compatible(a, b) -> bool:
    """Sizes of different tensors (keys and values, the mask and the keys) that are not known to differ: a dynamic
    cache gives its keys and values lengths with symbols of their own. The op checks them when it runs (a mismatch
    raises, naming the arguments), so nothing is guarded here."""
    return a is not None and b is not None and len(a) == len(b) and not any(
        statically_known_true(x != y) for x, y in zip(a, b))


def _static(*sizes) -> bool:
    return all(isinstance(x, int) for x in sizes)


def kv_source(n, heads: int, gqa: bool) -> tuple[fx.Node, int]:
    """``(cache tensor [b, KV, S, d], G)`` behind SDPA's key or value argument ``n`` (see the module docstring)."""
    if not isinstance(n, fx.Node):
        raise NotDecodeAttention("keys or values are not a graph tensor")
    s = shape(n)
    if s is None or len(s) != 4:
        raise NotDecodeAttention(f"keys or values of shape {s}, not [b, heads, positions, head_dim]")
    name = op_name(n)
    if name in ("reshape", "view") and n.op == "call_method":
        ex = n.args[0]
        se = shape(ex)
        if op_name(ex) != "expand" or se is None or len(se) != 5:
            raise NotDecodeAttention("keys or values reshaped from something other than repeat_kv's expand")
        b, KV, G, S, d = se
        if not _static(KV, G, d) or not _same(s, (b, KV * G, S, d)):
            raise NotDecodeAttention(f"a [b, KV, G, S, d] expansion reshaped to {s}, not [b, KV*G, S, d]")
        src = ex.args[0]
        base = None
        if op_name(src) == "getitem" and isinstance(src.args[1], tuple):
            idx = src.args[1]
            idx = idx[:-1] if idx and idx[-1] is Ellipsis else idx
            if len(idx) >= 3 and _full(idx[0]) and _full(idx[1]) and idx[2] is None and all(map(_full, idx[3:])):
                base = src.args[0]
        elif op_name(src) == "unsqueeze" and tuple(src.args[1:]) in ((2,), (-3,)):
            base = src.args[0]
        if base is None or not _same(shape(src), (b, KV, 1, S, d)) or not _same(shape(base), (b, KV, S, d)):
            raise NotDecodeAttention("the grouped heads are not expanded as repeat_kv's x[:, :, None].expand(...)")
        return base, G
    if name == "repeat_interleave":
        G = _arg(n, 1, "repeats")
        dim = _arg(n, 2, "dim")
        base = n.args[0]
        sb = shape(base)
        if (not isinstance(G, int) or dim not in (1, -3) or sb is None or not _static(sb[1], sb[3])
                or not _same(s, (sb[0], sb[1] * G, sb[2], sb[3]))):
            raise NotDecodeAttention("keys or values repeated other than head-wise (repeat_interleave(x, G, dim=1))")
        return base, G
    if not _static(s[1], s[3]):
        raise NotDecodeAttention(f"keys or values of shape {s}: a dynamic number of heads or head dimension")
    if s[1] == heads or gqa:
        return n, 1 if s[1] == heads else heads // s[1]
    raise NotDecodeAttention(f"{s[1]} key/value heads for {heads} query heads, not expanded by repeat_kv")


def match(n: fx.Node) -> AttentionMatch:
    """The decode attention of SDPA call (or eager attention's second matmul) ``n``, or :class:`NotDecodeAttention`
    with the reason."""
    if op_name(n) in _MATMUL:
        return _match_eager(n)
    q, k, v = n.args[:3]
    mask = _arg(n, 3, "attn_mask")
    dropout = _arg(n, 4, "dropout_p", 0.0)
    causal = _arg(n, 5, "is_causal", False)
    scale = _arg(n, 6, "scale")
    gqa = bool(n.kwargs.get("enable_gqa", False))
    if not isinstance(dropout, (int, float)) or dropout != 0:
        raise NotDecodeAttention(f"dropout_p={dropout}")
    if causal is not False:
        raise NotDecodeAttention("is_causal=True")
    if scale is not None and not isinstance(scale, (int, float)):
        raise NotDecodeAttention("a scale computed in the graph")
    return _build(n, q, k, v, mask, scale, gqa)


def _only_user(x: fx.Node, user: fx.Node) -> None:
    if list(x.users) != [user]:
        raise NotDecodeAttention(f"`{x.name}` has readers besides the attention (e.g. attention weights returned)")


def _match_eager(n: fx.Node) -> AttentionMatch:
    """``matmul(P, v)`` with ``P = dropout_off(softmax(scores * scale + mask, dim=-1).to(dtype))`` and ``scores =
    matmul(q, k.transpose(2, 3))``: the pieces of transformers' ``eager_attention_forward``."""
    probs, v = n.args
    sm = _probabilities(probs)
    chain, x = [], probs
    while x is not sm:
        chain.append(x)
        x = x.args[0]
    for node, reader in zip(chain + [sm], [n] + chain):       # the probabilities feed the values' matmul only
        _only_user(node, reader)
    dim = _arg(sm, 1, "dim")
    if dim not in (-1, 3):
        raise NotDecodeAttention(f"a softmax over dim {dim}, not the positions")
    if _arg(sm, 3, "dtype") not in (None, torch.float32):
        raise NotDecodeAttention("a softmax in a dtype other than float32")
    x, mask, scale = sm.args[0], None, 1.0
    if op_name(x) == "add":                                     # scores * scale + mask (either order)
        _only_user(x, sm)
        a, b = x.args
        x, mask = (a, b) if _reaches_matmul(a) else (b, a)
        if not isinstance(mask, fx.Node):
            raise NotDecodeAttention("a constant added to the scores")
    if op_name(x) in ("mul", "div"):
        if len(x.users) != 1:
            raise NotDecodeAttention(f"`{x.name}` has readers besides the attention")
        a, b = x.args
        if op_name(x) == "mul":
            c, x = (b, a) if isinstance(b, (int, float)) else (a, b)
            scale = float(c) if isinstance(c, (int, float)) else None
        else:
            x, c = a, b
            scale = 1.0 / float(c) if isinstance(c, (int, float)) and c else None
        if scale is None:
            raise NotDecodeAttention("scores scaled by a graph tensor")
    if not isinstance(x, fx.Node) or op_name(x) not in _MATMUL:
        raise NotDecodeAttention("the scores are not a matmul of queries and keys (soft-capping, bias or sinks?)")
    if len(x.users) != 1:
        raise NotDecodeAttention(f"`{x.name}` (the scores) has readers besides the attention")
    q, kt = x.args
    if not isinstance(kt, fx.Node) or op_name(kt) != "transpose" or {d % 4 for d in kt.args[1:3]} != {2, 3}:
        raise NotDecodeAttention("keys not transposed as k.transpose(2, 3)")
    return _build(n, q, kt.args[0], v, mask, scale, gqa=False)


def _reaches_matmul(x) -> bool:
    x = _strip(x, ("mul", "div"))
    return isinstance(x, fx.Node) and op_name(x) in _MATMUL


def _build(n: fx.Node, q, k, v, mask, scale, gqa: bool) -> AttentionMatch:
    sq = shape(q)
    if sq is None or len(sq) != 4 or not _static(*sq[1:]):
        raise NotDecodeAttention(f"query of shape {sq}, not [b, H, T, dk] with static heads, tokens and dims")
    b, H, T, dk = sq
    if T > MAX_TOKENS:
        raise NotDecodeAttention(f"{T} query tokens, more than a decode step or a verify window ({MAX_TOKENS})")
    kb, G = kv_source(k, H, gqa)
    vb, Gv = kv_source(v, H, gqa)
    sk, sv = shape(kb), shape(vb)
    if G != Gv or not _compatible(sk[:3], sv[:3]) or not _compatible(sk[:1], (b,)) or sk[1] * G != H or sk[3] != dk:
        raise NotDecodeAttention(f"keys {sk} and values {sv} (groups {G} / {Gv}) do not fit a query {sq}")
    S = sk[2]                   # may be symbolic: a dynamic cache grows by a token a step
    if H // sk[1] * T > max_query_rows(sv[3]):
        raise NotDecodeAttention(f"{H // sk[1]} query heads per key/value head x {T} tokens: more query rows than "
                                 f"the kernel's tile holds ({max_query_rows(sv[3])})")
    mdt, mrows = None, 1
    if mask is not None:
        sm = shape(mask)
        mdt = dtype_of(mask)
        if (sm is None or len(sm) != 4 or not (_same(sm[:1], (1,)) or _compatible(sm[:1], (b,))) or sm[1] != 1
                or sm[2] not in (1, T) or not _compatible(sm[3:], (S,))):
            raise NotDecodeAttention(f"a mask of shape {sm}, not [b or 1, 1, {T} or 1, {S}] shared by the heads")
        mrows = sm[2]
        if mdt != torch.bool and not (mdt is not None and mdt.is_floating_point):
            raise NotDecodeAttention(f"a mask of dtype {mdt}")
    dt = dtype_of(q)
    if not dt == dtype_of(kb) == dtype_of(vb) or dt not in (torch.float16, torch.bfloat16, torch.float32):
        raise NotDecodeAttention(f"query / keys / values of dtypes {dt} / {dtype_of(kb)} / {dtype_of(vb)}")
    kex, vex = example(kb), example(vb)
    if kex.stride(-1) != 1 or vex.stride(-1) != 1:
        raise NotDecodeAttention("a cache without unit stride in its head dimension")
    if example(q).stride(-1) != 1:
        raise NotDecodeAttention("a query without unit stride in its head dimension")
    return AttentionMatch(n, q, kb, vb, mask, float(scale) if scale is not None else dk ** -0.5, H, T, sk[1], S, dk,
                          sv[3], dt, mdt, module_path(n), mrows)


def _insert(graph: fx.Graph, m: AttentionMatch) -> None:
    n = m.sdpa
    with graph.inserting_before(n):
        if m.mask is None:
            positions = m.positions if isinstance(m.positions, int) else graph.call_method("size", (m.k, 2))
            mask = graph.call_function(torch.ones, ((1, 1, positions),), {"dtype": torch.bool,
                                                                          "device": example(m.q).device})
        else:
            mask = graph.call_function(operator.getitem, (m.mask, (slice(None), 0)))
            mask = graph.call_method("contiguous", (mask,))        # the op reads positions with unit stride
        out = graph.call_function(torch.ops.replay_compile.decode_attention.default, (m.q, m.k, m.v, mask, m.scale))
    n.replace_all_uses_with(out)
    todo = list(n.all_input_nodes)
    graph.erase_node(n)
    while todo:                                # what fed only the old attention: the expansion, eager's chain
        a = todo.pop()
        if a.users or a.op not in ("call_method", "call_function") or op_name(a) not in _FEEDERS:
            continue
        todo.extend(a.all_input_nodes)
        graph.erase_node(a)


_CHECKED: dict[tuple, str | None] = {}


def check(m: AttentionMatch) -> str | None:
    """None if the op equals SDPA over expanded heads on a small instance of ``m``'s configuration (CPU reference,
    float64 inputs rounded to ``m.dtype``), else the difference."""
    key = m.config()
    if key not in _CHECKED:
        _CHECKED[key] = _check(m)
    return _CHECKED[key]


def _check(m: AttentionMatch) -> str | None:
    from ..ops.decode_attention import decode_attention

    g = torch.Generator().manual_seed(0)
    b, T, S, G = 2, m.tokens, 7 + m.tokens, m.heads // m.kv_heads
    q = torch.randn(b, m.heads, T, m.dk, generator=g).to(m.dtype)
    k = torch.randn(b, m.kv_heads, S, m.dk, generator=g).to(m.dtype)
    v = torch.randn(b, m.kv_heads, S, m.dv, generator=g).to(m.dtype)
    # rows filled to different lengths, the window's tokens in causal order at the end
    pos = torch.arange(S)
    fill = torch.tensor([S - T, S - T - 3])[:, None, None]
    tok = torch.arange(m.mask_rows)[None, :, None]
    keep = (pos < fill) | ((pos >= S - T) & (pos - (S - T) <= tok + (T - m.mask_rows)))
    mask = keep if m.mask_dtype in (None, torch.bool) else \
        torch.where(keep, torch.randn(keep.shape, generator=g, dtype=torch.float64), float("-inf")).to(m.mask_dtype)

    def expand(x):
        return x[:, :, None].expand(b, m.kv_heads, G, S, x.shape[-1]).reshape(b, m.heads, S, x.shape[-1])
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), expand(k).double(), expand(v).double(),
        attn_mask=mask[:, None].double() if mask.dtype != torch.bool else mask[:, None], scale=m.scale)
    got = decode_attention(q, k, v, mask, m.scale).double()
    tol = 1e-5 if m.dtype == torch.float32 else 2e-2
    err = float((got - want).abs().max())
    return None if err <= tol * (1 + float(want.abs().max())) else f"max difference {err:.3g} from SDPA"


def rewrite(gm: fx.GraphModule, cuda_only: bool = True) -> tuple[list[AttentionMatch], list[tuple[str, str]]]:
    """Rewrite every decode attention of ``gm``'s graph in place (``cuda_only``: those on CUDA tensors). Returns the
    rewritten matches and ``(layer, reason)`` for the SDPA calls left unchanged."""
    return rewrite_each(gm, attention_calls(gm.graph), match, check, _insert, tensor=lambda m: m.q,
                        cuda_only=cuda_only, noun="attention",
                        cpu_reason="not on CUDA (the CPU op is the reference: slower than SDPA there)",
                        describe=lambda m: f"decode attention ({m.tokens} token(s), {m.heads} query heads over "
                                           f"{m.kv_heads} key/value heads, {m.positions} positions) -> "
                                           f"replay_compile::decode_attention")
