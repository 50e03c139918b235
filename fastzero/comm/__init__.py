"""fastzero's communication layer: process-group setup from the launcher's
environment, recorded asynchronous collectives, and the flat bucket layout
with bucketed reduce-scatter / all-gather that the ZeRO stages use."""

from fastzero.comm.buckets import GradReducer, gather_params
from fastzero.comm.collectives import Comm, CommEvent, Handle
from fastzero.comm.env import DistEnv, default_backend, dist_env, init_distributed
from fastzero.comm.layout import Bucket, FlatLayout, Segment

__all__ = [
    "Bucket", "Comm", "CommEvent", "DistEnv", "FlatLayout", "GradReducer", "Handle", "Segment", "default_backend",
    "dist_env", "gather_params", "init_distributed",
]  # fmt: skip
