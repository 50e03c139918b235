"""Memory needed for model states (params, gradients, optimizer state) under
ZeRO, with DeepSpeed's estimators (``deepspeed.runtime.zero.stage_1_and_2``
and ``stage3``, 0.16) and fastzero's own figure.

DeepSpeed's formulas, for ``N`` params on ``G = nodes * gpus_per_node``
GPUs, mixed precision (16-bit params and grads, fp32 master and Adam
moments), in bytes per GPU and per CPU (the CPU figure includes
``additional_buffer_factor``; the GPU one never does)::

    ZeRO-2, offload none:       GPU  2N + 18N/G              CPU  4N * gpus_per_node * f
    ZeRO-2, offload optimizer:  GPU  2N                      CPU  N * max(4G, 16) * f
    ZeRO-3, offload none:       GPU  4L + 18N/G              CPU  (zero_init ? 4L : 4N) * gpus_per_node * f
    ZeRO-3, offload optimizer:  GPU  4L + 2N/G               CPU  N * c(16) * f
    ZeRO-3, offload both:       GPU  4L                      CPU  N * c(18) * f

    c(k) = k/nodes with zero_init, else max(4 * gpus_per_node, k/nodes)

where ``L`` is the largest layer's param count and 18 = 2 (16-bit grads) +
4 (fp32 grads) + 4 (fp32 master) + 8 (Adam's two moments).

fastzero's layout without offload, between steps (what
:meth:`fastzero.runtime.Engine.memory_breakdown` reports as ``params`` +
``grads`` + ``master`` + ``optimizer``; the gradient buckets excluded) is
:func:`model_states_bytes`::

    stage 2:  2N + 14N/G        16-bit params whole, and shards of the 16-bit grads (2),
                                fp32 master (4) and Adam's moments (8)
    stage 3:  16N/G + 2P        every one of those as a shard, plus the P params of the
                                persistent ones (numel < stage3_param_persistence_threshold)
                                held whole in 16 bits

Against DeepSpeed's figure: at stage 2 it is 4N/G lower (18N/G against
14N/G: fastzero keeps no fp32 copy of the gradient shard; the optimizer
reads the 16-bit shard); at stage 3 it is 16N/G against DeepSpeed's 18N/G
(2 + 2 + 4 + 8 bytes of 16-bit param, 16-bit grad, master and moments
shards), and 2P (persistent params, whole) against DeepSpeed's 4L. The
layers gathered during forward and backward at stage 3 come on top, up to
``stage3_max_live_parameters`` elements of 16 bits. N counts each param
once (tied params share memory); padding the flat layout to G equal
shards adds a few hundred elements per rank at most.

With fewer bytes of optimizer state (docs/optimizers.md, "State formats")
the sharded part shrinks: bf16 states 4 bytes per element instead of 8,
int8 states 2 plus their block scales, and bf16 params without an fp32
master (docs/zero.md) 4 bytes less (:func:`model_states_bytes`'s
``state_format`` and ``master``).

``python -m fastzero.estimate --model-params N [--largest-layer-params L]
--gpus-per-node G --nodes K [--stage 2|3] [--state-format bf16|int8]
[--no-master]`` prints DeepSpeed's table and fastzero's figure (and the
figure with the format or without the master, when asked).
"""

from __future__ import annotations

import argparse
import sys

import torch

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_states_bytes",
    "model_to_params",
    "main",
]

PERSISTENCE_THRESHOLD = 100_000  # the default stage3_param_persistence_threshold (fastzero.config)


def estimate_zero2_model_states_mem_needs(
    total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5
) -> tuple[int, int]:
    """DeepSpeed's ZeRO-2 figure: ``(cpu_bytes, gpu_bytes)`` (formulas in the module's doc)."""
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def estimate_zero3_model_states_mem_needs(
    total_params,
    largest_layer_params,
    num_gpus_per_node=1,
    num_nodes=1,
    cpu_offload=True,
    cpu_offload_params=True,
    zero_init=True,
    additional_buffer_factor=1.5,
) -> tuple[int, int, int]:
    """DeepSpeed's ZeRO-3 figure: ``(cpu_bytes, gpu_bytes, largest_layer_bytes)``."""
    gpus, per_node = num_nodes * num_gpus_per_node, 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        factor = 18 if cpu_offload_params else 16
        gpu = largest if cpu_offload_params else largest + int(2 * total_params / gpus)
        per_param = factor * per_node if zero_init else max(4 * num_gpus_per_node, factor * per_node)
        cpu = total_params * per_param * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / gpus)
        held = largest_layer_params if zero_init else total_params
        cpu = held * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest


# bytes per element of Adam's two moments in each state format (the engine keeps "param_dtype" states in the
# master's dtype, fp32); int8: one byte each plus two fp32 scales per block
STATE_BYTES = {"fp32": 8.0, "param_dtype": 8.0, "bf16": 4.0}


def state_bytes_per_element(state_format: str = "fp32", block_size: int = 256) -> float:
    if state_format == "int8":
        return 2.0 + 8.0 / block_size
    if state_format not in STATE_BYTES:
        raise ValueError(f"state_format={state_format!r}; known: {', '.join([*STATE_BYTES, 'int8'])}")
    return STATE_BYTES[state_format]


def model_states_bytes(
    total_params: int,
    world_size: int,
    stage: int,
    persistent_params: int = 0,
    *,
    state_format: str = "fp32",
    block_size: int = 256,
    master: bool = True,
) -> int:
    """fastzero's model-state bytes per rank, mixed precision, no offload,
    between steps (the module's doc): stage 2 ``2N + 14N/G``, stage 3
    ``16N/G + 2P`` with fp32 states and an fp32 master. ``state_format``
    ("bf16": 4 bytes of moments per element instead of 8; "int8": 2 plus 8
    per ``block_size`` of scales) and ``master=False`` (bf16 params without an
    fp32 master, ``bf16.bf16_master_weights_and_grads``: 4 bytes less) change
    the sharded part: ``2 + 4 (master) + moments`` bytes per element.
    Comparable with the sum of ``params``, ``grads``, ``master`` and
    ``optimizer`` in ``Engine.memory_breakdown()``."""
    sharded = 2 + (4 if master else 0) + state_bytes_per_element(state_format, block_size)
    if stage == 2:
        return int(2 * total_params + sharded * total_params / world_size)
    if stage == 3:
        return int((2 + sharded) * total_params / world_size) + 2 * persistent_params
    raise ValueError(f"stage={stage}: the estimate covers stages 2 and 3")


def model_to_params(model: torch.nn.Module, persistence_threshold: int = PERSISTENCE_THRESHOLD):
    """``(total, largest_layer, persistent)``: params counted once (tied ones
    share memory), the most params one module holds itself, and the params
    stage 3 keeps whole (numel below ``persistence_threshold``)."""
    unique = {p.data_ptr() if p.numel() else id(p): p for p in model.parameters()}
    numel = lambda p: int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()
    total = sum(numel(p) for p in unique.values())
    largest = max((sum(numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    persistent = sum(numel(p) for p in unique.values() if numel(p) < persistence_threshold)
    return total, largest, persistent


def _header(total_params, num_gpus_per_node, num_nodes, largest=None) -> str:
    nodes, gpus = ("nodes" if num_nodes > 1 else "node"), ("GPUs" if num_gpus_per_node > 1 else "GPU")
    model = f"SW: Model with {int(total_params / 1e6)}M total params"
    model += "." if largest is None else f", {int(largest / 1e6)}M largest layer params."
    return (
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n{model}\n"
        "  per CPU  |  per GPU |   Options"
    )


def _row(cpu, gpu, options) -> str:
    return f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}"


def _fastzero_line(total_params, gpus, stage, persistent) -> str:
    figure = model_states_bytes(total_params, gpus, stage, persistent)
    return f"fastzero, offload none, between steps: {figure / 2**30:.2f}GB per GPU (no fp32 grad copy)"


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
) -> None:
    """Prints DeepSpeed's ZeRO-2 table (offload cpu, then none) for a model
    of ``total_params``, and fastzero's own figure."""
    print(_header(total_params, num_gpus_per_node, num_nodes))
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor
        )
        print(_row(cpu, gpu, f"offload_optimizer={'cpu ' if offload else 'none'}"))
    print(_fastzero_line(total_params, num_nodes * num_gpus_per_node, 2, 0))


def estimate_zero2_model_states_mem_needs_all_live(
    model, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
) -> None:
    """:func:`estimate_zero2_model_states_mem_needs_all_cold` for ``model``'s param count."""
    total, _, _ = model_to_params(model)
    estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params,
    largest_layer_params,
    num_gpus_per_node=1,
    num_nodes=1,
    additional_buffer_factor=1.5,
    *,
    persistent_params=0,
) -> None:
    """Prints DeepSpeed's ZeRO-3 table (offload_param, offload_optimizer,
    zero_init) and fastzero's figure (``persistent_params``: see
    :func:`model_states_bytes`; unknown for a hypothetical model, so 0)."""
    print(_header(total_params, num_gpus_per_node, num_nodes, largest_layer_params))
    for offload in (True, False):
        for offload_params in (True, False):
            if offload_params and not offload:
                continue
            for zero_init in (True, False):
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    total_params,
                    largest_layer_params,
                    num_gpus_per_node,
                    num_nodes,
                    offload,
                    offload_params,
                    zero_init,
                    additional_buffer_factor,
                )
                options = (
                    f"offload_param={'cpu ' if offload_params else 'none'}, "
                    f"offload_optimizer={'cpu ' if offload else 'none'}, zero_init={int(zero_init)}"
                )
                print(_row(cpu, gpu, options))
    print(_fastzero_line(total_params, num_nodes * num_gpus_per_node, 3, persistent_params))


def estimate_zero3_model_states_mem_needs_all_live(
    model, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
) -> None:
    """:func:`estimate_zero3_model_states_mem_needs_all_cold` for ``model``
    (its params, largest layer and persistent params)."""
    total, largest, persistent = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(
        total, largest, num_gpus_per_node, num_nodes, additional_buffer_factor, persistent_params=persistent
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastzero.estimate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-params", type=float, required=True, help="total params (1.3e9 is fine)")
    parser.add_argument("--largest-layer-params", type=float, default=None, help="stage 3: the largest layer's")
    parser.add_argument("--gpus-per-node", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--stage", type=int, choices=(2, 3), default=None, help="default: both")
    parser.add_argument("--additional-buffer-factor", type=float, default=1.5)
    parser.add_argument("--state-format", choices=("fp32", "bf16", "int8"), default=None, help="Adam's states")
    parser.add_argument("--no-master", action="store_true", help="bf16 params without an fp32 master")
    args = parser.parse_args(argv)
    total = int(args.model_params)
    common = dict(num_gpus_per_node=args.gpus_per_node, num_nodes=args.nodes)
    if args.stage in (None, 2):
        estimate_zero2_model_states_mem_needs_all_cold(
            total, **common, additional_buffer_factor=args.additional_buffer_factor
        )
    if args.stage in (None, 3):
        if args.largest_layer_params is None:
            parser.error("stage 3 needs --largest-layer-params")
        if args.stage is None:
            print()
        largest = int(args.largest_layer_params)
        estimate_zero3_model_states_mem_needs_all_cold(
            total, largest, **common, additional_buffer_factor=args.additional_buffer_factor
        )
    if args.state_format or args.no_master:
        fmt, gpus = args.state_format or "fp32", args.gpus_per_node * args.nodes
        what = f"state_format={fmt}" + (", no fp32 master" if args.no_master else "")
        for stage in (2, 3) if args.stage is None else (args.stage,):
            figure = model_states_bytes(total, gpus, stage, state_format=fmt, master=not args.no_master)
            print(f"fastzero stage {stage}, {what}, offload none, between steps: {figure / 2**30:.2f}GB per GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
