"""Tensor parallelism for HF hybrid models: shard SSM heads (and attention/MLP) over a 1-D device mesh.

    mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (tp,))
    replay_compile.tensor_parallel.parallelize_hybrid(model, mesh)      # in place, on every rank
    model.forward = torch.compile(model.forward, backend="replayssm")  # per rank, as usual

Each rank keeps ``1/tp`` of every SSM layer's heads and B/C groups (Mamba-2 family) or key/value heads (Gated
DeltaNet), so its recurrent state, its replay rings and its decode-step traffic are ``1/tp`` of the whole. The
projections go through ``torch.distributed.tensor.parallel``: input projections :class:`ColwiseParallel` (local
outputs), output projections :class:`RowwiseParallel` (one all-reduce per layer), exactly as for attention and MLP
blocks. The SSM math between them runs on plain local tensors, which is what lets the replay pass find and rewrite it
per rank with no knowledge of the sharding.

Why not ``ColwiseParallel`` alone: the Mamba-2 ``in_proj`` packs ``[z | x | B | C | dt]`` (and Qwen3.5's
``in_proj_qkv`` packs ``[q | k | v]``) into one output axis, and an even split of that axis would hand rank 0 all of
``z`` and half of ``x``. The rows are first permuted so that rank ``r``'s contiguous shard is ``[z_r | x_r | B_r | C_r
| dt_r]``; the depthwise ``conv1d`` and the per-head parameters (``A_log``, ``D``, ``dt_bias``, the gated norm) are
sliced to the same heads. The module's size attributes (``num_heads``, ``n_groups``, ...) are set to the local sizes,
since the HF code splits and reshapes by them.

Kimi Delta Attention (Kimi-Linear, GLM-5.3-Flash, Ling-3.0-Flash) is sharded the same way by heads: ``q/k/v_proj``,
``b_proj``, the forget gate's and the output gate's head-wide projections column-wise (their low-rank first halves
``f_a_proj`` / ``g_a_proj`` replicated), ``o_proj`` row-wise, the conv, ``dt_bias`` and ``A_log`` sliced to the rank's
heads; the gated norm works within a head and is unchanged.

Supported: the Mamba-2 mixers of NemotronH, Mamba2, Bamba, Zamba2, GraniteMoeHybrid (heads and groups divisible by
``tp``; a grouped norm whose groups stay on one rank), Gated DeltaNet of Qwen3.5/Qwen3.5-MoE, Qwen3-Next and
OLMo-Hybrid (key and value heads divisible by ``tp``), Kimi Delta Attention (heads divisible by ``tp``); attention
with ``q/k/v/o_proj`` and dense MLPs with ``up/down(/gate)_proj``. Anything else with SSM parameters raises
:class:`UnsupportedSharding` naming the layer, rather than being sharded wrongly; MoE expert blocks, Kimi-Linear's
latent attention and embeddings stay replicated.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ._logging import log
from .errors import ReplayCompileError
from .integrations.hf_modules import is_kimi_delta_attention, is_mamba2_mixer


class UnsupportedSharding(ReplayCompileError):
    """A layer cannot be head-sharded at this tensor-parallel degree; the message names the layer and sizes."""


def _rows(segments: Sequence[int], tp: int, rank: int) -> torch.Tensor:
    """Indices of rank ``rank``'s share of every segment of a packed axis, in segment order.

    ``segments`` are the lengths of the packed pieces (e.g. ``[d_inner, d_inner + 2GN, H]``); each must be divisible
    by ``tp`` (the caller checks, to name the layer in the error).
    """
    idx, start = [], 0
    for n in segments:
        share = n // tp
        idx.append(torch.arange(start + rank * share, start + (rank + 1) * share))
        start += n
    return torch.cat(idx)


def _permutation(segments: Sequence[int], tp: int) -> torch.Tensor:
    """Row order that makes an even split of the packed axis give rank ``r`` exactly ``_rows(segments, tp, r)``."""
    return torch.cat([_rows(segments, tp, r) for r in range(tp)])


@torch.no_grad()
def _permute_out_rows(linear: nn.Linear, perm: torch.Tensor) -> None:
    linear.weight.copy_(linear.weight[perm.to(linear.weight.device)])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[perm.to(linear.bias.device)])


@torch.no_grad()
def _keep(module: nn.Module, name: str, idx: torch.Tensor, dim: int = 0) -> None:
    """Replace parameter ``name`` with its rows ``idx`` (a plain local tensor: only this rank's heads use it)."""
    p = getattr(module, name)
    if p is None:
        return
    local = p.detach().index_select(dim, idx.to(p.device)).clone()
    setattr(module, name, nn.Parameter(local, requires_grad=p.requires_grad))


def _slice_conv(conv: nn.Conv1d, idx: torch.Tensor) -> None:
    """Keep channels ``idx`` of a depthwise conv (its ``groups`` equal its channels)."""
    _keep(conv, "weight", idx)
    _keep(conv, "bias", idx)
    conv.in_channels = conv.out_channels = conv.groups = len(idx)


def _check(layer: str, tp: int, **sizes: int) -> None:
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        what = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise UnsupportedSharding(
            f"replay_compile.tensor_parallel: {layer}: {what} not divisible by the tensor-parallel degree {tp}. "
            f"Each rank must hold whole heads and whole B/C groups; pick a degree that divides "
            f"{', '.join(f'{k}={v}' for k, v in sizes.items())}, or leave this model unsharded.")


def _is_gdn(m: nn.Module) -> bool:
    return (all(hasattr(m, a) for a in ("A_log", "dt_bias", "conv1d", "num_v_heads", "num_k_heads"))
            and (hasattr(m, "out_proj") or hasattr(m, "o_proj")))


def _looks_like_ssm(m: nn.Module) -> bool:
    """SSM parameters on the module or a direct child (a forget gate's ``A_log``), or an SSM layer's class name."""
    return (hasattr(m, "A_log") or any(hasattr(c, "A_log") for c in m.children())
            or type(m).__name__.endswith(("DeltaAttention", "GatedDeltaNet", "Mixer", "LinearAttention")))


def _check_mamba2(name: str, m: nn.Module, tp: int) -> None:
    H, G, N, P = m.num_heads, m.n_groups, m.ssm_state_size, m.head_dim
    d_inner = m.intermediate_size
    layer = f"{name} ({type(m).__name__}: H={H}, G={G}, P={P}, N={N})"
    _check(layer, tp, num_heads=H, n_groups=G)
    norm = getattr(m, "norm", None)
    group_size = getattr(norm, "group_size", None)
    if norm is not None and hasattr(norm, "weight") and group_size is not None and group_size > d_inner // tp:
        raise UnsupportedSharding(
            f"replay_compile.tensor_parallel: {layer}: the gated norm normalises groups of {group_size} channels, "
            f"more than one rank holds ({d_inner // tp} at tp={tp}); that would need a cross-rank reduction inside "
            f"the norm, which is not supported.")
    proj = m.in_proj.out_features
    extra = proj - (2 * d_inner + 2 * G * N + H)
    if extra:
        raise UnsupportedSharding(
            f"replay_compile.tensor_parallel: {layer}: in_proj has {proj} outputs, expected "
            f"2*{d_inner} + 2*{G}*{N} + {H} = {proj - extra} for the [z | x | B | C | dt] layout; not sharded.")


def _shard_mamba2_mixer(name: str, m: nn.Module, mesh, tp: int, rank: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    H, G, N = m.num_heads, m.n_groups, m.ssm_state_size
    d_inner = m.intermediate_size
    norm = getattr(m, "norm", None)
    # in_proj: [z | x B C | dt] -> rank r's contiguous shard is [z_r | x_r B_r C_r | dt_r]
    _permute_out_rows(m.in_proj, _permutation([d_inner, d_inner, G * N, G * N, H], tp))
    parallelize_module(m, mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    _slice_conv(m.conv1d, _rows([d_inner, G * N, G * N], tp, rank))
    heads = _rows([H], tp, rank)
    for p in ("A_log", "D", "dt_bias"):
        _keep(m, p, heads)
    if norm is not None and getattr(norm, "weight", None) is not None:
        _keep(norm, "weight", _rows([d_inner], tp, rank))
    m.num_heads, m.n_groups, m.intermediate_size = H // tp, G // tp, d_inner // tp
    m.conv_dim = m.intermediate_size + 2 * m.n_groups * N
    for attr in ("ssm_heads", "mamba_num_heads"):  # aliases some families keep
        if isinstance(getattr(m, attr, None), int):
            setattr(m, attr, getattr(m, attr) // tp)


_GDN_SEPARATE = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj")     # OLMo-Hybrid


def _check_gdn(name: str, m: nn.Module, tp: int) -> None:
    H, HV, K, V = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    layer = f"{name} ({type(m).__name__}: key heads={H}, value heads={HV}, K={K}, V={V})"
    _check(layer, tp, num_k_heads=H, num_v_heads=HV)
    if not (hasattr(m, "in_proj_qkv") or hasattr(m, "in_proj_qkvz") or _linear(m, *_GDN_SEPARATE)):
        raise UnsupportedSharding(
            f"replay_compile.tensor_parallel: {layer}: unknown input projections (expected in_proj_qkv/z/b/a, "
            f"in_proj_qkvz/ba or {'/'.join(_GDN_SEPARATE)}); not sharded.")


def _shard_gdn(name: str, m: nn.Module, mesh, tp: int, rank: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    H, HV, K, V = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    kd, vd = H * K, HV * V
    if hasattr(m, "in_proj_qkv"):                      # Qwen3.5: [q | k | v] packed, z/b/a separate
        _permute_out_rows(m.in_proj_qkv, _permutation([kd, kd, vd], tp))
        plan = {p: ColwiseParallel() for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
    elif hasattr(m, "in_proj_qkvz"):                   # Qwen3-Next: packed per key head already, split evenly
        plan = {"in_proj_qkvz": ColwiseParallel(), "in_proj_ba": ColwiseParallel()}
    else:                                              # OLMo-Hybrid: one projection each, head-major
        plan = {p: ColwiseParallel() for p in _GDN_SEPARATE[:-1]}
    plan["out_proj" if hasattr(m, "out_proj") else "o_proj"] = RowwiseParallel()
    parallelize_module(m, mesh, plan)
    _slice_conv(m.conv1d, _rows([kd, kd, vd], tp, rank))    # the conv runs on [q | k | v] in both models
    heads = _rows([HV], tp, rank)
    for p in ("A_log", "dt_bias"):
        _keep(m, p, heads)
    m.num_k_heads, m.num_v_heads = H // tp, HV // tp
    m.key_dim, m.value_dim = m.num_k_heads * K, m.num_v_heads * V
    m.conv_dim = 2 * m.key_dim + m.value_dim


def _kda_parts(m: nn.Module) -> tuple[list[str], nn.Module]:
    """The head-wide projections of a KDA layer that are sharded column-wise (names relative to the layer)."""
    gate = m.forget_gate
    names = ["q_proj", "k_proj", "v_proj", "b_proj"]
    names += ["g_proj"] if hasattr(m, "g_proj") else ["g_b_proj"]                    # Ling-3.0-Flash / Kimi-Linear
    names += ["forget_gate.f_proj"] if hasattr(gate, "f_proj") else ["forget_gate.f_b_proj"]
    return names, gate


def _check_kda(name: str, m: nn.Module, tp: int) -> None:
    H, D = m.num_heads, m.head_dim
    layer = f"{name} ({type(m).__name__}: heads={H}, head_dim={D})"
    _check(layer, tp, num_heads=H)
    names, gate = _kda_parts(m)
    for n in names:
        try:
            sub = m.get_submodule(n)
        except AttributeError:
            sub = None
        want = H if n == "b_proj" else H * D
        if not isinstance(sub, nn.Linear) or sub.out_features != want:
            raise UnsupportedSharding(
                f"replay_compile.tensor_parallel: {layer}: {n} is not a linear map to {want} features (one per "
                f"{'head' if n == 'b_proj' else 'head channel'}); not sharded.")
    a_log, dt_bias = getattr(gate, "A_log", None), getattr(gate, "dt_bias", None)
    if a_log is None or dt_bias is None or list(a_log.shape).count(H) != 1 or dt_bias.numel() != H * D:
        raise UnsupportedSharding(
            f"replay_compile.tensor_parallel: {layer}: the forget gate's A_log / dt_bias are not one value per head "
            f"/ per head channel; not sharded.")


def _shard_kda(name: str, m: nn.Module, mesh, tp: int, rank: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    H, D = m.num_heads, m.head_dim
    names, gate = _kda_parts(m)
    plan = {n: ColwiseParallel() for n in names}
    plan["o_proj"] = RowwiseParallel()
    parallelize_module(m, mesh, plan)
    _slice_conv(m.conv1d, _rows([H * D] * 3, tp, rank))        # the conv runs on [q | k | v]
    _keep(gate, "dt_bias", _rows([H * D], tp, rank))
    _keep(gate, "A_log", _rows([H], tp, rank), dim=list(gate.A_log.shape).index(H))
    for mod in (m, gate):
        mod.num_heads = H // tp
        mod.qkv_dim = mod.num_heads * D
    m.conv_dim = 3 * m.qkv_dim


def _norm_across_heads(m: nn.Module) -> str | None:
    """The name of a query / key norm of attention block ``m`` whose weight spans several heads (OLMo's norm over the
    whole projection), else None: such a norm needs every head's values."""
    head_dim = getattr(m, "head_dim", None)
    for n in ("q_norm", "k_norm"):
        w = getattr(getattr(m, n, None), "weight", None)
        if isinstance(w, torch.Tensor) and head_dim and w.numel() > head_dim:
            return n
    return None


def _check_attention(name: str, m: nn.Module, tp: int) -> None:
    cfg = getattr(m, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads is not None:
        _check(f"{name} ({type(m).__name__})", tp, num_attention_heads=heads, num_key_value_heads=kv)


def _shard_attention(name: str, m: nn.Module, mesh, tp: int, rank: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(m, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                 "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    for attr in ("num_heads", "num_attention_heads", "num_key_value_heads"):
        if isinstance(getattr(m, attr, None), int):
            setattr(m, attr, getattr(m, attr) // tp)


def _check_mlp(name: str, m: nn.Module, tp: int) -> None:
    _check(f"{name} ({type(m).__name__})", tp, intermediate=m.down_proj.in_features)


def _shard_mlp(name: str, m: nn.Module, mesh, tp: int, rank: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    if isinstance(getattr(m, "gate_proj", None), nn.Linear):
        plan["gate_proj"] = ColwiseParallel()
    parallelize_module(m, mesh, plan)


def _linear(m: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Linear) for n in names)


def parallelize_hybrid(model: nn.Module, mesh, *, attention: bool = True, mlp: bool = True) -> nn.Module:
    """Shard ``model``'s SSM layers (and, unless turned off, attention and dense MLP blocks) over ``mesh``, in place.

    ``mesh``: a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` (every rank calls this with the same full
    model, e.g. loaded from the same checkpoint). Returns ``model``. Raises :class:`UnsupportedSharding` (naming the
    layer and sizes) for an SSM layer it cannot shard, before it changes anything.
    """
    if mesh.ndim != 1:
        raise UnsupportedSharding(f"replay_compile.tensor_parallel: expected a 1-D tensor-parallel mesh, got "
                                  f"{mesh.ndim}-D {tuple(mesh.shape)}; pass mesh['tp'] of a larger mesh.")
    tp, rank = mesh.size(), mesh.get_local_rank()
    plan: list[tuple[str, nn.Module, str]] = []
    for name, m in model.named_modules():
        if is_mamba2_mixer(m):
            plan.append((name, m, "mamba2"))
        elif _is_gdn(m):
            plan.append((name, m, "gdn"))
        elif is_kimi_delta_attention(m):
            plan.append((name, m, "kda"))
        elif _looks_like_ssm(m) and any(isinstance(c, nn.Conv1d) for c in m.children()):
            raise UnsupportedSharding(
                f"replay_compile.tensor_parallel: {name} ({type(m).__name__}) looks like an SSM layer of a kind "
                f"this helper does not shard (supported: Mamba-2 mixers, Gated DeltaNet, Kimi Delta Attention). Shard "
                f"it yourself so that the SSM update runs on local tensors, or leave the model unsharded.")
        elif attention and _linear(m, "q_proj", "k_proj", "v_proj", "o_proj"):
            wide = _norm_across_heads(m)
            if wide:
                log.info("replay_compile.tensor_parallel: %s (%s) left replicated: its %s normalises across heads, "
                         "which a head shard cannot compute alone", name, type(m).__name__, wide)
            else:
                plan.append((name, m, "attention"))
        elif mlp and _linear(m, "up_proj", "down_proj") and not hasattr(m, "experts") and not hasattr(m, "gate"):
            plan.append((name, m, "mlp"))
    for name, m, kind in plan:            # every check before any layer is touched: no half-sharded model
        _KINDS[kind][0](name, m, tp)
    for name, m, kind in plan:
        _KINDS[kind][1](name, m, mesh, tp, rank)
    return model


# kind -> (check: raises UnsupportedSharding, shard: in place)
_KINDS = {"mamba2": (_check_mamba2, _shard_mamba2_mixer), "gdn": (_check_gdn, _shard_gdn),
          "kda": (_check_kda, _shard_kda),
          "attention": (_check_attention, _shard_attention), "mlp": (_check_mlp, _shard_mlp)}
