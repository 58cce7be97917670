"""State pools indexed by slot (continuous batching): the pass rewrites ``pool[slot]`` gathers and ``pool[slot] = new``
/ ``index_copy_`` / ``index_put_`` scatters into the replay ops with ``slot_idx``.

The driver runs a serving loop on a pool with more slots than the batch: requests join (their slot gets a prefill
state, written eagerly outside the compiled step), leave, come in a different order every step, and slots are
recycled; the batch is padded to a fixed size with slot -1. The compiled module and the unmodified one run side by
side on their own pools; every real row's output is compared at every step, and every slot's true state at the end.
"""

import logging

import pytest
import torch
import torch.nn.functional as F

import replay_compile
from replay_compile.config import SUPPORTED_FAMILIES

H, P, N, G = 4, 6, 5, 2            # Mamba-2: heads, head dim, state dim, B/C groups
HV, HK, K, V = 4, 2, 5, 6          # delta rule: value heads, key heads, key dim, value dim
D1, N1 = 7, 4                      # Mamba-1: channels, states per channel
L = 3
SLOTS, BATCH = 6, 4                # the pool's slots, and BATCH more kept free for padding rows


def gather(pool, slot, how):
    return pool.index_select(0, slot) if how == "index_select" else pool[slot]


def scatter(pool, slot, new, how):
    if how == "index_copy":
        pool.index_copy_(0, slot, new)
    elif how == "index_put":
        pool.index_put_((slot,), new)
    else:
        pool[slot] = new


class Mamba2Pool(torch.nn.Module):
    def __init__(self, read="getitem", write="setitem"):
        super().__init__()
        self.A = torch.nn.Parameter(-torch.rand(H) - 0.1)
        self.read, self.write = read, write

    def forward(self, pool, slot, x, dt, B, C):
        d = F.softplus(dt)                                                  # [b, H]
        s = gather(pool, slot, self.read)
        new = s * torch.exp(d * self.A)[:, :, None, None] + \
            torch.einsum("bhp,bhn->bhpn", d[..., None] * x, B.repeat_interleave(H // G, 1))
        scatter(pool, slot, new, self.write)
        return torch.einsum("bhpn,bhn->bhp", new, C.repeat_interleave(H // G, 1))

    @staticmethod
    def shapes(b):
        return (b, H, P), (b, H), (b, G, N), (b, G, N)

    state_shape = (H, P, N)


class DeltaPool(torch.nn.Module):
    """Gated DeltaNet (``kda=False``) or KDA: per-key-head q, k repeated to the value heads."""

    def __init__(self, kda=False, read="getitem", write="setitem"):
        super().__init__()
        self.kda, self.read, self.write = kda, read, write
        self.A_log = torch.nn.Parameter(torch.rand(HV) * 0.5)
        self.dt_bias = torch.nn.Parameter(torch.randn(HV, K if kda else 1) * 0.3)

    def forward(self, pool, slot, q, k, v, a, b):
        r = HV // HK
        q = F.normalize(q, dim=-1).repeat_interleave(r, dim=1) * K ** -0.5
        k = F.normalize(k, dim=-1).repeat_interleave(r, dim=1)
        g = -self.A_log.exp()[:, None] * F.softplus(a + self.dt_bias)          # [b, HV, K or 1]
        decay = g.exp()[..., None] if self.kda else g[..., 0].exp()[..., None, None]
        s = gather(pool, slot, self.read) * decay
        delta = (v - (s * k.unsqueeze(-1)).sum(-2)) * b.sigmoid()[..., None]
        new = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
        scatter(pool, slot, new, self.write)
        return (new * q.unsqueeze(-1)).sum(-2)

    def shapes(self, b):
        return (b, HK, K), (b, HK, K), (b, HV, V), (b, HV, K if self.kda else 1), (b, HV)

    state_shape = (HV, K, V)


class Mamba1Pool(torch.nn.Module):
    """Mamba-1's step on a pool of [D, N] states (a decay per channel and state)."""

    def __init__(self, read="getitem", write="setitem"):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.rand(D1, N1).log1p())
        self.read, self.write = read, write

    def forward(self, pool, slot, x, dt, B, C):
        d = F.softplus(dt)                                                  # [b, D]
        s = gather(pool, slot, self.read)
        new = torch.exp(d[..., None] * -torch.exp(self.A_log)) * s + (d * x)[..., None] * B[:, None, :]
        scatter(pool, slot, new, self.write)
        return torch.matmul(new, C[..., None]).squeeze(-1)

    @staticmethod
    def shapes(b):
        return (b, D1), (b, D1), (b, N1), (b, N1)

    state_shape = (D1, N1)


def schedule(steps, gen, pad):
    """Per step: the slots of the batch's rows (real rows in a new order, then padding rows: slot -1, or with
    ``pad="spare"`` a spare slot of their own) and the slots that get a new request (a prefill state) before the
    step. Requests last 3-9 steps; a freed slot is reused."""
    free, live, out = list(range(SLOTS)), {}, []
    for t in range(steps):
        for s in [s for s, end in live.items() if end <= t]:
            del live[s]
            free.append(s)                            # recycled: the next join takes the longest-free slot
        joins = []
        while free and len(live) < BATCH - (t % 3 == 1):    # every third step one row short: padding
            s = free.pop(0)
            live[s] = t + int(torch.randint(3, 10, (), generator=gen))
            joins.append(s)
        rows = list(live)
        rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
        padding = [-1 if pad == "-1" else SLOTS + i for i in range(BATCH - len(rows))]
        out.append((rows + padding, joins))
    return out


def serve(mod, steps=5 * L + 4, pool_kind="wrapped", seed=0, device="cpu"):
    """Run the serving loop eagerly and compiled, compare; returns the rewrites made.

    Padding rows: slot -1 where the module gathers with ``pool[slot]`` (eager indexing wraps it to the pool's last
    slot, kept free; the rewrite skips the row, leaving that slot untouched and the row's output zero), a spare
    slot per row where it uses ``index_select`` (which refuses -1; those rows are then stepped like any other).

    ``pool_kind``: "wrapped" (a ``ReplayTensor``: a slot write folds that slot alone), "flushed" (a plain tensor,
    ``replay_compile.flush(pool)`` before the loop writes slots), "plain" (a plain tensor written as it is).
    On CUDA the graph lowers through Inductor and the step runs the Triton kernels."""
    pad = "-1" if mod.read == "getitem" else "spare"
    gen = torch.Generator().manual_seed(seed)
    mod = mod.to(device)
    pool_e = torch.randn(SLOTS + BATCH, *mod.state_shape, generator=gen).to(device)
    pool_c = pool_e.clone()
    if pool_kind == "wrapped":
        pool_c = replay_compile.ReplayTensor(pool_c)
    last = pool_c[-1].clone()
    options = {"buffer_len": L} if device == "cuda" else {"buffer_len": L, "lower": "eager"}
    options["families"] = SUPPORTED_FAMILIES          # Mamba-1 is opt-in
    cmod = torch.compile(mod, backend="replayssm", options=options, dynamic=False)
    with torch.no_grad():
        for t, (rows, joins) in enumerate(schedule(steps, gen, pad)):
            if joins and pool_kind == "flushed":
                replay_compile.flush(pool_c)
            for s in joins:                          # a new request's prefill state, written outside the step
                init = torch.randn(*mod.state_shape, generator=gen).to(device)
                pool_e[s] = init
                pool_c[s] = init
            slot = torch.tensor(rows, device=device)
            ins = [torch.randn(*shp, generator=gen).to(device) for shp in mod.shapes(BATCH)]
            ye, yc = mod(pool_e, slot, *ins), cmod(pool_c, slot, *ins)
            real = slot >= 0
            torch.testing.assert_close(yc[real], ye[real], rtol=2e-5, atol=2e-5, msg=f"step {t}, slots {rows}")
            assert not yc[~real].any(), "padding rows give zeros"
    replay_compile.flush(pool_c)
    got = pool_c.checkpoint if isinstance(pool_c, replay_compile.ReplayTensor) else pool_c
    if pad == "-1":
        assert torch.equal(got[-1], last), "padding rows never write the pool's last slot"
        got, pool_e = got[:-1], pool_e[:-1]
    torch.testing.assert_close(got, pool_e, rtol=2e-5, atol=2e-5)
    return [r for rep in replay_compile.reports() for r in rep.rewrites]


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    replay_compile.clear_reports()
    yield
    replay_compile.reset(None)      # a pool left holding records (the raising test) must not reach other tests


@pytest.mark.parametrize("read, write", [("getitem", "setitem"), ("index_select", "index_copy"),
                                         ("getitem", "index_put")])
def test_mamba2_pool_serving_loop(read, write):
    rws = serve(Mamba2Pool(read, write))
    assert [r.form for r in rws] == ["einsum/grouped/slot pool"]


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("read, write", [("getitem", "setitem"), ("index_select", "index_copy")])
def test_delta_pool_serving_loop(kda, read, write):
    rws = serve(DeltaPool(kda, read, write))
    assert [r.family for r in rws] == ["kda" if kda else "gdn"]
    assert rws[0].form.endswith("/slot pool")


@pytest.mark.parametrize("read, write", [("getitem", "setitem"), ("index_select", "index_copy")])
def test_mamba1_pool_serving_loop(read, write):
    rws = serve(Mamba1Pool(read, write))
    assert [(r.family, r.form) for r in rws] == [("mamba1", "mamba1/slot pool")]


@pytest.mark.gpu
@pytest.mark.parametrize("make", [lambda: Mamba2Pool(), lambda: Mamba2Pool("index_select", "index_copy"),
                                  lambda: DeltaPool(False), lambda: DeltaPool(True, "index_select", "index_copy"),
                                  lambda: Mamba1Pool()],
                         ids=["mamba2", "mamba2-index_copy", "gdn", "kda-index_copy", "mamba1"])
def test_pool_serving_loop_cuda(make):
    """The same loop through Inductor and the Triton kernels (their ``slot_idx`` rows and padding)."""
    rws = serve(make(), device="cuda")
    assert len(rws) == 1 and rws[0].form.endswith("/slot pool")


class ReadsPoolTwice(Mamba2Pool):
    def forward(self, pool, slot, x, dt, B, C):
        y = super().forward(pool, slot, x, dt, B, C)
        return y + pool[slot].sum(-1)


class WritesOtherSlots(Mamba2Pool):
    def forward(self, pool, slot, x, dt, B, C):
        d = F.softplus(dt)
        s = pool[slot]
        new = s * torch.exp(d * self.A)[:, :, None, None] + \
            torch.einsum("bhp,bhn->bhpn", d[..., None] * x, B.repeat_interleave(H // G, 1))
        pool[slot.flip(0)] = new                       # rows written to other rows' slots
        return torch.einsum("bhpn,bhn->bhp", new, C.repeat_interleave(H // G, 1))


@pytest.mark.parametrize("case, reason", [
    (ReadsPoolTwice, "read 2 times"),
    (WritesOtherSlots, "read 0 times"),
])
def test_pool_near_misses_are_left_unchanged_and_reported(case, reason, caplog):
    mod = case()
    pool = torch.randn(SLOTS, H, P, N)
    want = pool.clone()
    slot = torch.tensor([2, 0, 5])
    ins = [torch.randn(*s) for s in mod.shapes(3)]
    with caplog.at_level(logging.WARNING, logger="replay_compile"):
        cmod = torch.compile(mod, backend="replayssm", options={"buffer_len": L, "lower": "eager"})
        torch.testing.assert_close(cmod(pool, slot, *ins), mod(want, slot, *ins))
    torch.testing.assert_close(pool, want)
    rep = replay_compile.reports()
    assert not [r for x in rep for r in x.rewrites]
    assert any(reason in s.reason for x in rep for s in x.skipped), [s.reason for x in rep for s in x.skipped]
    with pytest.raises(Exception, match=reason):
        torch._dynamo.reset()
        torch.compile(mod, backend="replayssm", options={"buffer_len": L, "lower": "eager", "strict": True})(
            pool.clone(), slot, *ins)


def test_plain_pool_flushed_before_slot_writes_is_exact():
    serve(DeltaPool(), pool_kind="flushed")


def test_plain_pool_written_behind_the_steps_back_raises():
    """A plain pool's version counter moves for a write of any of its slots: the step refuses to guess which."""
    with pytest.raises(replay_compile.ReplayCompileError, match="written outside the compiled step") as e:
        serve(Mamba2Pool(), pool_kind="plain")
    assert "ReplayTensor(pool)" in str(e.value)
