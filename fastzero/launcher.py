"""``fastzero``: a thin front over ``torchrun``, which stays the engine
(rendezvous, restarts, multi-node).

    fastzero --nproc_per_node 4 train.py --my-arg 1          # this host
    fastzero --nnodes 2 --node_rank 0 --master_addr h0 ...   # one host of several, as torchrun
    fastzero --hostfile hosts --launcher ssh train.py        # every host of a DeepSpeed hostfile

A hostfile is DeepSpeed's: one ``hostname slots=N`` per line, ``#`` comments.
With one, the launcher starts torchrun on every host (over ssh, or one pdsh
call), host i as node rank i, rendezvous on the first host, in the current
directory, with the environment variables that matter to training exported.

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
import signal
import subprocess
import sys
import time
from pathlib import Path

from fastzero.launch_agent import EOF_FLAG, die_with_parent

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

# More processes per host than this is a typo (slots=40000), not a machine.
MAX_SLOTS = 1024
# How long the children get to stop after a forwarded signal before they are
# SIGKILLed: torchrun's own grace for its workers (30 s) and a margin.
KILL_GRACE_S = 40.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
# A host name or address as ssh and pdsh take it: names, IPv4, [IPv6], user@host.
# No leading '-' (ssh would read an option), no whitespace, no shell
# metacharacters, no ',' (pdsh's list separator).
HOST_RE = re.compile(r"[A-Za-z0-9_\[][A-Za-z0-9_.@:%\[\]-]*")


class LaunchError(RuntimeError):
    pass


def check_host(host: str, what: str) -> None:
    if HOST_RE.fullmatch(host) is None:
        raise LaunchError(
            f"{what} {host!r} is not a host name or address "
            "(letters, digits and . _ - @ : % [ ]; not starting with '-')"
        )


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
        check_host(host, f"{source}:{lineno}: host")
        if not 1 <= slots <= MAX_SLOTS:
            raise LaunchError(f"{source}:{lineno}: {host} has slots={slots}; must be >= 1 and <= {MAX_SLOTS}")
        if any(h == host for h, _ in hosts):
            raise LaunchError(f"{source}:{lineno}: host {host} is listed twice")
        hosts.append((host, slots))
    if not hosts:
        raise LaunchError(f"{source} lists no hosts")
    return hosts


def read_hostfile(name: str) -> list[tuple[str, int]]:
    path = Path(name)
    if not path.exists():
        raise LaunchError(f"hostfile {path} does not exist")
    if path.is_dir():
        raise LaunchError(f"hostfile {path} is a directory")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LaunchError(f"hostfile {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise LaunchError(f"hostfile {path} cannot be read: {exc.strerror}") from None
    return parse_hostfile(text, str(path))


def torchrun_args(args: argparse.Namespace, nnodes: int, node_rank: int | str, nproc: int, master: str) -> list[str]:
    """The launch agent's arguments (torchrun's, every option as --name=value;
    fastzero.launch_agent runs torchrun and keeps the script's exit code)."""
    out = [
        "-m",
        "fastzero.launch_agent",
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
    commands = []
    for i, (host, slots) in enumerate(hosts):
        agent = torchrun_args(args, len(hosts), i, slots, master)
        agent.insert(2, EOF_FLAG)  # the ssh connection closing stops that host's job
        commands.append(["ssh", "-o", "BatchMode=yes", host, prefix + shlex.join(agent)])
    return commands


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


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be checked before anything starts."""
    script = Path(args.script)
    if not script.exists():
        raise LaunchError(f"{args.script}: no such training script")
    if script.is_dir():
        raise LaunchError(f"{args.script} is a directory; give the training script's path")
    if not os.access(script, os.R_OK):
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
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(
            f"--nnodes {args.nnodes}, --node_rank {args.node_rank}: need nnodes >= 1 and 0 <= node_rank < nnodes"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        if args.hostfile:
            commands = remote_commands(args, read_hostfile(args.hostfile))
        else:
            nproc = args.nproc_per_node
            if nproc is None:
                import torch

                nproc = max(1, torch.cuda.device_count())
            master = args.master_addr or "127.0.0.1"
            commands = [[sys.executable, *torchrun_args(args, args.nnodes, args.node_rank, nproc, master)]]
    except LaunchError as exc:
        print(f"fastzero: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for c in commands:
            print(shlex.join(c))
        return 0
    return run_all(commands, ssh_stdin=bool(args.hostfile) and args.launcher == "ssh")


if __name__ == "__main__":
    sys.exit(main())
