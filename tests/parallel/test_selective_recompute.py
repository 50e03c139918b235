"""The selective policy's recompute: dropout masks kept as bits (no random
draw in the recompute), ops whose outputs nothing reads skipped once a
plan is learned, and every way a plan can stop fitting (a changed grad
flag, a buffer written in place, a custom autograd Function, a random op
that is no mask) falling back to a plain recompute. Each against the
un-checkpointed run, bit for bit, over several steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bench.kernels.act_ckpt import Block  # the bench's transformer block: pre-LN attention + MLP, dropout 0.1
from fastzero import checkpointing
from fastzero.ops.onebit import unpack_mask
from fastzero.parallel import checkpointing as impl
from fastzero.parallel import selective


@pytest.fixture(autouse=True)
def fresh():
    impl._unconfigure()
    checkpointing.get_cuda_rng_tracker().reset()
    selective.forget_plans()
    yield
    selective.forget_plans()
    checkpointing.get_cuda_rng_tracker().reset()


class Ops(TorchDispatchMode):
    """Counts the aten ops that actually run (under the selective modes: what they did not skip)."""

    def __init__(self):
        super().__init__()
        self.ran: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__  # e.g. "addmm.default"
        self.ran[name] = self.ran.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def steps(blocks, wrap, n=3, seed=0):
    """n forward + backward steps from the same seeds; per step the grads, the input's grad and the ops the
    backward (its recomputes) ran."""
    out = []
    for step in range(n):
        torch.manual_seed(seed + step)
        x = torch.randn(2, 8, 16, requires_grad=True)
        for p in blocks.parameters():
            p.grad = None
        h = x
        for b in blocks:
            h = wrap(b, h)
        with Ops() as ops:
            (h * h.detach().cos()).sum().backward()
        grads = [None if p.grad is None else p.grad.clone() for p in blocks.parameters()]
        out.append((grads, x.grad.clone(), ops.ran, torch.rand(2)))
    return out


def assert_same_grads(got, want):
    for (g, xg, _, nxt), (w, xw, _, wnxt) in zip(got, want, strict=True):
        assert torch.equal(xg, xw)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g, w, strict=True))
        assert torch.equal(nxt, wnxt)  # the generator ends where the plain run's does


def selective_wrap(ratio=1.25):
    return lambda b, h: checkpointing.checkpoint(b, h, policy=checkpointing.SelectivePolicy(ratio))


def test_dropout_masks_are_kept_as_bits_and_the_recompute_draws_nothing(monkeypatch):
    unpacked = []
    monkeypatch.setattr(selective, "unpack_mask", lambda bits, out: unpacked.append(bits) or unpack_mask(bits, out))
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(16, 2) for _ in range(3))
    want = steps(blocks, lambda b, h: b(h))
    got = steps(blocks, selective_wrap())
    assert_same_grads(got, want)
    for _, _, ran, _ in got:
        assert "bernoulli_.float" not in ran  # every mask came back from its bits
    assert len(unpacked) == 2 * 3 * len(got)  # two masks unpacked per block and step


def test_the_recompute_skips_what_no_backward_reads_once_learned():
    """The MLP's down-projection feeds only the block's output (dropout saves its mask, the residual add
    nothing): from the second step its matmul is not recomputed (the dropout's multiply and the add, cheap, run
    on its stand-in)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(16, 2) for _ in range(3))
    want = steps(blocks, lambda b, h: b(h), n=4)
    got = steps(blocks, selective_wrap(0.1), n=4)  # room for the masks only: every matmul is recomputed or skipped
    assert_same_grads(got, want)
    # 3 blocks; forward matmuls qkv, proj, up, down (addmm); the backward's own matmuls are mm
    addmm = [ran["addmm.default"] for _, _, ran, _ in got]
    assert addmm[0] == 3 * 4  # learning: everything ran
    assert addmm[1:] == [3 * 3] * 3  # the down-projection skipped in every block
    plans = [p for p in selective._PLANS.values() if p is not None]
    assert plans and all(len(p.dead) == 1 and len(p.unread) == 2 for p in plans)  # addmm skipped; mul, add run


def test_a_plan_that_no_longer_fits_falls_back_to_a_plain_recompute():
    """A parameter frozen after the plan was learned: the recompute's grad flags differ from the learned
    ones, the planned run stops at the first op that reads it and the block is recomputed plainly."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(16, 2) for _ in range(2))
    steps(blocks, selective_wrap(), n=2)  # learn and use
    assert not selective._MISSES
    blocks[1].up.weight.requires_grad_(False)
    want = steps(blocks, lambda b, h: b(h), n=2, seed=10)
    got = steps(blocks, selective_wrap(), n=2, seed=10)
    assert_same_grads(got, want)
    assert sum(selective._MISSES.values()) >= 1


class Noisy(nn.Module):
    """A matmul, Gaussian noise (a random op that is no 0/1 mask), dropout, a matmul."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(x)
        h = F.dropout(h + 0.1 * torch.randn_like(h), 0.3, self.training)
        return x + self.b(torch.tanh(h))


def test_a_random_op_that_is_no_mask_keeps_no_masks():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Noisy() for _ in range(2))
    want = steps(blocks, lambda b, h: b(h))
    got = steps(blocks, selective_wrap())
    assert_same_grads(got, want)
    for _, _, ran, _ in got:
        assert ran["bernoulli_.float"] == 2 and ran["randn_like.default"] == 2  # the generator replayed


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(16, 16), nn.BatchNorm1d(8), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.b(torch.tanh(self.bn(self.a(x))))


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.x = x  # held on ctx, not saved: no saved-tensor hook sees it
        return x * x

    @staticmethod
    def backward(ctx, g):
        return 2 * ctx.x * g


class WithCustomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.b(Square.apply(self.a(x)))


@pytest.mark.parametrize("make", [WithBatchNorm, WithCustomFunction], ids=["buffer_written", "custom_function"])
def test_blocks_that_cannot_be_planned_are_recomputed_whole(make):
    """A block that writes a tensor from outside in place (BatchNorm's running stats) or holds tensors on a
    custom Function's ctx gets no plan: every op is recomputed, and grads match the plain run."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(make() for _ in range(2))
    want = steps(blocks, lambda b, h: b(h))
    for b in blocks:  # the plain run moved BatchNorm's running stats: start the checkpointed run from the same
        if isinstance(b, WithBatchNorm):
            b.bn.reset_running_stats()
    got = steps(blocks, selective_wrap(0.5))  # keeps no output (each is as large as the input)
    assert_same_grads(got, want)
    assert selective._PLANS and all(p is None for p in selective._PLANS.values())
    for _, _, ran, _ in got[1:]:
        assert ran["addmm.default"] == 2 * 2  # the last matmul, which nothing reads, still ran


def test_a_new_block_at_a_freed_blocks_address_is_known_by_a_new_key():
    """CPython gives a freed module's address to the next one: keyed by id, a new model would find the old
    one's plans and kept choices (the cause of a peak that differed by test order)."""
    policy, x = checkpointing.SelectivePolicy(), torch.randn(4, 8)
    ids, keys = set(), set()
    for _ in range(50):
        block = nn.Linear(8, 8)
        ids.add(id(block))
        keys.add(selective.block_key(block, (x,), policy))
        assert selective.block_key(block, (x,), policy) in keys  # steady while it lives
        closure = lambda t, block=block: block(t)  # noqa: E731
        assert selective.block_key(closure, (x,), policy) == selective.block_key(closure, (x,), policy)
        del block, closure
    if len(ids) == 50:
        pytest.skip("the allocator reused no freed module's address")
    assert len(keys) == 50


def test_a_wrong_plan_cannot_change_the_gradients():
    """A plan that (wrongly) skips the GELU, whose output the down-projection's backward reads: the
    recompute sees autograd save a stand-in, stops and runs plainly; the grads stay exact."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(16, 2) for _ in range(2))
    steps(blocks, selective_wrap(0.1), n=1)  # learn
    for plan in selective._PLANS.values():
        (gelu,) = [i for i, k in enumerate(plan.keys) if k[0] is torch.ops.aten.gelu.default]
        shape, dtype, stride, device = plan.keys[gelu][1][0][0]  # its input's, as its output's
        plan.dead[gelu] = (torch.Tensor, [(shape, stride, dtype, device)])
    want = steps(blocks, lambda b, h: b(h), n=1, seed=3)
    got = steps(blocks, selective_wrap(0.1), n=1, seed=3)
    assert_same_grads(got, want)
    assert sum(selective._MISSES.values()) == 2  # each block's planned run missed once


class WithInnerHooks(nn.Module):
    """A torch.utils.checkpoint (its own saved-tensor hooks) or save_on_cpu inside the block."""

    def __init__(self, inner: str):
        super().__init__()
        self.inner = inner
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.inner == "checkpoint":
            h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=False)
        else:
            with torch.autograd.graph.save_on_cpu():
                h = torch.tanh(self.b(h))
        return x + self.c(h)


@pytest.mark.parametrize("inner", ["checkpoint", "save_on_cpu"])
def test_saved_tensor_hooks_inside_the_block_are_never_planned_around(inner):
    """Tensors saved under the block's own hooks are out of the selective mode's sight: no plan, exact grads."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(WithInnerHooks(inner) for _ in range(2))
    want = steps(blocks, lambda b, h: b(h))
    got = steps(blocks, selective_wrap(0.1))
    assert_same_grads(got, want)
    assert selective._PLANS and all(p is None for p in selective._PLANS.values())


class ReadsThroughPython(nn.Module):
    """Feeds values read outside torch's ops (``.tolist()``) back into the computation: no check sees the read."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        y = self.b(h)  # read only through Python below: the plan finds it unread
        scale = torch.tensor(y.detach().tolist()).abs().mean()
        return h * scale


def test_a_read_through_python_shows_as_nan_and_skip_unread_false_is_exact():
    torch.manual_seed(0)
    blocks = nn.ModuleList(ReadsThroughPython() for _ in range(2))
    want = steps(blocks, lambda b, h: b(h))
    exact = steps(
        blocks, lambda b, h: checkpointing.checkpoint(b, h, policy=checkpointing.SelectivePolicy(skip_unread=False))
    )
    assert_same_grads(exact, want)
    assert not selective._PLANS  # nothing learned without skips
    skipping = steps(blocks, selective_wrap(0.1))
    grads, x_grad, _, _ = skipping[1]  # planned from the second step: the stand-in reads as NaN, loudly
    assert torch.isnan(x_grad).any()
    with pytest.raises(TypeError, match="skip_unread"):
        checkpointing.SelectivePolicy(skip_unread=1)
