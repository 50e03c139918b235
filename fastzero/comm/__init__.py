"""fastzero's communication layer: process-group setup from the launcher's
environment, recorded asynchronous collectives, the flat bucket layout
with bucketed reduce-scatter / all-gather that the ZeRO stages use, and
1-bit Adam's compressed all-reduce, ZeRO++'s quantized all-gather and
reduce-scatter (flat or hierarchical across nodes); torch.distributed's functional
surface under DeepSpeed's names (``import fastzero.comm as dist``, as
``import deepspeed.comm as dist``: :mod:`fastzero.comm.functional`); and
DeepSpeed's communication logger (``log_summary()``: :mod:`fastzero.comm.logger`)."""

from fastzero.comm import functional
from fastzero.comm.buckets import BufferPool, GradReducer, gather_chunks, gather_params
from fastzero.comm.collectives import Comm, CommEvent, Handle, cross_node_bytes, gloo_twin, new_groups
from fastzero.comm.compressed import compressed_allreduce, compressed_reduce_scatter, error_buffers, padded_numel
from fastzero.comm.env import DistEnv, default_backend, dist_env, init_distributed
from fastzero.comm.functional import *  # noqa: F403 (the names in functional.__all__)
from fastzero.comm.layout import Bucket, FlatLayout, Segment
from fastzero.comm.logger import (
    CommsLogger,
    comms_logger,
    configure,
    get_comm_operation_count,
    get_logged_comm_ops,
    has_comm_data,
    log_summary,
    reset_log,
)
from fastzero.comm.quantized import (
    GradQuant,
    Hierarchy,
    QuantFormat,
    QuantizedGather,
    QuantizedReduceScatter,
    hierarchy,
    node_ranks,
)

__all__ = [
    "Bucket",
    "GradQuant",
    "Hierarchy",
    "QuantFormat",
    "QuantizedGather",
    "QuantizedReduceScatter",
    "gather_chunks",
    "cross_node_bytes",
    "hierarchy",
    "new_groups",
    "node_ranks",
    "BufferPool",
    "Comm",
    "CommsLogger",
    "comms_logger",
    "configure",
    "get_comm_operation_count",
    "get_logged_comm_ops",
    "has_comm_data",
    "log_summary",
    "reset_log",
    "CommEvent",
    "DistEnv",
    "FlatLayout",
    "GradReducer",
    "Handle",
    "Segment",
    "compressed_allreduce",
    "compressed_reduce_scatter",
    "default_backend",
    "dist_env",
    "error_buffers",
    "gather_params",
    "gloo_twin",
    "init_distributed",
    "padded_numel",
    *functional.__all__,
]
