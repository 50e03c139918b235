"""DeepSpeed's launcher flags on ``fastzero`` (issue 14): the hostfile and
--include/--exclude with DeepSpeed's semantics (the cases of DeepSpeed's own
tests/unit/launcher/test_run.py, as data), the command each --launcher builds
for a two-host hostfile (argv, nothing run), the flags' mapping onto torchrun's,
the worker shim, and --local_rank reaching a script (a real 2-rank launch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fastzero import launcher
from fastzero.launch_agent import BIND_CORES_ENV, NO_LOCAL_RANK_ENV, RUN_AS_ENV, rank_environment, worker_argv
from fastzero.launch_hosts import (
    LaunchError,
    cores_for_rank,
    parse_core_list,
    parse_hostfile,
    parse_resource_filter,
    select_resources,
)
from fastzero.launch_runners import MVAPICH_HOSTFILE, Job, multi_node_plan
from tests.dist import free_port
from tests.paths import REPO, WORKERS

SCRIPT = WORKERS / "print_args.py"
W4 = [0, 1, 2, 3]

# ---------------------------------------------------------------------------
# --include / --exclude: DeepSpeed's test_parser_local, test_parser_multinode, test_parser_errors

ONE = {"worker-0": W4}
TWO = {"worker-0": W4, "worker-1": W4}
FILTERS = [
    (ONE, "", "", ONE),
    (ONE, "", "worker-0:1", {"worker-0": [0, 2, 3]}),
    (ONE, "", "worker-0:1,2", {"worker-0": [0, 3]}),
    (ONE, "worker-0:1", "", {"worker-0": [1]}),
    (ONE, "worker-0:1,1", "", {"worker-0": [1]}),
    (ONE, "worker-0:1@worker-0:0,1", "", {"worker-0": [0, 1]}),
    (ONE, "worker-0", "", ONE),
    (ONE, "", "worker-0", {}),
    (ONE, "", "worker-0:0,1,2,3", {}),
    (TWO, "", "", TWO),
    (TWO, "worker-1:0,3", "", {"worker-1": [0, 3]}),
    (TWO, "", "worker-1", {"worker-0": W4}),
    (TWO, "", "worker-0:0,1@worker-1:3", {"worker-0": [2, 3], "worker-1": [0, 1, 2]}),
    (TWO, "worker-1@worker-0:2", "", {"worker-0": [2], "worker-1": W4}),  # hostfile order kept
]


@pytest.mark.parametrize("hosts, include, exclude, expected", FILTERS)
def test_resource_filter_as_deepspeed(hosts, include, exclude, expected):
    got = parse_resource_filter(hosts, include, exclude)
    assert got == expected and list(got) == list(expected)


@pytest.mark.parametrize(
    "include, exclude, match",
    [
        ("A", "B", "mutually exclusive"),
        ("jeff", "", "hostname 'jeff' not found in hostfile"),
        ("", "jeff", "hostname 'jeff' not found in hostfile"),
        ("worker-1:4", "", "no slot '4' specified on host 'worker-1'"),
        ("", "worker-1:4", "no slot '4' specified on host 'worker-1'"),
        ("", "worker-1@worker-0:1@5", "hostname '5' not found"),
        ("worker-1:a", "", "slots 'a' of worker-1 are not numbers"),
        ("worker-1:", "", "is not NAME or NAME:SLOT"),
        ("worker-1:0:1", "", "is not NAME or NAME:SLOT"),
        ("worker-0@", "", "is not NAME or NAME:SLOT"),
        ("-oProxyCommand=x", "", "is not a host name"),
    ],
)
def test_resource_filter_errors(include, exclude, match):
    with pytest.raises(LaunchError, match=match):
        parse_resource_filter(TWO, include, exclude)


def test_select_resources_num_nodes_num_gpus():
    pool = [("a", 4), ("b", 4), ("c", 2)]
    assert select_resources(pool) == {"a": W4, "b": W4, "c": [0, 1]}
    assert select_resources(pool, num_nodes=2) == {"a": W4, "b": W4}
    assert select_resources(pool, num_nodes=2, num_gpus=1) == {"a": [0], "b": [0]}
    assert select_resources(pool, num_gpus=2) == {"a": [0, 1], "b": [0, 1], "c": [0, 1]}
    # slots beyond the hostfile's are refused (DeepSpeed's runner would let a:5 through)
    with pytest.raises(LaunchError, match="no slot '5' specified on host 'c'"):
        select_resources(pool, include="c:5")
    for kw in ({"num_nodes": 1}, {"num_gpus": 1}, {"num_nodes": 1, "num_gpus": 1}):  # DeepSpeed's test_num_plus_parser
        for flt in ({"include": "a"}, {"exclude": "a"}):
            with pytest.raises(LaunchError, match="cannot specify --num_nodes/--num_gpus with --include/--exclude"):
                select_resources(pool, **kw, **flt)
    with pytest.raises(LaunchError, match="--num_nodes 4: must be >= 1 and <= the 3 hosts"):
        select_resources(pool, num_nodes=4)
    with pytest.raises(LaunchError, match="left no slot"):
        select_resources(pool, exclude="a@b@c")


# ---------------------------------------------------------------------------
# Hostfiles: DeepSpeed's test_hostfile_good, test_hostfiles_bad


def test_hostfile_good_as_deepspeed():
    text = """
    worker-1 slots=2
    worker-2 slots=2

    localhost slots=1
    123.23.12.10 slots=2

    #worker-1 slots=3
    # this is a comment
    worker-3 slots=8 max_slots=8
    """
    assert parse_hostfile(text) == [
        ("worker-1", 2),
        ("worker-2", 2),
        ("localhost", 1),
        ("123.23.12.10", 2),
        ("worker-3", 8),
    ]


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "worker-1 slots=2\nworker-2 slots=1\nworker-1 slots=1",
            "hostfile:3: hostfile contains multiple entries for worker-1",
        ),
        ("this is bad slots=1", "hostfile:1: hostfile contains a bad entry: 'this is bad slots=1'"),
        ("missingslots", "hostfile:1: hostfile contains a bad entry: 'missingslots'"),
        ("  \n", "hostfile lists no hosts"),
        (
            "worker-1 slots=2\nthis is bad slots=1\nworker-2 slots=4\nmissingslots\n",
            "hostfile:2: hostfile contains a bad",
        ),
        ("worker-1 slots=x", "bad entry"),
        ("worker-1 slots=0", "worker-1 has slots=0; must be >= 1"),
        ("a;b slots=1", "is not a host name"),
    ],
)
def test_hostfile_errors_name_the_line(text, match):
    with pytest.raises(LaunchError, match=match):
        parse_hostfile(text)


# ---------------------------------------------------------------------------
# Each runner's command for a two-host hostfile

HOSTS = {"node-a": [0, 1], "node-b": [0, 1]}


def job(**kw) -> Job:
    base = dict(
        script="train.py",
        script_args=["--deepspeed_config", "ds.json"],
        python="/py",
        cwd="/work dir",
        master_addr="node-a",
        master_port=1234,
        exports={"NCCL_DEBUG": "INFO"},
        hostfile="/h/hosts",
    )
    return Job(**{**base, **kw})


WORKER = ["/py", "-u", "-m", "fastzero.launch_agent", "--worker", "train.py", "--deepspeed_config", "ds.json"]
AGENT = "-m fastzero.launch_agent --nnodes=2 --nproc_per_node=2 --node_rank={r} --master_addr=node-a --master_port=1234"
TAIL = " train.py --deepspeed_config ds.json"


def test_ssh_runner():
    plan = multi_node_plan("ssh", job(), HOSTS)
    assert plan.ssh_stdin and len(plan.commands) == 2
    for rank, (cmd, host) in enumerate(zip(plan.commands, HOSTS)):
        agent = AGENT.format(r=rank).replace("-m fastzero.launch_agent", "-m fastzero.launch_agent --exit_on_stdin_eof")
        assert cmd == ["ssh", "-o", "BatchMode=yes", host, f"cd '/work dir' && env NCCL_DEBUG=INFO /py {agent}{TAIL}"]


def test_pdsh_runner():
    (cmd,) = multi_node_plan("pdsh", job(launcher_args=["-R", "ssh"]), HOSTS).commands
    remote = f"cd '/work dir' && env NCCL_DEBUG=INFO /py {AGENT.format(r='%n')}{TAIL}"
    assert cmd == ["pdsh", "-S", "-f", "1024", "-w", "node-a,node-b", "-R", "ssh", remote]


def test_pdsh_runner_passes_devices_and_shim_settings():
    hosts = {"node-a": [1, 3], "node-b": [1, 3]}
    (cmd,) = multi_node_plan("pdsh", job(no_local_rank=True, bind_core_list="0-7"), hosts).commands
    assert f"env NCCL_DEBUG=INFO CUDA_VISIBLE_DEVICES=1,3 {NO_LOCAL_RANK_ENV}=1 {BIND_CORES_ENV}=0-7 /py" in cmd[-1]
    with pytest.raises(LaunchError, match=r"--launcher pdsh runs the same on every host; their slots differ"):
        multi_node_plan("pdsh", job(), {"node-a": [0, 1], "node-b": [0]})


RDZV = ["MASTER_ADDR=node-a", "MASTER_PORT=1234"]


def test_openmpi_runner():
    (cmd,) = multi_node_plan("openmpi", job(), HOSTS).commands
    head = [
        "mpirun",
        "-n",
        "4",
        "-hostfile",
        "/h/hosts",
        "--mca",
        "btl",
        "^openib",
        "--mca",
        "btl_tcp_if_include",
        "eth0",
    ]
    exports = ["-x", "NCCL_DEBUG=INFO", "-x", RDZV[0], "-x", RDZV[1], "-x", "UCX_TLS=tcp"]
    assert cmd == head + exports + WORKER
    (cmd,) = multi_node_plan("openmpi", job(launcher_args=["--mca", "btl_tcp_if_include", "ib0"]), HOSTS).commands
    assert cmd[:11] == [*head[:8], "--mca", "btl_tcp_if_include", "ib0"]


def test_mpich_runner():
    (cmd,) = multi_node_plan("mpich", job(), HOSTS).commands
    assert cmd == [
        "mpirun", "-n", "4", "-ppn", "2",
        "-genv", "NCCL_DEBUG", "INFO", "-genv", "MASTER_ADDR", "node-a", "-genv", "MASTER_PORT", "1234",
        "-genv", "WORLD_SIZE", "4", "-genv", "LOCAL_SIZE", "2", "-hosts", "node-a,node-b",
        *WORKER,
    ]  # fmt: skip


def test_mvapich_runner():
    plan = multi_node_plan("mvapich", job(), HOSTS)
    (cmd,) = plan.commands
    assert plan.files == {MVAPICH_HOSTFILE: "node-a\nnode-b\n"}
    assert cmd[:8] == ["mpirun", "-np", "4", "-ppn", "2", "--hostfile", MVAPICH_HOSTFILE, "-env"]
    env = cmd[7 : -len(WORKER)]
    assert env[::2] == ["-env"] * (len(env) // 2)
    assert {"MV2_SMP_USE_CMA=0", "MV2_SUPPORT_DL=1", "NCCL_DEBUG=INFO", *RDZV} <= set(env[1::2])
    assert cmd[-len(WORKER) :] == WORKER


def test_slurm_runner():
    (cmd,) = multi_node_plan("slurm", job(launcher_args=["-p", "gpu"]), HOSTS).commands
    assert cmd == [
        "srun", "-n", "4", "--nodes", "2", "--ntasks-per-node", "2", "--nodelist", "node-a,node-b", "-p", "gpu",
        "--export=ALL,NCCL_DEBUG=INFO,MASTER_ADDR=node-a,MASTER_PORT=1234",
        *WORKER,
    ]  # fmt: skip


def test_elastic_runs_torchrun_with_c10d():
    (cmd,) = multi_node_plan("pdsh", job(elastic=(1, 2)), HOSTS).commands
    assert "-m fastzero.launch_agent --nnodes=1:2 --nproc_per_node=2 --rdzv_backend=c10d" in cmd[-1]
    assert "--rdzv_endpoint=node-a:1234 --rdzv_id=123456789 train.py" in cmd[-1] and "--node_rank" not in cmd[-1]


# ---------------------------------------------------------------------------
# The command line: DeepSpeed's flags onto torchrun's


@pytest.fixture
def no_job_hostfile(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "DEFAULT_HOSTFILE", str(tmp_path / "none"))
    return tmp_path


def commands(argv: list[str]) -> list[list[str]]:
    args = launcher.build_parser().parse_args([*argv, str(SCRIPT), "out"])
    launcher.check_args(args)
    return launcher.plan(args).commands


def test_num_gpus_and_num_nodes_are_torchruns_nproc_and_nnodes(no_job_hostfile):
    for flag in ("--num_gpus", "--num_accelerators", "--nproc_per_node"):
        (cmd,) = commands([flag, "3", "--num_nodes", "2", "--node_rank", "1", "--master_addr", "h0"])
        assert cmd[:2] == [sys.executable, "-m"]
        assert cmd[3:8] == [
            "--nnodes=2",
            "--nproc_per_node=3",
            "--node_rank=1",
            "--master_addr=h0",
            "--master_port=29500",
        ]
        assert cmd[-2:] == [str(SCRIPT), "out"]


def test_local_include_exclude_pick_devices(no_job_hostfile, monkeypatch):
    monkeypatch.setattr(launcher, "_local_devices", lambda: 4)
    (cmd,) = commands(["--include", "localhost:1,3"])
    assert cmd[:2] == ["env", "CUDA_VISIBLE_DEVICES=1,3"] and "--nproc_per_node=2" in cmd
    (cmd,) = commands(["-e", "localhost:0"])
    assert cmd[:2] == ["env", "CUDA_VISIBLE_DEVICES=1,2,3"] and "--nproc_per_node=3" in cmd
    (cmd,) = commands(["--no_local_rank"])
    assert cmd[:2] == ["env", f"{NO_LOCAL_RANK_ENV}=1"] and "--nproc_per_node=4" in cmd


def test_hostfile_flags(no_job_hostfile):
    hosts = no_job_hostfile / "hosts"
    hosts.write_text("node-a slots=4\nnode-b slots=4\n")
    # one host of the hostfile, DeepSpeed's way: run here, no ssh
    (cmd,) = commands(["-H", str(hosts), "--num_nodes", "1", "--num_gpus", "2"])
    assert cmd[0] == sys.executable and "--nproc_per_node=2" in cmd and "--master_addr=127.0.0.1" in cmd
    # ... unless --force_multi
    (cmd,) = commands(["-H", str(hosts), "--num_nodes", "1", "--force_multi"])
    assert cmd[:4] == ["ssh", "-o", "BatchMode=yes", "node-a"] and "--nproc_per_node=4" in cmd[-1]
    (a, b) = commands(["-H", str(hosts), "-i", "node-a:2@node-b:0,1"])
    assert "CUDA_VISIBLE_DEVICES=2 " in a[-1] and "--nproc_per_node=1" in a[-1] and "--master_addr=node-a" in a[-1]
    assert "CUDA_VISIBLE_DEVICES" not in b[-1] and "--nproc_per_node=2" in b[-1] and "--node_rank=1" in b[-1]
    (cmd,) = commands(["-H", str(hosts), "--launcher", "SLURM"])
    assert cmd[:3] == ["srun", "-n", "8"]


def test_the_job_hostfile_is_the_default(no_job_hostfile, monkeypatch):
    hosts = no_job_hostfile / "job_hosts"
    hosts.write_text("node-a slots=1\nnode-b slots=1\n")
    monkeypatch.setattr(launcher, "DEFAULT_HOSTFILE", str(hosts))
    assert len(commands([])) == 2
    (cmd,) = commands(["--nnodes", "2", "--node_rank", "1", "--master_addr", "h0"])  # torchrun's way: this host only
    assert "--node_rank=1" in cmd


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--num_gpus", "1", "-i", "localhost"], "cannot specify --num_nodes/--num_gpus with --include/--exclude"),
        (["-i", "a", "-e", "b"], "mutually exclusive"),
        (
            ["-H", "{hosts}", "--launcher", "openmpi", "-i", "node-a@node-b:0"],
            "--launcher openmpi runs the hostfile as it is",
        ),
        (["-H", "{hosts}", "--launcher", "mpich", "--max_restarts", "1"], "--launcher mpich starts every rank itself"),
        (["-H", "{hosts}", "--node_rank", "0"], "--node_rank is for a launch on one host"),
        (["--elastic_training"], "--elastic_training needs --master_addr"),
        (["--min_elastic_nodes", "2"], "--min_elastic_nodes needs --elastic_training"),
        (["--bind_core_list", "3-1"], "--bind_core_list '3-1': bad range"),
        (["--bind_cores_to_rank", "--bind_core_list", "0", "--num_gpus", "2"], "1 cores for 2 ranks per host"),
    ],
)
def test_bad_deepspeed_flags_are_refused(argv, match, no_job_hostfile, capsys):
    hosts = no_job_hostfile / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    argv = [a.replace("{hosts}", str(hosts)) for a in argv]
    assert launcher.main([*argv, "--dry_run", str(SCRIPT), "out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastzero: error: ") and match in err, err


def test_elastic_local(no_job_hostfile):
    (cmd,) = commands(["--elastic_training", "--master_addr", "h0", "--max_elastic_nodes", "3", "--num_gpus", "1"])
    assert cmd[3:7] == ["--nnodes=1:3", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=h0:29500"]


# ---------------------------------------------------------------------------
# The worker shim


def test_rank_variables_of_mpi_and_slurm():
    assert rank_environment({"RANK": "1", "PMI_RANK": "3"}) == {}
    assert rank_environment(
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    ) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
    }
    mpich = {"PMI_RANK": "3", "PMI_SIZE": "4", "LOCAL_SIZE": "2"}
    assert rank_environment(mpich) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    slurm = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}
    assert rank_environment(slurm) == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}
    mv2 = {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1"}
    assert rank_environment(mv2)["LOCAL_RANK"] == "1"


def test_worker_argv_local_rank_first():
    assert worker_argv("t.py", ["--x", "1"], {"LOCAL_RANK": "3"}) == [
        sys.executable,
        "-u",
        "t.py",
        "--local_rank=3",
        "--x",
        "1",
    ]
    assert worker_argv("t.py", ["--x"], {"LOCAL_RANK": "3", NO_LOCAL_RANK_ENV: "1"}) == [
        sys.executable,
        "-u",
        "t.py",
        "--x",
    ]


def test_local_rank_only_for_a_script_that_declares_it(tmp_path):
    """A DeepSpeed script declares --local_rank; a torchrun-style one that
    does not would stop on the unknown argument, so it gets LOCAL_RANK only."""
    declares, plain = tmp_path / "ds.py", tmp_path / "plain.py"
    declares.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--local_rank', type=int)\n")
    plain.write_text("import os, sys\nprint(os.environ['LOCAL_RANK'], sys.argv[1:])\n")
    assert worker_argv(str(declares), ["--x"], {"LOCAL_RANK": "1"})[-2:] == ["--local_rank=1", "--x"]
    assert worker_argv(str(plain), ["--x"], {"LOCAL_RANK": "1"}) == [sys.executable, "-u", str(plain), "--x"]


def test_core_lists_as_deepspeed():
    assert parse_core_list("0,2-4,6") == [0, 2, 3, 4, 6]
    assert parse_core_list("5") == [5]
    for bad in ("2,1", "1-3,3", "a", "1-", ""):
        with pytest.raises(LaunchError):
            parse_core_list(bad)
    assert [cores_for_rank(list(range(7)), 3, r) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(LaunchError, match="2 cores for 3 ranks"):
        cores_for_rank([0, 1], 3, 0)


# ---------------------------------------------------------------------------
# A real launch: 1 node, 2 ranks


def run_print_args(tmp_path, *flags, script=str(SCRIPT)):
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "fastzero.launcher", "--num_gpus", "2", "--master_port", str(free_port()), *flags]
        + [script, str(out)],
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_local_rank_reaches_the_script(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    bind = ["--bind_cores_to_rank"] if len(cores) >= 2 else []
    for rank, got in enumerate(run_print_args(tmp_path, *bind)):
        assert got["argv"][0] == f"--local_rank={rank}" and got["local_rank_arg"] == rank
        assert got["LOCAL_RANK"] == str(rank)
        if bind:
            share = len(cores) // 2
            assert got["cores"] == cores[share * rank : share * (rank + 1)] and got["OMP_NUM_THREADS"] == str(share)


def test_no_local_rank_and_module(tmp_path):
    """--no_local_rank, and the script run as a module (--module)."""
    for rank, got in enumerate(
        run_print_args(tmp_path, "--no_local_rank", "--module", script="tests.workers.print_args")
    ):
        assert got["argv"] == [str(tmp_path / "out")] and got["local_rank_arg"] is None
        assert got["LOCAL_RANK"] == str(rank)


def test_exports_deepspeed_env_and_cwd_on_pythonpath(no_job_hostfile, monkeypatch):
    home, work = no_job_hostfile / "home", no_job_hostfile / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\nMY_VAR = a b\n")
    (work / ".deepspeed_env").write_text("# here\n\nMY_VAR=c\n")
    (work / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", "/lib")
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    monkeypatch.chdir(work)
    (cmd, _) = commands(["-H", "hosts"])
    assert f"PYTHONPATH={work}:/lib " in cmd[-1] and " NCCL_IB_DISABLE=1 " in cmd[-1] and " MY_VAR=c " in cmd[-1]
    (work / ".deepspeed_env").write_text("$(id)=1\n")
    with pytest.raises(LaunchError, match=r".deepspeed_env:1: '\$\(id\)=1' is not NAME=value"):
        commands(["-H", "hosts"])


def test_pdsh_over_ssh_and_ssh_port():
    (cmd,) = multi_node_plan("pdsh", job(ssh_port=2222), HOSTS).commands
    assert cmd[:10] == [
        "env",
        "PDSH_SSH_ARGS_APPEND=-p 2222",
        "pdsh",
        "-S",
        "-f",
        "1024",
        "-w",
        "node-a,node-b",
        "-R",
        "ssh",
    ]
    first, _ = multi_node_plan("ssh", job(ssh_port=2222), HOSTS).commands
    assert first[:6] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "node-a"]


def test_module_and_no_python(no_job_hostfile):
    assert worker_argv("pkg.train", ["--x"], {"LOCAL_RANK": "1", RUN_AS_ENV: "module"}) == [
        sys.executable, "-u", "-m", "pkg.train", "--local_rank=1", "--x",
    ]  # fmt: skip
    assert worker_argv("./run.sh", [], {RUN_AS_ENV: "exec"}) == ["./run.sh", "--local_rank=0"]


def test_module_names_are_checked(no_job_hostfile, capsys):
    assert launcher.main(["--module", "--dry_run", "pkg.train"]) == 0
    assert capsys.readouterr().out.startswith(f"env {RUN_AS_ENV}=module ")
    assert launcher.main(["--module", "--dry_run", "pkg/train.py"]) == 2
    assert "--module pkg/train.py: not a module name" in capsys.readouterr().err
    assert launcher.main(["--module", "--no_python", "--dry_run", "pkg.train"]) == 2
    assert "--module and --no_python do not mix" in capsys.readouterr().err
