"""What the ``fastzero`` launcher runs on every host: torchrun, in this
process, with two things torchrun alone does not do.

- **The script's exit code comes back.** torchrun reports any failed worker
  as exit code 1 (``ChildFailedError`` escapes its ``main``); here the first
  failure's own code is the exit code, a worker killed by signal N gives
  128+N as shells do, and torchrun stopped by signal N exits 128+N after
  it has shut its workers down (it forwards the signal to them, waits up to
  30 s, then SIGKILLs them).
- **No worker outlives its torchrun.** torchrun starts each worker in a
  session of its own, so a SIGKILLed torchrun (which cannot clean up) would
  leave them running. Each worker is started as ``python -m
  fastzero.launch_agent --worker script args``, which asks the kernel for
  SIGKILL when its parent (torchrun) dies (``prctl(PR_SET_PDEATHSIG)``,
  Linux) and then execs the script in the same process, same pid.

The shim also does what DeepSpeed's launcher does for each rank: it passes
``--local_rank=N`` to a script that declares it (its source mentions
``local_rank``), first of its arguments (not with
``_FASTZERO_NO_LOCAL_RANK=1``, the launcher's ``--no_local_rank``); started
by mpirun or srun instead of torchrun, it sets RANK, WORLD_SIZE and
LOCAL_RANK from the MPI/SLURM variables; with ``_FASTZERO_BIND_CORES``
(``all`` or a list such as ``0-7,16-23``, the launcher's
``--bind_cores_to_rank``/``--bind_core_list``) it pins itself to its share
of the cores, DeepSpeed's split (len // local ranks each, in order), and
sets OMP_NUM_THREADS to that share's size.

``python -m fastzero.launch_agent [--exit_on_stdin_eof] <torchrun args>``:
with ``--exit_on_stdin_eof`` (the launcher's ssh mode) an end of file on
stdin, i.e. the ssh connection to the launcher closed, stops the job as a
SIGHUP does: a remote host's torchrun does not outlive its launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
AGENT_PID = "_FASTZERO_AGENT_PID"  # set by the agent for its workers: who their parent must be

WORKER_FLAG = "--worker"
EOF_FLAG = "--exit_on_stdin_eof"
NO_LOCAL_RANK_ENV = "_FASTZERO_NO_LOCAL_RANK"
BIND_CORES_ENV = "_FASTZERO_BIND_CORES"
RUN_AS_ENV = "_FASTZERO_RUN_AS"  # "module": python -m script; "exec": the script itself, no python

# (rank, world size, local rank, local size) as each MPI/SLURM starter names them.
RANK_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)

# libc for prctl, loaded once here: a preexec_fn (after fork, before exec) must not load libraries.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Asks the kernel to send `sig` to this process when its parent dies
    (Linux; elsewhere a no-op). If the parent is already gone (it died before
    this call), exits at once. Safe in a ``preexec_fn``: no allocation beyond
    one ctypes call on a library loaded before the fork (see `_libc`)."""
    if _libc is None:
        return
    _libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def exit_code_of(exitcode: int) -> int:
    """A process's exit code as a shell reports it: a negative Popen code
    (killed by signal N) becomes 128+N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def rank_environment(env: dict[str, str]) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from an MPI or SLURM
    starter's variables, where torchrun's are not set ({} if neither)."""
    if "RANK" in env:
        return {}
    for rank, size, local, local_size in RANK_VARIABLES:
        if rank in env and size in env:
            out = {"RANK": env[rank], "WORLD_SIZE": env[size], "LOCAL_RANK": env.get(local, "0")}
            if local_size in env or "LOCAL_SIZE" in env:
                out["LOCAL_WORLD_SIZE"] = env.get(local_size) or env["LOCAL_SIZE"]
            if local not in env and "LOCAL_SIZE" in env:  # MPICH without MPI_LOCALRANKID: ranks fill hosts in order
                out["LOCAL_RANK"] = str(int(env[rank]) % int(env["LOCAL_SIZE"]))
            return out
    return {}


def bind_cores(spec: str, local_rank: int, local_size: int) -> list[int]:
    """This rank's share of the cores (``all``: those this process may use)."""
    from fastzero.launch_hosts import cores_for_rank, parse_core_list

    cores = sorted(os.sched_getaffinity(0)) if spec == "all" else parse_core_list(spec)
    mine = cores_for_rank(cores, local_size, local_rank)
    os.sched_setaffinity(0, mine)
    return mine


def declares_local_rank(script: str, run_as: str = "") -> bool:
    """Whether the script (a path, or a module name with ``run_as ==
    "module"``) mentions ``local_rank``, as a DeepSpeed script declaring
    ``--local_rank`` does. A script that does not would fail on the unknown
    argument (argparse) or read it as its own; one that cannot be read gets
    it, as DeepSpeed gives it to every script."""
    path = script
    if run_as == "module":
        import importlib.util

        try:
            spec = importlib.util.find_spec(script)
        except (ImportError, ValueError):
            return True
        path = spec.origin if spec is not None and spec.origin else ""
    try:
        with open(path, "rb") as f:
            return b"local_rank" in f.read(1 << 24)
    except OSError:
        return True


def worker_argv(script: str, args: list[str], env: dict[str, str]) -> list[str]:
    """The script's command line: ``python -u script [--local_rank=N] args``
    (``python -u -m script ...`` or ``script ...`` as RUN_AS_ENV says);
    ``--local_rank`` only for a script that declares it (see
    :func:`declares_local_rank`) and not with ``--no_local_rank``."""
    wanted = env.get(NO_LOCAL_RANK_ENV) != "1" and declares_local_rank(script, env.get(RUN_AS_ENV, ""))
    local = [f"--local_rank={env.get('LOCAL_RANK', '0')}"] if wanted else []
    run_as = env.get(RUN_AS_ENV, "")
    if run_as == "exec":
        return [script, *local, *args]
    return [sys.executable, "-u", *(["-m"] if run_as == "module" else []), script, *local, *args]


def _worker(argv: list[str]) -> None:
    """``--worker script args``: becomes ``python -u script [--local_rank=N]
    args`` after arranging to die with torchrun (and the rank variables and
    core binding above)."""
    if not argv:
        sys.exit("fastzero.launch_agent --worker: no script given")
    parent = os.environ.get(AGENT_PID)
    if parent is not None:
        die_with_parent(int(parent))
    os.environ.update(rank_environment(dict(os.environ)))
    spec = os.environ.get(BIND_CORES_ENV)
    if spec:
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        mine = bind_cores(spec, int(os.environ.get("LOCAL_RANK", "0")), local_size)
        os.environ["OMP_NUM_THREADS"] = str(len(mine))
    command = worker_argv(argv[0], argv[1:], dict(os.environ))
    os.execvp(command[0], command)


def _hang_up_on_eof() -> None:
    """Stops the job (SIGHUP to this process: torchrun's handler shuts its
    workers down) when stdin reaches its end."""

    def watch() -> None:
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGHUP)

    threading.Thread(target=watch, name="fastzero-stdin-eof", daemon=True).start()


def torchrun_argv(argv: list[str]) -> list[str]:
    """torchrun's arguments with the script replaced by the worker shim:
    ``[opts..., script, args...]`` -> ``[opts..., -m, fastzero.launch_agent, --worker, script, args...]``.
    The script is the first argument not starting with '-' (the launcher
    writes every torchrun option as ``--name=value``)."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            return [*argv[:i], "-m", "fastzero.launch_agent", WORKER_FLAG, *argv[i:]]
    raise SystemExit("fastzero.launch_agent: no training script among the arguments")


def agent(argv: list[str]) -> int:
    """Runs torchrun with `argv` and returns the exit code the launcher passes on."""
    if argv and argv[0] == EOF_FLAG:
        argv = argv[1:]
        _hang_up_on_eof()
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    os.environ[AGENT_PID] = str(os.getpid())
    try:
        torchrun_main(torchrun_argv(argv))
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        code = exit_code_of(failure.exitcode) or 1
        print(f"fastzero: the training script failed (exit code {code}):\n{exc}", file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        print(f"fastzero: torchrun stopped by {exc.sigval.name}; workers shut down", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == WORKER_FLAG:
        _worker(argv[1:])  # does not return
    return agent(argv)


if __name__ == "__main__":
    sys.exit(main())
