"""The command lines the ``fastzero`` launcher runs, one builder per way of
reaching the hosts (DeepSpeed's ``multinode_runner.py``, rewritten for
torchrun and fastzero's worker shim). Builders only build: nothing here
starts a process, so each can be tested on its argv.

- ``local``: torchrun (the launch agent) on this host.
- ``ssh``: one ``ssh host ...`` per host, each starting the launch agent as node rank i.
- ``pdsh``: one ``pdsh -w h0,h1 ...`` starting the agent everywhere (``%n`` is the node rank).
- ``openmpi``, ``mpich``, ``mvapich``, ``slurm``: ``mpirun``/``srun`` start
  every rank themselves, each as ``python -u -m fastzero.launch_agent
  --worker script args`` (the shim maps the MPI/SLURM rank variables onto
  RANK, WORLD_SIZE and LOCAL_RANK, passes ``--local_rank``, binds cores).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from fastzero.launch_agent import (
    BIND_CORES_ENV,
    EOF_FLAG,
    NO_LOCAL_RANK_ENV,
    RUN_AS_ENV,
    WORKER_FLAG,
)
from fastzero.launch_hosts import LaunchError, Resources

RUNNERS = ("ssh", "pdsh", "openmpi", "mpich", "mvapich", "slurm")
MPI_RUNNERS = ("openmpi", "mpich", "mvapich")
PDSH_MAX_FAN_OUT = 1024
ELASTIC_RUN_ID = "123456789"  # DeepSpeed's default (ELASTIC_RUN_ID overrides it)
MVAPICH_HOSTFILE = "/tmp/fastzero_mvapich_hostfile"


@dataclass
class Job:
    script: str
    script_args: list[str]
    python: str
    cwd: str
    master_addr: str
    master_port: int
    max_restarts: int = 0
    no_local_rank: bool = False
    bind_core_list: str | None = None  # None: no binding; "all": every core this process may use
    elastic: tuple[int, int] | None = None  # (min nodes, max nodes)
    elastic_run_id: str = ELASTIC_RUN_ID
    exports: dict[str, str] = field(default_factory=dict)  # this host's environment worth passing on
    launcher_args: list[str] = field(default_factory=list)
    hostfile: str | None = None
    run_as: str = ""  # "module" (--module) or "exec" (--no_python)
    ssh_port: int | None = None


@dataclass
class Plan:
    commands: list[list[str]]
    files: dict[str, str] = field(default_factory=dict)  # written before the commands run
    ssh_stdin: bool = False


def worker_env(job: Job) -> dict[str, str]:
    """What the worker shim reads: --no_local_rank, core binding, --module/--no_python."""
    env = {RUN_AS_ENV: job.run_as} if job.run_as else {}
    if job.no_local_rank:
        env[NO_LOCAL_RANK_ENV] = "1"
    if job.bind_core_list is not None:
        env[BIND_CORES_ENV] = job.bind_core_list
    return env


def visible_devices(slots: list[int]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for a host whose slots are not simply 0..n-1."""
    return {} if slots == list(range(len(slots))) else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}


def agent_args(job: Job, nnodes: int, node_rank: int | str, nproc: int) -> list[str]:
    """The launch agent's arguments: torchrun's, every option as --name=value."""
    out = ["-m", "fastzero.launch_agent"]
    if job.elastic is not None:
        lo, hi = job.elastic
        out += [
            f"--nnodes={lo}:{hi}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={job.master_addr}:{job.master_port}",
            f"--rdzv_id={job.elastic_run_id}",
        ]
    else:
        out += [
            f"--nnodes={nnodes}",
            f"--node_rank={node_rank}",
            f"--master_addr={job.master_addr}",
            f"--master_port={job.master_port}",
        ]
    out.insert(3, f"--nproc_per_node={nproc}")
    if job.max_restarts:
        out.append(f"--max_restarts={job.max_restarts}")
    return out + [job.script, *job.script_args]


def _env_prefix(env: dict[str, str]) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def local_plan(job: Job, nnodes: int, node_rank: int, slots: list[int]) -> Plan:
    env = {**visible_devices(slots), **worker_env(job)}
    return Plan([[*_env_prefix(env), job.python, *agent_args(job, nnodes, node_rank, len(slots))]])


def _remote_shell(job: Job, env: dict[str, str], argv: list[str]) -> str:
    exports = " ".join(shlex.quote(f"{k}={v}") for k, v in {**job.exports, **env}.items())
    return f"cd {shlex.quote(job.cwd)} && env {exports} {shlex.quote(job.python)} {shlex.join(argv)}"


def ssh_plan(job: Job, hosts: Resources) -> Plan:
    commands = []
    for rank, (host, slots) in enumerate(hosts.items()):
        agent = agent_args(job, len(hosts), rank, len(slots))
        agent.insert(2, EOF_FLAG)  # the ssh connection closing stops that host's job
        env = {**visible_devices(slots), **worker_env(job)}
        port = ["-p", str(job.ssh_port)] if job.ssh_port is not None else []
        commands.append(["ssh", "-o", "BatchMode=yes", *port, *job.launcher_args, host, _remote_shell(job, env, agent)])
    return Plan(commands, ssh_stdin=True)


def _uniform(hosts: Resources, runner: str) -> list[int]:
    slot_lists = list(hosts.values())
    if any(s != slot_lists[0] for s in slot_lists):
        detail = ", ".join(f"{h}: {s}" for h, s in hosts.items())
        raise LaunchError(f"--launcher {runner} runs the same on every host; their slots differ ({detail})")
    return slot_lists[0]


def pdsh_plan(job: Job, hosts: Resources) -> Plan:
    slots = _uniform(hosts, "pdsh")
    env = {**visible_devices(slots), **worker_env(job)}
    remote = _remote_shell(job, env, agent_args(job, len(hosts), "%n", len(slots)))
    rcmd = [] if "-R" in job.launcher_args else ["-R", "ssh"]  # DeepSpeed: PDSH_RCMD_TYPE=ssh
    argv = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(hosts), *rcmd, *job.launcher_args, remote]
    if job.ssh_port is not None:
        argv = ["env", f"PDSH_SSH_ARGS_APPEND=-p {job.ssh_port}", *argv]
    return Plan([argv])


def _worker(job: Job) -> list[str]:
    return [job.python, "-u", "-m", "fastzero.launch_agent", WORKER_FLAG, job.script, *job.script_args]


def _rendezvous(job: Job, slots: list[int]) -> dict[str, str]:
    """What every rank started by mpirun/srun gets: this host's exports, the
    shim's settings, the rendezvous and (same slots on every host) the devices."""
    return {
        **job.exports,
        **visible_devices(slots),
        **worker_env(job),
        "MASTER_ADDR": job.master_addr,
        "MASTER_PORT": str(job.master_port),
    }


def openmpi_plan(job: Job, hosts: Resources) -> Plan:
    """``mpirun -n N -hostfile F``: the hostfile as it is (DeepSpeed: no filters)."""
    slots = _uniform(hosts, "openmpi")
    world = len(slots) * len(hosts)
    argv = ["mpirun", "-n", str(world), "-hostfile", str(job.hostfile), "--mca", "btl", "^openib"]
    given = job.launcher_args
    if not any(a in ("-mca", "--mca") and b == "btl_tcp_if_include" for a, b in zip(given, given[1:])):
        argv += ["--mca", "btl_tcp_if_include", "eth0"]
    argv += given
    for k, v in {**_rendezvous(job, slots), "UCX_TLS": "tcp"}.items():
        argv += ["-x", f"{k}={v}"]
    return Plan([argv + _worker(job)])


def mpich_plan(job: Job, hosts: Resources) -> Plan:
    slots = _uniform(hosts, "mpich")
    ppn = len(slots)
    world = ppn * len(hosts)
    argv = ["mpirun", "-n", str(world), "-ppn", str(ppn), *job.launcher_args]
    for k, v in _rendezvous(job, slots).items():
        argv += ["-genv", k, v]
    argv += ["-genv", "WORLD_SIZE", str(world), "-genv", "LOCAL_SIZE", str(ppn), "-hosts", ",".join(hosts)]
    return Plan([argv + _worker(job)])


MVAPICH_ENV = {
    "MV2_SMP_USE_CMA": "0",
    "MV2_DEBUG_SHOW_BACKTRACE": "1",
    "MV2_SUPPORT_DL": "1",
    "MV2_ENABLE_AFFINITY": "0",
    "MV2_INTER_ALLGATHER_TUNING": "5",
    "MV2_CUDA_USE_NAIVE": "0",
}


def mvapich_plan(job: Job, hosts: Resources) -> Plan:
    slots = _uniform(hosts, "mvapich")
    ppn = len(slots)
    world = ppn * len(hosts)
    argv = ["mpirun", "-np", str(world), "-ppn", str(ppn), "--hostfile", MVAPICH_HOSTFILE, *job.launcher_args]
    for k, v in {**MVAPICH_ENV, **_rendezvous(job, slots)}.items():
        argv += ["-env", f"{k}={v}"]
    return Plan([argv + _worker(job)], files={MVAPICH_HOSTFILE: "".join(f"{h}\n" for h in hosts)})


def slurm_plan(job: Job, hosts: Resources) -> Plan:
    """``srun`` over the chosen hosts: -n ranks on --nodelist, the same number per host."""
    slots = _uniform(hosts, "slurm")
    ppn = len(slots)
    world = ppn * len(hosts)
    argv = ["srun", "-n", str(world), "--nodes", str(len(hosts)), "--ntasks-per-node", str(ppn)]
    argv += ["--nodelist", ",".join(hosts), *job.launcher_args]
    exports = ",".join(f"{k}={v}" for k, v in _rendezvous(job, slots).items())
    argv.append(f"--export=ALL,{exports}")
    return Plan([argv + _worker(job)])


PLANS = {
    "ssh": ssh_plan,
    "pdsh": pdsh_plan,
    "openmpi": openmpi_plan,
    "mpich": mpich_plan,
    "mvapich": mvapich_plan,
    "slurm": slurm_plan,
}


def multi_node_plan(runner: str, job: Job, hosts: Resources) -> Plan:
    if runner not in PLANS:
        raise LaunchError(f"--launcher {runner}: not one of {', '.join(RUNNERS)}")
    return PLANS[runner](job, hosts)
