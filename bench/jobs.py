"""Multi-process benchmark jobs: a worker script run as `world` local ranks
with torchrun's variables over Gloo, one thread each, its result read back;
and what the workers share (their result written, their resident set read)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

# "bench" in a source checkout, "fastzero.bench" in an install: workers run as
# modules of whichever this is, with the folder that holds it on PYTHONPATH.
PACKAGE = __package__
ROOT = Path(sys.modules[PACKAGE.partition(".")[0]].__file__).resolve().parent.parent


def worker_env(**extra: str) -> dict[str, str]:
    """The environment a worker subprocess needs to import this package."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def worker_command(module: str, *args: str) -> list[str]:
    """``python -m <this package>.<module> ARGS``."""
    return [sys.executable, "-m", f"{PACKAGE}.{module}", *args]


class JobFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: str, spec: dict, world: int, timeout: float, local_world: int | None = None) -> dict:
    """Runs the module `worker` of this package (argv[1]: the JSON spec, plus ``out``, where rank 0
    writes its JSON result) as `world` processes; returns that result. `local_world`: ranks per simulated
    node (LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK as torchrun sets them on each node).
    Raises JobFailed with the failing rank's log tail."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, out=os.path.join(tmp, "result.json"))
        port = str(free_port())
        logs = [Path(tmp, f"rank{rank}.log") for rank in range(world)]
        procs = []
        for rank, log in enumerate(logs):
            local = local_world or world
            env = worker_env(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank % local),
                LOCAL_WORLD_SIZE=str(local),
                GROUP_RANK=str(rank // local),
                MASTER_PORT=port,
                MASTER_ADDR="127.0.0.1",
                OMP_NUM_THREADS="1",
            )
            command = worker_command(worker, json.dumps(spec))
            with open(log, "w") as f:  # a file, not a pipe: no rank blocks on its output
                procs.append(subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        try:
            codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p in procs:
                p.kill()
                p.wait()
        for rank, log in enumerate(logs):
            if codes is None or codes[rank]:
                why = f"timed out after {timeout:.0f} s" if codes is None else f"exited {codes[rank]}"
                raise JobFailed(f"rank {rank} {why}: {log.read_text().strip()[-1500:]}")
        with open(spec["out"]) as f:
            return json.load(f)


def finish_rank(result: dict, path: str, rank: int, barrier: Callable[[], None]) -> NoReturn:
    """A worker's end: rank 0 writes `result` to `path` (what run_ranks reads back), every rank waits for that
    (`barrier`), then leaves at once. torch's teardown of Gloo now and then aborts ("terminate called without an
    active exception", seen with FSDP2) when the job is done: so none is run."""
    if rank == 0:
        with open(path, "w") as f:
            json.dump(result, f)
    barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rss_bytes(field: str = "VmRSS") -> int:
    """A /proc/self/status figure in bytes: the resident set (VmRSS), its peak since the last reset (VmHWM), the
    data segment (VmData); 0 where there is no such file."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def reset_peak_rss() -> None:
    """VmHWM := VmRSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
