"""``fastzero``: a thin front over ``torchrun``, which stays the engine
(rendezvous, restarts, multi-node), that takes torchrun's flags and
DeepSpeed's launcher's (``deepspeed`` -> ``fastzero`` in a command line).

    fastzero --nproc_per_node 4 train.py --my-arg 1          # this host
    fastzero --num_gpus 4 train.py --my-arg 1                # the same, DeepSpeed's spelling
    fastzero --nnodes 2 --node_rank 0 --master_addr h0 ...   # one host of several, as torchrun
    fastzero --hostfile hosts train.py                       # every host of a DeepSpeed hostfile, over ssh
    fastzero -H hosts -i 'h0:0,1@h1' --launcher pdsh train.py

A hostfile is DeepSpeed's: one ``hostname slots=N`` per line, ``#`` comments
(default /job/hostfile, if it exists). With one, the launcher starts torchrun
on every host (over ssh, or one pdsh call), host i as node rank i,
rendezvous on the first host, in the current directory, with the environment
variables that matter to training exported; or has mpirun/srun start every
rank (--launcher openmpi|mpich|mvapich|slurm). docs/launcher.md has every flag.

Each rank's script gets ``--local_rank=N`` first among its arguments, as
under DeepSpeed (not with --no_local_rank), and LOCAL_RANK in its
environment always.

Signals and exit codes (docs/launcher.md): SIGTERM, SIGHUP and SIGINT to the
launcher go to every process group it started (torchrun, or the ssh/pdsh
clients), which shut their workers down; what is still running
``KILL_GRACE_S`` seconds later is SIGKILLed, and the launcher exits 128+N for
signal N. A SIGKILLed launcher takes its children with it (parent-death
signal), and they take their workers. Otherwise the launcher exits with the
training script's own exit code (128+N for a worker killed by signal N).
Every argument is checked before anything starts: a problem is one
``fastzero: error: ...`` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from fastzero.launch_agent import die_with_parent
from fastzero.launch_hosts import (  # noqa: F401  (parse_hostfile, check_host: the launcher's API)
    MAX_SLOTS,
    LaunchError,
    check_host,
    parse_core_list,
    parse_hostfile,
    read_hostfile,
    select_resources,
)
from fastzero.launch_runners import MPI_RUNNERS, RUNNERS, Job, Plan, local_plan, multi_node_plan

EXPORT_PREFIXES = (
    "NCCL_",
    "GLOO_",
    "PYTHON",
    "FASTZERO_",
    "OMP_",
    "MKL_",
    "CUDA_",
    "TORCH_",
    "TRITON_",
    "LD_LIBRARY",
    "PATH",
    "HF_",
    "DS_",
)

# How long the children get to stop after a forwarded signal before they are
# SIGKILLed: torchrun's own grace for its workers (30 s) and a margin.
KILL_GRACE_S = 40.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's, used when it exists and no --hostfile is given


class _Signalled(Exception):
    pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the process group `proc` leads (started with its own session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone


def run_all(commands: list[list[str]], *, ssh_stdin: bool = False, grace_s: float = KILL_GRACE_S) -> int:
    """Runs the commands side by side, each in a process group of its own
    that dies with this process; the first failure stops the others, and its
    exit code is returned. SIGTERM, SIGHUP and SIGINT are forwarded to every
    group; after `grace_s` seconds the groups still running are SIGKILLed and
    128+signum is returned. `ssh_stdin`: each command's stdin is a pipe this
    process holds open until it exits (the ssh mode's hang-up on EOF)."""
    me = os.getpid()
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        for p in procs:
            _signal_group(p, signum)

    procs: list[subprocess.Popen] = []
    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        for c in commands:
            procs.append(
                subprocess.Popen(
                    c,
                    start_new_session=True,
                    preexec_fn=lambda: die_with_parent(me),
                    stdin=subprocess.PIPE if ssh_stdin else None,
                )
            )
            if received:  # a signal came while starting: the new group gets it too
                _signal_group(procs[-1], received[0])
        first_failure = 0
        deadline = None
        while any(p.poll() is None for p in procs):
            if received and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    _signal_group(p, signal.SIGKILL)
                deadline = float("inf")
            for p in procs:
                code = p.poll()
                if code and not first_failure:
                    first_failure = code if code > 0 else 128 - code
                    for q in procs:
                        if q.poll() is None:
                            _signal_group(q, signal.SIGTERM)
                    if deadline is None:
                        deadline = time.monotonic() + grace_s
            time.sleep(0.05)
        if received:
            return 128 + received[0]
        if not first_failure:
            first_failure = next((p.returncode for p in procs if p.returncode), 0)
            first_failure = first_failure if first_failure >= 0 else 128 - first_failure
        return first_failure
    finally:
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()
            if p.stdin is not None:
                p.stdin.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastzero", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--nproc_per_node",
        "--num_gpus",
        "--num_accelerators",
        type=int,
        default=None,
        help="processes per host (default: its GPUs, else 1; with a hostfile: each host's slots)",
    )
    p.add_argument(
        "--nnodes",
        "--num_nodes",
        type=int,
        default=None,
        help="hosts (default 1; with a hostfile: use its first N hosts)",
    )
    p.add_argument("--node_rank", type=int, default=None, help="this host's rank, for a launch without a hostfile")
    p.add_argument("--master_addr", default=None, help="rank 0's host (default: 127.0.0.1, or the hostfile's first)")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--max_restarts", type=int, default=0, help="torchrun restarts the job this often on failure")
    p.add_argument(
        "-H",
        "--hostfile",
        default=None,
        help=f"DeepSpeed hostfile: 'hostname slots=N' lines ({DEFAULT_HOSTFILE} if it exists)",
    )
    p.add_argument("-i", "--include", default="", help="hosts/slots to use: 'h0:0,1@h1' (DeepSpeed's syntax)")
    p.add_argument("-e", "--exclude", default="", help="hosts/slots not to use: 'h1:0@h2' (DeepSpeed's syntax)")
    p.add_argument(
        "--launcher", type=str.lower, choices=RUNNERS, default="ssh", help="how to reach the hostfile's hosts"
    )
    p.add_argument("--launcher_args", default="", help="extra arguments for ssh/pdsh/mpirun/srun, one quoted string")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    p.add_argument("--force_multi", action="store_true", help="a hostfile of one host: reach it with --launcher too")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="pin each rank to its share of the cores")
    p.add_argument("--bind_core_list", default=None, help="the cores to share out, e.g. 0-7,16-23 (default: all)")
    p.add_argument("--elastic_training", action="store_true", help="torchrun's elastic rendezvous (c10d)")
    p.add_argument("--min_elastic_nodes", type=int, default=None, help="elastic: fewest hosts (default 1)")
    p.add_argument("--max_elastic_nodes", type=int, default=None, help="elastic: most hosts (default: all)")
    p.add_argument("--module", action="store_true", help="the script is a module: python -m script")
    p.add_argument("--no_python", action="store_true", help="run the script itself, not with python")
    p.add_argument("--ssh_port", type=int, default=None, help="ssh's port (--launcher ssh or pdsh)")
    p.add_argument("--no_ssh_check", action="store_true", help="accepted for DeepSpeed; fastzero does no ssh check")
    p.add_argument("--log_level", default="info", help="accepted for DeepSpeed; no effect")
    p.add_argument("-q", "--quiet", action="store_true", help="accepted for DeepSpeed; no effect")
    p.add_argument("--dry_run", action="store_true", help="print the commands instead of running them")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be checked before anything starts."""
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python do not mix")
    if args.ssh_port is not None and not 1 <= args.ssh_port <= 65535:
        raise LaunchError(f"--ssh_port {args.ssh_port}: must be a TCP port, 1 to 65535")
    script = Path(args.script)
    if args.module:
        if re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", args.script) is None:
            raise LaunchError(f"--module {args.script}: not a module name")
    elif args.no_python and not script.exists() and shutil.which(args.script) is not None:
        pass  # a command on PATH
    elif not script.exists():
        raise LaunchError(f"{args.script}: no such training script")
    elif script.is_dir():
        raise LaunchError(f"{args.script} is a directory; give the training script's path")
    elif not os.access(script, os.R_OK):
        raise LaunchError(f"{args.script}: the training script is not readable")
    if not 1 <= args.master_port <= 65535:
        raise LaunchError(f"--master_port {args.master_port}: must be a TCP port, 1 to 65535")
    if args.master_addr is not None:
        check_host(args.master_addr, "--master_addr")
    if args.max_restarts < 0:
        raise LaunchError(f"--max_restarts {args.max_restarts}: must be >= 0")
    nproc = args.nproc_per_node
    if nproc is not None and not 1 <= nproc <= MAX_SLOTS:
        raise LaunchError(f"--nproc_per_node {nproc}: must be >= 1 and <= {MAX_SLOTS}")
    nnodes, rank = args.nnodes or 1, args.node_rank or 0
    if (args.nnodes is not None and args.nnodes < 1) or not 0 <= rank < nnodes:
        raise LaunchError(
            f"--nnodes {args.nnodes}, --node_rank {args.node_rank}: need nnodes >= 1 and 0 <= node_rank < nnodes"
        )
    if args.bind_core_list is not None:
        parse_core_list(args.bind_core_list)
    for flag in ("min_elastic_nodes", "max_elastic_nodes"):
        value = getattr(args, flag)
        if value is not None and not args.elastic_training:
            raise LaunchError(f"--{flag} needs --elastic_training")
        if value is not None and value < 1:
            raise LaunchError(f"--{flag} {value}: must be >= 1")
    if args.elastic_training and args.master_addr is None:
        raise LaunchError("--elastic_training needs --master_addr (the rendezvous host)")


def _elastic(args: argparse.Namespace, nnodes: int) -> tuple[int, int] | None:
    if not args.elastic_training:
        return None
    lo = args.min_elastic_nodes or 1
    hi = args.max_elastic_nodes or max(nnodes, lo)
    if lo > hi:
        raise LaunchError(f"--min_elastic_nodes {lo} > --max_elastic_nodes {hi}")
    return lo, hi


ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def read_env_files() -> dict[str, str]:
    """DeepSpeed's ``.deepspeed_env`` (``DS_ENV_FILE`` names it) in the home
    directory, then the current one: ``NAME=value`` lines exported to every
    host (blank lines and ``#`` comments skipped)."""
    name = os.environ.get("DS_ENV_FILE") or ".deepspeed_env"
    out: dict[str, str] = {}
    for folder in (Path.home(), Path(".")):
        path = folder / name
        if not path.is_file():
            continue
        for lineno, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, eq, value = line.partition("=")
            if not eq or ENV_NAME_RE.fullmatch(key.strip()) is None:
                raise LaunchError(f"{path}:{lineno}: {line!r} is not NAME=value")
            out[key.strip()] = value.strip()
    return out


def _exports(cwd: str) -> dict[str, str]:
    """What every host gets: this one's training environment, the current
    directory first on PYTHONPATH (as DeepSpeed), the .deepspeed_env files."""
    out = {k: v for k, v in sorted(os.environ.items()) if k.startswith(EXPORT_PREFIXES)}
    out["PYTHONPATH"] = cwd + (":" + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    return {**out, **read_env_files()}


def _check_cores(args: argparse.Namespace, nproc: int, here: bool = True) -> None:
    """With core binding, a core per local rank (of this host's, or of
    --bind_core_list on other hosts)."""
    if not args.bind_cores_to_rank or (not here and not args.bind_core_list):
        return
    cores = parse_core_list(args.bind_core_list) if args.bind_core_list else sorted(os.sched_getaffinity(0))
    if len(cores) < nproc:
        raise LaunchError(f"--bind_cores_to_rank: {len(cores)} cores for {nproc} ranks per host; need one each")


def plan(args: argparse.Namespace) -> Plan:
    """What to run, from checked arguments."""
    job = Job(
        script=args.script,
        script_args=args.script_args,
        python=sys.executable,
        cwd=os.getcwd(),
        master_addr=args.master_addr or "127.0.0.1",
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        no_local_rank=args.no_local_rank,
        bind_core_list=(args.bind_core_list or "all") if args.bind_cores_to_rank else None,
        elastic_run_id=os.environ.get("ELASTIC_RUN_ID") or "123456789",
        launcher_args=shlex.split(args.launcher_args),
        run_as="module" if args.module else "exec" if args.no_python else "",
        ssh_port=args.ssh_port,
    )
    hostfile = args.hostfile
    if hostfile is None and args.node_rank is None and Path(DEFAULT_HOSTFILE).is_file():
        hostfile = DEFAULT_HOSTFILE
    if hostfile is None:
        if args.include or args.exclude:
            if args.nproc_per_node is not None:
                raise LaunchError("cannot specify --num_nodes/--num_gpus with --include/--exclude")
            slots = select_resources([("localhost", _local_devices())], args.include, args.exclude)["localhost"]
        else:
            slots = list(range(args.nproc_per_node or _local_devices()))
        _check_cores(args, len(slots))
        job.elastic = _elastic(args, args.nnodes or 1)
        return local_plan(job, args.nnodes or 1, args.node_rank or 0, slots)
    if args.node_rank is not None:
        raise LaunchError("--node_rank is for a launch on one host, without a hostfile")
    hosts = select_resources(read_hostfile(hostfile), args.include, args.exclude, args.nnodes, args.nproc_per_node)
    job.hostfile = hostfile
    if not args.force_multi and len(hosts) == 1:  # DeepSpeed: one host is this one, no ssh
        ((slots),) = hosts.values()
        _check_cores(args, len(slots))
        job.elastic = _elastic(args, 1)
        return local_plan(job, 1, 0, slots)
    job.master_addr = args.master_addr or next(iter(hosts))
    _check_cores(args, max(len(s) for s in hosts.values()), here=False)
    job.exports = _exports(job.cwd)
    job.elastic = _elastic(args, len(hosts))
    if args.launcher in (*MPI_RUNNERS, "slurm"):
        if job.elastic is not None or args.max_restarts:
            raise LaunchError(
                f"--launcher {args.launcher} starts every rank itself: no torchrun, so no "
                "--elastic_training or --max_restarts (use ssh or pdsh)"
            )
        if args.launcher == "openmpi" and (args.include or args.exclude or args.nnodes or args.nproc_per_node):
            raise LaunchError(
                "--launcher openmpi runs the hostfile as it is: no --include/--exclude/"
                "--num_nodes/--num_gpus (edit the hostfile, or use ssh/pdsh/mpich/slurm)"
            )
    return multi_node_plan(args.launcher, job, hosts)


def _local_devices() -> int:
    import torch

    return max(1, torch.cuda.device_count())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        todo = plan(args)
    except LaunchError as exc:
        print(f"fastzero: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for path, text in todo.files.items():
            print(f"# {path}: {text!r}")
        for c in todo.commands:
            print(shlex.join(c))
        return 0
    try:
        for path, text in todo.files.items():
            Path(path).write_text(text)
    except OSError as exc:
        print(f"fastzero: error: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    return run_all(todo.commands, ssh_stdin=todo.ssh_stdin)


if __name__ == "__main__":
    sys.exit(main())
