"""fastzero's communication layer: process-group setup from the launcher's
environment, recorded asynchronous collectives, the flat bucket layout
with bucketed reduce-scatter / all-gather that the ZeRO stages use, and
1-bit Adam's compressed all-reduce; and torch.distributed's functional
surface under DeepSpeed's names (``import fastzero.comm as dist``, as
``import deepspeed.comm as dist``: :mod:`fastzero.comm.functional`)."""

from fastzero.comm.buckets import BufferPool, GradReducer, gather_params
from fastzero.comm.collectives import Comm, CommEvent, Handle
from fastzero.comm.compressed import compressed_allreduce, compressed_reduce_scatter, error_buffers, padded_numel
from fastzero.comm.env import DistEnv, default_backend, dist_env, init_distributed
from fastzero.comm.functional import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    gather,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    irecv,
    is_available,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter_tensor,
    scatter,
    send,
)
from fastzero.comm.layout import Bucket, FlatLayout, Segment

__all__ = [
    "Bucket",
    "BufferPool",
    "Comm",
    "CommEvent",
    "DistEnv",
    "FlatLayout",
    "GradReducer",
    "Handle",
    "ReduceOp",
    "Segment",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "compressed_allreduce",
    "compressed_reduce_scatter",
    "default_backend",
    "destroy_process_group",
    "dist_env",
    "error_buffers",
    "gather",
    "gather_params",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "new_group",
    "padded_numel",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]
