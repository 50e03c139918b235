"""Tensor-parallel layers, their autograd functions, sequence parallelism and
vocab_parallel_cross_entropy: as 2 and 4 Gloo processes against the
unsharded PyTorch layers (every output and grad, every element), and in one
process (tensor-parallel size 1, bad input)."""

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastzero.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_to_tensor_group,
    gather_from_sequence_parallel_region,
    gather_from_tensor_group,
    is_sequence_parallel,
    is_tensor_parallel,
    reduce_from_tensor_group,
    reduce_scatter_to_sequence_parallel_region,
    register_sequence_parallel_grad_hooks,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_group,
    vocab_parallel_cross_entropy,
)
from tests.dist import run_ranks
from tests.paths import WORKERS
from tests.workers.tp_layers import Conv1D

WORKER = WORKERS / "tp_layers.py"


def required(world: int) -> set[str]:
    """Cases the worker must have run (a case it skips fails the test)."""
    names = set()
    for bias in (True, False):
        for flag in (True, False):
            col, row = f"column/bias={bias}/gather={flag}", f"row/bias={bias}/input_is_parallel={flag}"
            names |= {f"{col}/{k}" for k in ("out", "grad_x", "grad_w", "init_weight")}
            names |= {f"{row}/{k}" for k in ("out", "grad_x", "grad_w", "init_weight")}
            if bias:
                names |= {f"{col}/grad_b", f"{row}/grad_b"}
    for padding in ("None", str(5 * world - 2)):
        for sp in (False, True):
            names |= {f"embedding/padding={padding}/sequence_parallel={sp}/{k}" for k in ("init", "out", "grad_w")}
    grads = ("out", "grad_x", "col_grad_w", "col_grad_b", "row_grad_w", "row_grad_b")
    for mlp in ["mlp", "from_linear", "from_conv1d"] + (["mlp/group", "mlp/mpu"] if world == 4 else []):
        names |= {f"{mlp}/{k}" for k in grads}
    for dim in (0, 1):
        names |= {f"sequence_parallel/seq_dim={dim}/{k}" for k in (*grads, "ln_grad_w", "ln_grad_b", "summed")}
    names |= {f"sequence_parallel/seq_dim=0/hooks/{k}" for k in (*grads, "ln_grad_w", "ln_grad_b", "hooked")}
    names |= {f"sequence_parallel/autocast/{k}" for k in ("out", "grad_x", "grad_w", "grad_b")}
    for ignore in (-100, 3):
        for smoothing in (0.0, 0.1):
            for reduction in ("mean", "sum", "none"):
                names |= {
                    f"cross_entropy/ignore={ignore}/smoothing={smoothing}/{reduction}/{k}" for k in ("loss", "grad")
                }
    names |= {"cross_entropy/bf16/loss", "cross_entropy/bf16/grad", "cross_entropy/all_ignored"}
    for fn in ("copy_to", "reduce_from", "scatter_to", "gather_from"):
        names |= {f"{fn}/{dtype}/{d}" for dtype in ("float32", "bfloat16", "float16") for d in ("fwd", "bwd")}
    for how in ("native", "fallback"):
        for dim in (0, 1, -1):
            names |= {f"reduce_scatter_seq/seq{dim}/float32/{how}/{d}" for d in ("fwd", "bwd", "input_kept")}
            names |= {f"gather_seq/seq{dim}/bfloat16/{how}/tp_grad={t}/bwd" for t in (True, False)}
    return names


ERRORS = {
    "column_not_divisible": r"ValueError: ColumnParallelLinear: output_size=\d+ is not divisible by \d+ .*multiple of",
    "column_stride_not_divisible": r"ValueError: .*output_size=\d+ is not divisible by \d+ .* x stride 2; .*multiple",
    "row_not_divisible": r"ValueError: RowParallelLinear: input_size=\d+ is not divisible by \d+ .*multiple of",
    "embedding_not_divisible": r"ValueError: VocabParallelEmbedding: num_embeddings=\d+ .*pad the vocabulary",
    "from_linear_not_divisible": r"ValueError: ColumnParallelLinear: output_size=\d+ is not divisible",
    "scatter_not_divisible": r"ValueError: scatter_to_tensor_group: dim 1 .* not divisible .*multiple of",
    "seq_not_divisible": r"ValueError: reduce_scatter_to_sequence_parallel_region: dim 0 .* not divisible",
    "row_input_size": r"ValueError: RowParallelLinear: input has \d+ features .*input_is_parallel=True",
    "embedding_id_out_of_range": r"ValueError: VocabParallelEmbedding: ids must lie in \[0, \d+\)",
    "cross_entropy_target_out_of_range": r"ValueError: vocab_parallel_cross_entropy: target \d+ is outside",
}


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_equal_the_unsharded_ones(tmp_path, world):
    run_ranks(WORKER, world, [tmp_path / "out"], timeout=600)
    names = None
    for rank in range(world):
        res = torch.load(tmp_path / f"out.rank{rank}.pt")
        pairs = res["pairs"]
        names = names or set(pairs)
        assert set(pairs) == names, f"rank {rank} ran other cases"
        missing = required(world) - names
        assert not missing, sorted(missing)
        for name, (got, want, exact, atol) in pairs.items():
            assert got.dtype == want.dtype and got.shape == want.shape, (rank, name, got.shape, want.shape)
            if exact:
                assert torch.equal(got, want), (rank, name)
            elif atol is not None:  # bf16 under autocast: a bound the worker states with its reason
                torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m, n=name, r=rank: f"{r} {n}: {m}")
            else:  # fp32: torch.testing's default tolerances, NaN where PyTorch gives NaN
                torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m, n=name, r=rank: f"{r} {n}: {m}")
        assert set(res["errors"]) == set(ERRORS)
        for name, pattern in ERRORS.items():
            assert re.search(pattern, res["errors"][name]), (name, res["errors"][name])


def test_one_rank_is_a_no_op():
    x = torch.randn(4, 6)
    for fn in (copy_to_tensor_group, reduce_from_tensor_group, scatter_to_tensor_group, gather_from_tensor_group):
        assert fn(x) is x
    for fn in (scatter_to_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region):
        assert fn(x, seq_dim=1) is x
    assert gather_from_sequence_parallel_region(x, False) is x


def test_one_rank_layers_are_the_torch_layers():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(11, 6, padding_idx=2), nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 6))
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(11, 6, padding_idx=2)
    col, row = ColumnParallelLinear(6, 5), RowParallelLinear(5, 6)
    for (name, p), q in zip(ref.named_parameters(), [emb.weight, col.weight, col.bias, row.weight, row.bias]):
        assert torch.equal(p, q), name
    assert is_tensor_parallel(col.weight) and is_tensor_parallel(col.bias) and not is_tensor_parallel(row.bias)
    ids = torch.randint(0, 11, (3, 4))
    ids[0, 0] = 2
    want = ref(ids)
    got = row(F.gelu(col(emb(ids))))
    torch.testing.assert_close(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), [emb.weight, col.weight, col.bias, row.weight, row.bias]):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert emb.weight.grad[2].abs().sum() == 0  # padding_idx gets no grad


def test_from_linear_takes_transformers_conv1d():
    """The worker's Conv1D stand-in is transformers' Conv1D (same init draws,
    layout and forward), and from_linear keeps its [in, out] layout."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")  # in the test extra
    torch.manual_seed(3)
    theirs = pytorch_utils.Conv1D(8, 5)
    torch.manual_seed(3)
    ours = Conv1D(8, 5)
    x = torch.randn(2, 3, 5)
    assert torch.equal(theirs.weight, ours.weight) and torch.equal(theirs(x), ours(x))
    col = ColumnParallelLinear.from_linear(theirs)
    row = RowParallelLinear.from_linear(theirs)
    for layer in (col, row):
        assert layer.transposed and layer.weight.shape == (5, 8) and torch.equal(layer.weight, theirs.weight)
        torch.testing.assert_close(layer(x), theirs(x))
    assert col.weight.partition_dim == 1 and row.weight.partition_dim == 0


def test_sequence_parallel_grads_are_left_alone_on_one_rank():
    ln = nn.LayerNorm(4)
    ln(torch.randn(2, 4)).sum().backward()
    before = ln.weight.grad.clone()
    assert allreduce_sequence_parallel_grads(ln) == 0  # nothing marked
    row = RowParallelLinear(4, 3, input_is_parallel=True, sequence_parallel=True)
    row(torch.randn(2, 4)).sum().backward()
    assert allreduce_sequence_parallel_grads([ln, row]) == 1  # the row layer's bias
    assert torch.equal(ln.weight.grad, before)
    assert register_sequence_parallel_grad_hooks(row) == []  # one rank: nothing to sum


def test_copies_share_the_group():
    layer = ColumnParallelLinear(4, 6)
    twin = copy.deepcopy(layer)
    assert twin.group is layer.group and torch.equal(twin.weight, layer.weight)
    assert twin.weight.partition_dim == 0  # nn.Parameter's own deepcopy would drop the marks
    row = copy.deepcopy(RowParallelLinear(4, 6, input_is_parallel=True, sequence_parallel=True))
    assert row.weight.partition_dim == 1 and is_sequence_parallel(row.bias)


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="sequence_parallel=True needs gather_output=False"):
        ColumnParallelLinear(4, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear(4, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match="stride must be at least 1"):
        ColumnParallelLinear(4, 4, stride=0)
    with pytest.raises(TypeError, match="takes an nn.Linear or a Hugging Face Conv1D, not Conv2d"):
        ColumnParallelLinear.from_linear(nn.Conv2d(2, 2, 1))
    partitioned = nn.Linear(4, 4)
    partitioned.weight.data = torch.empty(0)  # what a ZeRO-3 partitioned param looks like
    with pytest.raises(ValueError, match=r"GatheredParameters"):
        RowParallelLinear.from_linear(partitioned)
    with pytest.raises(ValueError, match="max_norm is not supported"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(4, 2, max_norm=1.0))
    with pytest.raises(ValueError, match="padding_idx=9 is outside"):
        VocabParallelEmbedding(4, 2, padding_idx=9)
    with pytest.raises(TypeError, match="ids must be int64 or int32"):
        VocabParallelEmbedding(4, 2)(torch.zeros(3))
    with pytest.raises(ValueError, match="ids must lie in"):
        VocabParallelEmbedding(4, 2)(torch.tensor([-1]))
    with pytest.raises(ValueError, match="input has 3 features in its last dim, expected input_size=4"):
        ColumnParallelLinear(4, 2)(torch.zeros(2, 3))
    logits, target = torch.randn(3, 5), torch.tensor([0, 1, 4])
    with pytest.raises(ValueError, match="reduction must be"):
        vocab_parallel_cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must lie in"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"without the last \(vocabulary\) dim"):
        vocab_parallel_cross_entropy(logits, target[:2])
    with pytest.raises(TypeError, match="target must hold int64"):
        vocab_parallel_cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match=r"target 5 is outside the vocabulary \[0, 5\)"):
        vocab_parallel_cross_entropy(logits, torch.tensor([0, 5, -100]))
    z = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(z, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_cross_entropy_is_torch(dtype):
    """Tensor-parallel size 1 (the math without collectives): loss and grads as
    F.cross_entropy's, in the logits' dtype."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 3, 11, generator=gen) * 4).to(dtype)
    target = torch.randint(0, 11, (6, 3), generator=gen)
    target[0] = -100
    za, zb = logits.clone().requires_grad_(), logits.float().requires_grad_()
    got = vocab_parallel_cross_entropy(za, target, label_smoothing=0.2)
    want = F.cross_entropy(zb.reshape(-1, 11), target.reshape(-1), label_smoothing=0.2)
    got.backward()
    want.backward()
    assert got.dtype == dtype and za.grad.dtype == dtype
    torch.testing.assert_close(got, want.to(dtype))
    torch.testing.assert_close(za.grad, zb.grad.to(dtype))
