"""The peer of ``python -m bench.run --kernel zeropp``: DeepSpeed's ZeRO stage 3
with its ZeRO++ keys (qwZ ``zero_quantized_weights``, qgZ
``zero_quantized_gradients``, hpZ ``zero_hpz_partition_size``) on the same
model, data and config as fastzero's job (bench/zeropp_worker.py calls
:func:`deepspeed_job` on every rank, in place of ``fastzero_job``).

DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``, Gloo), with
``LOCAL_SIZE`` set from ``LOCAL_WORLD_SIZE`` as DeepSpeed's own launcher sets
it: the CPU accelerator's ``device_count()`` is the ranks per node, which
qgZ's node-local and cross-node all-to-all groups and hpZ's node-sized
groups are built from.

The counted step: every torch.distributed collective DeepSpeed launches
(``deepspeed.comm`` calls torch.distributed; its TorchBackend keeps its own
references to ``all_gather_into_tensor`` and ``reduce_scatter_tensor``,
which are wrapped too) is recorded as a :class:`fastzero.comm.CommEvent`
with the input tensor's bytes and the group's global ranks, so the bytes
are counted exactly as fastzero's own (``wire_bytes``, ``cross_node_bytes``).
What it moved is told by who called it (the Python stack at launch): the
param all-gathers of the forward and backward (DeepSpeed's param
coordinator) are "param", the gradient reduce-scatter (or qgZ's
all-to-alls) of the ipg buckets "grad", the rest (the persistent params'
all-gather after the step, the gradient norm, the overflow check) "other".
``ZEROPP_DS_TRACE=1``: rank 0 prints each counted collective, its kind,
bytes, group and callers.

The model-state bytes: the distinct storages of the params (persistent ones
whole), their partitions, grads, the optimizer's state and the ZeRO
optimizer's flat buffers after the counted step, plus hpZ's secondary
pieces as they were before that step (DeepSpeed makes them in the forward
and drops them in the step).

DeepSpeed JIT-builds two C++ ops on first use (deepspeed_shm_comm for its
TorchBackend, fused_adam for the config's AdamW) into
~/.cache/torch_extensions: minutes on a small machine, once.

Where DeepSpeed cannot run a variant here (not importable, an op it needs
has no CPU build, it refuses the setting), :func:`deepspeed_job` raises the
worker's ``Skip`` with the exception and where it came from, on every rank
alike and before any collective could wait on a rank that left.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import torch

from .tiny_gpt import lm_loss, make_model
from .zero_worker import held_bytes, optimizer_tensors, tensors_in
from .zeropp_worker import batch

# torch.distributed's collectives: name -> (CommEvent op, how to read the input tensors' bytes from the arguments)
_first = lambda index, name: lambda a, k: _nbytes(a[index] if len(a) > index else k.get(name))
COLLECTIVES = {
    "all_gather_into_tensor": ("all_gather", _first(1, "input_tensor")),
    "_all_gather_base": ("all_gather", _first(1, "input_tensor")),
    "all_gather": ("all_gather", _first(1, "tensor")),
    "all_gather_coalesced": ("all_gather", _first(1, "input_tensor_list")),
    "reduce_scatter_tensor": ("reduce_scatter", _first(1, "input")),
    "_reduce_scatter_base": ("reduce_scatter", _first(1, "input")),
    "reduce_scatter": ("reduce_scatter", _first(1, "input_list")),
    "all_to_all_single": ("all_to_all", _first(1, "input")),
    "all_to_all": ("all_to_all", _first(1, "input_tensor_list")),
    "all_reduce": ("all_reduce", _first(0, "tensor")),
    "all_reduce_coalesced": ("all_reduce", _first(0, "tensors")),
    "broadcast": ("broadcast", _first(0, "tensor")),
}
# collectives CommEvent has no formula for: seen in the counted step, they stop the job (no bytes go uncounted)
UNCOUNTABLE = ("reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")
PARAM_SITES = ("partitioned_param_coordinator.py",)  # fetch_sub_module: the forward's and backward's gathers
GRAD_SITES = ("__reduce_and_partition_ipg_grads", "reduce_scatter_coalesced", "all_to_all_quant_reduce")


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(_nbytes(x) for x in t) if isinstance(t, (list, tuple)) else 0


def site(stack) -> str:
    """param, grad or other, from the frames (file, function) of the call's stack."""
    files = [os.path.basename(f.filename) for f in stack]
    funcs = [f.name for f in stack]
    if any(name in GRAD_SITES for name in funcs):
        return "grad"
    if any(name in PARAM_SITES for name in files):
        return "param"
    return "other"


class Counter:
    """While entered, every collective DeepSpeed launches is recorded as a
    ``(kind, CommEvent)`` in ``events`` (the outermost call only: a
    collective torch builds from another is counted once)."""

    def __init__(self) -> None:
        self.events: list = []
        self.callers: list = []  # the outermost DeepSpeed runtime functions of each call's stack (the trace)
        self.depth = 0
        self.saved: list = []

    def _wrap(self, name, fn):
        import torch.distributed as dist

        from fastzero.comm import CommEvent

        op, size = COLLECTIVES.get(name, (None, None))

        def counted(*args, **kwargs):
            outer = self.depth == 0
            self.depth += 1
            try:
                if outer:
                    if op is None:
                        raise RuntimeError(
                            f"bench.zeropp_deepspeed: DeepSpeed called torch.distributed.{name}, "
                            "which the byte count has no formula for"
                        )
                    group = kwargs.get("group")
                    if group is None:
                        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
                    event = CommEvent(op, name, size(args, kwargs), 0.0, world_size=len(ranks), ranks=ranks)
                    stack = traceback.extract_stack()[:-1]
                    self.events.append((site(stack), event))
                    self.callers.append([f.name for f in stack if "deepspeed/runtime" in f.filename][:4])
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted

    def __enter__(self):
        import deepspeed.comm.comm as ds_comm
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        originals = {}
        for name in (*COLLECTIVES, *UNCOUNTABLE):
            for mod in (dist, c10d):
                fn = getattr(mod, name, None)
                if fn is None:
                    continue
                originals.setdefault(id(fn), (name, fn, self._wrap(name, fn)))
                self.saved.append((mod, name, fn))
                setattr(mod, name, originals[id(fn)][2])
        cdb = ds_comm.cdb  # TorchBackend: all_gather_function / reduce_scatter_function bound at its start
        for attr, value in list(vars(cdb).items()):
            if id(value) in originals and originals[id(value)][1] is value:
                self.saved.append((cdb, attr, value))
                setattr(cdb, attr, originals[id(value)][2])
        return self

    def __exit__(self, *exc):
        for obj, name, fn in reversed(self.saved):
            setattr(obj, name, fn)
        self.saved.clear()
        return False


def zero_keys(zero: dict) -> dict:
    """The zero_optimization keys DeepSpeed's config model knows (it forbids others): fastzero-only keys dropped."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    known = set()
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        known |= {name, field.alias} - {None}
    return {k: v for k, v in zero.items() if k in known}


def where(exc: BaseException) -> str:
    """``ExcType: message (at file:line in func, from file:line in func)``: the
    innermost frame and the innermost one in DeepSpeed outside its op builders."""
    frames = traceback.extract_tb(exc.__traceback__)
    short = lambda f: f"{f.filename.split('site-packages/')[-1]}:{f.lineno} in {f.name}"
    inner = frames[-1] if frames else None
    caller = next(
        (f for f in reversed(frames) if "/deepspeed/" in f.filename and "op_builder" not in f.filename),
        None,
    )
    caller = None if caller is inner else caller
    text = f"{type(exc).__name__}: {str(exc).strip()}"
    if inner is not None:
        text += f" (at {short(inner)}" + (f", from {short(caller)}" if caller is not None else "") + ")"
    return text


# Where the ZeRO++ parts load DeepSpeed's QuantizerBuilder op (its CUDA quantize/dequantize kernels), DeepSpeed 0.19.8
QUANTIZER_SITES = {
    "zero_quantized_weights": "qwZ (zero_quantized_weights) loads QuantizerBuilder in deepspeed.initialize "
    "(deepspeed/runtime/zero/partition_parameters.py, CUDAQuantizer.__init__)",
    "zero_quantized_gradients": "qgZ (zero_quantized_gradients) loads it at the first gradient reduction "
    "(deepspeed/runtime/comm/coalesced_collectives.py, all_to_all_quant_reduce, from stage3.py __avg_scatter_grads)",
}


def needs_quantizer(variant: dict) -> list[str]:
    """The ZeRO++ keys of `variant` that load DeepSpeed's QuantizerBuilder op."""
    return [k for k in QUANTIZER_SITES if variant.get(k)]


def deepspeed_job(spec: dict, config: dict, Skip: type[Exception]):
    """DeepSpeed's stage 3 set up on this rank: ``(step, counted, state_bytes)`` as fastzero_job returns them."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))  # DeepSpeed's launcher sets it
    try:
        import deepspeed
        from deepspeed.ops import op_builder
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"; no process group yet
        raise Skip(f"deepspeed not importable ({where(exc)})") from None
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # made by the import, at INFO
    version = f"DeepSpeed {deepspeed.__version__}, DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}"

    # Decided before any process group exists, alike on every rank: the op qwZ and qgZ load, loaded now as they load
    # it (qgZ does only inside the first backward, past the point where the worker could still report a skip).
    parts = needs_quantizer(spec["variant"])
    if parts:
        builder = None
        try:
            builder = op_builder.QuantizerBuilder()
            builder.load()
        except Exception as exc:  # noqa: BLE001 - the op cannot be had here: the variant cannot run
            sites = "; ".join(QUANTIZER_SITES[p] for p in parts)
            kind = type(builder).__name__ if builder is not None else "?"
            raise Skip(f"{version}: {sites}; here QuantizerBuilder is {kind}, which raised {where(exc)}") from None

    config = dict(config, zero_optimization=zero_keys(config["zero_optimization"]))
    deepspeed.init_distributed(dist_backend="gloo")
    import torch.distributed as dist

    model = make_model(spec["hidden"], spec["layers"])
    try:  # a setting DeepSpeed refuses is refused by every rank at the same point
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except Exception as exc:  # noqa: BLE001
        raise Skip(
            f"{version}: deepspeed.initialize refused {spec['variant'] or 'the base config'}: {where(exc)}"
        ) from None
    rank, world = dist.get_rank(), dist.get_world_size()

    secondary = {"bytes": 0}  # hpZ's pieces, as the counted step's backward left them

    def step(i: int, before_step=None) -> float:
        ids = batch(spec, i, rank, world)
        loss = lm_loss(engine(ids[:, :-1]), ids)
        engine.backward(loss)
        if before_step is not None:
            before_step()
        engine.step()
        return loss.item()

    def held_secondary() -> None:
        # hpZ: a param's secondary piece (its node's share) is made when the forward releases it and dropped by the
        # step (invalidate_secondary_tensor), so it is read here, before the step, and added to the state after it
        secondary["bytes"] = held_bytes(getattr(p, "ds_secondary_tensor", None) for p in engine.module.parameters())

    def counted(i: int, nodes: dict[int, int]) -> tuple[float, dict]:
        from fastzero.comm import cross_node_bytes

        with Counter() as c:
            loss = step(i, held_secondary)
        sums = {f"{side}_{k}": 0.0 for side in ("wire", "cross") for k in ("param", "grad", "other")}
        for k, e in c.events:
            sums[f"wire_{k}"] += e.wire_bytes
            sums[f"cross_{k}"] += cross_node_bytes(e, nodes)
        sums["collectives"] = len(c.events)
        if os.environ.get("ZEROPP_DS_TRACE") and rank == 0:  # what was counted, one line each
            for (k, e), who in zip(c.events, c.callers):
                print(f"trace {k:5s} {e.tag:22s} {e.nbytes:9d} B ranks {e.ranks} {'/'.join(who)}", file=sys.stderr)
        return loss, sums

    def state_bytes() -> int:
        zero = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3: flat buffers and partitions are attributes
        held = list(engine.module.parameters())
        held += [getattr(p, a, None) for p in list(held) for a in ("ds_tensor", "ds_secondary_tensor")]
        held += [p.grad for p in held if p is not None]
        held += optimizer_tensors(zero.optimizer) + tensors_in(vars(zero))
        return held_bytes(held) + secondary["bytes"]

    return step, counted, state_bytes
