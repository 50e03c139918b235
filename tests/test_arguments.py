"""DeepSpeed's command-line arguments: ``fastzero.add_config_arguments`` and
``fastzero.initialize(args=...)`` reading the config path they carry."""

import argparse
import json
import os
import subprocess
import sys

import pytest

import fastzero
from fastzero.config import ConfigError, config_from_args
from tests.workers.train_zero import make_model

CONFIG = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.125}}}


def parser():
    return fastzero.add_config_arguments(argparse.ArgumentParser())


def test_the_arguments_and_their_defaults():
    p = argparse.ArgumentParser()
    assert fastzero.add_config_arguments(p) is p
    args = p.parse_args([])
    assert vars(args) == dict(
        deepspeed=False,
        deepspeed_config=None,
        deepscale=False,
        deepscale_config=None,
        fastzero=False,
        fastzero_config=None,
    )
    args = p.parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--fastzero", "--deepscale"])
    assert (args.deepspeed, args.deepspeed_config, args.fastzero, args.deepscale) == (True, "ds.json", True, True)
    assert any(g.title == "DeepSpeed" for g in p._action_groups)  # one group, as DeepSpeed's help shows it


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


@pytest.mark.parametrize("flag", ["--deepspeed_config", "--deepscale_config", "--fastzero_config"])
def test_initialize_reads_each_alias(config_file, flag, recwarn):
    args = parser().parse_args(["--deepspeed", flag, config_file])
    engine, optimizer, _, _ = fastzero.initialize(args=args, model=make_model())
    assert engine._config.train_micro_batch_size_per_gpu == 4
    assert optimizer.param_groups[0]["lr"] == 0.125
    deprecated = [w for w in recwarn if issubclass(w.category, FutureWarning) and "deepscale" in str(w.message)]
    assert len(deprecated) == (flag == "--deepscale_config")


def test_a_plain_namespace_works_too(config_file):
    """Scripts that build args themselves: only the attributes they have are read."""
    assert config_from_args(argparse.Namespace(deepspeed_config=config_file), None) == config_file
    assert config_from_args(argparse.Namespace(local_rank=0), {"a": 1}) == {"a": 1}
    assert config_from_args(None, "x.json") == "x.json"


def test_config_given_twice_is_refused(config_file):
    args = parser().parse_args(["--deepspeed_config", config_file])
    with pytest.raises(ConfigError, match="Not sure how to proceed, we were given deepspeed configs in the deepspeed"):
        fastzero.initialize(args=args, model=make_model(), config=CONFIG)
    with pytest.raises(ConfigError, match="Not sure how to proceed"):
        fastzero.initialize(args=args, model=make_model(), config_params=CONFIG)


def test_two_different_config_arguments_are_refused(config_file, tmp_path):
    args = parser().parse_args(["--deepspeed_config", config_file, "--fastzero_config", str(tmp_path / "other.json")])
    with pytest.raises(ConfigError, match="given both --deepspeed_config .* and --fastzero_config"):
        fastzero.initialize(args=args, model=make_model())
    same = parser().parse_args(["--deepspeed_config", config_file, "--fastzero_config", config_file])
    assert config_from_args(same, None) == config_file


def test_no_config_anywhere_says_how_to_give_one():
    with pytest.raises(ConfigError, match="--deepspeed_config"):
        fastzero.initialize(args=parser().parse_args([]), model=make_model())


def test_version_parts():
    assert fastzero.__version__.startswith(f"{fastzero.__version_major__}.{fastzero.__version_minor__}.")
    assert fastzero.version_info == (fastzero.__version_major__, fastzero.__version_minor__, fastzero.__version_patch__)
    assert all(isinstance(p, int) for p in fastzero.version_info)


def test_a_deepspeed_script_reaches_the_submodules_as_attributes():
    """``deepspeed.comm.get_rank()``, ``deepspeed.utils.RepeatingLoader``: loaded on first use, not by the import."""
    code = (
        "import sys, fastzero as deepspeed\n"
        "assert 'fastzero.comm' not in sys.modules and 'fastzero.utils' not in sys.modules\n"
        "assert deepspeed.comm.get_rank() == 0 and deepspeed.comm.get_world_size() == 1\n"
        "assert list(zip(range(3), deepspeed.utils.RepeatingLoader([7]))) == [(0, 7), (1, 7), (2, 7)]\n"
        "assert callable(deepspeed.zero.Init)\n"
        "try:\n    deepspeed.no_such_thing\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
