"""``fastzero``: a thin front over ``torchrun``, which stays the engine
(rendezvous, restarts, multi-node).

    fastzero --nproc_per_node 4 train.py --my-arg 1          # this host
    fastzero --nnodes 2 --node_rank 0 --master_addr h0 ...   # one host of several, as torchrun
    fastzero --hostfile hosts --launcher ssh train.py        # every host of a DeepSpeed hostfile

A hostfile is DeepSpeed's: one ``hostname slots=N`` per line, ``#`` comments.
With one, the launcher starts torchrun on every host (over ssh, or one pdsh
call), host i as node rank i, rendezvous on the first host, in the current
directory, with the environment variables that matter to training exported.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

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


class LaunchError(RuntimeError):
    pass


def parse_hostfile(text: str, source: str = "hostfile") -> list[tuple[str, int]]:
    """[(host, slots)] in file order; each host once."""
    hosts: list[tuple[str, int]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if match is None:
            raise LaunchError(f"{source}:{lineno}: {raw.strip()!r}: expected 'hostname slots=N'")
        host, slots = match.group(1), int(match.group(2))
        if slots < 1:
            raise LaunchError(f"{source}:{lineno}: {host} has slots={slots}; must be >= 1")
        if any(h == host for h, _ in hosts):
            raise LaunchError(f"{source}:{lineno}: host {host} is listed twice")
        hosts.append((host, slots))
    if not hosts:
        raise LaunchError(f"{source} lists no hosts")
    return hosts


def torchrun_args(args: argparse.Namespace, nnodes: int, node_rank: int | str, nproc: int, master: str) -> list[str]:
    out = [
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={nproc}",
        f"--master_addr={master}",
        f"--master_port={args.master_port}",
    ]
    if args.max_restarts:
        out.append(f"--max_restarts={args.max_restarts}")
    return out + [args.script, *args.script_args]


def remote_commands(args: argparse.Namespace, hosts: list[tuple[str, int]]) -> list[list[str]]:
    """The commands that start torchrun on every host of the hostfile."""
    master = args.master_addr or hosts[0][0]
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith(EXPORT_PREFIXES))
    prefix = f"cd {shlex.quote(os.getcwd())} && env {exports} {shlex.quote(sys.executable)} "
    if args.launcher == "pdsh":
        if len({s for _, s in hosts}) != 1:
            raise LaunchError(f"pdsh starts one command on every host; slots differ ({hosts}): use --launcher ssh")
        cmd = prefix + shlex.join(torchrun_args(args, len(hosts), "%n", hosts[0][1], master))
        return [["pdsh", "-S", "-f", "1024", "-w", ",".join(h for h, _ in hosts), cmd]]
    return [
        ["ssh", "-o", "BatchMode=yes", host, prefix + shlex.join(torchrun_args(args, len(hosts), i, slots, master))]
        for i, (host, slots) in enumerate(hosts)
    ]


def run_all(commands: list[list[str]]) -> int:
    """Runs the commands side by side; the first failure stops the others."""
    procs = [subprocess.Popen(c) for c in commands]
    try:
        codes = [None] * len(procs)
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    try:
                        codes[i] = p.wait(timeout=0.5)
                    except subprocess.TimeoutExpired:
                        continue
                    if codes[i] != 0:
                        for q in procs:
                            if q.poll() is None:
                                q.send_signal(signal.SIGTERM)
        return next((c for c in codes if c), 0)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        return 130


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastzero", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--nproc_per_node",
        "--num_gpus",
        type=int,
        default=None,
        help="processes on this host (default: its GPUs, else 1)",
    )
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--master_addr", default=None, help="rank 0's host (default: 127.0.0.1, or the hostfile's first)")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--max_restarts", type=int, default=0, help="torchrun restarts the job this often on failure")
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile: 'hostname slots=N' lines")
    p.add_argument("--launcher", choices=("ssh", "pdsh"), default="ssh", help="how to reach the hostfile's hosts")
    p.add_argument("--dry_run", action="store_true", help="print the commands instead of running them")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not Path(args.script).exists():
            raise LaunchError(f"{args.script}: no such training script")
        if args.hostfile:
            path = Path(args.hostfile)
            if not path.exists():
                raise LaunchError(f"hostfile {path} does not exist")
            commands = remote_commands(args, parse_hostfile(path.read_text(), str(path)))
        else:
            nproc = args.nproc_per_node
            if nproc is None:
                import torch

                nproc = max(1, torch.cuda.device_count())
            if nproc < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
                raise LaunchError(
                    f"--nproc_per_node {nproc}, --nnodes {args.nnodes}, --node_rank {args.node_rank}: "
                    "need nproc >= 1 and 0 <= node_rank < nnodes"
                )
            master = args.master_addr or "127.0.0.1"
            commands = [[sys.executable, *torchrun_args(args, args.nnodes, args.node_rank, nproc, master)]]
    except LaunchError as exc:
        print(f"fastzero: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for c in commands:
            print(shlex.join(c))
        return 0
    return run_all(commands)


if __name__ == "__main__":
    sys.exit(main())
