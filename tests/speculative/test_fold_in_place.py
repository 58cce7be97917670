"""The final fold of a layer's rings into the cache state, done in place (a scaling and one batched GEMM), equals the
reference fold (delta rule and Mamba-2); a slot without records keeps its state bit for bit."""

import pytest
import torch

from replay_compile.kernels.delta_reference import delta_replay_materialize_reference
from replay_compile.kernels.mamba2_reference import replay_materialize_reference
from replay_compile.speculative.delta_layer import SpecDeltaLayer
from replay_compile.speculative.mamba2_layer import SpecMamba2Layer


def _layer(cls, state):
    """A layer of ``cls`` holding only what the fold reads: its cache state, no read copy."""
    layer = object.__new__(cls)
    layer.read_state, layer.state = None, state
    return layer


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("HV,Hk", [(4, 2), (3, 3)])
def test_in_place_fold_equals_the_reference_fold(kda, HV, Hk):
    g = torch.Generator().manual_seed(0)
    S, K, V, L = 5, 8, 6, 16
    state = torch.randn(S, HV, K, V, generator=g)
    d = torch.randn(S, HV, L, V, generator=g)
    k = torch.nn.functional.normalize(torch.randn(S, Hk, L, K, generator=g), dim=-1)
    gates = -torch.rand((S, HV, L, K) if kda else (S, HV, L), generator=g)
    gates[1, :, 2] = -float("inf")                                  # a gate that closes: exact zeros, no NaN
    w = torch.tensor([0, 3, 16, 7, 1], dtype=torch.int32)
    want = delta_replay_materialize_reference(state.double(), d.double(), k.double(), gates.double(), w)
    layer = _layer(SpecDeltaLayer, state.clone())
    assert layer._fold_in_place((d, k, gates), w)
    torch.testing.assert_close(layer.state.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.state[0], state[0])                    # w = 0: untouched
    assert not layer.state.isnan().any()


def test_in_place_fold_declines_what_it_does_not_handle():
    layer = _layer(SpecDeltaLayer, torch.zeros(2, 2, 4, 4, dtype=torch.float64))
    rings = (torch.zeros(2, 2, 8, 4), torch.zeros(2, 1, 8, 4), torch.zeros(2, 2, 8))
    assert not layer._fold_in_place(rings, torch.zeros(2, dtype=torch.int32))
    layer.state = torch.zeros(2, 2, 4, 4)
    layer.read_state = torch.zeros(2, 2, 4, 4)
    assert not layer._fold_in_place(rings, torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("H,G", [(4, 2), (3, 1), (2, 2)])
def test_mamba2_in_place_fold_equals_the_reference_fold(H, G):
    g = torch.Generator().manual_seed(1)
    S, P, N, L = 5, 6, 8, 16
    state = torch.randn(S, H, P, N, generator=g)
    x = torch.randn(S, H, L, P, generator=g).bfloat16()              # the rings' own dtypes: activations in bf16
    dt = torch.rand(S, H, L, generator=g)
    la = -torch.rand(S, H, L, generator=g) * 2
    la[2, :, 5] = -float("inf")                                     # a decay that closes: exact zeros, no NaN
    B = torch.randn(S, G, L, N, generator=g).bfloat16()
    w = torch.tensor([0, 3, 16, 7, 1], dtype=torch.int32)
    want = replay_materialize_reference(state.double(), x.double(), dt.double(), la.double(), B.double(), w)
    layer = _layer(SpecMamba2Layer, state.clone())
    assert layer._fold_in_place((x, dt, la, B), w)
    torch.testing.assert_close(layer.state.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.state[0], state[0])                    # w = 0: untouched
    assert not layer.state.isnan().any()


def test_mamba2_in_place_fold_declines_what_it_does_not_handle():
    rings = (torch.zeros(2, 2, 8, 4), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), torch.zeros(2, 1, 8, 4))
    layer = _layer(SpecMamba2Layer, torch.zeros(2, 2, 4, 4, dtype=torch.bfloat16))
    assert not layer._fold_in_place(rings, torch.zeros(2, dtype=torch.int32))
    layer.state = torch.zeros(2, 2, 4, 4).transpose(2, 3)           # not contiguous: a view would not write through
    assert not layer._fold_in_place(rings, torch.zeros(2, dtype=torch.int32))
