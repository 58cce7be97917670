"""Whatever touches a cache state outside our compiled step, the result is right: transformers' hybrid models
compiled with ``backend="replayssm"`` against the same models run eagerly doing the same thing, tokens, logits and
the recurrent state compared (fp32, tiny random models, eager lowering to keep the file fast).

Each test is one way a user or a server reaches the state: an eager fallback of Dynamo in the middle of a decode,
two threads decoding their own models, a write to one row of the state (a slot reused), ``inference_mode``, a second
instance of a model class, ``materialize`` after a write, writes through ``.data`` and NumPy.
"""

import threading

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList  # noqa: E402

import replay_compile  # noqa: E402
from replay_compile import state as replay_state  # noqa: E402
from replay_compile.bench import cache_kwarg  # noqa: E402
from replay_compile.replay_tensor import ReplayTensor  # noqa: E402
from replay_compile.testing.hf_models import DELTA_FAMILY, LIGHTNING_FAMILY, MAMBA2_FAMILY, make_inputs  # noqa: E402

pytestmark = pytest.mark.hf

L = 4                   # short rings: a 20-token decode crosses four flushes
NEW = 20
BUILD = {**MAMBA2_FAMILY, **DELTA_FAMILY, **LIGHTNING_FAMILY}


def build(family):
    return BUILD[family](dtype=torch.float32, seed=0)


def compiled(model):
    model.forward = torch.compile(model.forward, backend="replayssm", options={"buffer_len": L, "lower": "eager"})
    return model


def generate(model, ids, cache=None, **kw):
    kw.setdefault("max_new_tokens", NEW)
    if cache is not None:
        kw[cache_kwarg(model)] = cache
    with torch.no_grad():
        return model.generate(ids, do_sample=False, return_dict_in_generate=True,
                              output_logits=True, **kw)


def states(cache) -> list:
    """The recurrent states: of transformers' cache layers, or of MiniMax's own list."""
    return [t for layer in cache.layers for _, t in sorted(getattr(layer, "recurrent_states", {}).items())
            if t is not None] + [t for t in getattr(cache, "linear_cache", []) if isinstance(t, torch.Tensor)]


def assert_same(got, want, got_cache=None, want_cache=None):
    assert torch.equal(got.sequences, want.sequences)
    scale = max(float(w.abs().max()) for w in want.logits)
    worst = max(float((g - w).abs().max()) for g, w in zip(got.logits, want.logits))
    assert worst <= 1e-4 * scale, f"logits differ by {worst:.3g} (scale {scale:.3g})"
    gc = got_cache if got_cache is not None else got.past_key_values
    wc = want_cache if want_cache is not None else want.past_key_values
    for g, w in zip(states(gc), states(wc)):
        torch.testing.assert_close(g.clone(), w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))


class AtStep(LogitsProcessor):
    """Runs ``fn(step)`` before the logits of each decode step are used (outside compiled code)."""

    def __init__(self, fn):
        self.fn, self.step = fn, 0

    def __call__(self, input_ids, scores):
        self.fn(self.step)
        self.step += 1
        return scores


@pytest.mark.slow
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5", "minimax"])
def test_an_eager_fallback_in_the_middle_of_a_decode_is_exact(family):
    """``set_stance("force_eager")`` for steps 5-9 (as when Dynamo hits its recompile limit): those steps run
    transformers' own code on the cache states, which must see and write the current state."""
    ref, model = build(family), compiled(build(family))
    ids = make_inputs(ref)

    def stance(step):
        torch.compiler.set_stance("force_eager" if 5 <= step < 10 else "default")

    try:
        got = generate(model, ids, logits_processor=LogitsProcessorList([AtStep(stance)]))
    finally:
        torch.compiler.set_stance("default")
    assert_same(got, generate(ref, ids))
    assert all(isinstance(t, ReplayTensor) for t in states(got.past_key_values))


def test_running_out_of_recompiles_is_exact():
    """With Dynamo's recompile limit at 1 the decode graphs after the first one run eagerly on the cache."""
    ref, model = build("bamba"), build("bamba")
    ids = make_inputs(ref)
    torch._dynamo.reset()
    compiled(model)
    with torch._dynamo.config.patch(recompile_limit=1):
        got = generate(model, ids)
    assert_same(got, generate(ref, ids))


@pytest.mark.slow
def test_two_threads_decoding_their_own_models_are_exact():
    families = ["nemotron_h", "granitemoehybrid"]
    refs = {f: generate(build(f), make_inputs(build(f))) for f in families}
    models = {f: compiled(build(f)) for f in families}
    for f in families:                                  # compile in this thread first
        generate(models[f], make_inputs(models[f]))
    errors = []

    def work(f):
        try:
            for _ in range(3):
                assert_same(generate(models[f], make_inputs(models[f])), refs[f])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((f, e))

    threads = [threading.Thread(target=work, args=(f,)) for f in families]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.slow
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_a_write_to_one_row_leaves_the_other_rows_exact(family):
    """A server reusing slot 0: ``state[0].zero_()`` on every recurrent state at step 7 (a flush is 1 step away,
    records are held for both rows)."""
    ref, model = build(family), compiled(build(family))
    ids = make_inputs(ref)
    caches = DynamicCache(config=ref.config), DynamicCache(config=model.config)

    def zero_row(cache):
        def fn(step):
            if step == 7:
                for t in states(cache):
                    t[0].zero_()
        return LogitsProcessorList([AtStep(fn)])

    want = generate(ref, ids, cache=caches[0], logits_processor=zero_row(caches[0]))
    got = generate(model, ids, cache=caches[1], logits_processor=zero_row(caches[1]))
    assert_same(got, want, caches[1], caches[0])


# -- a hand-written decode loop (plain state tensors, as a cache that generate never handled holds them) ------------

def manual_decode(model, ids, cache, steps, at=None):
    """Prefill then ``steps`` greedy steps on ``cache``; ``at(step, cache)`` runs before each step. Returns logits."""
    out = []
    with torch.no_grad():
        o = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        for step in range(steps):
            out.append(o.logits[:, -1])
            if at is not None:
                at(step, cache)
            o = model(input_ids=o.logits[:, -1:].argmax(-1), use_cache=True, **{cache_kwarg(model): cache})
    return out


@pytest.mark.slow
def test_stepping_under_inference_mode_then_flushing_outside_is_exact():
    """A hand-written decode under ``torch.inference_mode()`` that ends with records held, then ``flush`` from
    outside it (inference tensors can be written only inside inference mode: the flush must still complete, never
    stop halfway), then decoding on from the same caches."""
    ref, model = build("nemotron_h"), compiled(build("nemotron_h"))
    ids = make_inputs(ref)
    caches = DynamicCache(config=ref.config), DynamicCache(config=model.config)
    with torch.inference_mode():
        want = manual_decode(ref, ids, caches[0], 6)
        got = manual_decode(model, ids, caches[1], 6)
    assert any(rs.dirty for rs in replay_state.states_of(caches[1]))
    assert replay_compile.flush(caches[1]) == len(states(caches[1]))
    for g, w in zip(states(caches[1]), states(caches[0])):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))
    with torch.inference_mode():
        more = [o.logits[:, -1] for o in (m(input_ids=want[-1].argmax(-1, keepdim=True), use_cache=True,
                                              **{cache_kwarg(m): c}) for m, c in zip((ref, model), caches))]
    torch.testing.assert_close(more[1], more[0], rtol=1e-4, atol=1e-4 * float(more[0].abs().max()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))


@pytest.mark.slow
def test_flush_reaches_a_state_stepped_by_a_second_instance_of_the_model_class():
    first, second = compiled(build("nemotron_h")), compiled(build("nemotron_h"))
    ids = make_inputs(first)
    manual_decode(first, ids, DynamicCache(config=first.config), 6)
    cache = DynamicCache(config=second.config)
    manual_decode(second, ids, cache, 6)
    assert replay_compile.flush(second) == len(states(cache))
    assert not any(rs.dirty for rs in replay_state.states_of(cache))


@pytest.mark.slow
def test_materialize_after_a_write_returns_the_written_contents():
    model = compiled(build("nemotron_h"))
    cache = DynamicCache(config=model.config)
    manual_decode(model, make_inputs(model), cache, 6)       # records held: 6 steps, L = 4
    t = states(cache)[0]
    assert replay_state.lookup(t).dirty
    new = torch.randn_like(t)
    t.copy_(new)                                                 # a write that bypasses the compiled step
    torch.testing.assert_close(replay_compile.materialize(t), new, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["data", "numpy"])
def test_writes_through_data_and_numpy_on_a_protected_cache_are_exact(how):
    ref, model = build("nemotron_h"), compiled(build("nemotron_h"))
    ids = make_inputs(ref)

    def halve_row1(step, cache):
        if step == 1:
            assert replay_compile.protect(cache) in (0, len(states(cache)))
        if step == 9:
            for t in states(cache):
                if how == "data":
                    t.data[1].mul_(0.5)
                else:
                    arr = t.numpy()
                    arr[1] *= np.float32(0.5)

    want = manual_decode(ref, ids, DynamicCache(config=ref.config), 16, halve_row1)
    got = manual_decode(model, ids, DynamicCache(config=model.config), 16, halve_row1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))


@pytest.mark.slow
def test_an_interrupted_step_is_not_taken_for_an_outside_write():
    """A KeyboardInterrupt raised after the compiled step ran (as one arriving in a later layer would): the states
    are those after the step, and decoding on from them is exact (the step's own writes are not mistaken for an
    outside write that would drop the held records). Mamba2 (no attention layer): a DynamicCache's attention
    entries are appended by Dynamo after the graph returns, so an interrupted graph leaves them before the step."""
    import gc

    from replay_compile.backend import ReplayRunner

    ref, model = build("mamba2"), compiled(build("mamba2"))
    ids = make_inputs(ref)
    caches = DynamicCache(config=ref.config), DynamicCache(config=model.config)

    def interrupt_once(step, cache):
        if step != 6 or cache is not caches[1]:
            return
        for runner in [o for o in gc.get_objects() if type(o) is ReplayRunner and o.sites]:
            real = runner.compiled

            def raising(*args, real=real, runner=runner):
                runner.compiled = real
                real(*args)
                raise KeyboardInterrupt

            runner.compiled = raising

    def run(m, cache, tokens=None):
        """12 decode steps; fed ``tokens`` (teacher forcing) or, without them, the greedy tokens. Returns the logits
        of each step (None for an interrupted one) and the tokens fed."""
        out, fed = [], []
        with torch.no_grad():
            o = m(input_ids=ids, use_cache=True, **{cache_kwarg(m): cache})
            for step in range(12):
                tok = tokens[step] if tokens is not None else o.logits[:, -1:].argmax(-1)
                fed.append(tok)
                interrupt_once(step, cache)
                try:
                    o = m(input_ids=tok, use_cache=True, **{cache_kwarg(m): cache})
                    out.append(o.logits[:, -1])
                except KeyboardInterrupt:
                    out.append(None)
        return out, fed

    want, tokens = run(ref, caches[0])
    got, _ = run(model, caches[1], tokens)
    assert got[6] is None
    for g, w in zip(got, want):
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))
    replay_compile.flush(caches[1])
    for g, w in zip(states(caches[1]), states(caches[0])):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))
