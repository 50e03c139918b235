"""Running a test script as N ranks on this machine, over Gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(
    script, world: int, args: list[str] = (), env: dict | None = None, local_world: int | None = None
) -> list[subprocess.Popen]:
    """Starts `world` processes of `script` with torchrun's variables;
    `local_world`: ranks per simulated node (LOCAL_RANK, LOCAL_WORLD_SIZE
    and GROUP_RANK as torchrun sets them on each node; else LOCAL_RANK is
    the rank)."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        node = (
            {}
            if local_world is None
            else {"LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(rank // local_world)}
        )
        penv = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank % (local_world or world)),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
            **node,
            **(env or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *map(str, args)],
                env=penv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def run_ranks(
    script, world: int, args: list[str] = (), timeout: float = 300, env: dict | None = None, local_world=None
) -> list[str]:
    """Runs the ranks to the end; fails with every rank's stderr tail if one fails."""
    procs = start_ranks(script, world, args, env, local_world)
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            p.kill()
    bad = [(r, p.returncode, err) for r, (p, (_, err)) in enumerate(zip(procs, outs)) if p.returncode != 0]
    if bad:
        raise AssertionError("\n".join(f"rank {r} exited {rc}:\n{err[-3000:]}" for r, rc, err in bad))
    return [out for out, _ in outs]
