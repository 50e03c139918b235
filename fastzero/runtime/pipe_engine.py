"""The pipeline engine: trains a :class:`fastzero.pipe.PipelineModule` by
running a schedule (:mod:`fastzero.pipe.schedule`: per-rank instruction
lists) through one interpreter, over the pipe x data (x tensor) topology,
with ZeRO over the data axis as the plain engine does.

What it adds to :class:`~fastzero.runtime.engine.Engine`:

* ``train_batch(data_iter)`` / ``eval_batch(data_iter)``: micro-batches =
  ``gradient_accumulation_steps``; the first stage loads inputs, the last
  loads labels and computes the loss; activations and their gradients travel
  by :class:`fastzero.pipe.p2p.P2P`.
* The ZeRO groups see a pipeline stage's backwards as the plain engine's
  micro-batch backwards: the first accumulates fresh, the last is the
  boundary whose reductions overlap it; stage 2 too reduces on the boundary
  only (``FlatGroup(reduce_once=True)``). Zero-bubble's split backward hands
  every gradient over at W (:mod:`fastzero.pipe.weight_grad`), so the groups
  see one accumulation per micro-batch there too.
* Tied weights (``TiedLayerSpec``) get a ZeRO group of their own per key,
  laid out alike on every stage that holds the key; after the data-parallel
  reduction their gradient (or shard) is summed over those stages, and the
  norm counts it on the first of them only.
* The gradient norm and the overflow check span every stage.
* ZeRO stage 3: a step gathers this stage's params once, before its first
  forward, and holds them until its last backward (W under zb-h1), so the
  all-gathers per step do not grow with the micro-batches; gradients are
  reduce-scattered per micro-batch as stage 3 does.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fastzero.comm import Comm
from fastzero.config import ConfigError
from fastzero.pipe import schedule as sched
from fastzero.pipe.channels import ChannelP2P
from fastzero.pipe.module import PipelineModule
from fastzero.pipe.p2p import P2P
from fastzero.pipe.simulate import default_schedule, simulate_schedule
from fastzero.pipe.weight_grad import DeferWeightGrads, WeightGradStore
from fastzero.runtime.engine import Engine
from fastzero.runtime.groups import ZeroGroup


class PipelineError(RuntimeError):
    """A pipeline step that cannot go on (a data iterator ran dry, a misuse)."""


def _tensors(obj: Any) -> list[Tensor]:
    """The tensors of a (nested) tuple/list/dict, in order."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _cast(obj: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Floating tensors to the training dtype and every tensor to `device`."""
    if isinstance(obj, Tensor):
        return obj.to(device, dtype if obj.is_floating_point() else obj.dtype)
    if isinstance(obj, tuple):
        return tuple(_cast(o, device, dtype) for o in obj)
    if isinstance(obj, list):
        return [_cast(o, device, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: _cast(v, device, dtype) for k, v in obj.items()}
    return obj


def _leaves(obj: Any) -> Any:
    """A received activation as graph leaves: floating tensors require grad."""
    if isinstance(obj, Tensor):
        return obj.detach().requires_grad_(obj.is_floating_point())
    if isinstance(obj, tuple):
        return tuple(_leaves(o) for o in obj)
    if isinstance(obj, list):
        return [_leaves(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _leaves(v) for k, v in obj.items()}
    return obj


@dataclass
class _MicroBatch:
    """One (micro-batch, chunk)'s state on this rank, from load to backward."""

    inputs: Any = None  # what the chunk's forward takes (loaded, or received as leaves)
    outputs: Any = None  # its forward's output (the loss on the last part)
    recv: Any = None  # a posted receive of the input (RecvActivation)
    recv_grad: Any = None  # a posted receive of the output's gradient (RecvGrad)
    input_grads: Any = None  # the gradient of the inputs, to send back
    store: WeightGradStore | None = None  # zb: what B left for W


@dataclass
class _Step:
    """One train_batch/eval_batch's state."""

    train: bool
    compute_loss: bool = True
    keep_outputs: bool = False  # eval_batch(return_logits=True): the last part's outputs
    batches: dict[int, Any] = field(default_factory=dict)  # micro-batch -> (inputs, labels) loaded on this rank
    slots: dict[tuple[int, int], _MicroBatch] = field(default_factory=dict)
    losses: list[Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    sends: list[Any] = field(default_factory=list)
    backwards: int = 0  # gradient accumulations done (BackwardPass or BackwardWeight)
    total_backwards: int = 0

    def slot(self, mb: int, chunk: int) -> _MicroBatch:
        return self.slots.setdefault((mb, chunk), _MicroBatch())

    def release(self, mb: int, chunk: int) -> None:
        """Drops the slot once nothing of it is pending (its gradient sent, W done)."""
        slot = self.slots.get((mb, chunk))
        if slot is not None and slot.input_grads is None and slot.store is None:
            del self.slots[(mb, chunk)]


class PipelineEngine(Engine):
    """Trains a :class:`~fastzero.pipe.PipelineModule`; built by
    ``fastzero.initialize`` when the model is one. Only
    :meth:`train_batch` and :meth:`eval_batch` run the model (as in
    DeepSpeed's PipelineEngine)."""

    _pipelined = True

    def __init__(self, module: PipelineModule, config, **kwargs: Any) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(
                f"the pipeline engine trains a fastzero.pipe.PipelineModule, not {type(module).__name__}: build the "
                "model from LayerSpecs (docs/pipeline.md)"
            )
        hpz = config.zero_optimization.zero_hpz_partition_size
        if hpz > 1:
            raise ConfigError(
                f"zero_optimization.zero_hpz_partition_size = {hpz} with a pipeline: at stage 3 the pipeline engine "
                "gathers each param of its stage once per step and holds it for every micro-batch, so no later gather "
                "is left for hpZ to keep inside the node; leave it at 1 (qwZ and qgZ work with pipelines)"
            )
        super().__init__(module, config, mpu=module.topology, **kwargs)
        if self._overlap_gather:
            # a layer run as forward_fn(module, x) (a tied embedding as the output head): that module's forward
            # never runs, so the chunk's forward pre-hook waits for its params' post-step all-gather
            for chunk in module.chunks:
                for func in chunk.forward_funcs:
                    if isinstance(func, functools.partial) and func.args and isinstance(func.args[0], torch.nn.Module):
                        for p in func.args[0].parameters():
                            self.register_external_parameter(chunk, p)
        pc = config.pipeline
        self.num_stages, self.stage_id = module.num_stages, module.stage_id
        self.virtual_stages = module.virtual_stages
        if pc.virtual_stages is not None and pc.virtual_stages != self.virtual_stages:
            raise ConfigError(
                f"pipeline.virtual_stages = {pc.virtual_stages} but the PipelineModule was built with "
                f"virtual_stages={self.virtual_stages}: make them equal (or leave the key out)"
            )
        if pc.stages != "auto" and pc.stages != self.num_stages:
            raise ConfigError(
                f"pipeline.stages = {pc.stages} but the PipelineModule has {self.num_stages} stages: make them equal "
                '(or "auto")'
            )
        # NCCL matches a rank pair's sends and receives in the order posted, whatever the channel: only 1f1b posts
        # them in the same order on both ends, so the other schedules need a communicator per channel
        # (fastzero.pipe.channels); Gloo's tags keep channels apart in one group
        nccl = self.device.type != "cpu"
        self._channel_groups = pc.p2p_groups == "per_channel" or (pc.p2p_groups == "auto" and nccl)
        self.schedule_name = self._pick_schedule(pc.schedule)
        if nccl and not self._channel_groups and self.schedule_name != "1f1b":
            raise ConfigError(
                f"pipeline.schedule {self.schedule_name} on {self.device.type} (NCCL) with pipeline.p2p_groups "
                '"shared": its two ends of a stage pair post messages in different orders, which one NCCL '
                'communicator cannot match; set p2p_groups to "auto" or "per_channel" (or use schedule 1f1b)'
            )
        if self.schedule_name == "zb-h1" and getattr(module, "activation_checkpoint_interval", 0):
            raise ConfigError(
                "pipeline.schedule zb-h1 splits each backward into input and weight halves, which a recomputed "
                "(checkpointed) layer cannot: set activation_checkpoint_interval=0 or use schedule 1f1b/interleaved"
            )
        try:  # a schedule that cannot run these sizes says so now, not at the first train_batch
            self._schedule(self.gradient_accumulation_steps(), train=True)
        except ValueError as exc:
            raise ConfigError(f"pipeline.schedule {self.schedule_name}: {exc}") from None
        self._parts = self.num_stages * self.virtual_stages
        if self._channel_groups:
            pipelines = module.topology.get_axis_comm_lists("pipe")
            self.p2p = ChannelP2P(pipelines, self._parts, timeout=pc.p2p_timeout, device=self.device)
        else:
            self.p2p = P2P(timeout=pc.p2p_timeout, device=self.device)
        self._inside_step = False
        self.data_iterator: Iterator | None = None
        self._held: tuple[list, list] | None = None  # stage 3: the units gathered for the whole step
        # the last train_batch's idle fraction on this rank (time waiting for a neighbour) and the schedule's
        # simulated one (all ranks; forward 1, backward 2), for gradient_accumulation_steps micro-batches
        self.bubble: dict[str, float] = {}
        self._theory: tuple[int, float] = (0, 0.0)

    # -- set-up -----------------------------------------------------------------------------
    def _split_groups(self, groups: list[dict]) -> list[dict]:
        """Each tied key's params get a group of their own (same settings),
        in key order: every stage holding the key lays it out alike, so the
        data-parallel shards line up across stages and one all-reduce over
        the key's stages sums them."""
        tied = self.module.tied_groups()
        # key, ids of its params, its process group, whether this stage counts it in the norm (the first holder)
        self._tied: list[tuple[str, set[int], Any, bool]] = []
        by_name = dict(self.module.named_parameters())
        topo = self.module.topology
        out = []
        for key in sorted(tied):
            names, ranks, group = tied[key]
            ids = {id(by_name[n]) for n in names if n in by_name}
            if ids:
                first = min(topo.get_coord(r).pipe for r in ranks)
                self._tied.append((key, ids, group, first == self.module.stage_id))
        taken: set[int] = set()
        for g in groups:
            rest = [p for p in g["params"] if not any(id(p) in t[1] for t in self._tied)]
            if rest:
                out.append({**g, "params": rest})
        for _, ids, *_ in self._tied:
            for g in groups:
                mine = [p for p in g["params"] if id(p) in ids and id(p) not in taken]
                taken.update(id(p) for p in mine)
                if mine:
                    out.append({**g, "params": mine})
        return out

    def _tied_of(self, group: ZeroGroup) -> tuple[str, set[int], Any, bool] | None:
        return next((t for t in self._tied if group.params and id(group.params[0]) in t[1]), None)

    def _counted(self, group: ZeroGroup) -> bool:
        tied = self._tied_of(group)
        return tied is None or tied[3]

    def _pick_schedule(self, name: str) -> str:
        if name != "auto":
            if name == "interleaved" and self.virtual_stages < 2:
                raise ConfigError(
                    "pipeline.schedule interleaved needs virtual stages: build the PipelineModule with "
                    "virtual_stages >= 2 (or use 1f1b / zb-h1)"
                )
            if name != "interleaved" and self.virtual_stages > 1:
                raise ConfigError(
                    f"pipeline.schedule {name} runs one chunk per stage, but the PipelineModule has "
                    f"virtual_stages={self.virtual_stages}: use schedule interleaved (or auto)"
                )
            return name
        if self.virtual_stages > 1:  # the module is cut into chunks: only the interleaved schedule runs them
            return "interleaved"
        if self.device.type != "cpu" and not self._channel_groups:
            return "1f1b"  # the one schedule one NCCL communicator per pair can run (above)
        return default_schedule(self.gradient_accumulation_steps(), self.num_stages)

    # -- who is where -------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def _part(self, chunk: int) -> int:
        return self.stage_id + chunk * self.num_stages

    def _rank_of_part(self, part: int) -> int:
        """The global rank holding global part `part` at this rank's data and tensor coordinates."""
        topo = self.module.topology
        coord = topo.get_coord(self.global_rank)._asdict()
        coord["pipe"] = part % self.num_stages
        return topo.get_rank(**coord)

    # -- the API --------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("a pipeline engine runs the model through train_batch() and eval_batch() only")

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("a pipeline engine runs the model through train_batch() and eval_batch() only")

    def step(self) -> None:
        if not self._inside_step:
            raise PipelineError("a pipeline engine steps inside train_batch(); do not call step()")
        super().step()

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator train_batch()/eval_batch() pull from when given none
        (DeepSpeed's; ``initialize(training_data=...)`` sets one cycling over
        its loader)."""
        self.data_iterator = iterator

    def train_batch(self, data_iter: Iterator | None = None) -> Tensor:
        """One optimizer step over ``gradient_accumulation_steps``
        micro-batches of `data_iter` (``(inputs, labels)`` pairs, pulled on the
        first and the last stage; default: :meth:`set_dataiterator`'s);
        returns the mean micro-batch loss (over micro-batches and
        data-parallel ranks) on every rank."""
        data_iter = data_iter if data_iter is not None else self.data_iterator
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() under torch.no_grad(): use eval_batch() to evaluate")
        self.module.train()
        m = self.gradient_accumulation_steps()
        step = _Step(train=True, total_backwards=m * self.virtual_stages)
        self._run(self._schedule(m, train=True), step, data_iter)
        return self._mean_loss(step)

    def eval_batch(
        self,
        data_iter: Iterator | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ):
        """The loss of ``num_micro_batches`` (default
        ``gradient_accumulation_steps``) micro-batches, forward only, as
        DeepSpeed's: the mean over micro-batches (``reduce_output="avg"``) and
        data-parallel ranks, broadcast to every stage (`bcast_loss`);
        ``return_logits=True`` also returns the last stage's outputs (None on
        the others)."""
        data_iter = data_iter if data_iter is not None else self.data_iterator
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output = {reduce_output!r}: use 'avg' or None")
        schedule = self._schedule(num_micro_batches or self.gradient_accumulation_steps(), train=False)
        was_training = self.module.training
        self.module.eval()
        step = _Step(train=False, compute_loss=compute_loss, keep_outputs=return_logits)
        try:
            with torch.no_grad():
                self._run(schedule, step, data_iter)
        finally:
            self.module.train(was_training)
        if reduce_output is None:
            loss = step.losses if self._holds_last() else None
        else:
            loss = self._mean_loss(step, broadcast=bcast_loss) if compute_loss else None
        if return_logits:
            return loss, (step.outputs if self._holds_last() else None)
        return loss

    # -- the interpreter ----------------------------------------------------------------------
    def _schedule(self, micro_batches: int, train: bool) -> sched.PipeSchedule:
        """This rank's schedule (forward-only for eval: DeepSpeed's inference schedule, or interleaved's)."""
        name = self.schedule_name if train else "interleaved" if self.virtual_stages > 1 else "1f1b"
        return sched.make_schedule(
            name, micro_batches, self.num_stages, self.stage_id, virtual_stages=self.virtual_stages, train=train
        )

    def _holds_last(self) -> bool:
        return self._part(self.virtual_stages - 1) == self._parts - 1

    def _run(self, schedule, step: _Step, data_iter) -> None:
        start = time.perf_counter()
        idle = 0.0
        handlers = {
            sched.LoadMicroBatch: self._load,
            sched.ForwardPass: self._forward,
            sched.BackwardPass: self._backward,
            sched.BackwardInput: self._backward_input,
            sched.BackwardWeight: self._backward_weight,
            sched.SendActivation: self._send_activation,
            sched.RecvActivation: self._recv_activation,
            sched.SendGrad: self._send_grad,
            sched.RecvGrad: self._recv_grad,
            sched.ReduceTiedGrads: lambda cmd, step, it: None,  # summed after the reduction (ReduceGrads)
            sched.ReduceGrads: self._reduce_grads,
            sched.OptimizerStep: self._optimizer_step,
        }
        self._hold_params()
        try:
            for instructions in schedule.steps():
                for cmd in instructions:
                    idle += handlers[type(cmd)](cmd, step, data_iter) or 0.0
        finally:
            self._release_params()  # (eval, a stage without backwards, or an error: no collectives in it)
        for h in step.sends:  # (after an error nothing is waited for: the error is the news)
            h.wait()
        total = time.perf_counter() - start
        if step.train:
            m = self.gradient_accumulation_steps()
            if self._theory[0] != m:
                result = simulate_schedule(self.schedule_name, m, self.num_stages, self.virtual_stages)
                self._theory = (m, float(result.bubble_fraction))
            self.bubble = {"measured": idle / total if total > 0 else 0.0, "theory": self._theory[1]}

    def _batch(self, step: _Step, mb: int, data_iter) -> Any:
        if mb not in step.batches:
            if data_iter is None:
                raise PipelineError(
                    f"stage {self.stage_id} needs micro-batches but train_batch()/eval_batch() got no data_iter: "
                    "pass an iterator of (inputs, labels) on the first and last stages"
                )
            try:
                batch = next(data_iter)
            except StopIteration:
                raise PipelineError(
                    f"the data iterator ran dry at micro-batch {mb + 1} of {self.gradient_accumulation_steps()} "
                    f"on stage {self.stage_id}: give at least gradient_accumulation_steps batches per step (wrap it "
                    "in fastzero.utils.RepeatingLoader to cycle)"
                ) from None
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise PipelineError(
                    f"a pipeline micro-batch is an (inputs, labels) pair; the data iterator gave {type(batch).__name__}"
                    + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                )
            step.batches[mb] = _cast(tuple(batch), self.device, self.dtype)
        return step.batches[mb]

    def _load(self, cmd, step: _Step, data_iter) -> None:
        part = self._part(cmd.chunk)
        if part == 0 or part == self._parts - 1:
            self._batch(step, cmd.micro_batch, data_iter)

    def _forward(self, cmd, step: _Step, data_iter) -> float:
        slot = step.slot(cmd.micro_batch, cmd.chunk)
        part, idle = self._part(cmd.chunk), 0.0
        if part == 0:
            slot.inputs = self._batch(step, cmd.micro_batch, data_iter)[0]
        else:
            if slot.recv is None:
                self._recv_activation(cmd, step, data_iter)
            t = time.perf_counter()
            received = slot.recv.wait()
            idle = time.perf_counter() - t
            slot.recv = None
            slot.inputs = _leaves(received) if step.train else received
        chunk = self.module.chunks[cmd.chunk]
        inputs = slot.inputs
        t = time.perf_counter()
        split = step.train and self.schedule_name == "zb-h1"
        with DeferWeightGrads() if split else contextlib.nullcontext():
            out = chunk(inputs)
            if part == self._parts - 1:
                if step.keep_outputs:
                    step.outputs.append(out)
                loss_fn = self.module.loss_fn
                if loss_fn is not None and step.compute_loss:
                    labels = self._batch(step, cmd.micro_batch, data_iter)[1]
                    out = loss_fn(out, labels)
                if isinstance(out, Tensor) and out.numel() == 1:
                    step.losses.append(out.detach().float())
        self.timers["forward"] += time.perf_counter() - t
        slot.outputs = out
        if not step.train:
            slot.inputs = None
        return idle

    def _output_grads(self, slot: _MicroBatch, cmd, step: _Step) -> tuple[list[Tensor], list[Tensor | None], float]:
        """The forward's outputs that need a gradient, and those gradients
        (received, or None for the loss, scaled under fp16)."""
        idle = 0.0
        if self._part(cmd.chunk) == self._parts - 1:
            loss = slot.outputs
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise PipelineError(
                    "the last stage's output is not a one-element loss: give the PipelineModule a loss_fn "
                    "(or make its last layer return the loss)"
                )
            if self.loss_scaler is not None:
                loss = loss.float() * self.loss_scaler.loss_scale
            return [loss], [None], idle
        if slot.recv_grad is None:
            self._recv_grad(cmd, step, None)
        t = time.perf_counter()
        grads = slot.recv_grad.wait()  # one entry (a tensor or None) per tensor of the activation sent
        idle = time.perf_counter() - t
        slot.recv_grad = None
        pairs = [(o, g) for o, g in zip(_tensors(slot.outputs), grads) if g is not None and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs], idle

    def _input_grads(self, slot: _MicroBatch, cmd) -> None:
        """What SendGrad sends: one entry per tensor of the received activation
        (None where it needs none); nothing on the first part."""
        if self._part(cmd.chunk) > 0:
            slot.input_grads = tuple(t.grad if t.requires_grad else None for t in _tensors(slot.inputs))
        slot.inputs = slot.outputs = None

    def _begin_accumulation(self, step: _Step) -> None:
        first, boundary = step.backwards == 0, step.backwards == step.total_backwards - 1
        for group in self.groups:
            group.begin_backward(first, boundary)

    def _end_accumulation(self, step: _Step) -> None:
        for group in self.groups:
            group.end_backward()
        step.backwards += 1
        if step.backwards == step.total_backwards:  # the step's last backward: the optimizer changes the shards
            self._release_params()

    @contextlib.contextmanager
    def _hooks_quiet(self):
        # stage 3's backward pre-hooks fire on the first layer too, whose input needs no grad: expected
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            yield

    def _hold_params(self) -> None:
        """Stage 3: every param of this stage gathered (all in flight at
        once) and held through the step, whatever order the schedule runs
        the micro-batches' forwards and backwards in; a tied weight used
        through a ``forward_fn`` (no module hook fires) is whole too."""
        if self.fetcher is not None and self._held is None:
            # for training: through qwZ's codes when on (the exact weights are for readers)
            self._held = self.fetcher.hold([u.param for u in self.fetcher.unit_of.values()], exact=False)

    def _release_params(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self.fetcher.unhold(*held)
            self.fetcher.end_backward()  # the partitioned params released, as after a plain engine's backward

    def _backward(self, cmd, step: _Step, data_iter) -> float:
        slot = step.slot(cmd.micro_batch, cmd.chunk)
        outs, grads, idle = self._output_grads(slot, cmd, step)
        t = time.perf_counter()
        self._begin_accumulation(step)
        with self._hooks_quiet():
            torch.autograd.backward(outs, grads)
        self._end_accumulation(step)
        self._input_grads(slot, cmd)
        step.release(cmd.micro_batch, cmd.chunk)
        self.timers["backward"] += time.perf_counter() - t
        return idle

    def _backward_input(self, cmd, step: _Step, data_iter) -> float:
        """zb's B: the input's gradient now; every param's gradient waits in
        the store for W."""
        slot = step.slot(cmd.micro_batch, cmd.chunk)
        outs, grads, idle = self._output_grads(slot, cmd, step)
        t = time.perf_counter()
        inputs = [x for x in _tensors(slot.inputs) if x.requires_grad]
        params = [p for p in self.module.chunks[cmd.chunk].parameters() if p.requires_grad]
        slot.store = WeightGradStore()
        with slot.store.filling(), self._hooks_quiet():
            got = torch.autograd.grad(outs, inputs + params, grads, allow_unused=True)
        for x, g in zip(inputs, got):
            x.grad = g
        slot.store.other.extend((p, g) for p, g in zip(params, got[len(inputs) :]) if g is not None)
        self._input_grads(slot, cmd)
        self.timers["backward"] += time.perf_counter() - t
        return idle

    def _backward_weight(self, cmd, step: _Step, data_iter) -> None:
        slot = step.slot(cmd.micro_batch, cmd.chunk)
        t = time.perf_counter()
        params, grads = slot.store.take()
        self._begin_accumulation(step)
        if params:
            torch.autograd.backward(params, grads)
        self._end_accumulation(step)
        slot.store = None
        step.release(cmd.micro_batch, cmd.chunk)
        self.timers["backward"] += time.perf_counter() - t

    def _send_activation(self, cmd, step: _Step, data_iter) -> None:
        slot = step.slot(cmd.micro_batch, cmd.chunk)
        part = self._part(cmd.chunk)
        step.sends.append(self.p2p.isend(slot.outputs, self._rank_of_part(part + 1), f"act{part + 1}"))
        if not step.train:
            slot.outputs = None

    def _recv_activation(self, cmd, step: _Step, data_iter) -> None:
        slot = step.slot(cmd.micro_batch, cmd.chunk)
        if slot.recv is None:
            part = self._part(cmd.chunk)
            slot.recv = self.p2p.irecv(self._rank_of_part(part - 1), f"act{part}")

    def _send_grad(self, cmd, step: _Step, data_iter) -> None:
        slot = step.slot(cmd.micro_batch, cmd.chunk)
        part = self._part(cmd.chunk)
        step.sends.append(self.p2p.isend(slot.input_grads, self._rank_of_part(part - 1), f"grad{part - 1}"))
        slot.input_grads = None
        step.release(cmd.micro_batch, cmd.chunk)

    def _recv_grad(self, cmd, step: _Step, data_iter) -> None:
        slot = step.slot(cmd.micro_batch, cmd.chunk)
        if slot.recv_grad is None:
            part = self._part(cmd.chunk)
            slot.recv_grad = self.p2p.irecv(self._rank_of_part(part + 1), f"grad{part}")

    def _reduce_grads(self, cmd, step: _Step, data_iter) -> None:
        """The data-parallel reductions ran with the last backward; here
        each tied weight's reduced gradient is summed over the stages that
        hold it."""
        for group in self.groups:
            tied = self._tied_of(group)
            if tied is not None and tied[2] is not None:
                Comm(tied[2]).all_reduce(group.grads(), tag="tied").wait()

    def _optimizer_step(self, cmd, step: _Step, data_iter) -> None:
        m = self.gradient_accumulation_steps()
        self.micro_steps += m - 1  # the step below sees the accumulation boundary
        self._inside_step = True
        try:
            self.step()
        finally:
            self._inside_step = False

    def _mean_loss(self, step: _Step, broadcast: bool = True) -> Tensor:
        """The mean micro-batch loss on the last stage, averaged over the
        data-parallel ranks and broadcast over the pipe group."""
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self._holds_last() and step.losses:
            loss = torch.stack(step.losses).mean()
            if self.comm.world_size > 1:
                self.comm.all_reduce(loss, tag="loss").wait()
                loss /= self.comm.world_size
        if broadcast and self.pipe_comm is not None:
            self.pipe_comm.broadcast(loss, src=self.num_stages - 1, tag="loss").wait()
        self.last_loss = loss
        return loss
