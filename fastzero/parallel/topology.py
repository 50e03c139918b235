"""The process topology: named axes (``pipe``, ``data``, ``model``) over the
ranks, rank <-> coordinates both ways, each axis's process groups, and an
object with Megatron's ``mpu`` interface.

:class:`ProcessTopology`, :class:`PipeDataParallelTopology` and
:class:`PipeModelDataParallelTopology` keep DeepSpeed's semantics and method
names (``deepspeed/runtime/pipe/topology.py``, DeepSpeed 0.16): the layout is
row-major, the last axis varies fastest. For ``axes=["pipe", "data",
"model"]``, ``dims=[2, 2, 2]``, rank 1 is ``(pipe=0, data=0, model=1)``: the
tensor (model) group's ranks are adjacent, so its frequent, small collectives
stay on the fast links inside a node.

:class:`Topology` is fastzero's entry: ``Topology(tensor=2, data=2)`` builds
the groups of every axis once and answers Megatron's mpu calls
(``get_model_parallel_group()`` ...), so code written for DeepSpeed's
``mpu=`` works with it. ``model`` is the tensor-slicing axis, as in Megatron:
``get_model_parallel_*`` and ``get_tensor_model_parallel_*`` are the same
group (DeepSpeed's PipelineParallelGrid calls that one the *slice* group,
and its ``get_model_parallel_group`` spans pipe x model; the two agree while
``pipe`` is 1). ``tensor`` is accepted wherever an axis is named.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence
from itertools import product
from typing import Any

import torch.distributed as dist

from fastzero.comm import dist_env, init_distributed
from fastzero.parallel.groups import set_current


class ProcessTopology:
    """Maps ranks to coordinates on named axes (DeepSpeed's class, same
    method names and results). ``axes`` names each axis, ``dims`` its
    length; rank = row-major index of the coordinate (the last axis varies
    fastest)::

        >>> t = ProcessTopology(axes=["x", "y"], dims=[2, 3])
        >>> t.get_rank(x=0, y=1), t.get_coord(4)
        (1, ProcessCoord(x=1, y=1))
    """

    _ALIASES: dict[str, str] = {}  # another name accepted for an axis

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}: give one each")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names {axes} repeat; name each axis once")
        bad = [(a, d) for a, d in zip(axes, dims) if not isinstance(d, int) or isinstance(d, bool) or d < 1]
        if bad:
            raise ValueError(f"ProcessTopology: axis sizes must be integers >= 1; got {bad}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self._coords = [self.ProcessCoord(*c) for c in product(*(range(d) for d in dims))]
        self.mapping = {c: r for r, c in enumerate(self._coords)}

    def _axis(self, name: str) -> str:
        return self._ALIASES.get(name, name)

    def _key(self, coords: dict[str, int]) -> dict[str, int]:
        out = {}
        for name, value in coords.items():
            axis = self._axis(name)
            if axis not in self.axes:
                raise ValueError(f"{name!r} is not an axis of this topology; its axes are {self.axes}")
            out[axis] = value
        return out

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at the coordinates (every axis named)."""
        key = self._key(coord_kwargs)
        if len(key) != len(self.axes):
            raise ValueError(f"get_rank() needs a coordinate on every axis {self.axes}; for a slice use filter_match()")
        coord = self.ProcessCoord(**key)
        if coord not in self.mapping:
            raise ValueError(f"{coord} is outside the topology (axis sizes {dict(zip(self.axes, self.dims))})")
        return self.mapping[coord]

    def get_axis_names(self) -> list[str]:
        """The axis names, in layout order."""
        return self.axes

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Sequence[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """The rank's coordinates as a string, for file names: ``model_01``
        (axes in `omit_axes` left out)."""
        omit = {self._axis(a) for a in omit_axes}
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omit)

    def get_dim(self, axis: str) -> int:
        """The number of ranks along `axis`; 0 for an axis the topology lacks (as DeepSpeed)."""
        axis = self._axis(axis)
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        """The ``ProcessCoord`` of `rank` (its axes are attributes)."""
        if not isinstance(rank, int) or not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank!r} not found in topology (ranks 0..{len(self._coords) - 1})")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists of `axis`'s groups: ranks that differ only in
        `axis`, one list per coordinate of the other axes (in layout order);
        [] for an axis the topology lacks (as DeepSpeed)."""
        axis = self._axis(axis)
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for coord in product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, coord))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates match every given axis value, in rank order."""
        key = self._key(filter_kwargs)
        return [r for r, c in enumerate(self._coords) if all(getattr(c, a) == v for a, v in key.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on `axis` is `idx`."""
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self._coords)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism (axes ``pipe``, ``data``; data varies fastest)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor (model) parallelism: axes ``pipe``, ``data``,
    ``model`` in that order (model varies fastest); ``tensor`` names ``model``."""

    _ALIASES = {"tensor": "model"}

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _world() -> tuple[int, int]:
    """(world size, rank), joining the process group from the launcher's environment if needed."""
    if not (dist.is_available() and dist.is_initialized()) and dist_env().world_size > 1:
        init_distributed()
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class Topology(PipeModelDataParallelTopology):
    """fastzero's process topology: ``Topology(tensor=2, data=2)`` on 4
    ranks. `data` defaults to world / (tensor x pipe). Builds the process
    groups of every axis (every rank creates every group, in the same
    order, as torch requires) and answers Megatron's mpu interface; pass it
    to ``fastzero.initialize(topology=...)`` or make it current with
    :meth:`make_current` for the parallel layers. Joins the process group
    from the launcher's environment first if needed.

    A ProcessTopology method that names an axis takes ``tensor`` for
    ``model``; :meth:`world_size` is the topology's size (all ranks)."""

    def __init__(self, tensor: int = 1, data: int | None = None, pipe: int = 1) -> None:
        world, rank = _world()
        sizes = {"tensor": tensor, "pipe": pipe, **({} if data is None else {"data": data})}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
        if bad:
            raise ValueError(f"Topology: sizes must be integers >= 1; got {bad}")
        if data is None:
            data, rem = divmod(world, tensor * pipe)
            if rem or data < 1:
                raise ValueError(
                    f"Topology(tensor={tensor}, pipe={pipe}): tensor x pipe = {tensor * pipe} does not divide the "
                    f"world size {world}; pick sizes whose product divides it"
                )
        if tensor * data * pipe != world:
            raise ValueError(
                f"Topology(tensor={tensor}, data={data}, pipe={pipe}): tensor x data x pipe = {tensor * data * pipe}"
                f" but the world size is {world}; pick sizes whose product is {world} (or leave data out to "
                "derive it)"
            )
        super().__init__(num_pp=pipe, num_mp=tensor, num_dp=data)
        self.global_rank = rank
        self.coord = self.get_coord(rank)
        self._groups: dict[str, Any] = {}  # axis -> this rank's group along it (None without a process group)
        self._ranks: dict[str, list[int]] = {}  # axis -> the global ranks of this rank's group along it
        distributed = dist.is_available() and dist.is_initialized()
        for axis in self.axes:  # every rank builds every group, in the same order
            for ranks in self.get_axis_comm_lists(axis):
                group = dist.new_group(ranks=ranks) if distributed else None
                if rank in ranks:
                    self._groups[axis], self._ranks[axis] = group, ranks

    @classmethod
    def of(cls, topology: ProcessTopology) -> Topology:
        """The Topology (with its groups) of a DeepSpeed-style topology:
        axes among ``pipe``, ``data``, ``model`` laid out as
        :class:`PipeModelDataParallelTopology` lays them out."""
        if isinstance(topology, Topology):
            return topology
        extra = [a for a in topology.get_axis_names() if a not in ("pipe", "data", "model")]
        if extra:
            raise ValueError(
                f"topology axes {extra} are not pipe, data or model: fastzero trains over those three axes only"
            )
        size = lambda a: max(topology.get_dim(a), 1)
        out = cls(tensor=size("model"), data=size("data"), pipe=size("pipe"))
        if any(
            topology.get_coord(r)._asdict() != _coord_on(topology, out.get_coord(r)) for r in range(out.world_size())
        ):
            raise ValueError(
                f"topology axes {topology.get_axis_names()} lay ranks out in another order than pipe, data, model: "
                "build it as PipeModelDataParallelTopology or PipeDataParallelTopology, or pass Topology(...)"
            )
        return out

    def make_current(self) -> Topology:
        """Makes this the current topology (the parallel layers' default); returns it."""
        set_current(self)
        return self

    # -- groups ---------------------------------------------------------------------------
    def get_group(self, axis: str):
        """This rank's process group along `axis` (None when there is no process group)."""
        return self._groups[self._axis_checked(axis)]

    def get_group_ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along `axis`, in group-rank order."""
        return list(self._ranks[self._axis_checked(axis)])

    def _axis_checked(self, axis: str) -> str:
        name = self._axis(axis)
        if name not in self.axes:
            raise ValueError(f"{axis!r} is not an axis of the topology; its axes are {self.axes} (and 'tensor')")
        return name

    def _rank(self, axis: str) -> int:
        return getattr(self.coord, axis)

    # -- Megatron's / DeepSpeed's mpu interface -----------------------------------------------
    def get_global_rank(self) -> int:
        return self.global_rank

    def topology(self) -> Topology:
        return self

    def get_model_parallel_rank(self) -> int:
        return self._rank("model")

    def get_model_parallel_world_size(self) -> int:
        return self.get_dim("model")

    def get_model_parallel_group(self):
        return self._groups["model"]

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self._rank("data")

    def get_data_parallel_world_size(self) -> int:
        return self.get_dim("data")

    def get_data_parallel_group(self):
        return self._groups["data"]

    def get_pipe_parallel_rank(self) -> int:
        return self._rank("pipe")

    def get_pipe_parallel_world_size(self) -> int:
        return self.get_dim("pipe")

    def get_pipe_parallel_group(self):
        return self._groups["pipe"]

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_stage_id = get_pipe_parallel_rank
    get_data_parallel_id = get_data_parallel_rank

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.get_dim(a)}" for a in ("tensor", "data", "pipe"))
        return f"Topology({sizes}; rank {self.global_rank} at {tuple(self.coord)})"

    __str__ = __repr__


def _coord_on(topology: ProcessTopology, coord) -> dict[str, int]:
    """`coord` restricted to the axes `topology` has."""
    return {a: getattr(coord, a) for a in topology.get_axis_names()}
