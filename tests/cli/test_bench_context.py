"""``replay-compile bench --context N``: the cache filled as an N-token prompt would leave it, and the step's
bytes floor."""

import pytest
import torch

pytest.importorskip("transformers")

from replay_compile import bench  # noqa: E402
from replay_compile.integrations.hf_modules import attention_layers, cache_kwarg  # noqa: E402
from replay_compile.testing.hf_models import MAMBA2_FAMILY, make_inputs  # noqa: E402
from replay_compile.testing.tp_parity import _conv_states, _recurrent_states  # noqa: E402


def _prefilled(batch=2, prompt=5, length=40):
    from transformers import StaticCache
    model = MAMBA2_FAMILY["nemotron_h"](dtype=torch.float32)
    cache = StaticCache(config=model.config, max_cache_len=length)
    ids = make_inputs(model, batch=batch, prompt_len=prompt, seed=0)
    with torch.no_grad():
        model(ids, use_cache=True, cache_position=torch.arange(prompt), **{cache_kwarg(model): cache})
    return model, cache


def test_fill_context_fills_the_positions_and_moves_the_write_position():
    model, cache = _prefilled()
    layers = attention_layers(cache)
    assert layers
    before = [layer.keys[:, :, :5].clone() for layer in layers]
    bench.fill_context(cache, 5, 30)
    for layer, kept in zip(layers, before):
        assert torch.equal(layer.keys[:, :, :5], kept)                       # the prompt's keys stay
        assert (layer.keys[:, :, 5:30] != 0).all() and (layer.values[:, :, 5:30] != 0).all()
        assert (layer.keys[:, :, 30:] == 0).all()
        count = getattr(layer, "cumulative_length", None)
        if isinstance(count, torch.Tensor):
            assert int(count) == 30
    # and a decode step runs from there, writing its keys at position 30
    tok = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        model(tok, use_cache=True, cache_position=torch.tensor([30]), **{cache_kwarg(model): cache})
    assert all((layer.keys[:, :, 30] != 0).any() for layer in layers)


def test_step_floor_counts_weights_states_and_the_filled_cache():
    model, cache = _prefilled()
    floor = bench.step_floor_bytes(model, cache, batch=2, filled=12)
    kv = sum(2 * t.shape[1] * 12 * t.shape[3] * t.element_size() for layer in attention_layers(cache)
             for t in (layer.keys, layer.values))
    assert floor["kv"] == kv
    assert floor["ssm"] == sum(t.numel() * t.element_size() for t in _recurrent_states(cache))
    assert floor["conv"] == 2 * sum(t.numel() * t.element_size() for t in _conv_states(cache))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < floor["weights"] <= params
    assert floor["total"] == floor["weights"] + floor["ssm"] + floor["conv"] + floor["kv"]


def test_gemm_terms_are_every_linear_weight_read_once_and_applied_to_each_row():
    model, _ = _prefilled()
    terms = bench.step_gemm_terms(model, batch=3)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(terms) == len(linears) and linears
    assert terms == [(w.numel() * w.element_size(), 6 * w.numel()) for w in linears]
    assert sum(b for b, _ in terms) <= sum(p.numel() * p.element_size() for p in model.parameters())


def test_roofline_floor_adds_only_the_compute_a_product_takes_beyond_its_bytes():
    bw, peak = 1e12, 100e12                                              # ridge point: 100 flop per byte
    assert bench.roofline_floor_ms(4e9, [], bw, peak) == pytest.approx(4.0)
    below = [(1e9, 50e9)]                                                # 50 flop per byte: bytes-bound, no change
    assert bench.roofline_floor_ms(4e9, below, bw, peak) == pytest.approx(4.0)
    above = [(1e9, 300e9), (1e9, 50e9)]                                 # the first takes 3 ms, not 1
    assert bench.roofline_floor_ms(4e9, above, bw, peak) == pytest.approx(6.0)


def test_bench_one_decodes_after_the_context():
    model, _ = _prefilled()
    row = bench.bench_one(model, 2, "eager", 4, 16, prompt_len=5, context=25)
    assert row["context"] == 25 and row["floor_bytes"] > 0
    assert row["gemm_terms"] == bench.step_gemm_terms(model, 2)
    assert row["queued_ms"] != row["queued_ms"]                     # NaN: queued steps are timed on GPUs only


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "replayssm-ro"])
def test_queued_steps_run_ahead_of_the_device_and_continue_the_decode(mode):
    """The queued loop decodes on from the timed one in the same cache (sized for both: a position past its end
    would fail the step), through a flush (L = 4, 8 steps), and reports the device's and the host's time per
    step."""
    model = MAMBA2_FAMILY["nemotron_h"](dtype=torch.float32).cuda()
    row = bench.bench_one(model, 2, mode, 6, 4, prompt_len=5, context=25, queued=8)
    assert row["queued_ms"] > 0 and row["host_ms"] > 0
    assert row["context"] == 25


@pytest.mark.parametrize("name, category", [
    ("_decode_attention_split", "attention"),
    ("pytorch_flash::flash_fwd_kernel", "attention"),
    ("triton_poi_fused_clone_expand_5", "KV expand copy"),
    ("triton_poi_fused__unsafe_view_clone_expand_transpose_12", "KV expand copy"),
    # Inductor names a fused kernel by all its ops: gates or norms that broadcast with an expand are not a KV copy
    ("triton_red_fused__to_copy__unsafe_view_add_clone_exp_expand_mul_neg_rsqrt_select_silu_slice_softplus",
     "norms, gates, other fused"),
    ("triton_poi_fused__to_copy__unsafe_view_add_expand_mean_mul_pow_rsqrt_silu_slice_split_with_sizes_transpose_3",
     "norms, gates, other fused"),
    ("_mamba2_replay_whole_kernel", "SSM step"),
    ("_delta_replay_step_kernel", "SSM step"),
    ("nvjet_tst_128x64_64x4_1x2_h_bz_coopB_TNT", "GEMM"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3", "norms, gates, other fused"),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copy / memset"),
    ("triton_per_fused_silu_mul_9", "norms, gates, other fused"),
])
def test_profile_categories(name, category):
    assert bench.kernel_category(name) == category


def test_profile_table_and_csv(tmp_path, capsys):
    rows = [dict(model="m", batch=2, context=8, mode="replayssm-ro", step_ms=1.0,
                 profile={"attention": 0.25, "GEMM": 0.5},
                 kernels={"nvjet_tst_128x64": (0.5, 7.0), "_decode_attention_kernel": (0.25, 2.0),
                          "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>": (0.0625, 1.0)})]
    bench._write_profile(rows, str(tmp_path), quiet=False)
    text = (tmp_path / "profile.csv").read_text().splitlines()
    assert text[0] == "model,batch,context,mode,step_ms,device_ms,attention,GEMM" and text[1].endswith(",0.25,0.5")
    out = capsys.readouterr().out
    assert "0.750" in out and "costliest kernels, m bs2 replayssm-ro" in out
    # every kernel, costliest first, a name with commas kept whole; read back as the merge of workers reads it
    from replay_compile.bench_parallel import read_kernel_profiles
    kern = (tmp_path / "profile_kernels.csv").read_text().splitlines()
    assert kern[0] == "model,batch,context,mode,kernel,category,ms_per_step,launches_per_step" and len(kern) == 4
    assert kern[1].startswith("m,2,8,replayssm-ro,nvjet_tst_128x64,GEMM,0.5,7.0")
    assert read_kernel_profiles(str(tmp_path / "profile_kernels.csv")) == {("m", 2, "replayssm-ro"): rows[0]["kernels"]}


def test_the_banner_names_the_kernel_packages_transformers_would_route_to(monkeypatch):
    """A results table says whether its transformers rows ran the kernel path: the packages that import, with their
    versions; one whose import fails (a compiled extension that does not load) is not counted."""
    import sys
    import types

    from replay_compile.bench import kernel_packages, run_banner

    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.6.0"))
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)              # import raises ImportError
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    assert kernel_packages() == "fla 0.6.0"
    assert run_banner().endswith("transformers' kernel packages: fla 0.6.0")
    monkeypatch.setitem(sys.modules, "fla", None)
    assert kernel_packages() == "none"
