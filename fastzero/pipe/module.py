"""A model cut into pipeline stages: DeepSpeed's ``PipelineModule``,
``LayerSpec`` and ``TiedLayerSpec`` (``deepspeed/runtime/pipe/module.py``,
DeepSpeed 0.16), plus virtual stages (v chunks per rank, for the
interleaved schedule).

The model is a list of layers whose forward is ``x = layer(x)`` in order.
The list is cut into ``p * v`` contiguous parts (p = pipeline stages, v =
virtual stages); rank s of the pipe axis owns parts s, s + p, s + 2p, ...
as its chunks 0, 1, ..., v - 1. Only the owning rank builds a
:class:`LayerSpec`; the others never instantiate it (the ``parameters``
partition counts parameters on the meta device). Built layers are
registered under their global layer index, so ``state_dict`` names do not
depend on the layout: layer 7's weight is ``7.weight`` at any p and v, and
the union over stages is the unpipelined model's ``state_dict``.

Differences from DeepSpeed: the forward does not reseed the generators per
layer and micro-batch when ``seed_layers`` is set (``seed_layers`` seeds
each layer's construction only); ``partition_method`` also takes an explicit
list of boundaries; a part left without layers is an error.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastzero.parallel.checkpointing import checkpoint, non_reentrant_checkpoint
from fastzero.parallel.groups import current, set_current
from fastzero.parallel.topology import PipeModelDataParallelTopology, ProcessTopology, Topology
from fastzero.pipe.partition import partition_balanced, partition_uniform

__all__ = ["LayerSpec", "PipelineChunk", "PipelineModule", "TiedLayerSpec"]

_PARTITION_METHODS = "'parameters', 'uniform', 'type:REGEX' or a list of boundaries"


def _call_repr(name: str, args: Sequence, kwargs: dict) -> str:
    inner = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(inner)})"


class LayerSpec:
    """A layer to build later, on the stage that owns it:
    ``LayerSpec(nn.Linear, 8, 8, bias=False)`` stands for
    ``nn.Linear(8, 8, bias=False)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(
                f"LayerSpec({typename!r}, ...): the first argument must be an nn.Module subclass "
                "(pass a function or a built module to PipelineModule's layers directly)"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        return _call_repr(self.typename.__name__, self.module_args, self.module_kwargs)

    def build(self, log: bool = False) -> nn.Module:
        """Builds the layer (`log`: DeepSpeed's argument, prints what is built)."""
        if log:
            print(f"building {self!r}")
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every TiedLayerSpec with the same
    `key`: built once per stage that uses it, its `tied_weight_attr`
    weights kept identical across those stages and their gradients summed
    (:meth:`PipelineModule.allreduce_tied_grads`). ``forward_fn(module,
    x)``, when given, replaces ``module(x)`` for this occurrence (an
    embedding reused as the output head)."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"TiedLayerSpec key {key!r}: give a non-empty string without '.' (a module name)")
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"TiedLayerSpec {key!r}: forward_fn must be callable as forward_fn(module, x)")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not self.tied_weight_attr or not all(isinstance(a, str) for a in self.tied_weight_attr):
            raise ValueError(f"TiedLayerSpec {key!r}: tied_weight_attr must be a name or a list of names")


def _layer_name(layer: Any) -> str | None:
    """The class name DeepSpeed matches ``type:REGEX`` against."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return layer.__class__.__name__
    return getattr(layer, "__name__", None)


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _set_seed(seed: int) -> None:
    """DeepSpeed's ``set_random_seed``: Python's, numpy's and torch's generators."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional; torch's generator is what layers draw from
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)


def _get_attr(module: nn.Module, name: str) -> torch.Tensor:
    """``module.a.b`` for the name ``"a.b"`` (DeepSpeed's ``_recursive_getattr``)."""
    out = module
    for part in name.split("."):
        out = getattr(out, part)
    return out


def _on_backend(tensor: torch.Tensor, group) -> torch.Tensor:
    """`tensor`, or a CUDA copy of it where the group's backend is NCCL (which takes CUDA tensors only)."""
    if dist.get_backend(group) == "nccl" and not tensor.is_cuda:
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor


class PipelineChunk(nn.Module):
    """One part of the model on this rank: its layers' forwards in order
    (``x = layer(x)``, tuples passed through as DeepSpeed passes them),
    with activation checkpointing every ``activation_checkpoint_interval``
    layers. The layers are registered on the :class:`PipelineModule`, not
    here: a chunk has no submodules and no ``state_dict``; its
    :meth:`named_parameters` gives its layers' parameters under their
    PipelineModule names. Attributes: ``index`` (local chunk), ``part``
    (global part), ``start``/``stop`` (global layer range)."""

    def __init__(self, owner: PipelineModule, index: int, part: int, start: int, stop: int, funcs, names) -> None:
        super().__init__()
        self.index, self.part, self.start, self.stop = index, part, start, stop
        self.forward_funcs = list(funcs)  # a plain list: not submodules of the chunk
        self._names = list(names)  # each func's PipelineModule name (None for a function)
        # kept outside nn.Module's registry: registering the owner would make a cycle of submodules
        object.__setattr__(self, "_owner", owner)
        self._checkpointable: tuple[int, list[bool]] | None = None

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        seen = set()
        for name, func in zip(self._names, self.forward_funcs):
            module = func.args[0] if isinstance(func, partial) else func
            if name is None or not isinstance(module, nn.Module):
                continue
            for n, p in module.named_parameters(
                prefix=f"{prefix}.{name}" if prefix else name, remove_duplicate=remove_duplicate
            ):
                if remove_duplicate and id(p) in seen:
                    continue
                seen.add(id(p))
                yield n, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def _flags(self, interval: int) -> list[bool]:
        """Whether each block of `interval` layers is checkpointed (cached per interval)."""
        if self._checkpointable is None or self._checkpointable[0] != interval:
            owner = self._owner
            funcs = self.forward_funcs
            flags = [owner._is_checkpointable(funcs[s : s + interval]) for s in range(0, len(funcs), interval)]
            self._checkpointable = (interval, flags)
        return self._checkpointable[1]

    def _run(self, start: int, end: int) -> Callable:
        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs  # a single tensor travels unwrapped
            for func in self.forward_funcs[start:end]:
                x = func(x)
            return x

        return run

    def forward(self, x: Any) -> Any:
        owner = self._owner
        interval = owner.activation_checkpoint_interval
        n = len(self.forward_funcs)
        if interval == 0:
            return self._run(0, n)(x)
        for start, ckpt in zip(range(0, n, interval), self._flags(interval)):
            end = min(start + interval, n)
            if not isinstance(x, tuple):  # tensors or tuples of tensors travel, never a tuple in a tuple
                x = (x,)
            x = owner.activation_checkpoint_func(self._run(start, end), *x) if ckpt else self._run(start, end)(*x)
        return x

    def extra_repr(self) -> str:
        return f"part={self.part}, layers={self.start}..{self.stop - 1}"


class PipelineModule(nn.Module):
    """A sequence of layers cut into pipeline stages (DeepSpeed's
    constructor; ``virtual_stages`` is fastzero's: v chunks per rank for the
    interleaved schedule). Built after ``fastzero.init_distributed()`` on
    every rank (it creates process groups collectively).

    `layers`: :class:`LayerSpec` (built on its owning stage only),
    :class:`TiedLayerSpec`, built ``nn.Module`` instances (built by the
    caller on every rank; registered only on the owning stage) and plain
    functions. `num_stages` alone makes ``Topology(pipe=num_stages)`` (data
    = world / pipe); a `topology` (``Topology`` or a DeepSpeed-style one
    with the ``pipe`` axis outermost) is used as given. `partition_method`:
    ``"parameters"`` (balance trainable parameter counts), ``"uniform"``
    (balance layer counts), ``"type:REGEX"`` (balance the layers whose class
    name matches, case-insensitive) or an explicit list of ``p*v + 1``
    boundaries. Every part must hold at least one layer.

    Attributes the engine reads: ``topology``, ``num_stages``, ``stage_id``,
    ``virtual_stages``, ``chunks`` (local chunk c is global part ``stage_id
    + c * num_stages``), ``loss_fn``, ``parts``."""

    def __init__(
        self,
        layers: Iterable,
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str | Sequence[int] = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable = checkpoint,
        checkpointable_layers: Sequence[str] | None = None,
        virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, PipelineModule):
                raise TypeError(f"layers[{idx}] is a PipelineModule: nesting is not supported; pass its layers")
            if not (isinstance(layer, LayerSpec) or callable(layer)):
                raise TypeError(
                    f"layers[{idx}] = {layer!r}: give a LayerSpec, a TiedLayerSpec, an nn.Module or a function"
                )
        _check_int("virtual_stages", virtual_stages, 1)
        _check_int("activation_checkpoint_interval", activation_checkpoint_interval, 0)
        if checkpointable_layers is not None and (
            isinstance(checkpointable_layers, str) or not all(isinstance(c, str) for c in checkpointable_layers)
        ):
            raise TypeError("checkpointable_layers must be a list of layer class names (or None)")
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = None if checkpointable_layers is None else list(checkpointable_layers)
        self.virtual_stages = virtual_stages

        self.topology, self.global_rank = _resolve_topology(num_stages, topology)
        self._topo = self.topology  # DeepSpeed's name
        self.num_stages = self.topology.get_dim("pipe")
        self.stage_id = self.topology.get_coord(self.global_rank).pipe
        # the tensor-parallel layers (ColumnParallelLinear & co.) split over the current topology's tensor axis:
        # it is this one while layers are built (and again from initialize() on); the previous one after
        previous = current()
        if self.topology is not _SEQUENTIAL_TOPOLOGY:
            set_current(self.topology)
        try:
            self.parts = self._partition(partition_method)
            self.tied_modules = nn.ModuleDict()
            self.tied_weight_attrs: dict[str, list[str]] = {}
            self._check_tied_specs()
            self.chunks = [self._build_chunk(c) for c in range(virtual_stages)]  # a list: not submodules
        finally:
            set_current(previous)
        self.forward_funcs = [f for chunk in self.chunks for f in chunk.forward_funcs]
        for p in self.parameters():  # DeepSpeed's mark; _index_tied_modules sets it on tied copies
            p.ds_pipe_replicated = False
        self._tied = self._index_tied_modules()
        self._synchronize_tied_weights()

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def build_sequential(cls, layers: Iterable, **kwargs: Any) -> PipelineModule:
        """The unpipelined model: every layer built on this process alone
        (no process groups, callable on any one rank), with the same seeds
        and ``state_dict`` names as the pipelined one; for reference runs
        and for loading a consolidated checkpoint. `kwargs`: the
        constructor's, less ``num_stages``/``topology``/``virtual_stages``."""
        for name in ("num_stages", "topology", "virtual_stages"):
            if name in kwargs:
                raise TypeError(f"build_sequential() builds one stage and one chunk; leave out {name!r}")
        return cls(layers, topology=_SEQUENTIAL, **kwargs)

    def _partition(self, method: str | Sequence[int]) -> list[int]:
        n, num_parts = self._num_layers, self.num_stages * self.virtual_stages
        where = f"{self.num_stages} stages x {self.virtual_stages} virtual stages = {num_parts} parts"
        if n < num_parts:
            raise ValueError(
                f"PipelineModule: {n} layers cannot fill {where}; every part needs at least one layer: use fewer "
                "stages or virtual stages, or more layers"
            )
        if not isinstance(method, str):
            parts = [int(b) for b in method]
            if len(parts) != num_parts + 1 or parts[0] != 0 or parts[-1] != n:
                raise ValueError(
                    f"partition_method={list(method)}: give {num_parts + 1} boundaries from 0 to {n} ({where})"
                )
        else:
            lower = method.lower()
            if lower == "uniform":
                parts = partition_uniform(n, num_parts)
            elif lower == "parameters":
                parts = partition_balanced([self._count_params(i) for i in range(n)], num_parts)
            elif lower.startswith("type:"):
                regex = re.compile(method[len("type:") :], re.IGNORECASE)
                names = [_layer_name(layer) for layer in self._layer_specs]
                weights = [int(bool(name and regex.search(name))) for name in names]
                if sum(weights) < num_parts:
                    raise ValueError(
                        f"partition_method={method!r} matches {sum(weights)} of the {n} layers, fewer than the "
                        f"{where}: a part would hold none; use a regex that matches more layers or fewer stages"
                    )
                parts = partition_balanced(weights, num_parts)
            else:
                raise ValueError(f"partition_method={method!r} is not one of {_PARTITION_METHODS}")
        empty = [k for k in range(num_parts) if parts[k + 1] <= parts[k]]
        if empty:
            raise ValueError(
                f"partition {parts} leaves part(s) {empty} without layers ({where}); every part needs at least one "
                "layer: give increasing boundaries or use another partition_method"
            )
        return parts

    def _count_params(self, idx: int) -> int:
        """Trainable parameters of layer `idx`; a LayerSpec is built on the meta device (no memory, no init)."""
        layer = self._layer_specs[idx]
        if isinstance(layer, LayerSpec):
            try:
                with torch.device("meta"):
                    return _trainable(layer.build())
            except Exception as exc:
                raise ValueError(
                    f"partition_method='parameters' counts parameters by building layers[{idx}] = {layer!r} on the "
                    f"meta device, which failed ({type(exc).__name__}: {exc}); make its constructor meta-safe or "
                    "use partition_method='uniform' or 'type:REGEX'"
                ) from exc
        return _trainable(layer) if isinstance(layer, nn.Module) else 0

    def _check_tied_specs(self) -> None:
        """The specs of one key must agree on what they build and tie: each stage builds from its first one."""
        first: dict[str, TiedLayerSpec] = {}
        for idx, spec in enumerate(self._layer_specs):
            if not isinstance(spec, TiedLayerSpec):
                continue
            ref = first.setdefault(spec.key, spec)
            if spec.typename is not ref.typename or spec.tied_weight_attr != ref.tied_weight_attr:
                raise ValueError(
                    f"layers[{idx}]: TiedLayerSpec {spec.key!r} builds {spec.typename.__name__} tying "
                    f"{spec.tied_weight_attr}, but an earlier one builds {ref.typename.__name__} tying "
                    f"{ref.tied_weight_attr}; give every spec of a key the same class and tied_weight_attr"
                )

    def _build_chunk(self, index: int) -> PipelineChunk:
        part = self.stage_id + index * self.num_stages
        start, stop = self.parts[part], self.parts[part + 1]
        funcs, names = [], []
        for idx in range(start, stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                (self.seed_fn or _set_seed)(self.base_seed + idx)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
                names.append(f"tied_modules.{layer.key}")
            elif isinstance(layer, (LayerSpec, nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.add_module(str(idx), module)
                funcs.append(module)
                names.append(str(idx))
            else:  # a function: nothing to build or register
                funcs.append(layer)
                names.append(None)
        return PipelineChunk(self, index, part, start, stop, funcs, names)

    # -- tied weights -------------------------------------------------------------------------------------------
    def _index_tied_modules(self) -> dict[str, tuple[list[str], list[int], Any]]:
        """Per key: the tied param names, the ranks holding the key (for this
        rank's data/tensor coordinates) and a group over them (None for one
        rank). Every rank creates every group in the same order (keys
        sorted, then data, then tensor coordinates), as new_group requires."""
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        topo, out = self.topology, {}
        distributed = self.topology is not _SEQUENTIAL_TOPOLOGY and dist.is_available() and dist.is_initialized()
        for key in keys:
            attrs = next(s.tied_weight_attr for s in self._layer_specs if isinstance(s, TiedLayerSpec) and s.key == key)
            stages = sorted(
                {
                    self.stage_owner(i)
                    for i, s in enumerate(self._layer_specs)
                    if isinstance(s, TiedLayerSpec) and s.key == key
                }
            )
            mine = None
            for d in range(topo.get_dim("data")):
                for m in range(topo.get_dim("model")):
                    ranks = [topo.get_rank(pipe=s, data=d, model=m) for s in stages]
                    group = dist.new_group(ranks=ranks) if distributed and len(ranks) > 1 else None
                    if self.global_rank in ranks:
                        mine = (ranks, group)
            if self.stage_id in stages:
                names = [f"tied_modules.{key}.{a}" for a in attrs]
                for a in attrs:
                    try:
                        _get_attr(self.tied_modules[key], a)
                    except AttributeError:
                        raise ValueError(
                            f"TiedLayerSpec {key!r}: tied_weight_attr {a!r} is not an attribute of its "
                            f"{type(self.tied_modules[key]).__name__}; name its tied parameters"
                        ) from None
                out[key] = (names, *mine)
                # counted once by a global grad norm: the copy on the lowest stage is the one
                for p in self.tied_modules[key].parameters():
                    p.ds_pipe_replicated = self.global_rank != mine[0][0]
        return out

    def _tied_tensors(self, key: str) -> list[torch.Tensor]:
        return [_get_attr(self.tied_modules[key], a) for a in self.tied_weight_attrs[key]]

    def _synchronize_tied_weights(self) -> None:
        """Makes each tied weight identical on its stages: broadcast from the lowest stage holding it."""
        for key, (_, ranks, group) in self._tied.items():
            if group is None:
                continue
            for t in self._tied_tensors(key):
                with torch.no_grad():
                    buf = _on_backend(t.data, group)
                    dist.broadcast(buf, src=ranks[0], group=group)
                    if buf is not t.data:
                        t.data.copy_(buf)

    def tied_groups(self) -> dict[str, tuple[list[str], list[int], Any]]:
        """``{key: (param names, global ranks of the stages holding the key,
        process group over them)}`` for the keys this rank holds; the group
        is None where one stage holds the key (or without a process group)."""
        return {k: (list(n), list(r), g) for k, (n, r, g) in self._tied.items()}

    def allreduce_tied_grads(self) -> None:
        """Sums each tied weight's gradient over the stages holding it (the
        engine's ``ReduceTiedGrads``). A tied weight with no gradient on a
        stage (its layer not run) contributes zeros, so no stage waits."""
        for key, (_, _, group) in self._tied.items():
            if group is None:
                continue
            for t in self._tied_tensors(key):
                if t.grad is None:
                    t.grad = torch.zeros_like(t)
                buf = _on_backend(t.grad, group)
                dist.all_reduce(buf, group=group)
                if buf is not t.grad:
                    t.grad.copy_(buf)

    allreduce_tied_weight_gradients = allreduce_tied_grads  # DeepSpeed's name

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        """DeepSpeed's: ``[(tied weight, its group), ...]`` for this rank."""
        return [(t, group) for key, (_, _, group) in self._tied.items() for t in self._tied_tensors(key)]

    # -- layout queries -----------------------------------------------------------------------------------------
    def partitions(self) -> list[int]:
        """The ``p*v + 1`` part boundaries: part k holds layers ``parts[k] .. parts[k+1]-1``."""
        return list(self.parts)

    def part_owner(self, layer_idx: int) -> tuple[int, int]:
        """``(stage, chunk)`` holding layer `layer_idx`."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer index {layer_idx!r} is outside 0..{self._num_layers - 1}")
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= layer_idx < self.parts[part + 1]:
                return part % self.num_stages, part // self.num_stages
        raise AssertionError(f"layer {layer_idx} in no part of {self.parts}")  # parts cover 0..n by construction

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline stage that holds layer `layer_idx`."""
        return self.part_owner(layer_idx)[0]

    def is_first_stage(self) -> bool:
        """Whether this rank holds part 0 (where inputs enter)."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank holds the last part (where the loss is computed)."""
        return self.stage_id == (self.num_stages * self.virtual_stages - 1) % self.num_stages

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def mpu(self) -> Topology:
        """The topology, which answers Megatron's mpu calls (DeepSpeed returns its grid)."""
        return self.topology

    # -- forward and checkpointing ------------------------------------------------------------------------------
    def forward(self, x: Any) -> Any:
        """Chunk 0's forward: with one virtual stage, this stage's whole forward (DeepSpeed's)."""
        return self.chunks[0](x)

    def set_checkpoint_interval(self, interval: int) -> None:
        _check_int("activation checkpoint interval", interval, 0)
        self.activation_checkpoint_interval = interval

    def _is_checkpointable(self, funcs: list) -> bool:
        """DeepSpeed's rule for a block of layers: with `checkpointable_layers`, all
        of the block's classes are listed; else any of its modules has
        parameters. GPT(2)ModelPipe under the reentrant checkpoint: only
        ParallelTransformerLayerPipe blocks (and listed ones)."""
        names = [f.__class__.__name__ for f in funcs]
        if self.activation_checkpoint_func is not non_reentrant_checkpoint and self.__class__.__name__ in (
            "GPTModelPipe",
            "GPT2ModelPipe",
        ):
            listed = self.checkpointable_layers or []
            return all("ParallelTransformerLayerPipe" in n or n in listed for n in names)
        if self.checkpointable_layers is not None:
            return all(n in self.checkpointable_layers for n in names)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))


def _check_int(name: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")


_SEQUENTIAL = object()  # build_sequential's topology argument
# One process, one stage: the unpipelined model's layout (no process groups)
_SEQUENTIAL_TOPOLOGY = PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=1)


def _resolve_topology(num_stages: int | None, topology: Any) -> tuple[Any, int]:
    """(fastzero Topology, this rank) from DeepSpeed's ``num_stages``/``topology`` arguments."""
    if topology is _SEQUENTIAL:
        return _SEQUENTIAL_TOPOLOGY, 0
    if num_stages is None and topology is None:
        raise ValueError("PipelineModule: give num_stages or topology")
    if num_stages is not None:
        _check_int("num_stages", num_stages, 1)
    if topology is None:
        topo = Topology(pipe=num_stages)
        return topo, topo.global_rank
    if not isinstance(topology, ProcessTopology):
        raise TypeError(f"topology={topology!r}: give a fastzero.parallel.Topology or a ProcessTopology")
    axes = topology.get_axis_names()
    if "pipe" not in axes:
        raise ValueError(
            f"topology axes {axes} have no 'pipe' axis: build it with a pipe axis (Topology(pipe=...), "
            "PipeDataParallelTopology) or pass num_stages"
        )
    if num_stages is not None and num_stages != topology.get_dim("pipe"):
        raise ValueError(
            f"num_stages={num_stages} but the topology's pipe axis has {topology.get_dim('pipe')}; give one of them"
        )
    topo = Topology.of(topology)  # checks the size against the world and that pipe is outermost
    return topo, topo.global_rank
