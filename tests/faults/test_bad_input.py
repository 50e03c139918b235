"""Bad input is refused up front with an error that names it: the launcher's
arguments and hostfiles, ``FASTZERO_*`` environment variables, config files,
op hyperparameters and shapes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fastzero.launcher import LaunchError, main, parse_hostfile
from tests.paths import REPO, WORKERS

SCRIPT = WORKERS / "pid_sleep.py"

# ---------------------------------------------------------------------------
# The launcher


@pytest.mark.parametrize(
    "host",
    ["-oProxyCommand=touch_x", "-v", "a;rm", "a$(id)", "a`id`", "a|b", "a&b", "a'b", 'a"b', "a,b", "a>b", "a\\b"],
)
def test_a_hostfile_host_that_is_not_a_host_name_is_refused(host):
    with pytest.raises(LaunchError, match="is not a host name"):
        parse_hostfile(f"{host} slots=1\n")


def test_host_names_ssh_takes_are_accepted():
    text = "node-1 slots=1\n10.0.0.2 slots=1\nuser@node.example.com slots=1\n[fe80::1%eth0] slots=1\nnode_3 slots=1\n"
    assert [h for h, _ in parse_hostfile(text)][-1] == "node_3"


def test_absurd_slot_counts_are_refused():
    with pytest.raises(LaunchError, match="slots=1025; must be >= 1 and <= 1024"):
        parse_hostfile("a slots=1025\n")
    assert parse_hostfile("a slots=1024\n") == [("a", 1024)]


@pytest.mark.parametrize(
    "args, match",
    [
        (["--nproc_per_node", "0"], "--nproc_per_node 0: must be >= 1"),
        (["--nproc_per_node", "-2"], "--nproc_per_node -2: must be >= 1"),
        (["--nproc_per_node", "5000"], "--nproc_per_node 5000: must be >= 1 and <= 1024"),
        (["--master_port", "0"], "--master_port 0: must be a TCP port"),
        (["--master_port", "70000"], "--master_port 70000: must be a TCP port"),
        (["--master_port", "-1"], "--master_port -1: must be a TCP port"),
        (["--master_addr=-oProxyCommand=x"], "--master_addr '-oProxyCommand=x' is not a host name"),
        (["--max_restarts", "-1"], "--max_restarts -1: must be >= 0"),
        (["--nnodes", "2", "--node_rank", "2"], "0 <= node_rank < nnodes"),
    ],
)
def test_bad_launcher_arguments_are_refused(args, match, capsys):
    assert main([*args, "--dry_run", str(SCRIPT)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastzero: error: ") and match in err and "Traceback" not in err


def test_a_directory_or_missing_script_is_refused(tmp_path, capsys):
    assert main(["--dry_run", str(tmp_path)]) == 2
    assert "is a directory; give the training script's path" in capsys.readouterr().err
    assert main(["--dry_run", str(tmp_path / "train.py")]) == 2
    assert "no such training script" in capsys.readouterr().err


def test_a_bad_hostfile_file_is_refused(tmp_path, capsys):
    assert main(["--hostfile", str(tmp_path), "--dry_run", str(SCRIPT)]) == 2
    assert f"hostfile {tmp_path} is a directory" in capsys.readouterr().err
    hosts = tmp_path / "hosts"
    hosts.write_bytes(b"node\xff slots=1\n")
    assert main(["--hostfile", str(hosts), "--dry_run", str(SCRIPT)]) == 2
    assert f"hostfile {hosts} is not UTF-8" in capsys.readouterr().err
    hosts.write_text("--help slots=1\n")
    assert main(["--hostfile", str(hosts), "--dry_run", str(SCRIPT)]) == 2
    assert f"{hosts}:1: host '--help' is not a host name" in capsys.readouterr().err


def test_the_command_line_error_has_no_traceback(tmp_path):
    """Run as the command: one line on stderr, exit code 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "fastzero.launcher", "--nproc_per_node", "0", str(SCRIPT)],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["fastzero: error: --nproc_per_node 0: must be >= 1 and <= 1024"]


# ---------------------------------------------------------------------------
# FASTZERO_* environment variables


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "-inf", "abc", "1e300", "30s"])
def test_a_bad_dist_timeout_is_refused_by_name(value):
    from fastzero.comm.env import init_distributed

    with pytest.raises(ValueError, match=rf"FASTZERO_DIST_TIMEOUT='{value}'.*must be a finite number > 0"):
        init_distributed(environ={"FASTZERO_DIST_TIMEOUT": value})


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "60", True])
def test_a_bad_timeout_argument_is_refused(value):
    from fastzero.comm.env import init_distributed

    with pytest.raises(ValueError, match="timeout_s=.*must be a number of seconds > 0"):
        init_distributed(timeout_s=value, environ={})


def test_a_bad_dist_backend_is_refused_by_name():
    from fastzero.comm.env import init_distributed

    with pytest.raises(ValueError, match="FASTZERO_DIST_BACKEND='gloox' is not one of gloo, nccl, mpi, ucc"):
        init_distributed(environ={"FASTZERO_DIST_BACKEND": "gloox"})


@pytest.mark.parametrize("value", ["yes", "true", "2", "off"])
def test_fastzero_jit_must_be_0_or_1(monkeypatch, value):
    from fastzero.native import loader

    monkeypatch.setenv("FASTZERO_JIT", value)
    with pytest.raises(ValueError, match=f"FASTZERO_JIT='{value}': it must be 1 or 0"):
        loader.jit_allowed()
    monkeypatch.delenv("FASTZERO_CUDA_LIB", raising=False)
    monkeypatch.setattr(loader, "_prebuilt_cuda_library", lambda: None)
    loader._load_cuda.cache_clear()
    try:
        with pytest.raises(ValueError, match="FASTZERO_JIT"):  # consulted where a build would start
            loader._load_cuda()
    finally:
        loader._load_cuda.cache_clear()
    for ok, allowed in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("FASTZERO_JIT", ok)
        assert loader.jit_allowed() is allowed


def test_fastzero_cuda_lib_must_name_a_file(monkeypatch, tmp_path):
    from fastzero.native import loader

    monkeypatch.setenv("FASTZERO_CUDA_LIB", str(tmp_path / "libnone.so"))
    with pytest.raises(ValueError, match="FASTZERO_CUDA_LIB=.*libnone.so': no such file"):
        loader._prebuilt_cuda_library()
    monkeypatch.setenv("FASTZERO_CUDA_LIB", str(tmp_path))
    with pytest.raises(ValueError, match="FASTZERO_CUDA_LIB=.*: a directory"):
        loader._prebuilt_cuda_library()
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("FASTZERO_CUDA_LIB", str(lib))
    assert loader._prebuilt_cuda_library() == lib


@pytest.mark.parametrize("value", ["sm_8x", "80;abc", "8", "80;-90", "1000"])
def test_fastzero_cuda_archs_format(monkeypatch, value):
    from fastzero.native import loader

    monkeypatch.setenv("FASTZERO_CUDA_ARCHS", value)
    with pytest.raises(ValueError, match="FASTZERO_CUDA_ARCHS=.*is not a CUDA architecture"):
        loader._cuda_archs()


def test_fastzero_cuda_archs_spellings(monkeypatch):
    from fastzero.native import loader

    monkeypatch.setenv("FASTZERO_CUDA_ARCHS", "sm_80, 90a;100;80")
    assert loader._cuda_archs() == ("80", "90a", "100")


def test_fastzero_cache_dir_must_not_be_a_file(monkeypatch, tmp_path):
    from fastzero.native import build

    not_dir = tmp_path / "file"
    not_dir.write_text("")
    monkeypatch.setenv("FASTZERO_CACHE_DIR", str(not_dir))
    with pytest.raises(ValueError, match="FASTZERO_CACHE_DIR=.*is not a directory"):
        build.cache_dir()
    monkeypatch.setenv("FASTZERO_CACHE_DIR", str(tmp_path / "new"))
    assert build.cache_dir() == tmp_path / "new"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FASTZERO_CACHE_DIR", "~/c")
    assert build.cache_dir() == tmp_path / "c"


def test_fastzero_backend_is_checked_by_the_shared_helper(monkeypatch):
    from fastzero.ops.backend import forced_backend

    monkeypatch.setenv("FASTZERO_BACKEND", " CPU ")
    assert forced_backend() == "cpu"
    monkeypatch.setenv("FASTZERO_BACKEND", "gpu")
    with pytest.raises(ValueError, match="FASTZERO_BACKEND='gpu' is not one of cuda, triton, cpu, reference"):
        forced_backend()


def test_a_node_local_root_must_be_a_directory(monkeypatch, tmp_path):
    """FASTZERO_NODE_LOCAL_ROOT_<i>: a node-local save names the variable
    and writes nothing."""
    import fastzero
    from tests.runtime.test_engine_single import cfg
    from tests.workers.train_zero import make_model

    config = cfg(checkpoint={"use_node_local_storage": True})
    engine, *_ = fastzero.initialize(model=make_model(), config=config)
    (tmp_path / "file").write_text("")
    for value, what in ((tmp_path / "missing", "no such directory"), (tmp_path / "file", "not a directory")):
        monkeypatch.setenv("FASTZERO_NODE_LOCAL_ROOT_0", str(value))
        with pytest.raises(ValueError, match=f"rank 0: FASTZERO_NODE_LOCAL_ROOT_0=.*{what}; it must name an existing"):
            engine.save_checkpoint(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("name", ["FASTZERO_BUILD_NATIVE", "FASTZERO_BUILD_CUDA", "FASTZERO_BUILD_STRICT"])
def test_setup_refuses_a_bad_build_switch(name):
    import os

    proc = subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=REPO,
        env=dict(os.environ, **{name: "yes"}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and f"{name}='yes': it must be 1 or 0" in proc.stderr


def test_env_helpers():
    from fastzero.native.envvars import env_choice, env_flag, env_float, env_path

    assert env_float("X", 3.0, environ={}) == 3.0 and env_float("X", 3.0, environ={"X": " "}) == 3.0
    assert env_float("X", 3.0, min_exclusive=0, environ={"X": "2.5"}) == 2.5
    with pytest.raises(ValueError, match=r"X='-1': it must be a finite number >= 0 \(or unset\)"):
        env_float("X", 1.0, minimum=0, environ={"X": "-1"})
    assert env_choice("X", ("a", "b"), "a", environ={}) == "a"
    assert env_flag("X", False, environ={"X": "1"}) is True
    assert env_path("X", environ={}) is None


# ---------------------------------------------------------------------------
# Op arguments


def _optimizers():
    from fastzero.ops import CPUAdam, FusedAdam, FusedLamb
    from fastzero.runtime.onebit_adam import OneBitAdam

    return [FusedAdam, CPUAdam, FusedLamb, OneBitAdam]


def _param():
    import torch

    return torch.nn.Parameter(torch.ones(3))


@pytest.mark.parametrize("cls", _optimizers(), ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "name, value, match",
    [
        ("lr", "1e-3", r"learning rate \(lr\) must be a real number, got str '1e-3'"),
        ("eps", None, "eps must be a real number, got NoneType None"),
        ("weight_decay", [1], "weight_decay must be a real number"),
        ("lr", float("nan"), r"invalid learning rate \(lr\) nan: it must be a finite number"),
        ("betas", (0.9,), r"betas must be a pair \(beta1, beta2\), got \(0.9,\)"),
        ("betas", 0.9, r"betas must be a pair \(beta1, beta2\), got 0.9"),
        ("betas", (0.9, 0.99, 0.1), r"betas must be a pair"),
        ("betas", ("0.9", 0.99), "beta1 must be a real number, got str '0.9'"),
        ("bias_correction", 2, "bias_correction must be True or False, got 2"),
        ("bias_correction", "yes", "bias_correction must be True or False, got 'yes'"),
    ],
)
@pytest.mark.parametrize("where", ["keyword", "param group"])
def test_a_bad_hyperparameter_is_named(cls, name, value, match, where):
    """As a keyword or in a torch-style param group dict, at construction (not at the first step)."""
    with pytest.raises((TypeError, ValueError), match=match) as info:
        if where == "keyword":
            cls([_param()], **{name: value})
        else:
            cls([{"params": [_param()]}, {"params": [_param()], name: value}])
    if where == "param group":
        assert str(info.value).startswith("param group 1: ")


def test_adamw_mode_must_be_a_bool():
    from fastzero.ops import CPUAdam, FusedAdam

    with pytest.raises(TypeError, match="FusedAdam: adam_w_mode must be True or False, got 'yes'"):
        FusedAdam([_param()], adam_w_mode="yes")
    with pytest.raises(TypeError, match="CPUAdam: adamw_mode must be True or False, got 'no'"):
        CPUAdam([_param()], adamw_mode="no")


@pytest.mark.parametrize("value", ["1.0", None, [1], float("nan"), -1.0, True])
def test_onebit_max_grad_norm_is_named(value):
    from fastzero.runtime.onebit_adam import OneBitAdam

    with pytest.raises(ValueError, match="OneBitAdam max_grad_norm=.*must be a number >= 0"):
        OneBitAdam([_param()], max_grad_norm=value)


def _attention(heads=2, block=4, **kw):
    from fastzero.ops import DenseSparsityConfig, SparseAttention

    return SparseAttention(DenseSparsityConfig(heads, block=block), max_seq_length=16, **kw)


def _qkv(*shape, dtype=None):
    import torch

    make = (lambda: torch.randn(*shape)) if dtype is None else (lambda: torch.ones(*shape, dtype=dtype))
    return make(), make(), make()


@pytest.mark.parametrize(
    "qkv, match",
    [
        (lambda: _qkv(1, 2, 8, 0), r"\(1, 2, 8, 0\) \[batch, heads, seq, head_dim\] have head_dim = 0"),
        (lambda: _qkv(1, 2, 0, 4), "have seq = 0; seq must be >= 1"),
        (lambda: _qkv(2, 8, 4), r"must be \[batch, heads, seq, head_dim\]; got \(2, 8, 4\)"),
        (lambda: _qkv(1, 3, 8, 4), "query has 3 heads, the sparsity config 2"),
        (lambda: _qkv(1, 2, 8, 4, dtype=__import__("torch").int64), "dtype torch.int64: SparseAttention takes"),
        (lambda: ([1.0], [1.0], [1.0]), "query must be a torch.Tensor"),
    ],
)
def test_sparse_attention_names_a_bad_input(qkv, match):
    with pytest.raises(ValueError, match=match):
        _attention()(*qkv())


def test_sparse_attention_batch_0_is_legal():
    assert _attention()(*_qkv(0, 2, 7, 4)).shape == (0, 2, 7, 4)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: _attention(block=0), "block must be an integer >= 1, got 0"),
        (lambda: _attention(block=-4), "block must be an integer >= 1, got -4"),
        (lambda: _attention(heads=0), "num_heads must be an integer >= 1, got 0"),
        (lambda: _attention(softmax_scale="0.1"), "softmax_scale must be a finite number"),
        (lambda: _attention(softmax_scale=float("inf")), "softmax_scale must be a finite number"),
    ],
)
def test_sparse_attention_names_a_bad_setting(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_sparse_attention_max_seq_length_and_module_arguments():
    from fastzero.ops import DenseSparsityConfig, SparseAttention

    with pytest.raises(ValueError, match="max_seq_length must be an integer >= 1, got 0"):
        SparseAttention(DenseSparsityConfig(2, block=4), max_seq_length=0)
    with pytest.raises(ValueError, match="sparsity_config must be a sparsity config"):
        SparseAttention({"block": 4})


def test_block_sparse_attention_names_a_bad_block_or_length():
    import torch

    from fastzero.ops import block_sparse_attention

    q, k, v = _qkv(1, 2, 8, 4)
    with pytest.raises(ValueError, match="block must be an integer >= 1, got 0"):
        block_sparse_attention(q, k, v, torch.ones(2, 2, 2), 0)
    q, k, v = _qkv(1, 2, 6, 4)
    with pytest.raises(ValueError, match="seq 6 is not a multiple of the block 4"):
        block_sparse_attention(q, k, v, torch.ones(2, 1, 1), 4)
    with pytest.raises(ValueError, match="layout must be a torch.Tensor"):
        block_sparse_attention(*_qkv(1, 2, 8, 4), [[1]], 4)


def test_pad_to_block_size_names_a_bad_block():
    import torch

    from fastzero.ops import pad_to_block_size

    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        pad_to_block_size(0, input_ids=torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="needs input_ids"):
        pad_to_block_size(4)


# ---------------------------------------------------------------------------
# Config files


def _write(tmp_path, text: str | bytes):
    path = tmp_path / "ds_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize(
    "text, key_path",
    [
        ('{"train_batch_size": 8, "train_batch_size": 16}', "train_batch_size"),
        ('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}', "zero_optimization.stage"),
        (
            '{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "lr": 1e-2}}}',
            "optimizer.params.lr",
        ),
        ('{"train_batch_size": 8, "x": [{"a": 1}, {"a": 1, "a": 2}]}', r"x\[1\].a"),
    ],
)
def test_a_duplicate_key_is_refused_with_its_path(tmp_path, text, key_path):
    from fastzero.config import ConfigError, load_config

    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"config file {path}: {key_path}: the key '\w+' appears twice"):
        load_config(path)


def test_a_non_utf8_config_file_is_refused_with_its_path(tmp_path):
    from fastzero.config import ConfigError, load_config

    path = _write(tmp_path, b'{"train_batch_size": 8, "x": "\xff"}')
    with pytest.raises(ConfigError, match=rf"config file {path} is not UTF-8 text"):
        load_config(path)


def test_a_directory_as_config_file_is_refused_with_its_path(tmp_path):
    from fastzero.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"config file {tmp_path} is a directory"):
        load_config(tmp_path)


def test_errors_from_a_file_name_the_file_and_the_key(tmp_path):
    from fastzero.config import ConfigError, load_config

    text = '{"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}'
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"config file {path}: scheduler.params.warmup_num_steps = 0: must be >= 1"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^scheduler.params.warmup_num_steps = 0: must be >= 1"):
        load_config({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})


@pytest.mark.parametrize(
    "schedule, key",
    [
        ("WarmupLR", "warmup_num_steps"),
        ("WarmupDecayLR", "total_num_steps"),
        ("WarmupDecayLR", "warmup_num_steps"),
        ("WarmupCosineLR", "total_num_steps"),
        ("WarmupCosineLR", "warmup_num_steps"),
        ("OneCycle", "cycle_first_step_size"),
        ("LRRangeTest", "lr_range_test_step_size"),
    ],
)
def test_a_step_count_the_schedule_refuses_is_refused_at_load(schedule, key):
    from fastzero.config import ConfigError, load_config

    params = {"total_num_steps": 10, "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, key: 0}
    params = {k: v for k, v in params.items() if k == key or k in _scheduler_defaults(schedule)}
    with pytest.raises(ConfigError, match=rf"scheduler.params.{key} = 0: must be >= 1"):
        load_config({"train_batch_size": 8, "scheduler": {"type": schedule, "params": params}})


def _scheduler_defaults(schedule):
    from fastzero.config import SCHEDULER_PARAMS

    return SCHEDULER_PARAMS[schedule]


def _edge_cases():
    from fastzero.config import SCHEDULER_PARAMS

    for schedule, defaults in SCHEDULER_PARAMS.items():
        for key, default in defaults.items():
            if not isinstance(default, bool | str):
                for value in (0, 1, 2, 10**9, 0.0, 0.5, 1e30):
                    yield schedule, key, value


@pytest.mark.parametrize("schedule, key, value", list(_edge_cases()))
def test_a_schedule_the_config_accepts_builds_and_steps(schedule, key, value):
    """Every numeric scheduler parameter at its edges: refused at load, or the
    schedule builds and gives finite learning rates (nothing fails later)."""
    import math

    import torch

    from fastzero.config import ConfigError, load_config
    from fastzero.runtime.lr_schedules import SCHEDULES

    params = {"total_num_steps": 10, "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}
    params = {k: v for k, v in params.items() if k in _scheduler_defaults(schedule)} | {key: value}
    try:
        cfg = load_config({"train_batch_size": 8, "scheduler": {"type": schedule, "params": params}})
    except ConfigError as exc:
        assert f"scheduler.params.{key}" in str(exc)
        return
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=1e-3)
    sched = SCHEDULES[schedule](opt, **cfg.scheduler.params)
    for _ in range(25):
        sched.step()
        assert all(math.isfinite(lr) for lr in sched.get_last_lr())


def test_lamb_trust_ratio_bounds_are_checked_at_load():
    from fastzero.config import ConfigError, load_config

    opt = {"type": "Lamb", "params": {"min_coeff": 5.0, "max_coeff": 1.0}}
    with pytest.raises(ConfigError, match=r"optimizer.params.min_coeff = 5.0: must be <= optimizer.params.max_coeff"):
        load_config({"train_batch_size": 8, "optimizer": opt})
