"""The decode-conv rewrite: the depthwise causal conv of every SSM layer's decode step becomes shifted multiply-adds
(no convolution left in the graph), decode stays what the unrewritten compile gives (fp32: tokens identical, logits
within rounding), convolutions that are not a decode step's are left alone with the reason, and the switch turns
it off.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from replay_compile import backend as rb
from replay_compile.passes import decode_conv as dc
from replay_compile.passes.shifted_conv import shifted_conv1d

# -- the arithmetic -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2),
                                        (torch.float16, 2e-3)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("K, L, padding", [(4, 5, (0, 0)), (4, 3, (3, 3)), (3, 2, (1, 1)), (4, 6, (1, 2)),
                                           (1, 4, (0, 0)), (8, 9, (0, 0))],
                         ids=lambda v: str(v).replace(" ", ""))
def test_shifted_conv1d_equals_the_depthwise_conv(dtype, tol, bias, K, L, padding):
    g = torch.Generator().manual_seed(K * 10 + L)
    b, C = 3, 6
    x = torch.randn(b, C, L, generator=g).to(dtype)
    w = torch.randn(C, 1, K, generator=g).to(dtype)
    bb = torch.randn(C, generator=g).to(dtype) if bias else None
    want = F.conv1d(F.pad(x.double(), padding), w.double(), None if bb is None else bb.double(), groups=C)
    got = shifted_conv1d(x, w, bb, padding)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


# -- graphs written by hand: what is and is not a decode conv -----------------------------------------------------

B, C, K = 2, 8, 4


def _graph(fn, *args):
    """``fn`` traced by Dynamo into the graph the pass sees (the first graph of a capturing backend)."""
    graphs = []

    def capture(gm, ex):
        graphs.append(gm)
        return gm.forward
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs[0]


def _call(gm, **named):
    """``gm`` called with its inputs by name (Dynamo orders its placeholders by first use)."""
    phs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    return gm(*[next(v for k, v in named.items() if f"_{k}_" in f"_{p}_") for p in phs])


def _convs(gm) -> int:
    return len(dc.conv_calls(gm.graph))


def _decode_step(state, x, w, b):
    """transformers' ``causal_conv1d_update``: the conv over ``[conv state | new input]``, its last position."""
    seq = torch.cat([state, x], dim=-1)
    state.copy_(seq[:, :, -state.shape[-1]:])
    return F.conv1d(seq, w, b, padding=0, groups=seq.shape[1])[:, :, -x.shape[-1]:]


def _args(L=1, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, C, K, generator=g).to(dtype), torch.randn(B, C, L, generator=g).to(dtype),
            torch.randn(C, 1, K, generator=g).to(dtype), torch.randn(C, generator=g).to(dtype) if bias else None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("L", [1, 4], ids=["decode", "verify4"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_a_decode_step_conv_is_rewritten(dtype, L, bias):
    args = _args(L, dtype, bias)
    gm = _graph(_decode_step, *[a.clone() if a is not None else None for a in args])
    want_state = args[0].clone()
    want = _decode_step(want_state, *args[1:])
    done, left = dc.rewrite(gm, cuda_only=False)
    assert len(done) == 1 and not left, left
    assert _convs(gm) == 0                                    # no convolution left for the lowering
    assert done[0].out_length == L + 1 and done[0].padding == (0, 0)
    state = args[0].clone()
    (got,) = _call(gm, **{k: v for k, v in zip(("state", "x", "w", "b"), [state, *args[1:]]) if v is not None})
    assert got.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(state, want_state)                     # the conv-state update is untouched


def test_the_causal_padding_form_is_rewritten():
    """transformers' ``causal_conv1d_fn`` over a few tokens: ``padding=K - 1``, the first ``L`` outputs kept."""
    def causal(x, w):
        return F.conv1d(x, weight=w, bias=None, padding=w.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]]
    x, w = torch.randn(B, C, 5), torch.randn(C, 1, K)
    gm = _graph(causal, x, w)
    done, left = dc.rewrite(gm, cuda_only=False)
    assert len(done) == 1 and done[0].padding == (K - 1, K - 1) and _convs(gm) == 0, left
    torch.testing.assert_close(_call(gm, x=x, w=w)[0], causal(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spelling", ["nn_module", "convolution", "valid", "same"])
def test_other_spellings_are_rewritten(spelling):
    conv = torch.nn.Conv1d(C, C, K, groups=C, padding=K - 1)
    fns = {
        "nn_module": lambda x, weight, bias: conv(x),
        "convolution": lambda x, weight, bias: torch.convolution(x, weight, bias, [1], [2], [1], False, [0], C),
        "valid": lambda x, weight, bias: F.conv1d(x, weight, bias, padding="valid", groups=C),
        "same": lambda x, weight, bias: F.conv1d(x, weight, bias, padding="same", groups=C),
    }
    x = torch.randn(B, C, 5)
    args = dict(x=x, weight=conv.weight, bias=conv.bias)
    gm = _graph(fns[spelling], *args.values())
    done, left = dc.rewrite(gm, cuda_only=False)
    assert len(done) == 1 and _convs(gm) == 0, left
    with torch.no_grad():
        torch.testing.assert_close(_call(gm, **args)[0], fns[spelling](**args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case, reason", [
    ("prefill", "17 output positions"),
    ("groups", "not depthwise"),
    ("stride", "stride=2"),
    ("dilation", "dilation=2"),
    ("wide", "9 taps"),
    ("mixed_dtype", "not one floating dtype"),
])
def test_other_convolutions_are_left_unchanged_with_the_reason(case, reason, caplog):
    x = torch.randn(B, C, 20 if case == "prefill" else 8)
    w = torch.randn(C, 1, 9 if case == "wide" else K)
    fns = {
        "prefill": lambda x, w: F.conv1d(x, w, groups=C),
        "groups": lambda x, w: F.conv1d(x, w.expand(C, C // 2, K), groups=2),
        "stride": lambda x, w: F.conv1d(x, w, groups=C, stride=2),
        "dilation": lambda x, w: F.conv1d(x, w, groups=C, dilation=2),
        "wide": lambda x, w: F.conv1d(x, w, groups=C, padding=4),
    }
    if case == "mixed_dtype":                     # autocast: the convolution runs in bfloat16 on float32 operands
        def fn(x, w):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.conv1d(x, w, groups=C)
    else:
        fn = fns[case]
    gm = _graph(fn, x, w)
    with caplog.at_level(logging.DEBUG, logger="replay_compile"):
        done, left = dc.rewrite(gm, cuda_only=False)
    assert not done and len(left) == 1 and reason in left[0][1], left
    assert _convs(gm) == 1
    assert any("convolution left unchanged" in r.message and reason in r.message for r in caplog.records)


def test_auto_leaves_cpu_graphs_to_the_lowering():
    gm = _graph(_decode_step, *_args())
    done, left = dc.rewrite(gm, cuda_only=True)
    assert not done and "not on CUDA" in left[0][1] and _convs(gm) == 1


def test_a_configuration_failing_its_check_is_left_unchanged(monkeypatch, caplog):
    gm = _graph(_decode_step, *_args())
    monkeypatch.setattr(dc, "_CHECKED", {})
    monkeypatch.setattr(dc, "_check", lambda m: "max difference 1 from F.conv1d")
    with caplog.at_level(logging.WARNING, logger="replay_compile"):
        done, left = dc.rewrite(gm, cuda_only=False)
    assert not done and "max difference" in left[0][1] and _convs(gm) == 1
    assert any("failed its check" in r.message for r in caplog.records)


def test_the_check_runs_the_rewrite_itself(monkeypatch):
    """The compile-time check compares the rewritten graph with ``F.conv1d``: a wrong tap order fails it."""
    gm = _graph(_decode_step, *_args())
    m = dc.match(dc.conv_calls(gm.graph)[0])
    assert dc._check(m) is None
    real = dc.shifted_taps

    def reversed_taps(x, w, *a):
        return real(x, w.flip(-1), *a)
    monkeypatch.setattr(dc, "shifted_taps", reversed_taps)
    assert "max difference" in dc._check(m)


# -- the backend and its switch -----------------------------------------------------------------------------------


def _compile_decode_step(options):
    args = _args()
    fn = torch.compile(_decode_step, backend="replayssm", options={"lower": "eager", **options})
    state = args[0].clone()
    return fn(state, *args[1:]), state


@pytest.mark.parametrize("options, fires", [({"decode_conv": "on"}, True), ({"decode_conv": "off"}, False),
                                            ({"decode_conv": "auto"}, False), ({}, False),
                                            ({"decode_conv": "on", "enabled": False}, False)],
                         ids=["on", "off", "auto_cpu", "default", "disabled"])
def test_the_switch(options, fires):
    rb.clear_reports()
    got, state = _compile_decode_step(options)
    want_state = _args()[0]
    want = _decode_step(want_state, *_args()[1:])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(state, want_state)
    assert counters["replay_compile"]["decode_conv"] == int(fires)
    assert [len(r.convs) for r in rb.reports()] == [int(fires)]


def test_the_environment_switch(monkeypatch):
    monkeypatch.setenv("REPLAY_COMPILE_DECODE_CONV", "off")
    assert rb.ReplayConfig.from_options({})[0].decode_conv == "off"
    assert rb.ReplayConfig.from_options({"decode_conv": "on"})[0].decode_conv == "on"     # options win
    monkeypatch.setenv("REPLAY_COMPILE_DECODE_CONV", "On")
    assert rb.ReplayConfig.from_options({})[0].decode_conv == "on"
    monkeypatch.delenv("REPLAY_COMPILE_DECODE_CONV")
    assert rb.ReplayConfig().decode_conv == "auto"                  # the default: CUDA graphs


def test_a_bad_option_value_names_the_choices():
    with pytest.raises(ValueError, match="decode_conv must be one of"):
        rb.ReplayConfig.from_options({"decode_conv": "yes"})


@pytest.mark.slow
def test_inductor_fuses_the_rewritten_conv():
    """Through Inductor the rewritten step holds no convolution call; the unrewritten one does."""
    from torch._inductor.utils import run_and_get_code

    codes = {}
    for mode in ("off", "on"):
        torch._dynamo.reset()
        fn = torch.compile(_decode_step, backend="replayssm", options={"decode_conv": mode})
        args = _args()
        (got, code) = run_and_get_code(fn, args[0].clone(), *args[1:])
        want = _decode_step(args[0].clone(), *args[1:])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        codes[mode] = "\n".join(code)
    assert "convolution" in codes["off"]
    assert "convolution" not in codes["on"]
