"""The backend: Inductor lowering in place, shared replay state, rebinding, external writes, flush, options."""

import os
import re
import subprocess
import sys

import pytest
import torch
from test_pass_spellings import H, HFStyle, N, P, b, make_inputs
from torch._inductor.utils import run_and_get_code

import replay_compile
from replay_compile import state as replay_state

L = 4


def eager_and_compiled(mode=None, options=None):
    torch.manual_seed(0)
    mod = HFStyle()
    if mode is not None:   # torch.compile takes mode or options, not both
        return mod, torch.compile(mod, backend="replayssm", mode=mode)
    return mod, torch.compile(mod, backend="replayssm", options={"buffer_len": L, **(options or {})})


def step_both(cmod, mod, sc, se, steps, check=True):
    """Step the compiled module on ``sc`` and the eager one on ``se`` with the same inputs; compare if ``check``."""
    with torch.no_grad():
        for t in range(steps):
            yc, ye = cmod(sc, *make_inputs(t)), mod(se, *make_inputs(t))
            if check:
                torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-5, msg=f"step {t}")


@pytest.mark.slow
def test_inductor_runs_the_op_in_place_on_the_cache_with_no_state_copy():
    mod, cmod = eager_and_compiled()
    state = torch.randn(b, H, P, N)
    with torch.no_grad():
        _, codes = run_and_get_code(cmod, state, *make_inputs(0))
    code = "\n".join(codes)
    calls = re.findall(r"torch\.ops\.replay_compile\.mamba2_step\.default\((\w+),", code)
    assert len(calls) == 1, code
    state_arg = calls[0]
    assert re.fullmatch(r"arg\d+_1", state_arg), f"the op must get the graph input itself, got {state_arg}"
    # no buffer of the state's shape is allocated and nothing is copied into the cache tensor
    assert f"({b}, {H}, {P}, {N})" not in "".join(re.findall(r"empty_strided\w*\(\([^)]*\)", code)), code
    assert f"{state_arg}.copy_" not in code and "aten.copy_" not in code


def test_runs_are_correct_under_inductor_for_3L_steps():
    mod, cmod = eager_and_compiled()
    se = torch.randn(b, H, P, N)
    sc = se.clone()
    step_both(cmod, mod, sc, se, 3 * L + 1)
    assert not torch.equal(sc, se), "between flushes the cache holds the checkpoint"
    torch.testing.assert_close(replay_compile.materialize(sc), se, rtol=1e-5, atol=1e-5)
    assert replay_compile.flush(sc) == 1
    torch.testing.assert_close(sc, se, rtol=1e-5, atol=1e-5)


def test_replay_state_is_shared_by_recompiled_graphs():
    """Two compiled graphs (here: two compile calls) stepping one cache tensor share one ring."""
    mod, c1 = eager_and_compiled(options={"lower": "eager"})
    c2 = torch.compile(mod, backend="replayssm", options={"buffer_len": L})
    se = torch.randn(b, H, P, N)
    sc = se.clone()
    with torch.no_grad():
        for t in range(2 * L + 3):
            f = c1 if t % 3 else c2
            torch.testing.assert_close(f(sc, *make_inputs(t)), mod(se, *make_inputs(t)), rtol=1e-5, atol=1e-5)
    assert len([rs for rs in replay_state.all_states() if rs.state is sc]) == 1


def test_new_cache_object_rebinds_and_old_one_resumes():
    mod, cmod = eager_and_compiled(options={"lower": "eager"})
    e1, e2 = torch.randn(b, H, P, N), torch.randn(b, H, P, N)
    c1, c2 = e1.clone(), e2.clone()
    step_both(cmod, mod, c1, e1, L + 2)
    step_both(cmod, mod, c2, e2, L + 1)    # a fresh cache gets fresh rings, nothing leaks from c1
    step_both(cmod, mod, c1, e1, L)        # and c1 continues where it was
    replay_compile.flush(None)
    torch.testing.assert_close(c1, e1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c2, e2, rtol=1e-5, atol=1e-5)


def test_external_write_resets_the_replay_state():
    """A re-prefill writes the cache; held records must be dropped, not folded on top of the new contents."""
    mod, cmod = eager_and_compiled(options={"lower": "eager"})
    se = torch.randn(b, H, P, N)
    sc = se.clone()
    step_both(cmod, mod, sc, se, L // 2 + 1, check=False)
    fresh = torch.randn(b, H, P, N)
    se.copy_(fresh)
    sc.copy_(fresh)            # e.g. cache.reset() + prefill
    step_both(cmod, mod, sc, se, 2 * L)


def test_decode_loop_reuses_its_bindings_until_the_cache_is_written(monkeypatch):
    """The runner's fast path: same cache tensors, unwritten, no new replay state: no lookups; an external write
    (or another cache) goes the slow way again, and results stay exact throughout."""
    mod, cmod = eager_and_compiled(options={"lower": "eager"})
    se = torch.randn(b, H, P, N)
    sc = se.clone()
    step_both(cmod, mod, sc, se, 1)
    lookups = []
    real = replay_state.lookup
    monkeypatch.setattr(replay_state, "lookup", lambda t: (t is sc and lookups.append(t)) or real(t))
    step_both(cmod, mod, sc, se, L + 2)
    assert lookups == []      # (the graph's other inputs are looked up as possible readers of a stepped state)
    fresh = torch.randn(b, H, P, N)
    se.copy_(fresh)
    sc.copy_(fresh)
    step_both(cmod, mod, sc, se, 1)
    assert len(lookups) == 1
    step_both(cmod, mod, sc, se, 2 * L)
    assert len(lookups) == 1


def test_rings_die_with_their_cache_tensor_though_a_runner_holds_the_state():
    import gc
    import weakref

    mod, cmod = eager_and_compiled(options={"lower": "eager"})
    sc = torch.randn(b, H, P, N)
    step_both(cmod, mod, sc, sc.clone(), 2, check=False)
    rs = replay_state.lookup(sc)
    ring = weakref.ref(rs.rings[0])
    del sc
    gc.collect()
    assert rs.rings == () and ring() is None


def test_graphs_that_read_a_stepped_state_see_the_true_state():
    mod, cmod = eager_and_compiled(options={"lower": "eager"})
    reader = torch.compile(lambda s: s.sum(dim=(2, 3)) * 2, backend="replayssm")
    se = torch.randn(b, H, P, N)
    sc = se.clone()
    step_both(cmod, mod, sc, se, L + 2, check=False)
    with torch.no_grad():
        torch.testing.assert_close(reader(sc), se.sum(dim=(2, 3)) * 2, rtol=1e-5, atol=1e-5)


def test_a_reading_graph_looks_its_inputs_up_again_only_when_they_or_the_replay_states_change(monkeypatch):
    """A graph that reads states it does not step keeps the last call's lookups while the same tensors come back and
    no replay state was created since; another tensor, or a state bound after the first read, is looked up again,
    and every read sees the true state."""
    mod, cmod = eager_and_compiled(options={"lower": "eager"})
    reader = torch.compile(lambda s: s.sum(dim=(2, 3)) * 2, backend="replayssm")
    lookups = []
    real = replay_state.lookup
    monkeypatch.setattr(replay_state, "lookup", lambda t: lookups.append(t) or real(t))

    def read(sc, se):
        with torch.no_grad():
            torch.testing.assert_close(reader(sc), se.sum(dim=(2, 3)) * 2, rtol=1e-5, atol=1e-5)

    se = torch.randn(b, H, P, N)
    sc = se.clone()
    step_both(cmod, mod, sc, se, L + 2, check=False)
    read(sc, se)
    lookups.clear()
    for _ in range(3):                  # records held again each time: still folded before every read
        step_both(cmod, mod, sc, se, 1, check=False)
        read(sc, se)
    assert not any(t is sc for t in lookups)
    other = torch.randn(b, H, P, N)     # a tensor with no replay state yet
    read(other, other)
    assert any(t is other for t in lookups)
    ref = other.clone()
    step_both(cmod, mod, other, ref, 3, check=False)   # binds a state for it: the reader must fold its records
    read(other, ref)


def test_flush_by_model_container_and_tensor():
    mod, cmod = eager_and_compiled(options={"lower": "eager"})
    other = HFStyle()
    se = torch.randn(b, H, P, N)
    sc = se.clone()
    step_both(cmod, mod, sc, se, L + 1, check=False)
    assert replay_compile.flush(other) == 0          # not this model's state
    assert replay_compile.flush({"layers": [sc]}) == 1
    torch.testing.assert_close(sc, se, rtol=1e-5, atol=1e-5)
    step_both(cmod, mod, sc, se, 1, check=False)
    assert replay_compile.flush(mod) == 1
    torch.testing.assert_close(sc, se, rtol=1e-5, atol=1e-5)
    assert replay_compile.flush(mod) == 0


def test_reset_drops_records():
    mod, cmod = eager_and_compiled(options={"lower": "eager"})
    sc = torch.randn(b, H, P, N)
    before = sc.clone()
    with torch.no_grad():
        cmod(sc, *make_inputs(0))
    assert replay_compile.reset(sc) == 1
    assert replay_compile.flush(sc) == 0 and torch.equal(sc, before)


def spy_config_patches(monkeypatch) -> dict:
    """The Inductor config patches our backend hands ``compile_fx``, collected into the returned dict."""
    seen = {}
    import torch._inductor.compile_fx as cfx
    real = cfx.compile_fx

    def spy(gm, inputs, **kw):
        seen.update(kw.get("config_patches") or {})
        return real(gm, inputs, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    return seen


@pytest.mark.parametrize("mode, via_options", [("reduce-overhead", False), ("max-autotune-no-cudagraphs", False),
                                               ("reduce-overhead", True)])
def test_modes_are_honoured(mode, via_options, monkeypatch):
    seen = spy_config_patches(monkeypatch)
    if via_options:   # options={"mode": ...} lets a mode travel with our own options
        mod, cmod = eager_and_compiled(options={"mode": mode})
    else:
        mod, cmod = eager_and_compiled(mode=mode)
    with torch.no_grad():
        cmod(torch.randn(b, H, P, N), *make_inputs(0))
    expect = torch._inductor.list_mode_options(mode)
    assert expect and all(seen.get(k) == v for k, v in expect.items())


@pytest.mark.parametrize("options, env, expect", [({}, None, True), ({"combo_kernels": False}, None, False),
                                                  ({}, "0", None), ({"enabled": False}, None, None)])
def test_combo_kernels_for_graphs_with_rewrites(options, env, expect, monkeypatch):
    """Graphs with rewrites compile with Inductor's combo kernels (our op's prologue kernels launched as one);
    a user's ``combo_kernels`` option or ``REPLAY_COMPILE_COMBO_KERNELS=0`` wins; a graph with nothing rewritten
    gets plain Inductor's settings."""
    seen = spy_config_patches(monkeypatch)
    if env is not None:
        monkeypatch.setenv("REPLAY_COMPILE_COMBO_KERNELS", env)
    mod, cmod = eager_and_compiled(options=options)
    sc = torch.randn(b, H, P, N)
    step_both(cmod, mod, sc, sc.clone(), 2)
    assert seen.get("combo_kernels") is expect


def test_an_unknown_option_is_refused_naming_the_nearest_field():
    """A misspelt field must not travel to Inductor as a config patch (an AttributeError from its config there)."""
    mod, cmod = eager_and_compiled(options={"buffer_lenn": 8})
    with pytest.raises(Exception, match="unknown option 'buffer_lenn'.*did you mean 'buffer_len'"):
        cmod(torch.randn(b, H, P, N), *make_inputs(0))
    with pytest.raises(ValueError, match="did you mean 'combo_kernels'"):
        replay_compile.ReplayConfig.from_options({"combo_kernel": True})
    assert replay_compile.ReplayConfig.from_options({"combo_kernels": True, "mode": "max-autotune"})[1] == \
        {"combo_kernels": True, "mode": "max-autotune"}


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("REPLAY_COMPILE_BUFFER_LEN", "3")
    cfg, rest = replay_compile.ReplayConfig.from_options({"strict": True, "triton.cudagraphs": False})
    assert cfg.buffer_len == 3 and cfg.strict and rest == {"triton.cudagraphs": False}
    with pytest.raises(ValueError, match="buffer_len"):
        replay_compile.ReplayConfig(buffer_len=0)


def test_unsupported_state_dtype_is_left_unchanged_with_a_reason():
    mod = HFStyle()
    replay_compile.clear_reports()
    cmod = torch.compile(mod, backend="replayssm", options={"lower": "eager"})
    s = torch.randn(b, H, P, N).to(torch.float8_e4m3fn) if hasattr(torch, "float8_e4m3fn") else None
    if s is None:
        pytest.skip("no float8 dtype in this torch")
    try:
        cmod(s, *make_inputs(0))
    except Exception:
        pass   # eager float8 arithmetic may be unsupported on CPU; what matters is the pass's decision
    reps = replay_compile.reports()
    assert reps and not reps[-1].rewrites
    assert "state dtype torch.float8_e4m3fn is not supported" in reps[-1].skipped[0].reason


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("REPLAY_COMPILE_SKIP_ENTRYPOINT") == "1", reason="not installed")
def test_backend_name_works_without_importing_us():
    """The torch_dynamo_backends entry point: torch finds backend="replayssm" on its own."""
    code = ("import torch\n"
            "f = torch.compile(lambda s, x: s.copy_(s * 0.5 + x).sum(), backend='replayssm')\n"
            "print(float(f(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))))\n"
            "import sys; print('replay_compile' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["6.0", "True"]


def test_flush_after_an_external_write_drops_records_instead_of_folding_them():
    mod, cmod = eager_and_compiled(options={"lower": "eager"})
    sc = torch.randn(b, H, P, N)
    with torch.no_grad():
        for t in range(L // 2):
            cmod(sc, *make_inputs(t))
    sc.zero_()                      # e.g. cache.reset()
    replay_compile.flush(sc)        # e.g. generate returning: must not fold the old sequence into the zeros
    assert torch.count_nonzero(sc) == 0


def test_dynamic_true_rewrites_every_layer():
    """Under dynamic=True, Dynamo hands constant sizes as SymInts; they must count as static head/state dims."""
    from test_pass_properties import Mamba2Step
    mod = Mamba2Step(4, 3, 5, 2, 0)
    replay_compile.clear_reports()
    cmod = torch.compile(mod, backend="replayssm", options={"buffer_len": L, "lower": "eager"}, dynamic=True)
    se = torch.randn(3, 4, 3, 5)
    sc = se.clone()
    with torch.no_grad():
        for t in range(2 * L + 1):
            ins = (torch.randn(3, 4, 3), torch.randn(3, 4), torch.randn(3, 2, 5), torch.randn(3, 2, 5))
            torch.testing.assert_close(cmod(sc, *ins), mod(se, *ins), rtol=1e-5, atol=1e-5)
    reps = replay_compile.reports()
    assert [len(r.rewrites) for r in reps] == [1] and not reps[0].skipped


def test_summary_has_one_row_per_layer_over_every_graph():
    """Two decode graphs (two batch sizes, static shapes) rewrite the same layer: one row, and readable reports."""
    from test_pass_properties import Mamba2Step
    mod = Mamba2Step(4, 3, 5, 2, 0)
    replay_compile.clear_reports()
    cmod = torch.compile(mod, backend="replayssm", options={"buffer_len": L, "lower": "eager"}, dynamic=False)
    with torch.no_grad():
        for bs in (3, 2):
            cmod(torch.randn(bs, 4, 3, 5), torch.randn(bs, 4, 3), torch.randn(bs, 4), torch.randn(bs, 2, 5),
                 torch.randn(bs, 2, 5))
    assert len(replay_compile.reports()) == 2
    text = replay_compile.summary()
    rows = text.splitlines()
    assert len(rows) == 2 and "rewritten" in rows[0] and "mamba2" in rows[0], text
    assert rows[1] == "1 of 1 state-writing layers rewritten"
    assert repr(replay_compile.reports()[0]).startswith("PassResult(1 rewritten, 0 left unchanged)")


def test_cpu_graphs_are_left_to_the_lowering_by_default(monkeypatch, caplog):
    """Without CPU in ``devices`` a CPU graph compiles as plain torch.compile would, and the reason is said."""
    import logging

    monkeypatch.delenv("REPLAY_COMPILE_DEVICES", raising=False)
    replay_compile.clear_reports()
    mod, cmod = eager_and_compiled(options={"lower": "eager"})
    with caplog.at_level(logging.INFO, logger="replay_compile"):
        step_both(cmod, mod, torch.randn(b, H, P, N), torch.randn(b, H, P, N), 1, check=False)
    reps = replay_compile.reports()
    assert reps and not any(r.rewrites for r in reps) and "a graph on cpu: left to the lowering" in reps[0].note
    assert "add 'cpu' to options['devices']" in caplog.text
    assert "left to the lowering" in replay_compile.summary()
    with pytest.raises(ValueError, match="unknown devices"):
        replay_compile.ReplayConfig(devices=("tpu",))
