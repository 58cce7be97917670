"""``replay_compile::copy_positions``: the attention half of a speculative commit (a verify's scratch positions of a
static key/value cache copied to each row's own positions), in place, also through Inductor."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import replay_compile  # noqa: F401  (registers the ops)

b, H, S, D, T = 3, 2, 40, 8, 4


def _expected(cache, start, dest):
    out = cache.clone()
    for r in range(cache.shape[0]):
        for t in range(dest.shape[1]):
            out[r, :, dest[r, t]] = cache[r, :, start + t]
    return out


def test_copies_each_rows_window_to_its_positions():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(b, H, S, D, generator=g)
    dest = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8], [30, 31, 32, 33]])
    want = _expected(cache, S - T, dest)
    torch.ops.replay_compile.copy_positions(cache, S - T, dest)
    assert torch.equal(cache, want)


def test_destination_overlapping_the_source_reads_the_source_first():
    """The draft model points the positions it has no token for at the scratch's last column."""
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(b, H, S, D, generator=g)
    dest = torch.tensor([[S - 3, S - 2, S - 1, S - 1], [4, 5, 6, 7], [S - 1, S - 1, 9, 10]])
    src = cache[:, :, S - T:].clone()
    torch.ops.replay_compile.copy_positions(cache, S - T, dest)
    assert torch.equal(cache[1, :, 4:8], src[1])
    assert torch.equal(cache[0, :, S - 3], src[0, :, 0]) and torch.equal(cache[2, :, 9:11], src[2, :, 2:])


@pytest.mark.parametrize("cache_shape, dest, start, what", [
    ((b, H, S), torch.zeros(b, T, dtype=torch.long), S - T, "cache must be"),
    ((b, H, S, D), torch.zeros(b, T, dtype=torch.int32), S - T, "dest int64"),
    ((b, H, S, D), torch.zeros(b + 1, T, dtype=torch.long), S - T, "dest int64"),
    ((b, H, S, D), torch.zeros(b, T, dtype=torch.long), S - T + 1, "outside the cache"),
])
def test_bad_arguments_raise_before_anything_is_written(cache_shape, dest, start, what):
    cache = torch.randn(cache_shape)
    before = cache.clone()
    with pytest.raises(ValueError, match=what):
        torch.ops.replay_compile.copy_positions(cache, start, dest)
    assert torch.equal(cache, before)


def test_inductor_writes_the_cache_in_place_without_a_copy_of_it():
    """A round writes the verify's keys to the scratch, then commits them: the compiled code must not allocate a
    cache-sized buffer (the functionalised ``scatter_`` it replaces cloned the whole cache and copied it back)."""
    def commit(cache, new, dest):
        cache.index_copy_(2, torch.arange(S - T, S), new)
        torch.ops.replay_compile.copy_positions(cache, S - T, dest)

    g = torch.Generator().manual_seed(2)
    cache, new = torch.randn(b, H, S, D, generator=g), torch.randn(b, H, T, D, generator=g)
    dest = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8], [10, 11, 12, 13]])
    want = cache.clone()
    commit(want, new, dest)
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(commit, fullgraph=True), cache, new, dest)
    assert torch.equal(cache, want)
    allocations = [line for src in code for line in src.splitlines() if "empty_strided" in line and "= empty" in line
                   and f"({b}, {H}, {S}, {D})" in line]
    assert not allocations, allocations


@pytest.mark.parametrize("D, T, dtype", [(8, 4, torch.float32), (160, 3, torch.bfloat16), (256, 1, torch.float16)])
def test_kernel_copies_what_the_eager_form_copies(D, T, dtype):
    """The CUDA kernel (here through Triton's interpreter, or on the GPU where there is one) against the op's eager
    form, destinations overlapping the source included; a destination outside the cache is not written."""
    from replay_compile.kernels.copy_positions_triton import copy_positions_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(b, H, S, D, generator=g).to(dtype)
    dest = torch.stack([torch.randperm(S - T, generator=g)[:T] for _ in range(b)])
    dest[1] = torch.arange(S - T, S).roll(1)                         # a permutation of the source positions
    got = cache.clone().to(dev)
    copy_positions_triton(got, S - T, dest.to(dev))
    assert torch.equal(got.cpu(), _expected(cache, S - T, dest))

    dest[2, 0] = S                                                   # outside the cache: that one is skipped
    got = cache.clone().to(dev)
    copy_positions_triton(got, S - T, dest.to(dev))
    want = cache.clone()
    for r in range(b):
        for t in range(T):
            if dest[r, t] < S:
                want[r, :, dest[r, t]] = cache[r, :, S - T + t]
    assert torch.equal(got.cpu(), want)
