"""ZeRO stage 3 helpers with DeepSpeed's names.

``Init()`` partitions each parameter as its module is constructed, so a model
too big for one rank is never whole on one: inside the context, when a
module's ``__init__`` returns, its parameters are broadcast from rank 0 (so
every rank starts from the same weights) and each rank keeps only its chunk;
``fastzero.initialize`` with stage 3 then takes the chunks as they are.

``register_external_parameter(module, param)`` tells stage 3 that
``module``'s forward uses ``param`` although another module owns it (a tied
weight used directly), so it is gathered for ``module`` too.

``GatheredParameters(params, modifier_rank=0)`` makes partitioned params
whole for a block and puts what ``modifier_rank`` wrote in it back into
every rank's chunk (and an engine's fp32 masters): see
:mod:`fastzero.gathered_parameters`.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from fastzero.comm import FlatLayout, dist_env, init_distributed
from fastzero.estimate import (  # noqa: F401  (DeepSpeed: deepspeed.runtime.zero.stage_1_and_2, stage3)
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from fastzero.gathered_parameters import GatheredParameters  # noqa: F401  (DeepSpeed: deepspeed.zero)
from fastzero.parallel import data_group
from fastzero.runtime.stage3 import (
    WHOLE,
    ZeroParamStatus,  # noqa: F401  (DeepSpeed: deepspeed.zero.ZeroParamStatus)
    add_external_param,
    fetcher_of,
    is_partitioned,
    mark_partitioned,
    released_like,
)


def _all_module_classes(root: type = torch.nn.Module) -> list[type]:
    out, todo = [], [root]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return out


def partition_param(p: torch.Tensor, world_size: int, rank: int) -> None:
    """Keeps this rank's chunk of `p` (the stage-3 layout: one padded flat
    split in `world_size` equal chunks) and empties `p`."""
    lay = FlatLayout([p.numel()], world_size, WHOLE)
    lo, hi = lay.buckets[0].owned(rank)
    flat = p.detach().reshape(-1)
    shard = torch.zeros(hi - lo, dtype=p.dtype, device=p.device)
    n = max(0, min(hi, flat.numel()) - lo)
    shard[:n] = flat[lo : lo + n]
    mark_partitioned(p, shard, p.shape)
    p.data = released_like(p)


class Init:
    """``with fastzero.zero.Init(): model = MyModel()`` (DeepSpeed's
    ``deepspeed.zero.Init``; its other arguments are accepted and ignored).
    Params are split over `data_parallel_group`, else the data-parallel
    group of `mpu` or of the current topology, else every rank. Joins the
    process group from the environment first if needed."""

    def __init__(
        self,
        module=None,
        data_parallel_group=None,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype=None,
        mpu=None,
        **_ignored,
    ) -> None:
        self.enabled = enabled
        self.group = data_parallel_group if data_parallel_group is not None else data_group(mpu=mpu)
        self._patched: list[tuple[type, object]] = []
        self._depth: dict[int, int] = {}

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if not dist.is_initialized() and dist_env().world_size > 1:
            init_distributed()
        self.world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        grouped = dist.is_initialized() and self.group is not None
        self.ranks = dist.get_process_group_ranks(self.group) if grouped else list(range(self.world))
        for cls in _all_module_classes():
            if "__init__" in cls.__dict__:
                self._wrap(cls)
        init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        self._patched.append((torch.nn.Module, ("__init_subclass__", init_subclass)))

        def __init_subclass__(cls, **kwargs):  # classes defined inside the context are partitioned too
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            if "__init__" in cls.__dict__:
                self._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        return self

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__["__init__"]

        @functools.wraps(original)
        def __init__(module, *args, **kwargs):
            key = id(module)
            self._depth[key] = self._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                self._depth[key] -= 1
            if self._depth[key] == 0:  # the outermost __init__ of this object: its params are final
                del self._depth[key]
                self._partition(module)

        cls.__init__ = __init__
        self._patched.append((cls, ("__init__", original)))

    def _partition(self, module: torch.nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if is_partitioned(p):
                continue
            if self.world > 1:  # from the group's first rank (torch's src is a global rank)
                src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
                dist.broadcast(p.data, src, group=self.group)
            partition_param(p, self.world, self.rank)
            p._fz_init_ranks = self.ranks  # the engine checks it partitions over the same ranks

    def __exit__(self, *exc) -> None:
        for cls, (name, original) in reversed(self._patched):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._patched.clear()


def register_external_parameter(module: torch.nn.Module, param: torch.Tensor) -> None:
    """Before or after ``fastzero.initialize``: gather `param` for `module`'s
    forward too (stage 3)."""
    add_external_param(module, param)
    fetcher = fetcher_of(module)
    if fetcher is not None:
        fetcher.register_external(module, param)
