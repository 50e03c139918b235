"""Which ranks share a node-local checkpoint directory
(``checkpoint.use_node_local_storage: true``), and where each node's is.

A node is the ranks a launcher started together: torchrun, the fastzero
launcher, SLURM's block distribution and mpirun's ``--map-by slot`` give
each node consecutive ranks, numbered from LOCAL_RANK 0, so a rank's node is
keyed by its host and ``RANK - LOCAL_RANK`` (:func:`fastzero.comm.dist_env`).
Nodes are numbered in the order of their first rank; that rank (local rank
0) writes the node's shared files. Two nodes whose directories are one
directory on one host (a launcher that places ranks round-robin, or sets no
LOCAL_RANK) are refused: their saves would collide.

The path is the same string on every node, each node's own disk. To run
several "nodes" on one machine (the tests), ``FASTZERO_NODE_LOCAL_ROOT_<i>``
names a directory that stands for node ``i``'s root file system: node ``i``'s
directory for the path ``P`` is that directory joined with ``abspath(P)``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from fastzero.comm import dist_env
from fastzero.native.envvars import env_path
from fastzero.runtime.checkpoint_files import CheckpointError

ROOT_ENV = "FASTZERO_NODE_LOCAL_ROOT_{}"
RESHARD = (
    "node-local checkpoints load only at the layout that saved them; copy every node's directory into one shared "
    "directory and load with use_node_local_storage false to reshard"
)


@dataclass(frozen=True)
class Nodes:
    """The ranks of each node (in the order of their first rank), and this rank's node."""

    ranks: list[list[int]]
    node: int
    rank: int

    @property
    def leader(self) -> bool:
        """Whether this rank writes its node's shared files (the node's first rank)."""
        return self.ranks[self.node][0] == self.rank

    @property
    def leaders(self) -> list[int]:
        return [r[0] for r in self.ranks]

    @property
    def mine(self) -> list[int]:
        """The ranks whose files are in this rank's node directory."""
        return self.ranks[self.node]


def shared(comm) -> Nodes:
    """A file system every rank sees: one "node", rank 0 its writer."""
    return Nodes([list(range(comm.world_size))], 0, comm.rank)


def node_dir(path, node: int, environ=None) -> Path:
    """Node `node`'s directory for the configured `path` (see the module's note on the test hook)."""
    root = env_path(ROOT_ENV.format(node), must_exist="dir", environ=environ)
    if root is None:
        return Path(path)
    return Path(root) / os.path.abspath(path).lstrip(os.sep)


def layout(comm, path, extra=None) -> tuple[Nodes, Path, list]:
    """Every rank's node (one small all-gather; every rank calls it), this
    rank's node directory for `path`, and every rank's `extra` (a small
    value, such as rank 0's choice of a tag, carried by the same
    all-gather). Raises CheckpointError on every rank when two nodes would
    share one directory."""
    env = dist_env()
    key = (socket.gethostname(), env.rank - env.local_rank)
    gathered = comm.all_gather_objects((key, extra))
    order: dict[tuple, int] = {}
    for k, _ in gathered:
        order.setdefault(k, len(order))
    ranks = [[] for _ in order]
    for r, (k, _) in enumerate(gathered):
        ranks[order[k]].append(r)
    node = order[key]
    try:
        directory, problem = node_dir(path, node), None
    except ValueError as exc:  # a bad FASTZERO_NODE_LOCAL_ROOT_<i>: every rank must learn of it, or they would hang
        directory, problem = None, str(exc)
    # where each node's directory really is (nodes on one host must not share one), or a rank's problem
    where = comm.all_gather_objects((None if directory is None else os.path.realpath(directory), problem))
    bad = [(r, msg) for r, (_, msg) in enumerate(where) if msg is not None]
    if bad:
        raise ValueError(f"rank {bad[0][0]}: {bad[0][1]}")
    seen: dict[tuple[str, str], int] = {}
    for n, members in enumerate(ranks):
        host, real = gathered[members[0]][0][0], where[members[0]][0]
        other = seen.setdefault((host, real), n)
        if other != n:
            raise CheckpointError(
                f"use_node_local_storage: ranks {ranks[other]} and {members} are on host {host} as two nodes "
                f"(RANK - LOCAL_RANK differs) and would both write {real}; place each node's ranks consecutively "
                "with LOCAL_RANK counting from 0 (torchrun does; mpirun --map-by slot, srun --distribution=block)"
            )
    return Nodes(ranks, node, comm.rank), directory, [e for _, e in gathered]
