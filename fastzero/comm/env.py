"""Who this process is in the job, read from the launcher's environment:
torchrun (and anything that sets RANK/WORLD_SIZE), else OpenMPI's mpirun,
else SLURM's srun; then the process group over NCCL on GPUs or Gloo on CPUs.
torch.distributed stays the engine: this only reads what launchers set."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from fastzero.native.envvars import env_choice, env_float

DEFAULT_PORT = 29500
# What FASTZERO_DIST_BACKEND may name: torch.distributed's backends.
DIST_BACKENDS = ("gloo", "nccl", "mpi", "ucc")
# The longest collective timeout taken: ~31 years (datetime.timedelta overflows near 8.6e13 s).
MAX_TIMEOUT_S = 1e9


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "mpirun", "slurm" or "single"


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"{name} is not set; the launcher must set it (or use torchrun / fastzero to launch)")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"{name}={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[03-05,9],cpu1' -> 'gpu03'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise RuntimeError(f"cannot read the first host of SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]  # keeps the zero padding of the range


def dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """This process's rank, local rank, world size and rendezvous address."""
    env = os.environ if environ is None else environ
    port = _int(env, "MASTER_PORT", DEFAULT_PORT)
    if "RANK" in env or "WORLD_SIZE" in env:
        rank, world, local = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", 0)
        addr, launcher = env.get("MASTER_ADDR", "127.0.0.1"), "torchrun"
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        addr, launcher = env.get("MASTER_ADDR"), "mpirun"
        if addr is None:
            if _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world) != world:
                raise RuntimeError(
                    "mpirun across several hosts: set MASTER_ADDR to rank 0's host (mpirun -x MASTER_ADDR=<host>)"
                )
            addr = "127.0.0.1"
    elif "SLURM_PROCID" in env:
        rank, world, local = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID", 0)
        addr, launcher = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "")), "slurm"
    else:
        return DistEnv(0, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")
    if world < 1 or not 0 <= rank < world or local < 0:
        raise RuntimeError(
            f"inconsistent launcher environment ({launcher}): rank {rank}, local rank {local}, world size {world}"
        )
    return DistEnv(rank, local, world, addr, port, launcher)


def default_backend() -> str:
    """NCCL where there are GPUs, Gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
    *,
    backend: str | None = None,
    timeout_s: float | None = None,
    environ=None,
) -> DistEnv:
    """Joins (or, alone, forms) the default process group. A rank that never
    arrives, or dies, makes the others fail after `timeout_s` seconds
    (default: ``FASTZERO_DIST_TIMEOUT`` or 1800; a finite number > 0) with
    torch.distributed's error instead of hanging. ``FASTZERO_DIST_BACKEND``
    (gloo, nccl, mpi or ucc) overrides the automatic backend. A bad setting
    raises ValueError naming it.

    The positional parameters are DeepSpeed's (``deepspeed.comm.init_distributed``,
    v0.14-0.16): `dist_backend` (or `backend=`); `timeout` a timedelta (or
    `timeout_s=` seconds; not both); `init_method` and `rank`/`world_size`
    (>= 0 / > 0) replace the environment's rendezvous and place in the job;
    `distributed_port` is the port where MASTER_PORT is unset;
    `dist_init_required=False` requires a group made already (RuntimeError
    otherwise). `auto_mpi_discovery`, `verbose` and `config` are accepted and
    unused: the environment of torchrun, OpenMPI and SLURM is always read
    (:func:`dist_env`). Returns this process's :class:`DistEnv`."""
    if backend is not None and dist_backend is not None and backend != dist_backend:
        raise ValueError(f"dist_backend={dist_backend!r} and backend={backend!r}: give one")
    backend = dist_backend if dist_backend is not None else backend
    if timeout is not None:
        if timeout_s is not None:
            raise ValueError("timeout= and timeout_s= given together: give one")
        timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    base = os.environ if environ is None else environ
    if "MASTER_PORT" not in base and distributed_port != DEFAULT_PORT:
        environ = dict(base, MASTER_PORT=str(distributed_port))
    if dist_init_required is False and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "init_distributed(dist_init_required=False) but torch.distributed is not initialized: "
            "leave dist_init_required unset, or make the process group first"
        )
    env = dist_env(environ)
    if rank >= 0 or world_size > 0:
        rank = env.rank if rank < 0 else rank
        world_size = env.world_size if world_size <= 0 else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: the rank must be in [0, world_size)")
        env = replace(env, rank=rank, world_size=world_size)
    environ = os.environ if environ is None else environ
    if timeout_s is None:
        timeout_s = env_float(
            "FASTZERO_DIST_TIMEOUT", 1800.0, min_exclusive=0.0, maximum=MAX_TIMEOUT_S, environ=environ
        )
    else:
        try:
            ok = not isinstance(timeout_s, (bool, str)) and 0 < float(timeout_s) <= MAX_TIMEOUT_S
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"timeout_s={timeout_s!r}: it must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}")
    backend = backend or env_choice("FASTZERO_DIST_BACKEND", DIST_BACKENDS, environ=environ)
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RuntimeError(
                f"torch.distributed is already initialized as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but the environment says rank {env.rank} of {env.world_size}"
            )
        _destroy_at_exit()  # a group the script made: the same teardown hazard
        return env
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=init_method or f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _destroy_at_exit()
    return env


_registered = False


def _destroy_at_exit() -> None:
    """Destroys the default group at exit (once per process), whoever made
    it: left alive, torch's teardown at interpreter exit may abort the
    process (SIGABRT, "terminate called without an active exception") while
    Gloo's threads still hold tensors."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_destroy)


def _destroy() -> None:
    if dist.is_initialized():
        gc.collect()  # engines left in reference cycles go first: the group dying inside the GC at exit may abort
        if getattr(sys, "last_type", None) is None:  # a normal exit (after a crash, peers may be mid-collective)
            try:
                dist.barrier()  # every rank at teardown together: sockets closing under a busy peer can abort it
            except Exception:  # noqa: BLE001 - a dead peer: tear down what is left
                pass
        dist.destroy_process_group()
