"""Tiny random-weight HuggingFace Mamba-2 family models for CPU tests.

``MAMBA2_FAMILY[name](dtype=torch.float32, seed=0, initializer_range=0.5, **overrides)``
returns an eval-mode ``*ForCausalLM`` (``overrides`` are config kwargs). Weights are
drawn in fp32 under ``seed`` and then cast, so the fp32 and bf16 builds share weights.
``generation_config.eos_token_id`` is cleared so ``generate`` always runs
``max_new_tokens``. Checked with torch 2.13 (CPU) and transformers 5.24: 40-token greedy
generate takes 0.05-0.12 s eager (OMP_NUM_THREADS=1, batch 2); the first compiled
generate takes ~1.3-3.5 s (Dynamo tracing). Greedy tokens vary (>=12 distinct in 40), and
zeroing the SSM state at one decode step changes the logits by 40-130% (relative norm).

SSM parameter init: ``initializer_range`` only affects the Linear/Conv1d/Embedding weights
(mamba2 uses kaiming init for conv1d/out_proj). A_log/dt_bias/D are set independently
of it: A = -(1..H) and D = 1; softplus(dt_bias) is 1.31 for bamba/falcon_h1/
granitemoehybrid (per-step decay 0.27..0.005, which forgets almost at once) and
U[1e-3, 0.1] for mamba2/nemotron_h/zamba2 (decay ~0.99+, almost no input). So ``build``
redraws them per layer from ``seed`` and rescales the dt rows of ``in_proj``. The measured
per-token exp(A*dt) quantiles are then about 5%: 0.42, 50%: 0.79, 95%: 0.96 for every family.

Decode step (input_ids [B, 1]). On CPU every family takes the pure-torch path: the
hub-kernel wrappers log "falling back to its reference PyTorch implementation" (with
mamba_ssm installed on a GPU, the update would be an opaque kernel call instead). All six
modeling files carry a byte-identical copy of ``mamba2_selective_state_update``. No graph
breaks occur, and compiled generation matches eager token for token in fp32 and bf16. The
Mamba2 update region as captured (names shortened, tiny config: B=2 H=4 P=16 N=16 G=2)::

    dt_1 = dt.transpose(1, 2).expand(-1, -1, 16)      ; A_1 = A[:, None, None].expand(-1, 16, 16)
    B_1 = B.view(2, 2, 16); C_1 = C.view(2, 2, 16)  ; D = D_[:, None].expand(-1, 16)
    dt_bias = dt_bias_[:, None].expand(-1, 16); to_6 = dt_bias.to(torch.float32)  # model dtype
    dt_3 = torch._C._nn.softplus(dt_1 + to_6); dt_4 = dt_3[(Ellipsis, None)]
    dA = torch.exp(dt_4.float() * A_1.float()).to(device=device(type='cpu'))
    B_4 = B_1.reshape(2, 2, 1, 16).expand(2, 2, 2, 16).contiguous().reshape(2, 4, 1, 16)
    dB = dt_4 * B_4; dBx = (dB * hidden_states_4[(Ellipsis, None)]).to(device=...)
    mul_5 = l_kwargs_cache_layers_0_recurrent_states_0_ * dA; ssm_states = mul_5 + dBx
    to_9 = ssm_states.to(torch.float32)
    copy__1 = l_kwargs_cache_layers_0_recurrent_states_0_.copy_(to_9)
    C_4 = C_1.reshape(2, 2, 1, 16).expand(2, 2, 2, 16).contiguous().reshape(2, 4, 16)
    ssm_states_1 = ssm_states.to(device=device(type='cpu'), dtype=torch.float32)  # C dtype
    out_3 = torch.bmm(ssm_states_1.view(8, 16, 16), C_4.view(8, 16, 1))
    out_5 = (out_3.view(2, 4, 16) + hidden_states_4 * D).to(torch.float32)
    scan_output_1 = out_5.to(torch.float32).view(2, 1, -1)   # then gated RMSNorm, out_proj

(each line above is one or more FX nodes; the graph spells every op out separately).

* bamba, nemotron_h, zamba2, granitemoehybrid: op-for-op identical to mamba2 in fp32
  and bf16. Only names and constants differ: the submodule is ``.mamba`` (``.mixer`` in
  nemotron_h/mamba2), and granitemoehybrid's gated-norm eps is 1e-6.
* falcon_h1 (default ``mamba_rms_norm=False``) differs. Before the split it has
  ``hidden_states * 1.0`` (ssm_in_multiplier) and ``projected_states * ...mup_vector_``
  (a buffer placeholder). Inside the update: ``A[(slice(None), None, Ellipsis)]
  [(slice(None), slice(None), None)].expand(-1,16,16).to(dtype=torch.float32)``, and
  D/dt_bias are indexed as ``[(slice(None), None, Ellipsis)]``. z is passed:
  ``v = gate.view(2, 4, 16)`` (node placed before the dt math); after the D skip,
  ``out_6 = out_5 * torch.nn.functional.silu(v)`` (silu runs in the model dtype; gate is
  not upcast). There is no gated RMSNorm: ``.view(2, 1, 64)`` goes straight to out_proj.
  With ``mamba_rms_norm=True``, z=None and FalconH1RMSNormGated follows (it spells
  ``weight.view(2, 32) * x`` and applies the silu(gate) *after* the norm).
* dtypes: the recurrent state is **fp32 even in bf16 models** (lazily created as
  ``zeros_like`` of the chunk-scan final state, which is fp32). In bf16, then:
  ``dt_bias.to(bf16)``; dt/B/x/dBx are bf16; ``state(fp32)*dA(fp32) + dBx(bf16)`` promotes
  to fp32; the readout casts ``ssm_states.to(dtype=torch.bfloat16)`` before the bf16 ``bmm``;
  ``out_5 = (...).to(torch.bfloat16)``. The conv state has the model dtype.
* cache: generate uses ``DynamicCache`` (kwarg ``cache``; ``cache_params`` and
  ``past_key_values`` are deprecated). The placeholders are
  ``L_kwargs_cache_layers_{i}_recurrent_states_0_`` [B, H, P, N] and ``..._conv_states_0_``
  (i = global layer index, so attention layers leave gaps). Both are allocated once and
  updated with ``copy_``; they carry ``mark_static_address``
  (``_dynamo_static_input_type == 'unguarded'``). Parameter placeholders are named
  ``L_args_0_modules_backbone_...`` for mamba2 (its forward is reached through a
  ``*args`` deprecation wrapper) but ``L_self_modules_model_...`` for the hybrids.
* recompiles: mamba2 gives 2 graphs (prefill; decode, after a ``len(kwargs)`` guard).
  The hybrids give 3: prefill; decode #1 (static KV length); then a dynamic-shape decode
  graph with SymInt placeholders (e.g. ``s84``, ``s60``) for the growing KV cache, used
  for every later step. Both decode graphs contain the same SSM region with static shapes.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict

import torch

from ..integrations.hf_modules import is_gated_deltanet

VOCAB = 128
HIDDEN = 32
N_HEADS, HEAD_DIM, N_GROUPS, D_STATE = 4, 16, 2, 16  # expand 2: 4 * 16 == 2 * 32
CHUNK = 4  # < default prompt_len, so prefill crosses a chunk boundary
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
_MAMBA = dict(mamba_n_heads=N_HEADS, mamba_d_head=HEAD_DIM, mamba_n_groups=N_GROUPS, mamba_d_state=D_STATE,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=CHUNK)


def _mamba2_cfg():
    from transformers import Mamba2Config
    return Mamba2Config, dict(num_heads=N_HEADS, head_dim=HEAD_DIM, n_groups=N_GROUPS, state_size=D_STATE,
                              expand=2, conv_kernel=4, chunk_size=CHUNK, num_hidden_layers=2, **_COMMON)


def _bamba_cfg():
    from transformers import BambaConfig
    # Layers: mamba, attention, mamba (same layout for granitemoehybrid; nemotron_h adds an MLP block).
    return BambaConfig, dict(num_hidden_layers=3, attn_layer_indices=[1], **_ATTN, **_MAMBA, **_COMMON)


def _nemotron_h_cfg():
    from transformers import NemotronHConfig
    return NemotronHConfig, dict(
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        mamba_num_heads=N_HEADS, mamba_head_dim=HEAD_DIM, n_groups=N_GROUPS, ssm_state_size=D_STATE,
        conv_kernel=4, expand=2, chunk_size=CHUNK, head_dim=8, **_ATTN, **_COMMON)


def _falcon_h1_cfg():
    from transformers import FalconH1Config
    # Every Falcon-H1 layer is "hybrid": attention and mamba run in parallel.
    return FalconH1Config, dict(num_hidden_layers=2, mamba_d_ssm=N_HEADS * HEAD_DIM, head_dim=8,
                                **_ATTN, **_MAMBA, **_COMMON)


def _zamba2_cfg():
    from transformers import Zamba2Config
    # "hybrid" = shared attention block (+ linear) followed by a mamba layer.
    return Zamba2Config, dict(
        layers_block_type=["linear_attention", "hybrid", "linear_attention"], num_hidden_layers=3,
        n_mamba_heads=N_HEADS, mamba_ngroups=N_GROUPS, mamba_d_state=D_STATE, mamba_d_conv=4,
        mamba_expand=2, chunk_size=CHUNK, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, max_position_embeddings=256, **_COMMON)


def _granitemoehybrid_cfg():
    from transformers import GraniteMoeHybridConfig
    # num_local_experts=0 -> dense shared_mlp only (MoE routing is irrelevant to the SSM path).
    return GraniteMoeHybridConfig, dict(
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_local_experts=0, shared_intermediate_size=64, **_ATTN, **_MAMBA, **_COMMON)


def _ssm_mixers(model):
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("A_log", "dt_bias", "D", "in_proj"))]


@torch.no_grad()
def _perturb_ssm(model, seed: int) -> None:
    """Deterministically redraw A_log/dt_bias/D and tame the dt projection.

    -A = exp(A_log) ~ U[0.5, 2], softplus(dt_bias) ~ U[0.05, 0.4], D ~ U[0.5, 1.5], and the
    dt rows of in_proj (the last num_heads outputs in every family) are rescaled so the
    input-dependent dt pre-activation has std ~0.5 for unit-RMS inputs. Result:
    exp(A*dt) mostly in [0.4, 0.97]. Uses its own generator; global RNG untouched.
    """
    g = torch.Generator().manual_seed(10_000 + seed)
    for mixer in _ssm_mixers(model):
        h = mixer.num_heads
        u = lambda lo, hi: lo + (hi - lo) * torch.rand(h, generator=g)  # noqa: E731
        mixer.A_log.copy_(torch.log(u(0.5, 2.0)))
        dt = u(0.05, 0.4)
        mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
        mixer.D.copy_(u(0.5, 1.5))
        w = mixer.in_proj.weight
        w[-h:] *= 0.5 / (w[-h:].std() * math.sqrt(w.shape[1]) + 1e-6)


def _builder(cfg_fn: Callable[[], Any]) -> Callable[..., torch.nn.Module]:
    def build(dtype: torch.dtype = torch.float32, seed: int = 0, initializer_range: float = 0.5,
              **overrides) -> torch.nn.Module:
        import transformers
        cfg_cls, kw = cfg_fn()
        config = cfg_cls(**{**kw, "initializer_range": initializer_range, **overrides})
        model_cls = getattr(transformers, cfg_cls.__name__.replace("Config", "ForCausalLM"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config)
        _perturb_ssm(model, seed)
        model.generation_config.eos_token_id = None  # always run max_new_tokens
        return model.to(dtype).eval()
    build.__doc__ = f"Build a tiny random {cfg_fn.__name__[1:-4]} model (eval mode)."
    return build


def _build_nemotron_h_omni(dtype: torch.dtype = torch.float32, seed: int = 0, initializer_range: float = 0.5,
                           **overrides) -> torch.nn.Module:
    """Build a tiny random NemotronH-Omni (the NemotronH language model above behind a one-layer RADIO vision tower,
    no audio tower; eval mode). Text-only prompts decode through its NemotronH language model. ``overrides`` go to
    the text config."""
    import transformers
    cfg_cls = getattr(transformers, "NemotronH_Omni_Reasoning_V3_Config", None)
    if cfg_cls is None:
        raise RuntimeError(f"nemotron_h_omni is not in transformers {transformers.__version__} (it is from 5.2x on)")
    _, text = _nemotron_h_cfg()
    vision = dict(model_type="radio", hidden_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                  image_size=16, max_img_size=32, video_temporal_patch_size=2)
    config = cfg_cls(text_config=dict(model_type="nemotron_h", **{**text, "initializer_range": initializer_range,
                                                                   **overrides}),
                     vision_config=vision, projector_hidden_size=16, vision_hidden_size=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.NemotronH_Omni_Reasoning_V3(config)
    _perturb_ssm(model, seed)
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


MAMBA2_FAMILY: Dict[str, Callable[..., torch.nn.Module]] = {
    "mamba2": _builder(_mamba2_cfg),
    "bamba": _builder(_bamba_cfg),
    "nemotron_h": _builder(_nemotron_h_cfg),
    "falcon_h1": _builder(_falcon_h1_cfg),
    "zamba2": _builder(_zamba2_cfg),
    "granitemoehybrid": _builder(_granitemoehybrid_cfg),
    "nemotron_h_omni": _build_nemotron_h_omni,
}

# The transformers class each family needs: families newer than the oldest supported transformers are built only
# where their class exists (``available``).
_FAMILY_CLASS = {"nemotron_h_omni": "NemotronH_Omni_Reasoning_V3", "lara_mini": "LaraMiniForCausalLM",
                 "bailing_hybrid": "BailingHybridForCausalLM"}


def available(family: str) -> bool:
    """Whether the installed transformers has ``family`` (all but the newest families are in every supported
    version)."""
    import transformers
    return hasattr(transformers, _FAMILY_CLASS.get(family, "PreTrainedModel"))


def vocab_size(model) -> int:
    """The model's vocabulary size (a multimodal model keeps it in its text config)."""
    return model.config.get_text_config().vocab_size


def make_inputs(model, batch: int = 2, prompt_len: int = 5, seed: int = 0) -> torch.Tensor:
    """Random prompt ids in [3, vocab) (avoids pad/bos/eos), shape [batch, prompt_len]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size(model), (batch, prompt_len), generator=g)


def greedy_static_decode(model, forward, cache, prompt_len: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill a [2, prompt_len] :func:`make_inputs` prompt eagerly into ``cache`` (a static cache), then ``steps``
    one-token greedy steps through ``forward`` (the model's own or a compiled one). Returns the tokens [2, steps] and
    their logits [2, steps, vocab]."""
    from ..integrations.hf_modules import cache_kwarg

    ck = cache_kwarg(model)
    ids = make_inputs(model, batch=2, prompt_len=prompt_len, seed=0)
    out = model(ids, use_cache=True, cache_position=torch.arange(prompt_len), **{ck: cache})
    tok, toks, logits = out.logits[:, -1:].argmax(-1), [], []
    for t in range(steps):
        o = forward(tok, use_cache=True, cache_position=torch.tensor([prompt_len + t]), **{ck: cache})
        logits.append(o.logits)
        tok = o.logits[:, -1:].argmax(-1)
        toks.append(tok)
    return torch.cat(toks, 1), torch.cat(logits, 1)


# --- delta-rule families ----------------------------------------------------------------------------------------------
# Gated DeltaNet: Qwen3-Next, Qwen3.5 dense/MoE, OLMo-Hybrid, Lara-Mini, Qwen4-Exp (with indexed attention); KDA:
# Kimi-Linear, Ling-3.0-Flash (bailing_hybrid, with MLA attention), GLM-5.3-Flash (glm5_next, with indexed MLA).
# Grouped value heads (4 value heads over 2 key heads) and K != V, so the rewrite has to find the key groups.
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=6,
            linear_conv_kernel_dim=4)
_GDN_LAYERS = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                   head_dim=8)
_GDN_LAYERS_ONLY = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _qwen3_next_cfg():
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig, dict(decoder_sparse_step=1, **_MOE, **_GDN, **_GDN_LAYERS, **_ATTN, **_COMMON)


def _qwen3_5_cfg():
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig, dict(**_GDN, **_GDN_LAYERS, **_ATTN, **_COMMON)


def _qwen3_5_moe_cfg():
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig, dict(**_MOE, **_GDN, **_GDN_LAYERS, **_ATTN, **_COMMON)


def _kimi_linear_cfg():
    from transformers import KimiLinearConfig
    attn = {**_ATTN, "num_key_value_heads": _ATTN["num_attention_heads"]}      # MLA: one KV head per head
    return KimiLinearConfig, dict(
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4, moe_intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, mlp_layer_types=["dense", "sparse", "dense"],
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **attn, **_COMMON)


def _olmo_hybrid_cfg():
    from transformers import OlmoHybridConfig
    attn = {k: v for k, v in _ATTN.items() if k != "intermediate_size"}
    return OlmoHybridConfig, dict(intermediate_size=64, **_GDN, **_GDN_LAYERS_ONLY, **attn, **_COMMON)


def _lara_mini_cfg():
    from transformers import LaraMiniConfig
    attn = {k: v for k, v in _ATTN.items() if k != "intermediate_size"}
    return LaraMiniConfig, dict(num_hidden_layers=3, layer_types=["linear_attention", "sliding_attention",
                                                                  "linear_attention"],
                                head_dim=8, sliding_window=64, **_MOE, **_GDN, **attn, **_COMMON)


def _bailing_hybrid_cfg():
    from transformers import BailingHybridConfig
    attn = {k: v for k, v in _ATTN.items() if k != "intermediate_size"}
    attn["num_key_value_heads"] = attn["num_attention_heads"]                  # MLA: one KV head per head
    return BailingHybridConfig, dict(
        **_GDN_LAYERS_ONLY, intermediate_size=64, moe_intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, mlp_layer_types=["dense", "sparse", "dense"], kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, short_conv_kernel_size=4,
        n_group=1, topk_group=1, first_k_dense_replace=1, num_mtp_layers=0, **attn, **_COMMON)


def _qwen4_exp_cfg():
    from transformers import Qwen4ExpTextConfig
    attn = {k: v for k, v in _ATTN.items() if k != "intermediate_size"}
    # GDN layers and one indexed-attention layer (top-k selection by an indexer: `nonzero`, so graph breaks inside
    # the decode step)
    return Qwen4ExpTextConfig, dict(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["indexed_attention"], head_dim=8,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2,
        **_MOE, **_GDN, **attn, **_COMMON)


def _glm5_next_cfg():
    from transformers import Glm5NextConfig

    def text_only(**text):                      # the multimodal wrapper's text model is what decodes
        return Glm5NextConfig(text_config=text)
    # KDA layers and one indexed (DSA) attention layer: MLA without RoPE, a query LoRA, an indexer over pooled keys
    return text_only, dict(
        num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"], hidden_size=HIDDEN,
        intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, n_group=1, topk_group=1, index_topk=8,
        index_kpool=4, index_head_dim=8, index_n_heads=2, linear_head_dim=8, linear_num_heads=4,
        linear_conv_kernel_dim=4, mlp_layer_types=["dense", "sparse"], max_position_embeddings=256,
        **{k: v for k, v in _COMMON.items() if k != "hidden_size"})


def _plain_builder(cfg_fn: Callable[[], Any], model_cls_name: str,
                   initializer_range: float | None = 0.5) -> Callable[..., torch.nn.Module]:
    """A builder of ``model_cls_name`` from ``cfg_fn() -> (config class, kwargs)``; ``initializer_range`` None keeps
    the config's own."""
    def build(dtype: torch.dtype = torch.float32, seed: int = 0, initializer_range: float | None = initializer_range,
              **overrides) -> torch.nn.Module:
        import transformers
        cfg_cls, kw = cfg_fn()
        init = {} if initializer_range is None else {"initializer_range": initializer_range}
        config = cfg_cls(**{**kw, **init, **overrides})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = getattr(transformers, model_cls_name)(config)
        model.generation_config.eos_token_id = None  # always run max_new_tokens
        return model.to(dtype).eval()
    build.__doc__ = f"Build a tiny random {model_cls_name} (eval mode)."
    return build


DELTA_FAMILY: Dict[str, Callable[..., torch.nn.Module]] = {
    "qwen3_next": _plain_builder(_qwen3_next_cfg, "Qwen3NextForCausalLM"),
    "qwen3_5": _plain_builder(_qwen3_5_cfg, "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": _plain_builder(_qwen3_5_moe_cfg, "Qwen3_5MoeForCausalLM"),
    "kimi_linear": _plain_builder(_kimi_linear_cfg, "KimiLinearForCausalLM"),
    "olmo_hybrid": _plain_builder(_olmo_hybrid_cfg, "OlmoHybridForCausalLM"),
    "lara_mini": _plain_builder(_lara_mini_cfg, "LaraMiniForCausalLM"),
    "bailing_hybrid": _plain_builder(_bailing_hybrid_cfg, "BailingHybridForCausalLM"),
    "qwen4_exp": _plain_builder(_qwen4_exp_cfg, "Qwen4ExpForCausalLM"),
    "glm5_next": _plain_builder(_glm5_next_cfg, "Glm5NextForConditionalGeneration"),
}


_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2)


def _config(cls_name: str, **kw) -> Callable[[], Any]:
    def cfg():
        import transformers
        return getattr(transformers, cls_name), kw
    return cfg


MAMBA1_FAMILY: Dict[str, Callable[..., torch.nn.Module]] = {
    "mamba": _plain_builder(_config("MambaConfig", **_SMALL, state_size=8, expand=2), "MambaForCausalLM", None),
    "falcon_mamba": _plain_builder(_config("FalconMambaConfig", **_SMALL, state_size=8, expand=2),
                                   "FalconMambaForCausalLM", None),
    "jamba": _plain_builder(_config("JambaConfig", **_SMALL, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, num_experts=1, attn_layer_period=2, attn_layer_offset=1,
                                    mamba_d_state=8, mamba_expand=2), "JambaForCausalLM", None),
    # Mamba-1 split into heads, stepped head by head through slices of one state
    "zamba": _plain_builder(_config("ZambaConfig", vocab_size=64, hidden_size=32, num_hidden_layers=4,
                                    intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                                    attention_head_dim=16, n_mamba_heads=2, mamba_d_state=8, mamba_expand=2,
                                    layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
                            "ZambaForCausalLM", None),
}

# Lightning attention (MiniMax-Text-01): a per-head constant decay and a rank-1 ``k^T v`` update, Mamba-2's form on
# a [K, V] state, returned as a new tensor each step for the cache list to store
LIGHTNING_FAMILY: Dict[str, Callable[..., torch.nn.Module]] = {
    "minimax": _plain_builder(_config(
        "MiniMaxConfig", **_SMALL, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_local_experts=2, num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"],
        block_size=4), "MiniMaxForCausalLM", None),
}


@torch.no_grad()
def slow_gdn_gates(model, seed: int = 0) -> None:
    """Redraw every GDN layer's gates as the Mamba-2 builds do: -A ~ U[0.5, 2], softplus(dt_bias) ~ U[0.05, 0.4],
    and the ``a`` rows of the input projection (Qwen3-Next: inside ``in_proj_ba``, per key-head group ``[b | a]``)
    rescaled to a pre-activation std ~0.5."""
    g = torch.Generator().manual_seed(20_000 + seed)
    for m in model.modules():
        if not is_gated_deltanet(m):
            continue
        HV, Hk = m.num_v_heads, m.num_k_heads
        u = lambda lo, hi: lo + (hi - lo) * torch.rand(HV, generator=g)  # noqa: E731
        m.A_log.copy_(torch.log(u(0.5, 2.0)))
        dt = u(0.05, 0.4)
        m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))                      # softplus^-1
        w = (m.in_proj_a.weight if hasattr(m, "in_proj_a") else m.a_proj.weight if hasattr(m, "a_proj")
             else m.in_proj_ba.weight.view(Hk, 2, HV // Hk, -1)[:, 1])
        w *= 0.5 / (w.std() * math.sqrt(w.shape[-1]) + 1e-6)


def build_for_speculation(family: str) -> torch.nn.Module:
    """A tiny model of ``family`` whose greedy decode is a fair speculative test: the GDN builds get
    :func:`slow_gdn_gates` (with the stock init their gates forget almost everything each token, so drafts verified
    in one forward and tokens decoded one by one would agree for the wrong reason)."""
    if family in DELTA_FAMILY:
        model = DELTA_FAMILY[family]()
        slow_gdn_gates(model)
        return model
    return MAMBA2_FAMILY[family]()
