"""``SpeculativeGenerator``: calls of one shape run on the buffers (and, on CUDA, the captured graph) the last call
kept, fp32, greedy, against ``model.generate``.

A CUDA graph replays whatever memory it was captured over, so a reused call must write every tensor of the rounds,
the SSM layers, the cache and the proposer in place: the tests hold each one's address across calls, as well as the
tokens and the states left behind to ``generate``'s.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("transformers")

from replay_compile.integrations.hf_modules import attention_layers, output_cache  # noqa: E402
from replay_compile.passes.validate import rel_err  # noqa: E402
from replay_compile.speculative import DraftModel, PromptLookup, SpeculativeGenerator  # noqa: E402
from replay_compile.testing.hf_models import build_for_speculation, make_inputs  # noqa: E402
from replay_compile.testing.tp_parity import _conv_states, _recurrent_states  # noqa: E402

# (batch, prompt phrase, new tokens): the first three share a shape (cache_positions: 64), then another batch size
CALLS = [(3, 6, 12), (3, 7, 10), (3, 5, [14, 6, 9]), (2, 6, 12), (2, 4, 12)]


def _prompt(model, b, p):
    ids = make_inputs(model, batch=b, prompt_len=p, seed=10 * b + p)
    return torch.cat([ids, ids], dim=1)                        # repetitive: prompt lookup finds matches


def _reference(model, ids, new):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=max(new) if isinstance(new, list) else new, do_sample=False,
                              eos_token_id=[], return_dict_in_generate=True)


def _addresses(gen) -> dict:
    """Every tensor the kept rounds and layers hold, by name, with its address."""
    kept = gen._keep["kept"]
    out = {}
    for owner, obj in [("rounds", kept.rounds)] + [(f"layer{i}", layer) for i, layer in enumerate(kept.layers)]:
        for name, value in vars(obj).items():
            items = value if isinstance(value, (list, tuple)) else [value]
            for j, t in enumerate(items):
                if isinstance(t, torch.Tensor):
                    out[f"{owner}.{name}[{j}]"] = t.data_ptr()
    return out


def _states_match(out, ref, family):
    """The recurrent and conv states ``out`` left in its cache are the ones ``generate`` left (``ref``)."""
    for x, y in zip(_recurrent_states(out.cache) + _conv_states(out.cache),
                    _recurrent_states(output_cache(ref)) + _conv_states(output_cache(ref)), strict=True):
        assert rel_err(x, y) < 1e-4, (family, rel_err(x, y))


@pytest.mark.parametrize("family", [pytest.param("nemotron_h", marks=pytest.mark.hf),
                                    pytest.param("qwen3_5", marks=pytest.mark.hf),
                                    pytest.param("kimi_linear", marks=pytest.mark.hf), "zamba2"])
def test_calls_of_one_shape_reuse_the_kept_buffers_and_match_generate(family):
    model = build_for_speculation(family)
    gen = SpeculativeGenerator(model, num_draft=3, draft=PromptLookup(ngram=3), buffer_len=8, compile=False,
                               eos_token_id=[], pad_token_id=-7)
    reused, before = [], None
    for b, p, new in CALLS:
        ids = _prompt(model, b, p)
        ref = _reference(model, ids, new)
        out = gen(ids, new)
        budgets = new if isinstance(new, list) else [new] * b
        for row, n in enumerate(budgets):
            want = ref.sequences[row, :ids.shape[1] + n]
            assert torch.equal(out.sequences[row, :ids.shape[1] + n], want), (family, b, p, row)
            assert (out.sequences[row, ids.shape[1] + n:] == -7).all()
        reused.append(out.timing["reused"])
        now = _addresses(gen)
        if out.timing["reused"]:
            assert now == before, {k for k in now if now[k] != before.get(k)}
        before = now
        if not isinstance(new, list):            # the states left behind: generate's
            _states_match(out, ref, family)
    assert reused == [0.0, 1.0, 1.0, 0.0, 1.0], reused
    gen.release()
    out = gen(_prompt(model, 2, 6), 12)
    assert out.timing["reused"] == 0.0


def test_a_model_of_another_dtype_is_not_served_from_the_kept_buffers():
    """The kept cache holds the dtype of the model that filled it: after ``model.to(torch.bfloat16)`` the next call
    builds anew, its cache in the model's new dtype."""
    model = build_for_speculation("nemotron_h")
    gen = SpeculativeGenerator(model, num_draft=3, buffer_len=8, compile=False, eos_token_id=[])
    ids = _prompt(model, 2, 6)
    assert gen(ids, 8).timing["reused"] == 0.0 and gen(ids, 8).timing["reused"] == 1.0
    before = gen(ids, 8).cache
    model.to(torch.bfloat16)
    out = gen(ids, 8)
    assert out.timing["reused"] == 0.0 and out.cache is not before and out.sequences.shape == (2, 12 + 8)
    assert {layer.keys.dtype for layer in attention_layers(out.cache)} == {torch.bfloat16}


def test_a_draft_model_keeps_its_cache_between_calls():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = build_for_speculation("qwen3_5")
    torch.manual_seed(0)
    small = LlamaForCausalLM(LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    draft = DraftModel(small)
    gen = SpeculativeGenerator(model, num_draft=3, draft=draft, buffer_len=8, compile=False, eos_token_id=[])
    caches = []
    for b, p, new in CALLS[:3]:
        ids = _prompt(model, b, p)
        out = gen(ids, new)
        ref = _reference(model, ids, new)
        n = max(new) if isinstance(new, list) else new
        assert torch.equal(out.sequences[0, :ids.shape[1] + n], ref.sequences[0, :ids.shape[1] + n])
        caches.append((id(draft.cache), draft.cache.layers[0].keys.data_ptr(), out.timing["reused"]))
    assert len({c[:2] for c in caches}) == 1 and [c[2] for c in caches] == [0.0, 1.0, 1.0], caches


@pytest.mark.slow
def test_a_compiled_generator_compiles_once_per_shape():
    model = build_for_speculation("qwen3_5")
    gen = SpeculativeGenerator(model, num_draft=3, draft=PromptLookup(ngram=3), buffer_len=8, compile=True,
                               eos_token_id=[])
    torch._dynamo.reset()
    graphs = []
    for b, p, new in CALLS[:3]:
        ids = _prompt(model, b, p)
        counters.clear()
        out = gen(ids, new)
        graphs.append(counters["stats"]["unique_graphs"])
        ref = _reference(model, ids, new)
        n = max(new) if isinstance(new, list) else new
        assert torch.equal(out.sequences[0, :ids.shape[1] + n], ref.sequences[0, :ids.shape[1] + n])
    assert graphs == [1, 0, 0], graphs


class _Replayed:
    """A captured CUDA graph's stand-in on the CPU: ``replay()`` runs what was captured, and counts."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()

    def pool(self):
        return None


def _kept_calls(monkeypatch, family: str, fold_capture_fails: bool = False):
    """Three calls of one shape through ``generate_rounds`` with a kept dict and CUDA graphs on, the captures
    replaced by :class:`_Replayed`: the round's (``_capture``) and the final fold's (``_graph_of``). Each call's
    tokens and the states it leaves are generate's (checked before the next call refolds the kept cache). Returns
    each call's output with the number of fold captures made by then, and the fold captures."""
    from replay_compile.speculative import generate as gen_mod

    monkeypatch.setattr(gen_mod, "_capture", lambda step, name: _Replayed(step))
    folds = []

    def graph_of(fn, pool=None):
        folds.append(_Replayed(fn))
        return (None, "a host read") if fold_capture_fails else (folds[-1], None)
    monkeypatch.setattr(gen_mod, "_graph_of", graph_of)
    model = build_for_speculation(family)
    keep, calls, draft = {}, [], PromptLookup(ngram=3)
    for b, p, new in [(3, 6, 16), (3, 7, 14), (3, 5, 16)]:
        ids = _prompt(model, b, p)
        out = gen_mod.generate_rounds(model, ids, new, num_draft=3, draft=draft, buffer_len=8,
                                      compiler=None, eos=[], cuda_graph=True, keep=keep)
        _matches(out, _reference(model, ids, new), family)        # before the next call reuses the cache
        calls.append((out, len(folds)))
    return calls, folds


def _matches(out, ref, family):
    assert torch.equal(out.sequences, ref.sequences), family
    _states_match(out, ref, family)


@pytest.mark.parametrize("family", [pytest.param("nemotron_h", marks=pytest.mark.hf),
                                    pytest.param("qwen3_5", marks=pytest.mark.hf)])
def test_the_final_fold_is_captured_once_and_replayed_by_every_later_call(monkeypatch, family):
    """The first call folds eagerly and then captures the fold (after its rounds were captured); every later call of
    the shape replays that capture instead of folding eagerly, and leaves generate's tokens and states."""
    calls, folds = _kept_calls(monkeypatch, family)
    assert [n for _, n in calls] == [1, 1, 1], "the fold is captured once, in the first call"
    assert [out.timing["finish_replayed"] for out, _ in calls] == [0.0, 1.0, 1.0]
    assert [out.timing["reused"] for out, _ in calls] == [0.0, 1.0, 1.0]
    assert folds[0].replays == 2


@pytest.mark.hf
def test_a_fold_that_fails_its_capture_stays_eager_and_is_not_tried_again(monkeypatch, caplog):
    caplog.set_level("INFO", logger="replay_compile")
    calls, folds = _kept_calls(monkeypatch, "nemotron_h", fold_capture_fails=True)
    assert len(folds) == 1 and folds[0].replays == 0
    assert [out.timing["finish_replayed"] for out, _ in calls] == [0.0, 0.0, 0.0]
    assert [out.timing["reused"] for out, _ in calls] == [0.0, 1.0, 1.0]
    assert any("final fold" in r.getMessage() and "a host read" in r.getMessage() for r in caplog.records)
