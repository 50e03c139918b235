"""One rank of the tensor-parallel layer tests (tests/parallel/test_tp_layers.py),
started by tests/dist.py; argv[1] is the output path.

Every case builds the unsharded reference (nn.Linear, nn.Embedding,
F.cross_entropy, ...) in this process from the same seed and fresh random
inputs, runs the parallel version, and records (got, want, exact) pairs:
this rank's piece of the reference for split tensors, the whole reference
for replicated ones. Bad input records the error's message. The test
compares every element."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fastzero.parallel.mappings as mappings
from fastzero.comm import init_distributed
from fastzero.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_to_tensor_group,
    gather_from_sequence_parallel_region,
    gather_from_tensor_group,
    mark_sequence_parallel,
    reduce_from_tensor_group,
    reduce_scatter_to_sequence_parallel_region,
    register_sequence_parallel_grad_hooks,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_group,
    set_current,
    vocab_parallel_cross_entropy,
)

PAIRS: dict[str, tuple] = {}
ERRORS: dict[str, str] = {}


def rnd(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ints(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """Small integers: exact in bf16/fp16, and so are their sums over a few ranks."""
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


class Group:
    """A tensor group and this rank's place in it."""

    def __init__(self, group=None):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)

    def piece(self, t: torch.Tensor, dim: int, stride: int = 1) -> torch.Tensor:
        """This rank's chunk of `t` (with stride s: chunks rank, rank + size, ... of n / (size s))."""
        chunks = t.chunk(self.size * stride, dim)
        return torch.cat(chunks[self.rank :: self.size], dim)


def check(name: str, got, want, exact: bool = False, atol: float | None = None) -> None:
    """Records a pair: equal (exact), within `atol`, or else at torch.testing's default tolerances."""
    assert name not in PAIRS, name
    PAIRS[name] = (got.detach().clone(), want.detach().clone(), exact, atol)


def bf16_atol(want: torch.Tensor) -> float:
    """A bf16 result whose partial sums were rounded on each rank before the
    sum: a few bf16 roundings (2^-8 relative) of the largest element."""
    return 4 * 2.0**-8 * float(want.abs().max())


def error(name: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # the test checks the type and message
        ERRORS[name] = f"{type(e).__name__}: {e}"
    else:
        ERRORS[name] = "no error"


def run_mappings(g: Group, world: int) -> None:
    """Each autograd function's forward and backward against the collective it stands for,
    per-rank inputs made from seed + rank so every rank knows all of them."""
    r = g.rank
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tag = str(dtype).split(".")[1]
        xs = [ints(100 + k, 3, 2 * world, dtype=dtype) for k in range(world)]  # one per rank
        gs = [ints(200 + k, 3, 2 * world, dtype=dtype) for k in range(world)]

        x = leaf(xs[r])
        y = copy_to_tensor_group(x)
        y.backward(gs[r])
        check(f"copy_to/{tag}/fwd", y, xs[r], exact=True)
        check(f"copy_to/{tag}/bwd", x.grad, sum(gs), exact=True)

        x = leaf(xs[r])
        y = reduce_from_tensor_group(x)
        y.backward(gs[r])
        check(f"reduce_from/{tag}/fwd", y, sum(xs), exact=True)
        check(f"reduce_from/{tag}/bwd", x.grad, gs[r], exact=True)

        full = ints(300, 3, 5, 2 * world, dtype=dtype).transpose(0, 1)  # not contiguous
        x = leaf(full)
        y = scatter_to_tensor_group(x)
        gy = [ints(400 + k, *y.shape, dtype=dtype) for k in range(world)]
        y.backward(gy[r])
        check(f"scatter_to/{tag}/fwd", y, g.piece(full, -1), exact=True)
        check(f"scatter_to/{tag}/bwd", x.grad, torch.cat(gy, -1), exact=True)
        check(f"scatter_to/{tag}/contiguous", torch.tensor(y.is_contiguous()), torch.tensor(True), exact=True)

        x = leaf(xs[r])
        y = gather_from_tensor_group(x)
        gfull = ints(500, *y.shape, dtype=dtype)  # the same on every rank
        y.backward(gfull)
        check(f"gather_from/{tag}/fwd", y, torch.cat(xs, -1), exact=True)
        check(f"gather_from/{tag}/bwd", x.grad, g.piece(gfull, -1), exact=True)

        for native in (True, False):  # reduce-scatter, and its all-reduce + slice fallback
            mappings._native_reduce_scatter = native
            how = "native" if native else "fallback"
            for dim in (0, 1, -1):
                seq = [ints(600 + k, 2 * world, world, 2 * world, dtype=dtype) for k in range(world)]
                name = f"seq{dim}/{tag}/{how}"

                x = leaf(seq[0])  # the same on every rank
                y = scatter_to_sequence_parallel_region(x, seq_dim=dim)
                gy = [ints(700 + k, *y.shape, dtype=dtype) for k in range(world)]
                y.backward(gy[r])
                check(f"scatter_seq/{name}/fwd", y, g.piece(seq[0], dim), exact=True)
                check(f"scatter_seq/{name}/bwd", x.grad, torch.cat(gy, dim), exact=True)

                part = [g.piece(s, dim) for s in seq]  # rank k holds part[...] of its own tensor
                mine = [ints(800 + k, *part[0].shape, dtype=dtype) for k in range(world)]
                for tp_grad in (True, False):
                    x = leaf(mine[r])
                    y = gather_from_sequence_parallel_region(x, tp_grad, seq_dim=dim)
                    check(f"gather_seq/{name}/tp_grad={tp_grad}/fwd", y, torch.cat(mine, dim), exact=True)
                    if tp_grad:  # each rank a different partial grad of the whole: summed, then split
                        y.backward(seq[r])
                        check(f"gather_seq/{name}/tp_grad=True/bwd", x.grad, g.piece(sum(seq), dim), exact=True)
                    else:  # the same grad everywhere: split
                        y.backward(seq[0])
                        check(f"gather_seq/{name}/tp_grad=False/bwd", x.grad, g.piece(seq[0], dim), exact=True)

                x = leaf(seq[r])
                y = reduce_scatter_to_sequence_parallel_region(x, seq_dim=dim)
                y.backward(mine[r])
                check(f"reduce_scatter_seq/{name}/fwd", y, g.piece(sum(seq), dim), exact=True)
                check(f"reduce_scatter_seq/{name}/bwd", x.grad, torch.cat(mine, dim), exact=True)
                check(f"reduce_scatter_seq/{name}/input_kept", x.detach(), seq[r], exact=True)
        mappings._native_reduce_scatter = True


def run_column(g: Group) -> None:
    out = 3 * g.size
    for bias in (True, False):
        for gather in (True, False):
            name = f"column/bias={bias}/gather={gather}"
            torch.manual_seed(10)
            ref = nn.Linear(7, out, bias=bias)
            torch.manual_seed(10)
            layer = ColumnParallelLinear(7, out, bias=bias, gather_output=gather, group=g.group)
            check(f"{name}/init_weight", layer.weight, g.piece(ref.weight, 0), exact=True)
            x = rnd(11, 3, 5, 7)
            probe = rnd(12, 3, 5, out)
            xr, xt = leaf(x), leaf(x)
            want = ref(xr)
            (want * probe).sum().backward()
            got = layer(xt)
            ((got * probe) if gather else (got * g.piece(probe, -1))).sum().backward()
            check(f"{name}/out", got, want if gather else g.piece(want, -1))
            check(f"{name}/grad_x", xt.grad, xr.grad)
            check(f"{name}/grad_w", layer.weight.grad, g.piece(ref.weight.grad, 0))
            if bias:
                check(f"{name}/init_bias", layer.bias, g.piece(ref.bias, 0), exact=True)
                check(f"{name}/grad_b", layer.bias.grad, g.piece(ref.bias.grad, 0))
            check(f"{name}/marked", torch.tensor([layer.weight.partition_dim]), torch.tensor([0]), exact=True)

    torch.manual_seed(13)
    ref = nn.Linear(7, out)
    torch.manual_seed(13)
    layer = ColumnParallelLinear(7, out, gather_output=False, skip_bias_add=True, group=g.group)
    x = rnd(14, 4, 7)
    got, b = layer(x)
    check("column/skip_bias_add/out", got, g.piece(x @ ref.weight.t(), -1))
    check("column/skip_bias_add/bias", b, g.piece(ref.bias, 0), exact=True)

    # stride 2 (a fused layout): rank r holds chunks r and r + tp of the output rows
    torch.manual_seed(15)
    ref = nn.Linear(5, 4 * g.size)
    torch.manual_seed(15)
    layer = ColumnParallelLinear(5, 4 * g.size, stride=2, gather_output=False, keep_master_weight_for_test=True)
    check("column/stride2/weight", layer.weight, g.piece(ref.weight, 0, stride=2), exact=True)
    check("column/stride2/bias", layer.bias, g.piece(ref.bias, 0, stride=2), exact=True)
    check("column/stride2/master", layer.master_weight, ref.weight, exact=True)
    x = rnd(16, 3, 5)
    check("column/stride2/out", layer(x), g.piece(ref(x), -1, stride=2))


def run_row(g: Group) -> None:
    inp = 3 * g.size
    for bias in (True, False):
        for parallel in (True, False):
            name = f"row/bias={bias}/input_is_parallel={parallel}"
            torch.manual_seed(20)
            ref = nn.Linear(inp, 7, bias=bias)
            torch.manual_seed(20)
            layer = RowParallelLinear(inp, 7, bias=bias, input_is_parallel=parallel, group=g.group)
            check(f"{name}/init_weight", layer.weight, g.piece(ref.weight, 1), exact=True)
            x = rnd(21, 3, 5, inp)
            probe = rnd(22, 3, 5, 7)
            xr, xt = leaf(x), leaf(g.piece(x, -1) if parallel else x)
            want = ref(xr)
            (want * probe).sum().backward()
            got = layer(xt)
            (got * probe).sum().backward()
            check(f"{name}/out", got, want)
            check(f"{name}/grad_x", xt.grad, g.piece(xr.grad, -1) if parallel else xr.grad)
            check(f"{name}/grad_w", layer.weight.grad, g.piece(ref.weight.grad, 1))
            if bias:
                check(f"{name}/init_bias", layer.bias, ref.bias, exact=True)
                check(f"{name}/grad_b", layer.bias.grad, ref.bias.grad)
            check(f"{name}/marked", torch.tensor([layer.weight.partition_dim]), torch.tensor([1]), exact=True)


def run_embedding(g: Group) -> None:
    vocab = 5 * g.size
    for padding in (None, vocab - 2):
        for sp in (False, True):
            name = f"embedding/padding={padding}/sequence_parallel={sp}"
            torch.manual_seed(30)
            ref = nn.Embedding(vocab, 6, padding_idx=padding)
            torch.manual_seed(30)
            layer = VocabParallelEmbedding(vocab, 6, padding_idx=padding, sequence_parallel=sp, group=g.group)
            check(f"{name}/init", layer.weight, g.piece(ref.weight, 0), exact=True)
            ids = torch.randint(0, vocab, (2 * g.size, 3), generator=torch.Generator().manual_seed(31))
            ids[0, 0] = vocab - 1
            ids[1, 1] = vocab - 2
            probe = rnd(32, 2 * g.size, 3, 6)
            want = ref(ids)
            (want * probe).sum().backward()
            got = layer(ids)
            ((got * g.piece(probe, 0)) if sp else (got * probe)).sum().backward()
            check(f"{name}/out", got, g.piece(want, 0) if sp else want)
            check(f"{name}/grad_w", layer.weight.grad, g.piece(ref.weight.grad, 0))


def run_mlp(g: Group, tag: str = "", explicit: bool = True) -> None:
    """Column (gather_output=False) -> gelu -> row (input_is_parallel=True) against nn.Sequential;
    the group passed, or (explicit=False) found as the current one."""
    hidden = 4 * g.size
    torch.manual_seed(40)
    ref = nn.Sequential(nn.Linear(7, hidden), nn.GELU(), nn.Linear(hidden, 7))
    torch.manual_seed(40)
    group = g.group if explicit else None
    col = ColumnParallelLinear(7, hidden, gather_output=False, group=group)
    row = RowParallelLinear(hidden, 7, input_is_parallel=True, group=group)
    x = rnd(41, 3, 5, 7)
    probe = rnd(42, 3, 5, 7)
    xr, xt = leaf(x), leaf(x)
    want = ref(xr)
    (want * probe).sum().backward()
    got = row(F.gelu(col(xt)))
    (got * probe).sum().backward()
    name = f"mlp{tag}"
    check(f"{name}/out", got, want)
    check(f"{name}/grad_x", xt.grad, xr.grad)
    check(f"{name}/col_grad_w", col.weight.grad, g.piece(ref[0].weight.grad, 0))
    check(f"{name}/col_grad_b", col.bias.grad, g.piece(ref[0].bias.grad, 0))
    check(f"{name}/row_grad_w", row.weight.grad, g.piece(ref[2].weight.grad, 1))
    check(f"{name}/row_grad_b", row.bias.grad, ref[2].bias.grad)


def run_sequence_parallel(g: Group) -> None:
    """LayerNorm -> column -> gelu -> row with the sequence split, against the
    unsharded block; the marked grads summed after backward, or (hooks) during
    it, over two accumulated micro-batches."""
    hidden, ffn = 8, 4 * g.size
    for dim, hooks in ((0, False), (1, False), (0, True)):  # Megatron's [s, b, h], and [b, s, h]
        name = f"sequence_parallel/seq_dim={dim}" + ("/hooks" if hooks else "")
        torch.manual_seed(50)
        ref = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        torch.manual_seed(50)
        ln = nn.LayerNorm(hidden)
        col = ColumnParallelLinear(hidden, ffn, gather_output=False, sequence_parallel=True, seq_dim=dim)
        row = RowParallelLinear(ffn, hidden, input_is_parallel=True, sequence_parallel=True, seq_dim=dim)
        with torch.no_grad():  # LayerNorm starts at ones and zeros: move it so its grads are not special
            for p, q in zip(ref[0].parameters(), ln.parameters()):
                p.add_(rnd(51, hidden))
                q.add_(rnd(51, hidden))
        mark_sequence_parallel(ln)
        if hooks:
            handles = register_sequence_parallel_grad_hooks([ln, col, row])
            check(f"{name}/hooked", torch.tensor([len(handles)]), torch.tensor([3]), exact=True)
        shape = (2 * g.size, 3, hidden) if dim == 0 else (3, 2 * g.size, hidden)
        x = rnd(52, *shape)
        xr, xt = leaf(x), leaf(g.piece(x, dim))
        for micro in range(2 if hooks else 1):
            probe = rnd(53 + micro, *shape)
            want = ref(xr)
            (want * probe).sum().backward()
            got = row(F.gelu(col(ln(xt))))
            (got * g.piece(probe, dim)).sum().backward()
        if not hooks:
            summed = allreduce_sequence_parallel_grads([ln, col, row])  # ln weight, bias; row bias
            check(f"{name}/summed", torch.tensor([summed]), torch.tensor([3]), exact=True)
        check(f"{name}/out", got, g.piece(want, dim))
        check(f"{name}/grad_x", xt.grad, g.piece(xr.grad, dim))
        check(f"{name}/ln_grad_w", ln.weight.grad, ref[0].weight.grad)
        check(f"{name}/ln_grad_b", ln.bias.grad, ref[0].bias.grad)
        check(f"{name}/col_grad_w", col.weight.grad, g.piece(ref[1].weight.grad, 0))
        check(f"{name}/col_grad_b", col.bias.grad, g.piece(ref[1].bias.grad, 0))
        check(f"{name}/row_grad_w", row.weight.grad, g.piece(ref[3].weight.grad, 1))
        check(f"{name}/row_grad_b", row.bias.grad, ref[3].bias.grad)

    # the column layer's weight grad alone (an input that needs no grad: backward skips the reduce-scatter)
    torch.manual_seed(54)
    ref = nn.Linear(hidden, ffn)
    torch.manual_seed(54)
    col = ColumnParallelLinear(hidden, ffn, gather_output=False, sequence_parallel=True)
    x = rnd(55, 2 * g.size, 3, hidden)
    probe = rnd(56, 2 * g.size, 3, ffn)
    (ref(x) * probe).sum().backward()
    got = col(g.piece(x, 0))
    (got * g.piece(probe, -1)).sum().backward()
    check("sequence_parallel/weight_only/out", got, g.piece(ref(x), -1))
    check("sequence_parallel/weight_only/grad_w", col.weight.grad, g.piece(ref.weight.grad, 0))
    check("sequence_parallel/weight_only/grad_b", col.bias.grad, g.piece(ref.bias.grad, 0))

    # under autocast (bf16 matmuls, fp32 params): the same as nn.Linear under the same autocast
    torch.manual_seed(57)
    ref = nn.Linear(hidden, ffn)
    torch.manual_seed(57)
    col = ColumnParallelLinear(hidden, ffn, gather_output=False, sequence_parallel=True)
    x = rnd(58, 2 * g.size, 3, hidden)
    probe = rnd(59, 2 * g.size, 3, ffn)
    xr, xt = leaf(x), leaf(g.piece(x, 0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(xr)
        got = col(xt)
    (want.float() * probe).sum().backward()
    (got.float() * g.piece(probe, -1)).sum().backward()
    for name, got_, want_ in (
        ("out", got, g.piece(want, -1)),
        ("grad_x", xt.grad, g.piece(xr.grad, 0)),
        ("grad_w", col.weight.grad, g.piece(ref.weight.grad, 0)),
        ("grad_b", col.bias.grad, g.piece(ref.bias.grad, 0)),
    ):
        check(f"sequence_parallel/autocast/{name}", got_, want_, atol=bf16_atol(want_))


def run_cross_entropy(g: Group) -> None:
    vocab = 7 * g.size
    logits = rnd(60, 4, 5, vocab) * 5  # large enough that the max shift matters
    target = torch.randint(0, vocab, (4, 5), generator=torch.Generator().manual_seed(61))
    weights = rnd(62, 4, 5)
    for ignore in (-100, 3):
        t = target.clone()
        t[0, :2] = ignore
        t[2, 3] = ignore
        t[1, 0] = 3 if ignore == -100 else 4  # a class some rank owns, not ignored
        for smoothing in (0.0, 0.1):
            for reduction in ("mean", "sum", "none"):
                name = f"cross_entropy/ignore={ignore}/smoothing={smoothing}/{reduction}"
                zr, zt = leaf(logits), leaf(g.piece(logits, -1))
                want = F.cross_entropy(
                    zr.reshape(-1, vocab),
                    t.reshape(-1),
                    ignore_index=ignore,
                    label_smoothing=smoothing,
                    reduction=reduction,
                )
                got = vocab_parallel_cross_entropy(zt, t, smoothing, ignore, reduction)
                if reduction == "none":
                    want = want.reshape(t.shape)
                    (want * weights).sum().backward()
                    (got * weights).sum().backward()
                else:
                    (want * 1.7).backward()
                    (got * 1.7).backward()
                check(f"{name}/loss", got, want)
                check(f"{name}/grad", zt.grad, g.piece(zr.grad, -1))
    # bf16 logits: the loss and grad in bf16, as F.cross_entropy's on the same values in fp32, rounded once
    zr, zt = leaf(logits.bfloat16().float()), leaf(g.piece(logits, -1).bfloat16())
    want = F.cross_entropy(zr.reshape(-1, vocab), target.reshape(-1), label_smoothing=0.1)
    got = vocab_parallel_cross_entropy(zt, target, label_smoothing=0.1)
    want.backward()
    got.backward()
    check("cross_entropy/bf16/loss", got, want.bfloat16())
    check("cross_entropy/bf16/grad", zt.grad, g.piece(zr.grad, -1).bfloat16())
    # every target ignored: mean is 0/0 in PyTorch too
    t = torch.full((4, 5), -100)
    check(
        "cross_entropy/all_ignored",
        vocab_parallel_cross_entropy(g.piece(logits, -1), t),
        F.cross_entropy(logits.reshape(-1, vocab), t.reshape(-1)),
    )


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D as it is (weight [nx, nf]): the
    layout from_linear must handle; the test process checks it matches
    transformers' own class."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.reshape(*x.shape[:-1], self.nf)


def run_from_layers(g: Group) -> None:
    """from_linear (nn.Linear and Conv1D) and from_embedding: the slices of the
    given layer, and the same outputs and grads."""
    n = 4 * g.size
    torch.manual_seed(70)
    for kind in ("linear", "conv1d"):
        src1 = nn.Linear(6, n) if kind == "linear" else Conv1D(n, 6)
        src2 = nn.Linear(n, 6) if kind == "linear" else Conv1D(6, n)
        with torch.no_grad():
            src1.bias.add_(rnd(71, n))
            src2.bias.add_(rnd(72, 6))
        col = ColumnParallelLinear.from_linear(src1, gather_output=False, group=g.group)
        row = RowParallelLinear.from_linear(src2, input_is_parallel=True, group=g.group)
        name = f"from_{kind}"
        col_dim, row_dim = (0, 1) if kind == "linear" else (1, 0)
        check(f"{name}/col_weight", col.weight, g.piece(src1.weight, col_dim), exact=True)
        check(f"{name}/row_weight", row.weight, g.piece(src2.weight, row_dim), exact=True)
        check(
            f"{name}/partition_dims",
            torch.tensor([col.weight.partition_dim, row.weight.partition_dim]),
            torch.tensor([col_dim, row_dim]),
            exact=True,
        )
        x = rnd(73, 3, 5, 6)
        probe = rnd(74, 3, 5, 6)
        xr, xt = leaf(x), leaf(x)
        want = src2(F.gelu(src1(xr)))
        (want * probe).sum().backward()
        got = row(F.gelu(col(xt)))
        (got * probe).sum().backward()
        check(f"{name}/out", got, want)
        check(f"{name}/grad_x", xt.grad, xr.grad)
        check(f"{name}/col_grad_w", col.weight.grad, g.piece(src1.weight.grad, col_dim))
        check(f"{name}/col_grad_b", col.bias.grad, g.piece(src1.bias.grad, 0))
        check(f"{name}/row_grad_w", row.weight.grad, g.piece(src2.weight.grad, row_dim))
        check(f"{name}/row_grad_b", row.bias.grad, src2.bias.grad)

    emb = nn.Embedding(3 * g.size, 4, padding_idx=1)
    layer = VocabParallelEmbedding.from_embedding(emb, group=g.group)
    ids = torch.randint(0, 3 * g.size, (5, 2), generator=torch.Generator().manual_seed(75))
    check("from_embedding/weight", layer.weight, g.piece(emb.weight, 0), exact=True)
    check("from_embedding/out", layer(ids), emb(ids))


def run_errors(g: Group) -> None:
    w = g.size
    error("column_not_divisible", lambda: ColumnParallelLinear(7, 2 * w + 1))
    error("column_stride_not_divisible", lambda: ColumnParallelLinear(7, 3 * w, stride=2))
    error("row_not_divisible", lambda: RowParallelLinear(w + 1, 7))
    error("embedding_not_divisible", lambda: VocabParallelEmbedding(3 * w + 1, 4))
    error("from_linear_not_divisible", lambda: ColumnParallelLinear.from_linear(nn.Linear(4, w + 1)))
    error("scatter_not_divisible", lambda: scatter_to_tensor_group(torch.zeros(3, w + 1)))
    error("seq_not_divisible", lambda: reduce_scatter_to_sequence_parallel_region(torch.zeros(w + 1, 3)))
    error("row_input_size", lambda: RowParallelLinear(2 * w, 3, input_is_parallel=True)(torch.zeros(2, 2 * w)))
    error("embedding_id_out_of_range", lambda: VocabParallelEmbedding(2 * w, 3)(torch.tensor([0, 2 * w])))
    error(
        "cross_entropy_target_out_of_range",
        lambda: vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.tensor([0, 3 * w])),
    )


class MPU:
    """A hand-written Megatron-style mpu: only what the layers ask for."""

    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group


if __name__ == "__main__":
    init_distributed(timeout_s=120)
    world = dist.get_world_size()
    whole = Group()
    run_mappings(whole, world)
    run_column(whole)
    run_row(whole)
    run_embedding(whole)
    run_mlp(whole)
    run_sequence_parallel(whole)
    run_cross_entropy(whole)
    run_from_layers(whole)
    run_errors(whole)
    if world == 4:  # two tensor groups of 2 ranks: {0, 1} and {2, 3}; every rank builds both
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = groups[dist.get_rank() // 2]
        run_mlp(Group(mine), "/group")
        set_current(MPU(mine))  # the layers find the group through the current mpu
        run_mlp(Group(mine), "/mpu", explicit=False)
        set_current(None)
    torch.save({"pairs": PAIRS, "errors": ERRORS}, f"{sys.argv[1]}.rank{dist.get_rank()}.pt")
    dist.destroy_process_group()
