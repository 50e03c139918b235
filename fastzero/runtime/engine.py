"""The training engine ``fastzero.initialize`` returns: DeepSpeed's engine API
(``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``,
``save_checkpoint``/``load_checkpoint``) over ZeRO stages 0-3. Each param
group is a :class:`~fastzero.runtime.groups.ZeroGroup` (stages 0-2:
:class:`~fastzero.runtime.partition.FlatGroup`; stage 3:
:class:`~fastzero.runtime.stage3.Stage3Group`), and the engine calls only
what that interface declares.

The engine is thin: the layout and collectives are :mod:`fastzero.comm`'s,
the update is a fused optimizer's (one pass: unscale by the loss scale, the
1/(ranks x micro-batches) average and the clipping factor all folded into the
kernel's ``grad_scale``, the low-precision param copy written by the same
pass), and the loss scaler and schedules are :mod:`fastzero.runtime`'s.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fastzero.comm import (
    Comm,
    GradQuant,
    QuantFormat,
    dist_env,
    gloo_twin,
    hierarchy,
    init_distributed,
    new_groups,
    node_ranks,
)
from fastzero.comm import logger as comms_logging
from fastzero.config import Config, ConfigError, load_config
from fastzero.ops.norms import sum_of_squares
from fastzero.parallel import ProcessTopology, Topology, current, data_group, is_tensor_parallel, set_current
from fastzero.parallel.groups import tensor_group
from fastzero.runtime.agreement import check_start
from fastzero.runtime.client_optimizer import link_client_groups
from fastzero.runtime.config_getters import ConfigGetters
from fastzero.runtime.groups import ZeroGroup, mark_owner
from fastzero.runtime.loss_scaler import loss_scaler_from_config
from fastzero.runtime.lr_schedules import SCHEDULES
from fastzero.runtime.monitor import Monitor
from fastzero.runtime.onebit_base import OneBitBase
from fastzero.runtime.optimizer_builder import build_optimizer
from fastzero.runtime.partition import FlatGroup
from fastzero.runtime.stage3 import (
    FrozenShard,
    FrozenUnit,
    ParamFetcher,
    Stage3Group,
    ZeroPP,
    check_init_ranks,
    external_params,
    is_partitioned,
    refresh_persistent,
    take_init_shard,
)


class NonFiniteGradients(FloatingPointError):
    """The gradient norm is inf or NaN and ``non_finite_grads`` is ``raise``."""


def _param_groups(module: torch.nn.Module, model_parameters, client_optimizer) -> list[dict]:
    """The param groups to train: the client optimizer's, else
    `model_parameters` (params or dicts), else all of the module's; only
    params that require grad, each of the module's."""
    if isinstance(client_optimizer, torch.optim.Optimizer):
        groups = client_optimizer.param_groups
    else:
        source = module.parameters() if model_parameters is None else model_parameters
        source = list(source)
        groups = source if source and isinstance(source[0], dict) else [{"params": source}]
    own = {id(p) for p in module.parameters()}
    out = []
    for gi, group in enumerate(groups):
        params = [group["params"]] if isinstance(group["params"], Tensor) else list(group["params"])
        for pi, p in enumerate(params):
            if id(p) not in own:
                raise ValueError(f"param {pi} of group {gi} is not a parameter of the model; pass the model's own")
        params = [p for p in params if p.requires_grad]
        if params:
            out.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if not out:
        raise ValueError("the model has no parameters that require grad: nothing to train")
    return out


def _model_comms(mpu: Any, data: Comm) -> tuple[Comm | None, Comm | None]:
    """The tensor and pipe groups' Comms of `mpu` (None: no mpu, or size 1;
    an mpu without ``get_pipe_parallel_group`` has no pipe axis). Data x
    tensor x pipe must make up the world."""
    if mpu is None:
        return None, None
    tensor = Comm(tensor_group(mpu=mpu))
    pipe_group = getattr(mpu, "get_pipe_parallel_group", None)
    pipe = Comm(pipe_group()) if pipe_group is not None else None
    pipes = 1 if pipe is None else pipe.world_size
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if data.world_size * tensor.world_size * pipes != world:
        raise ValueError(
            f"{type(mpu).__name__}: data-parallel size {data.world_size} x tensor size {tensor.world_size} x pipe "
            f"size {pipes} != world size {world}; their product must be the world size"
        )
    return (tensor if tensor.world_size > 1 else None), (pipe if pipes > 1 else None)


_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Engine(ConfigGetters, torch.nn.Module):
    """Trains `module` data-parallel with ZeRO; built by :func:`initialize`.

    An ``nn.Module``, as DeepSpeed's engine is: the wrapped model is its
    ``module``, so ``parameters()``, ``named_parameters()`` (names start
    with ``module.``), ``train()``/``eval()`` and ``engine(batch)`` work as
    on any module, and an attribute the engine lacks is the wrapped module's
    (a Hugging Face model's ``generate``). ``engine.config`` is the config
    given to :func:`initialize`, as DeepSpeed's (a Hugging Face model's own:
    ``engine.module.config``); the parsed one is ``engine._config``.
    ``state_dict()``/``load_state_dict()`` are the wrapped module's (see
    there for stage 3).
    """

    _pipelined = False  # the pipeline engine trains over a pipe axis too (and reduces stage 2 once per step)

    def __init__(
        self,
        module: torch.nn.Module,
        config: Config,
        *,
        model_parameters=None,
        optimizer=None,
        lr_scheduler=None,
        comm: Comm | None = None,
        mpu: Any = None,
    ) -> None:
        super().__init__()
        self._config = cfg = config
        # mpu: a Topology or Megatron-style mpu. ZeRO partitions and reduces over its data-parallel group only
        # (self.comm); the tensor group sees only the gradient norm's scalars (self.tensor_comm)
        self.mpu = mpu
        self.comm = comm or Comm(data_group(mpu=mpu) if mpu is not None else None)
        self.tensor_comm, self.pipe_comm = _model_comms(mpu, self.comm)
        if self.pipe_comm is not None and not self._pipelined:
            raise ConfigError(
                f"the topology has pipe={self.pipe_comm.world_size}: the model must be a fastzero.pipe.PipelineModule "
                "(trained with engine.train_batch), or use pipe=1"
            )
        model_parallel = self.tensor_comm is not None or self.pipe_comm is not None
        self.world_comm = Comm() if model_parallel else self.comm  # checkpoints span every rank
        self.dp_world_size = self.comm.world_size
        self.mp_world_size = 1 if self.tensor_comm is None else self.tensor_comm.world_size
        self.stage = cfg.zero_optimization.stage
        partitioned = [n for n, p in module.named_parameters() if is_partitioned(p)]
        if partitioned and self.stage != 3:
            raise ConfigError(
                f"{partitioned[0]} (and {len(partitioned) - 1} more) were partitioned by fastzero.zero.Init: train "
                f"them with zero_optimization.stage 3 (stage is {self.stage})"
            )
        self.dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else torch.float32
        self.device = self.comm.device
        self.module = module.to(device=self.device, dtype=self.dtype)
        groups = self._split_groups(_param_groups(self.module, model_parameters, optimizer))
        names = {id(p): n for n, p in self.module.named_parameters()}
        self._sync_module_state()
        zero = cfg.zero_optimization
        # stages 1-2 reduce-scatter and all-gather the same buckets (see fastzero.comm.layout)
        bucket = (
            zero.reduce_bucket_size if self.stage == 0 else min(zero.reduce_bucket_size, zero.allgather_bucket_size)
        )
        overlap = zero.overlap_comm or self.stage == 0  # DDP-style stage 0 always overlaps
        world = self.comm.world_size
        # the gradient average: a factor before the sum (prescale_gradients: 1/ranks; else 1/predivide), the rest
        # after, folded into the optimizer's grad_scale (self._post_divide)
        pre = 1.0 if world == 1 else 1.0 / world if cfg.prescale_gradients else 1.0 / cfg.gradient_predivide_factor
        self._post_divide = world * pre
        reduction = dict(comm_dtype=_COMM_DTYPES.get(cfg.communication_data_type), pre_scale=pre)
        self.zeropp = self._zeropp(zero)
        self.groups: list[ZeroGroup]
        if self.stage == 3:
            threshold = zero.stage3_param_persistence_threshold
            offload = zero.offload_param
            self.groups = [
                Stage3Group(
                    g["params"],
                    [names[id(p)] for p in g["params"]],
                    comm=self.comm,
                    persistence_threshold=threshold,
                    offload=offload.device == "cpu",
                    pin_memory=offload.pin_memory,
                    zeropp=self.zeropp,
                    **reduction,
                )
                for g in groups
            ]
            self.fetcher = ParamFetcher(
                self.module,
                self.groups,
                prefetch_elements=zero.stage3_prefetch_bucket_size,
                max_live=zero.stage3_max_live_parameters,
                max_reuse=zero.stage3_max_reuse_distance,
                check=self._order_check() if zero.stage3_check_divergence else None,
                frozen=self._frozen_units(zero),
            )
            self._warn_idle_zeropp(zero)
        else:
            self.groups = [
                FlatGroup(
                    g["params"],
                    [names[id(p)] for p in g["params"]],
                    stage=self.stage,
                    comm=self.comm,
                    bucket_size=bucket,
                    overlap=overlap,
                    reduce_once=self._pipelined,  # stage 2: once per step, after the last micro-batch
                    weight_quant=self.zeropp.weights,
                    grad_quant=self.zeropp.grads,
                    key=k,
                    **reduction,
                )
                for k, g in enumerate(groups)
            ]
            self.fetcher = None
        # bf16.bf16_master_weights_and_grads: no fp32 master, the bf16 shard is the param the optimizer updates
        no_master = cfg.bf16.bf16_master_weights_and_grads
        self.master_dtype = self.dtype if no_master else torch.float32  # what checkpoints' "master" values hold
        self.optimizer = build_optimizer(
            cfg,
            groups,
            [g.optimizer_params() for g in self.groups],
            optimizer,
            master_weights=self.dtype != torch.float32 and not no_master,
        )
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer is not self.optimizer:
            link_client_groups(optimizer, self.optimizer, [g.params for g in self.groups])
        self.onebit = isinstance(self.optimizer, OneBitBase)  # the 1-bit family
        if self.onebit and model_parallel:
            raise ConfigError(
                f"{type(self.optimizer).__name__} with tensor or pipeline parallelism is not supported: its "
                "compressed exchange ignores the model split; use Adam/AdamW, or tensor and pipe size 1"
            )
        if self.onebit:  # the engine reduces warm-up grads, agrees on overflows, clips; at stage 1 it compresses
            shards = None if self.stage == 0 else [g.shard_map() for g in self.groups]  # per-param math on chunks
            self.optimizer.attach_engine(self.comm, exchange_momentum=self.stage == 0, shards=shards)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.loss_scaler = loss_scaler_from_config(cfg.fp16) if cfg.fp16.enabled else None
        self.optimizer.loss_scaler = self.loss_scaler  # DeepSpeed scripts read optimizer.cur_scale & co.
        # ignore_unused_parameters: false: the params whose gradient arrived since the last step, to name the others
        self._got_grad: set[int] | None = None if zero.ignore_unused_parameters else set()
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda p, group=group, i=i: self._grad_ready(group, i, p))
            for group in self.groups
            for i, p in enumerate(group.params)
        ]
        self.micro_steps = self.global_steps = self.global_samples = self.skipped_steps = 0
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self.client_optimizer, self.client_lr_scheduler = optimizer, lr_scheduler  # what the script passed
        # DeepSpeed's attributes: this process's rank on its node, the training_data loader (initialize sets
        # it), the data-parallel process group (None: the default group)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        self.training_dataloader = None
        world = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        self.data_parallel_group = self.comm.group if self.comm.group is not None else world
        self.pipeline_parallelism = self._pipelined
        self._gather_depth = 0  # nested gathered() blocks
        self._warned_codes = False  # state_dict() at stages 1-2 with qwZ said what it holds
        self._grads_fresh = True  # no backward since the gradients were last zeroed
        self._grads_reduced = False  # a boundary backward reduced the gradients and no step has used them yet
        self._no_sync = False  # inside no_sync(): backwards reduce nothing
        self._compiled = False  # compile() ran
        self._step_applied = False  # the last optimizer step updated the params
        self.grad_norm: float | None = None
        self.last_loss: Tensor | None = None
        # seconds spent in each phase since take_timers() (and when the last backward ended, for tests)
        self.timers: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0, "backward_end": 0.0}
        self.monitor = Monitor(cfg, rank=self.global_rank)
        mark_owner(self, (p for g in self.groups for p in g.params))  # for fastzero.zero.GatheredParameters
        # stages 1-2 with overlap_comm: step() returns with the param all-gathers in flight; each module's forward
        # pre-hook waits for the buckets of its own params (docs/zero.md, "The post-step all-gather")
        self._overlap_gather = self.stage in (1, 2) and zero.overlap_param_gather
        self._param_waits: dict[torch.nn.Module, list[tuple[FlatGroup, list[int], list[int]]]] = {}
        self._module_names = {m: n for n, m in self.module.named_modules()}
        if self._overlap_gather:
            for m in self.module.modules():
                self._add_param_waits(m, [*m.parameters(recurse=False), *external_params(m)])

    # -- set-up -----------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """What the engine lacks is the wrapped module's (DeepSpeed's engine
        does the same), so code written for the bare model keeps working."""
        try:
            return super().__getattr__(name)  # the engine's own params, buffers and submodules (self.module)
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and name != "module":
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"neither the engine nor its wrapped module has an attribute {name!r}")

    def _add_param_waits(self, m: torch.nn.Module, params: list[Tensor]) -> None:
        """`m`'s forward reads `params`: its pre-hook (registered once) waits
        for the post-step all-gather of the buckets that hold them."""
        ids = {id(p) for p in params}
        waits = self._param_waits.setdefault(m, [])
        fresh = not waits
        for g in self.groups:
            indices = [i for i, p in enumerate(g.params) if id(p) in ids]
            if indices:
                waits.append((g, g.buckets_of(indices), indices))
        if not waits:
            del self._param_waits[m]
        elif fresh:
            site = f"forward:{self._module_names.get(m) or type(m).__name__}"
            m.register_forward_pre_hook(lambda mod, _args, site=site: self._wait_module(mod, site))

    def _wait_module(self, m: torch.nn.Module, site: str) -> None:
        if not self._params_in_flight:
            return
        for g, buckets, indices in self._param_waits[m]:
            g.wait_gather(buckets, site, seen=indices)

    @property
    def _params_in_flight(self) -> bool:
        return self.stage in (1, 2) and any(g.gathering() for g in self.groups)

    def wait_params(self, site: str = "wait_params") -> None:
        """Stages 1-2 with ``overlap_comm``: waits for the params' post-step
        all-gather (step() returns with it in flight and each module's
        forward waits for its own buckets). Call it before reading params
        outside a forward after step() (``engine.module.parameters()``,
        ``fastzero.zero.GatheredParameters`` at stages 1-2, the end of
        training); the engine's own readers (step, backward, ``gathered()``,
        ``state_dict()``, ``load_state_dict()``, checkpoints,
        ``refresh_from_module()``) call it. A no-op otherwise."""
        if self._params_in_flight:
            for g in self.groups:
                g.wait_gather(site=site)

    def _zeropp(self, zero) -> ZeroPP:
        """ZeRO++'s parts that are on (docs/zeropp.md), over the data-parallel
        group; with one data-parallel rank there is nothing to send, so
        nothing is quantized. Makes the process groups qgZ's hierarchy and
        hpZ need: every rank of the world calls it."""
        if self.comm.world_size == 1:
            return ZeroPP()
        block = zero.zero_quantized_block_size
        weights = QuantFormat(8, block) if zero.zero_quantized_weights else None
        grads = None
        if zero.zero_quantized_gradients:
            stochastic = zero.zero_quantized_gradients_rounding == "stochastic"
            fmt = QuantFormat(zero.zero_quantized_gradients_bits, block, stochastic)
            grads = GradQuant(fmt, hierarchy(self.comm, node_ranks(self.comm)))
        hpz, size = None, zero.zero_hpz_partition_size
        if size > 1 and size < self.comm.world_size:
            first = self.comm.rank // size * size
            hpz = Comm(new_groups([list(self.comm.ranks[first : first + size])])[0])
        elif size > 1:
            warnings.warn(
                f"zero_optimization.zero_hpz_partition_size = {size} is the whole data-parallel group "
                f"({self.comm.world_size} ranks): a secondary partition over it is the primary one, so hpZ does "
                "nothing; set it to the ranks per node",
                UserWarning,
                3,
            )
        return ZeroPP(weights, grads, hpz)

    def _warn_idle_zeropp(self, zero) -> None:
        """Stage 3's qwZ and hpZ act on partitioned params only, the frozen codes on frozen params of at least
        stage3_param_persistence_threshold elements: say so when there are none, where they would do nothing."""
        idle = []
        if not any(not u.persistent for g in self.groups for u in g.units):
            idle += [
                k
                for k, v in (
                    ("zero_quantized_weights", self.zeropp.weights),
                    ("zero_hpz_partition_size", self.zeropp.hpz),
                )
                if v is not None
            ]
        if zero.zero_quantized_nontrainable_weights and not any(isinstance(u, FrozenUnit) for u in self.fetcher.frozen):
            idle.append("zero_quantized_nontrainable_weights")
        if idle:
            warnings.warn(
                f"zero_optimization.{' and '.join(idle)} at stage 3: {'it acts' if len(idle) == 1 else 'they act'} "
                f"on params of at least stage3_param_persistence_threshold ({zero.stage3_param_persistence_threshold}"
                " elements; frozen ones for zero_quantized_nontrainable_weights), smaller ones stay whole on every "
                "rank, and this model has none: nothing is quantized or kept; lower the threshold",
                UserWarning,
                3,
            )

    def comms(self) -> list[Comm]:
        """Every group this engine communicates over, each once: the
        data-parallel one, the world's (checkpoints), the tensor and pipe
        groups, and ZeRO++'s (qgZ's node and cross-node groups, hpZ's). Their
        records hold every collective the engine launched, with its bytes."""
        out = [self.comm, self.world_comm, self.tensor_comm, self.pipe_comm, *self.zeropp.comms()]
        return list({id(c): c for c in out if c is not None}.values())

    def _frozen_units(self, zero) -> list[FrozenUnit | FrozenShard]:
        """Stage 3's frozen params that the fetcher gathers for the modules
        that use them: those ``fastzero.zero.Init`` partitioned stay
        partitioned (:class:`FrozenShard`); with
        ``zero_quantized_nontrainable_weights``, the other floating ones of at
        least ``stage3_param_persistence_threshold`` elements (smaller ones
        stay as they are, as small trained ones stay whole) are kept as int8
        codes (:class:`FrozenUnit`)."""
        fmt = QuantFormat(8, zero.zero_quantized_block_size) if zero.zero_quantized_nontrainable_weights else None
        out: list[FrozenUnit | FrozenShard] = []
        for name, p in self.module.named_parameters():
            if p.requires_grad:
                continue
            shard = take_init_shard(p)
            if shard is not None:
                check_init_ranks(name, p, self.comm)
                out.append(FrozenShard(p, name, self.comm, shard))
            elif fmt is not None and p.is_floating_point() and p.numel() >= zero.stage3_param_persistence_threshold:
                out.append(FrozenUnit(p, name, fmt))
        return out

    @contextlib.contextmanager
    def _frozen_whole(self):
        """Frozen params kept as codes are whole (dequantized) inside: for
        checkpoints, which save and load them as plain tensors."""
        frozen = [] if self.fetcher is None else [u.param for u in self.fetcher.frozen]
        if not frozen:
            yield
            return
        held = self.fetcher.hold(frozen)
        try:
            yield
        finally:
            self.fetcher.unhold(*held)

    def exact_params(self) -> None:
        """Stages 1-2 with qwZ (``zero_quantized_weights``): the params, every
        rank's dequantized codes after a step, gathered again from the exact
        shards (a collective: every rank calls it), for a reader of the
        weights; the next step's gather makes them codes again. ``gathered()``,
        ``state_dict()`` and ``GatheredParameters`` call it; stage 3's gathers
        for readers are exact anyway. A no-op otherwise."""
        if self.stage in (1, 2) and self.zeropp.weights is not None:
            for g in self.groups:
                g.gather(exact=True)
                g.wait_gather(site="exact")

    def _split_groups(self, groups: list[dict]) -> list[dict]:
        """The param groups the engine shards, from the optimizer's (the
        pipeline engine gives each tied weight a group of its own)."""
        return groups

    def _order_check(self) -> Comm:
        """Where stage 3's per-module agreement runs: the data-parallel group
        when it is host-side (Gloo), else a Gloo group of the same ranks, so
        the check never waits behind the device's collectives."""
        if self.comm.device.type == "cpu":
            return self.comm
        return Comm(gloo_twin(self.comm.group))

    def _sync_module_state(self) -> None:
        """Every rank starts from rank 0's params and buffers."""
        if self.comm.world_size > 1:
            handles = [
                self.comm.broadcast(t.data, 0, "init")
                for t in self.module.state_dict().values()
                if isinstance(t, Tensor)
            ]
            for h in handles:
                h.wait()

    def _build_scheduler(self, client):
        if client is not None and self._config.scheduler.type:
            raise ConfigError("an lr_scheduler was passed to initialize() and the config has a scheduler: keep one")
        if callable(client) and not hasattr(client, "step"):
            return client(self.optimizer)
        if client is not None:
            client.optimizer = self.optimizer  # it was built on the client's optimizer, which the engine replaced
            return client
        if self._config.scheduler.type:
            return SCHEDULES[self._config.scheduler.type](self.optimizer, **self._config.scheduler.params)
        return None

    # -- the training loop ----------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    @property
    def global_rank(self) -> int:
        """This process's rank among all ranks (DeepSpeed's ``engine.global_rank``)."""
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    @property
    def world_size(self) -> int:
        """All ranks (DeepSpeed's ``engine.world_size``); the data-parallel ones are :attr:`dp_world_size`."""
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def is_gradient_accumulation_boundary(self) -> bool:
        """True for the last micro-batch before an optimizer step (or what
        :meth:`set_gradient_accumulation_boundary` set)."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's (Accelerate calls it): overrides the micro-step count's
        boundary from now on: set False before each micro-batch but the last,
        True before the last, then ``step()`` once. The average still divides
        by ``gradient_accumulation_steps``, as DeepSpeed's does."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary(is_boundary={is_boundary!r}): give True or False")
        self._boundary = is_boundary

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: a new micro-batch, the accumulation steps kept (the global batch follows)."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size!r}): give a positive int")
        total = micro_batch_size * self.gradient_accumulation_steps() * self.dp_world_size
        self._config = replace(self._config, train_micro_batch_size_per_gpu=micro_batch_size, train_batch_size=total)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch through the accumulation steps (the micro-batch stays)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1:
            raise ValueError(f"set_train_batch_size({train_batch_size!r}): give a positive int")
        if train_batch_size % per_step:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): not a multiple of micro-batch "
                f"{self.train_micro_batch_size_per_gpu()} x {self.dp_world_size} data-parallel ranks = {per_step}"
            )
        self._config = replace(
            self._config, train_batch_size=train_batch_size, gradient_accumulation_steps=train_batch_size // per_step
        )

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: communication_data_type, else the training dtype."""
        return _COMM_DTYPES.get(self._config.communication_data_type) or self.dtype

    def get_mom(self) -> list:
        """Each param group's ``momentum`` for SGD/RMSprop, else its ``betas`` (DeepSpeed's)."""
        key = "momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas"
        return [g.get(key) for g in self.optimizer.param_groups]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; floating-point input tensors are cast to the
        training dtype (and moved to the engine's device)."""
        start = time.perf_counter()
        cast = lambda x: (
            x.to(self.device, self.dtype if x.is_floating_point() else x.dtype) if isinstance(x, Tensor) else x
        )
        args = tuple(cast(a) for a in args)
        kwargs = {k: cast(v) for k, v in kwargs.items()}
        self.monitor.forward_begin(self)  # the flops profiler's step: its hooks and counter on
        try:
            out = self.module(*args, **kwargs)
        except RuntimeError as exc:
            # an empty (released) param met: which partitioned params the forward may have used outside their module
            hint = self.fetcher.hint(exc) if self.fetcher is not None else None
            if hint is None:
                raise
            raise RuntimeError(f"{exc}\n\n{hint}") from exc
        finally:
            self.monitor.forward_end(self)
        self.timers["forward"] += time.perf_counter() - start
        return out

    def train_batch(self, data_iter=None) -> Tensor:
        """DeepSpeed's pipeline call, refused here with the fix (the pipeline
        engine, for a PipelineModule, has it)."""
        raise TypeError(
            f"train_batch() runs a pipeline, and this engine's model is a {type(self.module).__name__}, not a "
            "fastzero.pipe.PipelineModule: train it with loss = engine(batch); engine.backward(loss); "
            "engine.step(), or build it from LayerSpecs as a PipelineModule (docs/pipeline.md)"
        )

    eval_batch = train_batch

    def register_external_parameter(self, module: torch.nn.Module, param: Tensor) -> None:
        """Stage 3: `module`'s forward uses `param` although another module
        owns it (a tied weight used directly, say): gather it for `module` too."""
        if self.fetcher is not None:
            self.fetcher.register_external(module, param)
        elif self._overlap_gather:
            self._add_param_waits(module, [param])

    def backward(self, loss: Tensor, retain_graph: bool = False) -> None:
        """Backward of `loss` (scaled when fp16); the gradients are reduced in
        buckets as backward produces them (stage 2 every micro-batch, stages
        0-1 on the last one before a step) and waited for before returning."""
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward(loss): loss must be a one-element tensor")
        start = time.perf_counter()
        self.last_loss = loss.detach()
        boundary = self.is_gradient_accumulation_boundary()
        first, self._grads_fresh = self._grads_fresh, False  # a second backward before step() accumulates
        # past 1-bit Adam's freeze_step grads stay local; inside no_sync() they wait for a backward outside
        reduce = boundary and not self._compressing() and not self._no_sync
        if self.zeropp.grads is not None:  # qgZ's stochastic rounding is keyed by the micro step (resumes exactly)
            self.zeropp.grads.round = self.micro_steps
        for group in self.groups:
            group.begin_backward(first, reduce)
        if self.fetcher is not None:
            self.fetcher.agree(None)  # every rank's forward ended at the same module
        if self.loss_scaler is not None:
            loss = loss.float() * self.loss_scaler.loss_scale
        with warnings.catch_warnings():
            # stage 3's backward pre-hooks fire on the first layer too, whose input needs no grad: expected
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            loss.backward(retain_graph=retain_graph)
        self.timers["backward_end"] = time.perf_counter()
        for group in self.groups:
            group.end_backward()
        if self.fetcher is not None:
            self.fetcher.end_backward()
        self._grads_reduced = reduce
        self.timers["backward"] += time.perf_counter() - start

    def step(self) -> None:
        """At an accumulation boundary: the optimizer step over this rank's
        shard, then the all-gather of the updated params; else nothing. A
        non-finite gradient norm (inf/NaN on any rank) skips the step on every
        rank: under fp16 the loss scaler lowers the scale; in fp32/bf16 it
        warns (``non_finite_grads: skip``) or raises :class:`NonFiniteGradients`
        (``raise``)."""
        if self._no_sync:
            raise RuntimeError(
                "engine.step() inside no_sync(): the gradients there are not reduced; step after the block "
                "(as DeepSpeed requires)"
            )
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        start = time.perf_counter()
        self.wait_params("step")  # buckets of params no forward used: the optimizer writes their chunks
        if any(g.unreduced() for g in self.groups):
            raise RuntimeError("gradients were not reduced: call engine.backward(loss), not loss.backward()")
        if self._got_grad is not None:
            self._check_all_used()
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        compressing = self._compressing()
        divisor = self.grad_divisor()
        clip = self._config.gradient_clipping
        # every step: it is also the non-finite check, agreed by every rank (one tiny all-reduce)
        self.grad_norm = (self._local_grad_norm() if compressing else self._grad_norm()) / divisor
        overflow = not math.isfinite(self.grad_norm)
        self._step_applied = not overflow
        self.optimizer.overflow = overflow  # DeepSpeed's ZeRO optimizers' flag (Accelerate reads it)
        if overflow:
            self._non_finite(scale)
        else:
            coef = clip / (self.grad_norm + 1e-6) if clip > 0 and self.grad_norm > clip else 1.0
            if compressing and self.stage == 1:  # the compressed reduce-scatter of the local grads
                for g in self.groups:
                    g.compressed_reduce(divisor / coef)
            self.optimizer.step(grad_scale=divisor / coef)
            # stage 3: the persistent params, one all-gather per dtype over all of them; stages 1-2: per bucket
            handles = refresh_persistent(self.groups) if self.stage == 3 else []
            for g in self.groups if self.stage < 3 else ():
                g.gather()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            for h in handles:
                h.wait("step")
            if not self._overlap_gather:  # else each module's forward waits for its buckets
                self.wait_params("step")
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self._zero_grads()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.timers["step"] += time.perf_counter() - start
        self.monitor.step(self)

    def _grad_ready(self, group: ZeroGroup, i: int, p: Tensor) -> None:
        if self._got_grad is not None:
            self._got_grad.add(id(p))
        group.grad_ready(i, p)

    def _check_all_used(self) -> None:
        """``ignore_unused_parameters: false``: every rank raises if a param
        got no gradient since the last step on any rank (one small
        all-gather per step, only with this setting)."""
        unused = [n for g in self.groups for n, p in zip(g.names, g.params) if id(p) not in self._got_grad]
        self._got_grad.clear()
        everyone = self.comm.all_gather_objects(unused)
        where = [
            f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''} (rank {r})"
            for r, names in enumerate(everyone)
            if names
        ]
        if where:
            self._zero_grads()
            raise RuntimeError(
                f"step {self.global_steps + 1}: params got no gradient: {'; '.join(where)}. Use them in the "
                "forward, freeze them (requires_grad=False), or set zero_optimization.ignore_unused_parameters: "
                "true (they then count as zero gradients)"
            )

    def _non_finite(self, scale: float) -> None:
        """A skipped step: counted, said (with the first param whose gradient
        is not finite, found only now), or raised as configured."""
        self.skipped_steps += 1
        step = self.global_steps + 1
        if self.loss_scaler is not None:
            self.monitor.log(f"step {step}: gradient overflow (loss scale {scale:g}), step skipped")
            return
        local = next((n for g in self.groups if (n := g.first_non_finite()) is not None), None)
        names = self.comm.all_gather_objects(local)
        where = next((f"{n} (on rank {r})" for r, n in enumerate(names) if n is not None), None)
        what = f"step {step}: the gradient norm is {self.grad_norm}"
        what += f"; first non-finite gradient: {where}" if where else ""
        if self._config.non_finite_grads == "raise":
            self._zero_grads()
            raise NonFiniteGradients(f"{what}. Nothing was updated (non_finite_grads: raise)")
        if self.global_rank == 0:
            warnings.warn(f"{what}; the step is skipped on every rank (non_finite_grads: skip)", RuntimeWarning, 2)

    def has_reduced_grads(self) -> bool:
        """Whether the gradients hold what a boundary backward reduced for
        the step, not yet used by it (:mod:`fastzero.runtime.param_access`)."""
        return self._grads_reduced

    def grad_divisor(self) -> float:
        """What the reduced gradients (:meth:`ZeroGroup.grads`: summed over
        ranks and micro-batches, times the loss scale) are divided by to give
        the average gradient the step uses (before clipping)."""
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        # local grads (1-bit Adam past freeze_step) are averaged over ranks by the compressed exchange
        ranks = 1 if self._compressing() else self._post_divide
        return scale * ranks * self.gradient_accumulation_steps()

    def _zero_grads(self) -> None:
        for group in self.groups:
            group.zero_grads()
        self._grads_fresh = True
        self._grads_reduced = False

    def _grad_norm(self) -> float:
        """The global L2 norm of the summed gradients: a local sum of squares
        per shard (accumulated in fp64 over short fp32 runs, see
        fastzero.ops.norms: one fp32 norm of the whole flat buffer comes out
        low and over-scales the clipped step), one tiny all-reduce (stages
        1-3). inf/NaN anywhere gives a non-finite norm: the overflow check."""
        if self.tensor_comm is not None or self.pipe_comm is not None:
            return self._model_parallel_grad_norm()
        sumsq = float(sum(sum_of_squares(g.grads()) for g in self.groups))
        if self.stage >= 1:
            (sumsq,) = self.comm.all_reduce_scalars([sumsq], tag="norm")
        return math.sqrt(sumsq) if sumsq >= 0 else float("nan")

    def _counted(self, group: ZeroGroup) -> bool:
        """Whether `group`'s gradients count in the norm here (the pipeline
        engine counts a tied weight on one of the stages that hold it)."""
        return True

    def _model_parallel_grad_norm(self) -> float:
        """With a tensor or pipe group: the sums of squares of split params
        (``is_tensor_parallel``) and of replicated ones, taken apart per
        owned piece and summed over the data group; then over the tensor
        group the split ones' sum, plus the replicated ones' from tensor
        rank 0 only (every tensor rank holds the same replicated gradient),
        and a flag for a non-finite replicated gradient on any rank; then
        the same over the pipe group (each stage holds other params), so that
        every rank of the world agrees on the norm and on an overflow."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # split, replicated: one host sync at the end
        for g in self.groups:
            if not self._counted(g):
                continue
            marked = {n for n, p in zip(g.names, g.params) if is_tensor_parallel(p)}
            for piece in g.owned(g.optimizer_params()):
                grad = piece.opt_param.grad
                if grad is not None:
                    window = grad.reshape(-1)[piece.offset : piece.offset + piece.hi - piece.lo]
                    sums[0 if piece.name in marked else 1] += sum_of_squares(window).to(sums.device)
        split, whole = sums.tolist()
        if self.stage >= 1:
            split, whole = self.comm.all_reduce_scalars([split, whole], tag="norm")
        tensor_rank = 0 if self.tensor_comm is None else self.tensor_comm.rank
        counted, bad = split + (whole if tensor_rank == 0 else 0.0), 0.0 if math.isfinite(whole) else 1.0
        for comm in (self.tensor_comm, self.pipe_comm):
            if comm is not None:
                counted, bad = comm.all_reduce_scalars([counted, bad], tag="norm")
        return math.sqrt(counted) if counted >= 0 and bad == 0 else float("nan")

    def _compressing(self) -> bool:
        return self.onebit and self.optimizer.compressing

    def _local_grad_norm(self) -> float:
        """1-bit Adam past freeze_step: the root mean square over ranks of
        each rank's local gradient norm (one tiny all-reduce; non-finite on
        any rank makes it non-finite everywhere)."""
        sumsq = float(sum(sum_of_squares(g.local_grads()) for g in self.groups))
        (sumsq,) = self.comm.all_reduce_scalars([sumsq], tag="norm")
        return math.sqrt(sumsq / self.comm.world_size) if sumsq >= 0 else float("nan")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are zeroed by the engine after each step; kept for
        DeepSpeed scripts that call it."""

    # -- state -----------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step updated the params (False after a
        step skipped for a non-finite gradient, or before any step)."""
        return self._step_applied

    def empty_partition_cache(self) -> None:
        """Stage 3: releases every gathered param that is not persistent (to
        free memory between, say, training and evaluation); a no-op at
        other stages, where params are never partitioned."""
        if self.fetcher is not None:
            self.fetcher.end_backward()

    def take_timers(self, keys: Iterable[str] = ("forward", "backward", "step")) -> dict[str, float]:
        """The seconds spent in each phase of `keys` since the last call
        (summed over micro-batches and steps), restarting them from zero."""
        out = {}
        for key in keys:
            out[key], self.timers[key] = self.timers[key], 0.0
        return out

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds for model states, by kind: ``params`` (the
        flat low-precision or fp32 params), ``grads`` (flat gradients, or
        the gradient shard), ``grad_buckets`` (stage 2's pooled buffers),
        ``master`` (fp32 master params; 0 in fp32 training, where the params
        are their own masters, and with ``bf16.bf16_master_weights_and_grads``,
        where the bf16 params are) and ``optimizer`` (exp_avg, exp_avg_sq). With
        ZeRO-Offload those two are 0 and ``offload_master``,
        ``offload_optimizer`` and ``offload_staging`` (the pipelined step's
        CPU buffers) are in CPU memory, as ``offload_params`` (stage 3's
        param shards with ``offload_param``). At stage 3 ``params`` is the
        shards plus the params gathered now (the persistent ones between
        steps). With OneBitAdam, ``compression_errors`` is its error-feedback
        buffers. ZeRO++ (docs/zeropp.md): ``hpz_params``, hpZ's secondary
        pieces; ``frozen_codes``, frozen params kept as int8 codes (and any
        dequantized now); qwZ at stages 1-2 adds the exact shard to
        ``params``. ``frozen_params``: the chunks of frozen params that
        ``fastzero.zero.Init`` partitioned (and any gathered now). The values
        add up to the rank's model-state bytes."""
        nbytes = lambda t: t.numel() * t.element_size()
        out = dict(params=0, grads=0, grad_buckets=0, master=0, optimizer=0)
        if self.onebit:  # error feedback: the optimizer's (stage 0) and the groups' (stage 1, added below)
            out["compression_errors"] = self.optimizer.error_bytes()
        offloaded = getattr(self.optimizer, "offloaded_bytes", None)
        if offloaded is not None:  # ZeRO-Offload: master and state in CPU memory, not on the device
            out.update({f"offload_{k}": v for k, v in offloaded().items()})
        for g in self.groups:
            for key, value in g.memory().items():
                out[key] = out.get(key, 0) + value
        for state in () if offloaded is not None else self.optimizer.state.values():
            for key, t in state.items():
                if isinstance(t, Tensor) and t.dim() > 0:
                    out["master" if key == "master_param" else "optimizer"] += nbytes(t)
        masters = getattr(self.optimizer, "master_bytes", None)
        if masters is not None and offloaded is None:  # a client optimizer: its masters are not in its state
            out["master"] += masters()
        frozen = [] if self.fetcher is None else self.fetcher.frozen
        if frozen:  # zero_quantized_nontrainable_weights: the codes, and any frozen param dequantized now
            codes = [u for u in frozen if isinstance(u, FrozenUnit)]
            if codes:
                out["frozen_codes"] = sum(u.packed.numel() + (0 if u.full is None else nbytes(u.full)) for u in codes)
            if len(codes) < len(frozen):  # FrozenShard: frozen params zero.Init partitioned
                out["frozen_params"] = sum(u.nbytes() for u in frozen if isinstance(u, FrozenShard))
        return out

    def gathered(self):
        """Every param whole inside the block (stage 3 gathers the partitioned
        ones and releases them after; other stages hold them whole anyway),
        with their exact values (with qwZ at stages 1-2 they are gathered
        again from the exact shards: a collective then, as at stage 3).
        DeepSpeed's ``zero.GatheredParameters`` for the whole model. Nests:
        the outermost block gathers and releases."""
        return self._gathered(exact=True)

    @contextlib.contextmanager
    def _gathered(self, exact: bool):
        self.wait_params("gathered")
        if exact:
            self.exact_params()
        if self.fetcher is None or self._gather_depth:
            self._gather_depth += 1
            try:
                yield self.module
            finally:
                self._gather_depth -= 1
            return
        held = self.fetcher.gather_all()
        self._gather_depth = 1
        try:
            yield self.module
        finally:
            self._gather_depth = 0
            self.fetcher.unhold(*held)
            self.fetcher.end_backward()

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The wrapped module's state dict, under its own names (no
        ``module.`` prefix), so it loads into the bare model. At stage 3 it is
        a collective (every rank calls it): the params are gathered and the
        dict holds copies of the whole tensors."""
        self.wait_params("state_dict")
        if self.fetcher is None:
            if self.stage in (1, 2) and self.zeropp.weights is not None and not self._warned_codes:
                self._warned_codes = True  # local (no collective: rank 0 alone may call it), so say what it holds
                warnings.warn(
                    "engine.state_dict() with zero_quantized_weights at stage 1-2 holds the params the model "
                    "computes with: the dequantized int8 codes of the last step's all-gather. For the exact weights "
                    "use engine.gathered() or save_16bit_model (every rank calls them), or save_checkpoint",
                    stacklevel=2,
                )
            return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        with self.gathered() as module:
            state = module.state_dict(prefix=prefix)
            copies = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in state.items()}
        if destination is not None:
            destination.update(copies)
            return destination
        return copies

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Into the wrapped module (keys as :meth:`state_dict` gives them; a
        ``module.`` prefix on every key is taken off), then this rank's
        shards and fp32 masters take the loaded values; the optimizer state
        is kept. At stage 3 a collective: every rank passes the same dict."""
        if assign:
            raise ValueError(
                "load_state_dict(assign=True) would swap out the params the engine's flat buffers hold: leave it False"
            )
        own = self.module.state_dict()
        if (
            state_dict
            and all(k.startswith("module.") for k in state_dict)
            and not any(k.startswith("module.") for k in own)
        ):
            state_dict = {k[len("module.") :]: v for k, v in state_dict.items()}
        with self._gathered(exact=False) as module:  # the values are replaced: nothing to gather exactly
            result = module.load_state_dict(state_dict, strict=strict)
            self.refresh_from_module()
        return result

    def save_16bit_model(
        self, save_dir, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """The whole model in its training dtype, written by rank 0 (every
        rank calls it), without the frozen params if asked. At stage 3 only
        with ``stage3_gather_16bit_weights_on_model_save``, as DeepSpeed;
        returns whether it was saved."""
        self._refuse_tensor_parallel("save_16bit_model")
        if self.stage == 3 and not self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            warnings.warn(
                "save_16bit_model at stage 3 needs zero_optimization."
                "stage3_gather_16bit_weights_on_model_save: true; nothing saved",
                stacklevel=2,
            )
            return False
        state = self._whole_state(exclude_frozen_parameters)
        if state is not None:
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
        self.comm.barrier()
        return True

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's (Accelerate saves stage-3 models through it): the
        whole model's state dict in its training dtype, on the CPU, on rank
        0, and None on the others; every rank calls it."""
        if self.stage != 3:
            raise ValueError(
                f"_zero3_consolidated_16bit_state_dict is for ZeRO stage 3, and this engine runs stage {self.stage}, "
                "where every rank holds the whole model: use engine.module_state_dict()"
            )
        self._refuse_tensor_parallel("_zero3_consolidated_16bit_state_dict")
        return self._whole_state(exclude_frozen_parameters)

    def _whole_state(self, exclude_frozen: bool) -> dict | None:
        """Rank 0: CPU copies of the whole module's state dict (params gathered); None elsewhere."""
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad} if exclude_frozen else set()
        with self.gathered() as module:
            if self.comm.rank != 0:
                return None
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k not in frozen}

    def module_state_dict(
        self, destination=None, prefix: str = "", keep_vars: bool = False, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any]:
        """DeepSpeed's: :meth:`state_dict` (the wrapped module's, under its
        own names), without the frozen params' entries if asked."""
        sd = self.state_dict(destination, prefix, keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        return sd

    def load_module_state_dict(
        self, checkpoint: dict, strict: bool = True, custom_load_fn=None, fetch_z3_params: bool = False, **more
    ):
        """DeepSpeed's: ``checkpoint["module"]`` into the model through
        :meth:`load_state_dict` (at stage 3 the params are gathered for it
        anyway, so ``fetch_z3_params`` changes nothing); with
        ``custom_load_fn``, ``custom_load_fn(src=..., dst=module)`` inside
        ``gathered()``, whose edits are kept."""
        if more:
            raise TypeError(f"load_module_state_dict: {', '.join(more)} not supported (DeepSpeed's expert options)")
        if not isinstance(checkpoint, dict) or "module" not in checkpoint:
            raise ValueError("load_module_state_dict(checkpoint): give a dict with the module's state under 'module'")
        if custom_load_fn is None:
            return self.load_state_dict(checkpoint["module"], strict=strict)
        with self.gathered() as module:
            custom_load_fn(src=checkpoint["module"], dst=module)
            self.refresh_from_module()
        return None

    def destroy(self) -> None:
        """DeepSpeed's: frees what the engine holds between uses (stage 3's gathered params)."""
        self.empty_partition_cache()

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's: the backwards inside reduce nothing; their gradients
        accumulate on this rank and the next backward outside reduces the
        sum. ``step()`` inside is refused, and so are stages 2-3, which
        partition the gradients as backward produces them (DeepSpeed's
        rules)."""
        if self.stage >= 2:
            raise RuntimeError(
                f"no_sync() at ZeRO stage {self.stage}: the gradients are partitioned as backward produces them, "
                "so every backward reduces (as in DeepSpeed); use gradient_accumulation_steps, or stage 0-1"
            )
        if self._no_sync:
            raise RuntimeError("no_sync() inside no_sync(): it does not nest (as in DeepSpeed)")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def compile(
        self, backend=None, compile_kwargs: dict | None = None, schedule=None, compiled_autograd_enabled: bool = False
    ) -> None:
        """DeepSpeed's: ``torch.compile`` of the wrapped module's forward
        (``backend``, and ``compile_kwargs`` for the rest of
        ``torch.compile``'s arguments); the engine around it stays eager.
        Stages 0-2 (a stage-3 param is gathered and released around each
        use, which a compiled graph's saved tensors do not survive);
        DeepCompile's ``schedule`` and compiled autograd are not
        implemented. Once per engine, as DeepSpeed's."""
        if schedule is not None or compiled_autograd_enabled:
            raise NotImplementedError("compile(schedule=..., compiled_autograd_enabled=True): DeepCompile's options")
        if self.stage == 3:
            raise NotImplementedError(
                "compile() at ZeRO stage 3: the params are gathered and released around each module, which a "
                "compiled graph does not survive; run stage 3 uncompiled, or compile at stages 0-2"
            )
        if self._compiled:
            return
        kwargs = dict(compile_kwargs or {})
        if backend is not None:
            kwargs["backend"] = backend
        self.module.compile(**kwargs)
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._compiled

    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """DeepSpeed's signature. Every rank calls it; returns the tag's
        directory (docs/checkpoints.md). `exclude_frozen_parameters`: the
        frozen params (``requires_grad=False``) are not saved, and a strict
        load does not miss them (the model keeps its own), as DeepSpeed."""
        from fastzero.runtime.checkpoint_io import save_checkpoint

        self.wait_params("save_checkpoint")
        with self._frozen_whole():
            return save_checkpoint(self, save_dir, tag, client_state or {}, save_latest, exclude_frozen_parameters)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn=None,
    ):
        """DeepSpeed's signature and argument order. Returns (the tag's
        directory, client_state), or (None, None) when there is no
        ``latest``. `load_module_only`: the weights and buffers only (no
        optimizer state, schedule, loss scale, step counters or RNG), as
        DeepSpeed's; `custom_load_fn` is refused by name."""
        from fastzero.runtime.checkpoint_io import load_checkpoint

        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported: leave it None")
        self.wait_params("load_checkpoint")  # an all-gather in flight would overwrite what is loaded
        with self._frozen_whole():
            return load_checkpoint(
                self,
                load_dir,
                tag,
                load_optimizer_states,
                load_lr_scheduler_states,
                load_module_strict,
                load_module_only,
            )

    def _refuse_tensor_parallel(self, what: str) -> None:
        # each tensor rank (pipeline stage) holds its own pieces (layers): one file would need them gathered
        if self.tensor_comm is not None or self.pipe_comm is not None:
            raise NotImplementedError(
                f"{what} with tensor or pipeline parallelism: save_checkpoint, then write the "
                "unsplit model with `python -m fastzero.checkpoint consolidate` (or fastzero.utils.zero_to_fp32)"
            )

    def refresh_from_module(self, params: Iterable[Tensor] | None = None) -> None:
        """After the module's trained params were changed outside training
        (edited in place, a state dict loaded into them): this rank's shard
        of them (all, or `params`) and its fp32 master take their current
        values; the optimizer state (exp_avg, exp_avg_sq, step) is kept.
        Every rank calls it with the params whole (at stage 3 inside
        ``engine.gathered()`` or ``fastzero.zero.GatheredParameters``) and
        holding the same values; it runs no collectives."""
        self.wait_params("refresh_from_module")
        trained = {id(p) for g in self.groups for p in g.params}
        wanted = None
        if params is not None:
            params = [params] if isinstance(params, Tensor) else list(params)
            names = {id(p): n for n, p in self.module.named_parameters()}
            for i, p in enumerate(params):
                if id(p) not in trained:
                    what = f"{names[id(p)]!r} is frozen" if id(p) in names else "it is not a parameter of the model"
                    raise ValueError(
                        f"refresh_from_module: params[{i}] is not a param this engine trains ({what}); pass the "
                        "trained params, or None for all"
                    )
            wanted = {id(p) for p in params}
        with torch.no_grad():
            for group, opt_group in zip(self.groups, self.optimizer.param_groups):
                mine = [p for p in group.params if wanted is None or id(p) in wanted]
                if mine:
                    group.reload_from_params(self.optimizer, opt_group["params"], mine)
            sync = getattr(self.optimizer, "sync_device_params", None)
            if sync is not None:  # offloaded masters were refreshed: the device shards from them
                sync()


def _cycle(loader) -> Iterable:
    while True:
        yield from loader


def initialize(
    args=None,
    model: torch.nn.Module | None = None,
    optimizer=None,
    model_parameters: Iterable | None = None,
    training_data=None,
    lr_scheduler=None,
    config: str | dict | None = None,
    config_params: dict | None = None,
    collate_fn=None,
    dist_init_required: bool | None = None,
    mpu: Any = None,
    topology: Topology | ProcessTopology | None = None,
):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, dataloader,
    lr_scheduler)``. Joins the process group from the launcher's environment
    when there is more than one rank and none exists yet.

    `topology` (a :class:`fastzero.parallel.Topology`, or a DeepSpeed-style
    ProcessTopology it is built from) or `mpu` (any object with Megatron's
    mpu interface), else the current one (:func:`fastzero.parallel.current`):
    ZeRO partitions and reduces over its data-parallel group, the batch
    sizes count data-parallel ranks, and it becomes the current one. With
    none, every rank is a data-parallel rank."""
    if model is None:
        raise ValueError("initialize() needs model=")
    from fastzero.config import autotp_size, config_from_args  # here: Engine's imports above are another change's

    config = config if config is not None else config_params
    # --deepspeed_config / --deepscale_config / --fastzero_config (fastzero.add_config_arguments)
    config = config_from_args(args, config)
    if config is None:
        raise ConfigError(
            "initialize() needs config= (a path to ds_config.json or a dict) or args with --deepspeed_config"
        )
    if topology is not None and mpu is not None:
        raise ValueError("initialize(): pass topology= or mpu=, not both (a Topology is an mpu)")
    env = dist_env()
    if env.world_size > 1 and dist_init_required is not False:
        init_distributed()
    if isinstance(topology, ProcessTopology):
        topology = Topology.of(topology)
    elif topology is not None:
        raise TypeError(f"initialize(topology=...) takes a fastzero.parallel.Topology, not {type(topology).__name__}")
    parallel = topology if topology is not None else mpu if mpu is not None else current()
    from fastzero.pipe.module import PipelineModule

    pipelined = isinstance(model, PipelineModule)
    if pipelined:  # the module's topology, built with it: pipe outermost
        if (topology is not None or mpu is not None) and parallel is not model.topology:
            raise ValueError(
                "initialize(): a PipelineModule trains over the topology it was built with; pass it as "
                "PipelineModule(topology=...) and leave topology=/mpu= out"
            )
        parallel = model.topology
    tp = autotp_size(config)  # tensor_parallel.autotp_size: AutoTP here, unless the model is sharded already
    if tp > 1:
        from fastzero.parallel.autotp import tp_model_init

        if parallel is None:
            parallel = Topology(tensor=tp)
        tp_model_init(model, tp, mpu=parallel)
    comm = Comm(data_group(mpu=parallel) if parallel is not None else None)  # the data-parallel ranks
    world = Comm()
    cfg = error = None
    try:
        cfg = load_config(config, world_size=comm.world_size)  # train_batch = micro * accumulation * data ranks
    except ConfigError as exc:
        error = exc
        if comm.world_size != world.world_size:
            error = ConfigError(
                f"{exc} (the world size in the batch arithmetic is the data-parallel size, {comm.world_size} of "
                f"{world.world_size} ranks)"
            )
    # every rank raises if any rank's config, or the model of any rank of its pipeline stage, differs
    check_start(world, cfg, error, model, part=model.stage_id if pipelined else 0)
    # the comms_logger section configures the communication logger before the engine's first collective
    # (DeepSpeed's dist.configure(config)); without one, a fastzero.comm.configure() the script made stays
    comms_logging.configure(cfg)
    kwargs = dict(model_parameters=model_parameters, optimizer=optimizer, lr_scheduler=lr_scheduler, comm=comm)
    if pipelined:
        from fastzero.runtime.pipe_engine import PipelineEngine  # it builds on this module

        engine = PipelineEngine(model, cfg, **kwargs)
    else:
        engine = Engine(model, cfg, mpu=parallel, **kwargs)
    if parallel is not None:
        set_current(parallel)  # the parallel layers' default from now on
    loader = None
    if training_data is not None:
        drop_last = cfg.dataloader_drop_last  # drop the last, short micro-batch (DeepSpeed's key)
        # split over the data-parallel ranks (tensor ranks of one data rank see the same) and shuffled, with one
        # rank too, as DeepSpeed's loader: the same order as its (seed 0; set_epoch(e) on data_sampler reshuffles)
        sampler = torch.utils.data.DistributedSampler(training_data, comm.world_size, comm.rank, drop_last=drop_last)
        loader = torch.utils.data.DataLoader(
            training_data,
            batch_size=cfg.train_micro_batch_size_per_gpu,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
        )
        loader.data_sampler = sampler  # DeepSpeed's loader's name for it
        engine.training_dataloader = loader
        if pipelined:  # train_batch() with no iterator cycles over the loader, as DeepSpeed's does
            engine.set_dataiterator(_cycle(loader))
    # the config's activation_checkpointing section configures fastzero.checkpointing (DeepSpeed's
    # checkpointing.configure(mpu, deepspeed_config=...)); without one, a configure() the script made stays
    from fastzero.parallel import checkpointing

    if cfg.activation_checkpointing != type(cfg.activation_checkpointing)() or not checkpointing.is_configured():
        if cfg.activation_checkpointing.partition_activations and parallel is None and comm.world_size > 1:
            raise ConfigError(
                "activation_checkpointing.partition_activations splits saved inputs across the tensor-parallel "
                "group, and without a topology or mpu every rank is data parallel (different activations): pass "
                "topology= or mpu= to initialize, or set partition_activations to false"
            )
        checkpointing.configure(parallel, deepspeed_config=cfg)  # its tensor group partitions the activations
    engine.config = config  # as DeepSpeed's engine: the config given (the model's own: engine.module.config)
    return engine, engine.optimizer, loader, engine.lr_scheduler


DeepSpeedEngine = Engine  # DeepSpeed's name, at its path (deepspeed.runtime.engine.DeepSpeedEngine)
