"""Megatron-style tensor-parallel layers: ColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding (Megatron-LM's
``tensor_parallel/layers.py``; names and argument order kept).

Rank r of the tensor group holds the r-th contiguous chunk of the split dim
(with ``stride`` s > 1, Megatron's fused-QKV layout: chunks r, r + tp, ...
of size n / (tp s)). Every split param is marked with
:func:`~fastzero.parallel.mark_tensor_parallel` (``partition_dim``,
``partition_stride``), which is what the engine and checkpoints read.

Initialisation: each rank initialises the *full* weight from the RNG, the
same draws in the same order as ``nn.Linear`` / ``nn.Embedding`` (or as
``init_method`` when one is given; the bias is then zero, as Megatron's), and
keeps its slice. So a tensor-parallel model built after
``torch.manual_seed(s)`` holds exactly the pieces of the unsharded model
built after the same seed. ``from_linear`` / ``from_embedding`` slice an
existing layer instead (what AutoTP uses); they take Hugging Face's
``Conv1D`` too (GPT-2; weight ``[in, out]``), whose layout the parallel
layer keeps (``transposed=True``): its weight is the matching slice of the
Conv1D weight, so consolidating the slices gives the Conv1D weight back.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastzero.parallel.groups import group_rank, group_size, mark_tensor_parallel, tensor_group
from fastzero.parallel.mappings import (
    _dim,
    _gather,
    _reduce_scatter,
    copy_to_tensor_group,
    gather_from_tensor_group,
    reduce_from_tensor_group,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_group,
)
from fastzero.parallel.sequence_parallel import mark_sequence_parallel

InitMethod = Callable[[Tensor], object]


class _GroupRef:
    """Holds a process group for a module: a ProcessGroup cannot be deep-copied,
    so copies of the module share the group (as they must: same ranks)."""

    __slots__ = ("group",)

    def __init__(self, group) -> None:
        self.group = group

    def __deepcopy__(self, memo) -> _GroupRef:
        return self


class _KeepsMarks(nn.Module):
    """nn.Parameter's deepcopy drops Python attributes; these layers' copies
    keep their params' marks (partition_dim, sequence_parallel, ...)."""

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        for name, p in self._parameters.items():
            if p is not None:
                new._parameters[name].__dict__.update(p.__dict__)
        return new


def _divide(size: int, world: int, stride: int, layer: str, name: str) -> int:
    if size % (world * stride):
        by = f"{world} (the tensor-parallel size)" + (f" x stride {stride}" if stride > 1 else "")
        raise ValueError(
            f"{layer}: {name}={size} is not divisible by {by}; make {name} a multiple of {world * stride} "
            "or use a tensor-parallel size that divides it"
        )
    return size // world


def _shard(full: Tensor, dim: int, world: int, rank: int, stride: int = 1) -> Tensor:
    """This rank's piece of `full` along `dim`, as a new tensor (`full` can be freed)."""
    per = full.shape[dim] // (world * stride)
    return torch.cat(torch.split(full, per, dim=dim)[rank::world], dim=dim)


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (transformers.pytorch_utils), found by shape, not import: weight [nx, nf]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def _linear_source(linear: nn.Module, layer: str) -> tuple[Tensor, Tensor | None, bool]:
    """(weight, bias, transposed) of an nn.Linear ([out, in]) or a Conv1D ([in, out])."""
    if isinstance(linear, nn.Linear):
        weight, transposed = linear.weight, False
        shape = (linear.out_features, linear.in_features)
    elif _is_conv1d(linear):
        weight, transposed = linear.weight, True
        shape = (weight.shape[0], linear.nf) if weight.dim() == 2 else None
    else:
        raise TypeError(f"{layer}.from_linear takes an nn.Linear or a Hugging Face Conv1D, not {type(linear).__name__}")
    if shape is None or tuple(weight.shape) != shape:
        raise ValueError(
            f"{layer}.from_linear: the {type(linear).__name__}'s weight has shape {tuple(weight.shape)}, not "
            f"{shape}: a partitioned (ZeRO-3) or meta param? Build the parallel layers before fastzero.initialize, "
            "or inside fastzero.zero.GatheredParameters"
        )
    if weight.is_meta:
        raise ValueError(f"{layer}.from_linear: the weight is on the meta device; materialise it first")
    return weight, linear.bias, transposed


class _LinearWithGatheredInput(torch.autograd.Function):
    """F.linear(all_gather(x, seq_dim), weight, bias), Megatron's sequence-parallel
    column matmul. The gathered input is not saved for backward (it is tp times
    the local one): backward gathers it again, overlapped with the input-grad
    matmul, and reduce-scatters the input grad, overlapped with the weight-grad one."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, dim):
        ctx.group, ctx.dim, ctx.has_bias = group, dim, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x, dim, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # under autocast the forward's matmul ran in another dtype than the saved tensors': compute in the grad's
        w = weight.to(grad.dtype)
        grad_x = grad_w = grad_b = None
        if need_w:
            gather_work, gathered = _gather(x, ctx.dim, ctx.group, async_op=True)
        if need_x:
            grad_total = grad.matmul(w)
        if need_w:
            gather_work.wait()
            total = gathered().to(grad.dtype)
        if need_x:
            what = "ColumnParallelLinear(sequence_parallel=True) backward"
            rs_work, scattered = _reduce_scatter(grad_total, ctx.dim, ctx.group, what, async_op=True)
        flat = grad.reshape(-1, grad.shape[-1])
        if need_w:
            grad_w = flat.t().matmul(total.reshape(-1, total.shape[-1])).to(weight.dtype)
        if need_b and ctx.has_bias:
            grad_b = flat.sum(0).to(ctx.bias_dtype)
        if need_x:
            rs_work.wait()
            grad_x = scattered().to(x.dtype)
        return grad_x, grad_w, grad_b, None, None


class _ParallelLinear(_KeepsMarks):
    """What the column and row layers share: the group, the layout, the init."""

    _name = ""
    split_dim_of_linear = 0  # dim of the [out, in] weight that is split

    def _configure(
        self,
        input_size: int,
        output_size: int,
        stride: int,
        skip_bias_add: bool,
        sequence_parallel: bool,
        seq_dim: int,
        transposed: bool,
        group,
        topology,
        mpu,
    ) -> None:
        self._group_ref = _GroupRef(tensor_group(group, topology=topology, mpu=mpu))
        self.world_size, self.rank = group_size(self.group), group_rank(self.group)
        self.input_size, self.output_size = input_size, output_size
        if stride < 1:
            raise ValueError(f"{self._name}: stride must be at least 1, got {stride}")
        self.stride, self.skip_bias_add = stride, skip_bias_add
        self.sequence_parallel, self.seq_dim, self.transposed = sequence_parallel, seq_dim, transposed
        self.master_weight = None

    @property
    def group(self):
        return self._group_ref.group

    @property
    def partition_dim(self) -> int:
        """The dim of the stored weight that is split (the layout flips it for Conv1D's [in, out])."""
        return 1 - self.split_dim_of_linear if self.transposed else self.split_dim_of_linear

    def _linear_weight(self) -> Tensor:
        return self.weight.t() if self.transposed else self.weight

    def _full_init(self, bias: bool, init_method: InitMethod | None, dtype, device) -> tuple[Tensor, Tensor | None]:
        """The unsharded weight and bias, drawn as nn.Linear (or HF Conv1D, when transposed) draws them."""
        shape = (self.input_size, self.output_size) if self.transposed else (self.output_size, self.input_size)
        weight = torch.empty(shape, dtype=dtype, device=device)
        full_bias = torch.empty(self.output_size, dtype=dtype, device=device) if bias else None
        with torch.no_grad():
            if init_method is not None:
                init_method(weight)
                if full_bias is not None:
                    full_bias.zero_()
            elif self.transposed:  # transformers' Conv1D.__init__
                nn.init.normal_(weight, std=0.02)
                if full_bias is not None:
                    full_bias.zero_()
            else:  # nn.Linear.reset_parameters
                nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
                if full_bias is not None:
                    bound = 1 / math.sqrt(self.input_size) if self.input_size > 0 else 0
                    nn.init.uniform_(full_bias, -bound, bound)
        return weight, full_bias

    def _take(
        self, weight: Tensor, bias: Tensor | None, split_bias: bool, weight_grad: bool = True, bias_grad: bool = True
    ) -> None:
        """Keeps this rank's slices of the full `weight` (and `bias`) as params."""
        with torch.no_grad():
            w = _shard(weight, self.partition_dim, self.world_size, self.rank, self.stride)
            self.weight = nn.Parameter(w, requires_grad=weight_grad)
            mark_tensor_parallel(self.weight, self.partition_dim, self.stride)
            if bias is None:
                self.register_parameter("bias", None)
                return
            if split_bias:
                b = _shard(bias, 0, self.world_size, self.rank, self.stride)
                self.bias = nn.Parameter(b, requires_grad=bias_grad)
                mark_tensor_parallel(self.bias, 0, self.stride)
            else:
                self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias_grad)

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, bias={self.bias is not None}, "
            f"tp={self.world_size}, rank={self.rank}, stride={self.stride}, transposed={self.transposed}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A split along its output dim: rank r holds
    ``weight [out/tp, in]`` and ``bias [out/tp]``. The input is whole on every
    rank (its grad is all-reduced); with ``gather_output`` the output is
    all-gathered along the last dim, else it stays split (for a
    :class:`RowParallelLinear` with ``input_is_parallel=True``).

    ``sequence_parallel=True``: the input is this rank's chunk of the
    sequence (dim ``seq_dim``) and is all-gathered before the matmul; the
    input grad is reduce-scattered back. Needs ``gather_output=False``.

    Returns the output; with ``skip_bias_add=True``, ``(output, bias)``
    without adding the bias (Megatron returns that pair always; here the plain
    tensor keeps the layer a drop-in for ``nn.Linear``).
    """

    _name = "ColumnParallelLinear"
    split_dim_of_linear = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        init_method: InitMethod | None = None,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        *,
        seq_dim: int = 0,
        transposed: bool = False,
        group=None,
        topology=None,
        mpu=None,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> None:
        super().__init__()
        self._configure(
            input_size, output_size, stride, skip_bias_add, sequence_parallel, seq_dim, transposed, group, topology, mpu
        )
        self._set_gather_output(gather_output)
        self.output_size_per_partition = _divide(output_size, self.world_size, stride, self._name, "output_size")
        weight, full_bias = self._full_init(bias, init_method, dtype, device)
        self._take(weight, full_bias, split_bias=True)
        if keep_master_weight_for_test:
            self.master_weight = weight

    def _set_gather_output(self, gather_output: bool) -> None:
        if self.sequence_parallel and gather_output:
            raise ValueError(
                "ColumnParallelLinear: sequence_parallel=True needs gather_output=False (the output stays split "
                "along the hidden dim for a RowParallelLinear with input_is_parallel=True)"
            )
        self.gather_output = gather_output

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        gather_output: bool = True,
        *,
        stride: int = 1,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        group=None,
        topology=None,
        mpu=None,
    ) -> ColumnParallelLinear:
        """This rank's column slice of an existing ``nn.Linear`` or HF ``Conv1D``
        (copied: the source can be freed); dtype, device and requires_grad kept."""
        weight, bias, transposed = _linear_source(linear, cls._name)
        out_size, in_size = (weight.shape[1], weight.shape[0]) if transposed else weight.shape
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._configure(
            in_size, out_size, stride, skip_bias_add, sequence_parallel, seq_dim, transposed, group, topology, mpu
        )
        layer._set_gather_output(gather_output)
        layer.output_size_per_partition = _divide(out_size, layer.world_size, stride, cls._name, "output_size")
        layer._take(weight.detach(), bias, True, weight.requires_grad, bias is not None and bias.requires_grad)
        return layer

    def forward(self, x: Tensor):
        if x.shape[-1] != self.input_size:
            raise ValueError(
                f"ColumnParallelLinear: input has {x.shape[-1]} features in its last dim, expected "
                f"input_size={self.input_size}"
            )
        weight = self._linear_weight()
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel and self.world_size > 1:
            out = _LinearWithGatheredInput.apply(x, weight, bias, self.group, _dim(x, self.seq_dim))
        else:
            out = F.linear(copy_to_tensor_group(x, self.group), weight, bias)
        if self.gather_output:
            out = gather_from_tensor_group(out, self.group)
        return (out, self.bias) if self.skip_bias_add else out


class RowParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A split along its input dim: rank r holds
    ``weight [out, in/tp]``; the partial products are all-reduced and the
    *full* ``bias [out]`` is added once after the reduction (its grad is the
    full grad on every rank). The input is split along its last dim: already
    (``input_is_parallel=True``, the output of a :class:`ColumnParallelLinear`
    with ``gather_output=False``) or here.

    ``sequence_parallel=True``: the partial products are reduce-scattered
    along the sequence (dim ``seq_dim``) instead of all-reduced, so each rank
    gets its chunk of the sequence; needs ``input_is_parallel=True``. The
    bias is then added to a chunk of the sequence, so its grad is partial: it
    is marked ``sequence_parallel`` for
    :func:`~fastzero.parallel.allreduce_sequence_parallel_grads`.

    Returns as :class:`ColumnParallelLinear`.
    """

    _name = "RowParallelLinear"
    split_dim_of_linear = 1

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod | None = None,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        *,
        seq_dim: int = 0,
        transposed: bool = False,
        group=None,
        topology=None,
        mpu=None,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> None:
        super().__init__()
        self._configure(
            input_size, output_size, stride, skip_bias_add, sequence_parallel, seq_dim, transposed, group, topology, mpu
        )
        self._set_input_is_parallel(input_is_parallel)
        self.input_size_per_partition = _divide(input_size, self.world_size, stride, self._name, "input_size")
        weight, full_bias = self._full_init(bias, init_method, dtype, device)
        self._take(weight, full_bias, split_bias=False)
        self._mark_bias()
        if keep_master_weight_for_test:
            self.master_weight = weight

    def _set_input_is_parallel(self, input_is_parallel: bool) -> None:
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (the input is the split "
                "output of a ColumnParallelLinear with gather_output=False)"
            )
        self.input_is_parallel = input_is_parallel

    def _mark_bias(self) -> None:
        if self.sequence_parallel and self.bias is not None:
            mark_sequence_parallel(self.bias)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        input_is_parallel: bool = False,
        *,
        stride: int = 1,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        group=None,
        topology=None,
        mpu=None,
    ) -> RowParallelLinear:
        """This rank's row slice of an existing ``nn.Linear`` or HF ``Conv1D``
        (the bias copied whole); dtype, device and requires_grad kept."""
        weight, bias, transposed = _linear_source(linear, cls._name)
        out_size, in_size = (weight.shape[1], weight.shape[0]) if transposed else weight.shape
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._configure(
            in_size, out_size, stride, skip_bias_add, sequence_parallel, seq_dim, transposed, group, topology, mpu
        )
        layer._set_input_is_parallel(input_is_parallel)
        layer.input_size_per_partition = _divide(in_size, layer.world_size, stride, cls._name, "input_size")
        layer._take(weight.detach(), bias, False, weight.requires_grad, bias is not None and bias.requires_grad)
        layer._mark_bias()
        return layer

    def forward(self, x: Tensor):
        expected = self.input_size_per_partition if self.input_is_parallel else self.input_size
        if x.shape[-1] != expected:
            which = "input_size / tp (input_is_parallel=True)" if self.input_is_parallel else "input_size"
            raise ValueError(
                f"RowParallelLinear: input has {x.shape[-1]} features in its last dim, expected {which} = {expected}"
            )
        if not self.input_is_parallel:
            x = scatter_to_tensor_group(x, self.group)
        partial = F.linear(x, self._linear_weight())
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.group, self.seq_dim)
        else:
            out = reduce_from_tensor_group(partial, self.group)
        if self.skip_bias_add:
            return out, self.bias
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(_KeepsMarks):
    """nn.Embedding with its rows (the vocabulary) split: rank r holds rows
    ``[r V/tp, (r+1) V/tp)``. Each rank looks up the ids it owns, zeros the
    others, and the results are all-reduced (with ``sequence_parallel``,
    reduce-scattered along ``seq_dim`` of the output instead).
    ``padding_idx`` as nn.Embedding's: that row starts at zero and gets no grad.
    Ids outside ``[0, num_embeddings)`` raise (every rank would mask them)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        init_method: InitMethod | None = None,
        sequence_parallel: bool = False,
        *,
        seq_dim: int = 0,
        group=None,
        topology=None,
        mpu=None,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> None:
        super().__init__()
        self._configure(num_embeddings, embedding_dim, padding_idx, sequence_parallel, seq_dim, group, topology, mpu)
        weight = torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device)
        with torch.no_grad():
            if init_method is None:  # nn.Embedding.reset_parameters
                nn.init.normal_(weight)
            else:
                init_method(weight)
            if self.padding_idx is not None:
                weight[self.padding_idx].zero_()
        self._take(weight, requires_grad=True)

    def _configure(self, num_embeddings, embedding_dim, padding_idx, sequence_parallel, seq_dim, group, topology, mpu):
        self._group_ref = _GroupRef(tensor_group(group, topology=topology, mpu=mpu))
        self.world_size, self.rank = group_size(self.group), group_rank(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per = num_embeddings // self.world_size
        if num_embeddings % self.world_size:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings={num_embeddings} is not divisible by the tensor-parallel "
                f"size {self.world_size}; pad the vocabulary to a multiple of {self.world_size} (Megatron's "
                "make-vocab-size-divisible-by) or use a tensor-parallel size that divides it"
            )
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"VocabParallelEmbedding: padding_idx={padding_idx} is outside the vocabulary of {num_embeddings}"
                )
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.num_embeddings_per_partition = per
        self.vocab_start_index, self.vocab_end_index = self.rank * per, (self.rank + 1) * per
        owned = padding_idx is not None and self.vocab_start_index <= padding_idx < self.vocab_end_index
        self._local_padding_idx = padding_idx - self.vocab_start_index if owned else None
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim

    @property
    def group(self):
        return self._group_ref.group

    def _take(self, weight: Tensor, requires_grad: bool) -> None:
        with torch.no_grad():
            self.weight = nn.Parameter(_shard(weight, 0, self.world_size, self.rank), requires_grad=requires_grad)
        mark_tensor_parallel(self.weight, 0)

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        sequence_parallel: bool = False,
        *,
        seq_dim: int = 0,
        group=None,
        topology=None,
        mpu=None,
    ) -> VocabParallelEmbedding:
        """This rank's rows of an existing ``nn.Embedding`` (copied); dtype, device, padding_idx kept."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(
                f"VocabParallelEmbedding.from_embedding takes an nn.Embedding, not {type(embedding).__name__}"
            )
        unsupported = [
            name
            for name, on in (
                ("max_norm", embedding.max_norm is not None),
                ("scale_grad_by_freq", embedding.scale_grad_by_freq),
                ("sparse", embedding.sparse),
            )
            if on
        ]
        if unsupported:
            raise ValueError(
                f"VocabParallelEmbedding.from_embedding: {', '.join(unsupported)} is not supported across a split "
                "vocabulary; build the nn.Embedding without it"
            )
        weight = embedding.weight
        if tuple(weight.shape) != (embedding.num_embeddings, embedding.embedding_dim):
            raise ValueError(
                f"VocabParallelEmbedding.from_embedding: the weight has shape {tuple(weight.shape)}, not "
                f"{(embedding.num_embeddings, embedding.embedding_dim)}: a partitioned (ZeRO-3) param? Build the "
                "parallel layers before fastzero.initialize, or inside fastzero.zero.GatheredParameters"
            )
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._configure(
            embedding.num_embeddings,
            embedding.embedding_dim,
            embedding.padding_idx,
            sequence_parallel,
            seq_dim,
            group,
            topology,
            mpu,
        )
        layer._take(weight.detach(), requires_grad=weight.requires_grad)
        return layer

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"VocabParallelEmbedding: ids must be int64 or int32, not {ids.dtype}")
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if bool(bad.any()):
            raise ValueError(
                f"VocabParallelEmbedding: ids must lie in [0, {self.num_embeddings}), got {int(ids[bad][0])}"
            )
        if self.world_size == 1:
            return F.embedding(ids, self.weight, self._local_padding_idx)
        foreign = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(foreign, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx).masked_fill(foreign.unsqueeze(-1), 0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group, self.seq_dim)
        return reduce_from_tensor_group(out, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, tp={self.world_size}, "
            f"rank={self.rank}, rows=[{self.vocab_start_index}, {self.vocab_end_index}), "
            f"sequence_parallel={self.sequence_parallel}"
        )
