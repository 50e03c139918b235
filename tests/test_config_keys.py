"""The table of every DeepSpeed config key (fastzero/config_keys.py): it
covers DeepSpeed's keys (the vendored list, and the installed deepspeed's
models when there is one), it matches the config's fields, the parser
follows it (a refused key says why, an alias reads as its key, no DeepSpeed
key is ever "no such key"), and docs/config_keys.md is generated from it."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from fastzero import config_keys
from fastzero.config import Config, ConfigError, ConfigNotSupported, load_config, to_dict
from fastzero.config_keys import ACCEPTED, ALIAS, IMPLEMENTED, KEYS, REFUSED, lookup

ROOT = Path(__file__).resolve().parent.parent
VENDORED = ROOT / "tests" / "data" / "deepspeed_config_keys.txt"
BASE = {"train_micro_batch_size_per_gpu": 2}


def vendored() -> list[str]:
    return [line.strip() for line in VENDORED.read_text().splitlines() if line.strip() and not line.startswith("#")]


def nested(path: str, value) -> dict:
    """{"a": {"b": value}} for "a.b"; optimizer.type=<name> as the type (a
    torch.optim class: SGD)."""
    if "=" in path:
        path, name = path.split("=")
        name = "SGD" if name == "<torch.optim class>" else name
        path, value = path.removesuffix(".type"), {"type": name}
    out = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def field_paths(cls=Config, prefix="") -> set[str]:
    out = set()
    for f in fields(cls):
        out.add(prefix + f.name)
        if f.metadata["kind"] == "section":
            out |= field_paths(f.metadata["section"], f"{prefix}{f.name}.")
    return out


def test_the_vendored_list_is_deepspeeds():
    keys = vendored()
    assert "DeepSpeed 0.19" in VENDORED.read_text().splitlines()[0]
    assert len(keys) > 300 and len(set(keys)) == len(keys)
    for key in ("zero_optimization.offload_optimizer.ratio", "checkpoint.tag_validation", "fp16.auto_cast"):
        assert key in keys


@pytest.mark.parametrize("key", vendored())
def test_every_deepspeed_key_is_in_the_table(key):
    found = lookup(key)
    assert found is not None, f"{key}: add it to fastzero/config_keys.py's KEYS"
    # the key itself, or a section above it refused whole
    assert found[0] == key or found[1].status == REFUSED


@pytest.mark.parametrize("key", [k for k in vendored() if "=" not in k])
def test_no_deepspeed_key_is_an_unknown_key(key):
    """Set to null, every DeepSpeed key loads, is refused, or is a bad value:
    never "no such key"."""
    try:
        load_config({**BASE, **nested(key, None)})
    except ConfigNotSupported:
        pass
    except ConfigError as exc:
        assert "no such key" not in str(exc), exc


def installed_deepspeed_keys() -> list[str]:
    pytest.importorskip("deepspeed")
    from tests.deepspeed_config_keys import deepspeed_keys

    return deepspeed_keys()


def test_every_key_of_the_installed_deepspeed_is_in_the_table():
    """A key a new DeepSpeed adds (to its pydantic models, the sections it reads
    from constants, or its optimizer and schedule names) fails here."""
    missing = [k for k in installed_deepspeed_keys() if lookup(k) is None]
    assert not missing, f"add to fastzero/config_keys.py (and regenerate {VENDORED.name}): {missing}"


# string constants of deepspeed.runtime.constants that name no config key: values and internal names
NOT_KEYS = {
    "train",  # ROUTE_*: the engine's routes
    "eval",
    "predict",
    "encode",
    "max_grad_norm",  # an optimizer param (optimizer.params)
    "check_overflow",  # CHECK_OVERFLOW: defined, read nowhere
    "ddp_bf16",  # the engine's optimizer-wrapper name
    "mean",  # gradient_allreduce_op's values
    "sum",
    "ds_pipe_replicated",  # a param attribute
    "data_parallel_group",  # engine internals
    "global_rank",
}


def test_every_key_constant_of_deepspeed_names_a_key_in_the_table():
    keys = installed_deepspeed_keys()
    from deepspeed.runtime import constants

    names = {part for k in [*KEYS, *keys] for part in re.split(r"[.=]", k)}
    strays = [
        (name, value)
        for name, value in vars(constants).items()
        if name.isupper() and isinstance(value, str) and value.isidentifier() and not name.endswith("_DEFAULT")
        if value not in names and value not in NOT_KEYS
    ]
    assert not strays, f"deepspeed.runtime.constants names keys missing from the table (or add to NOT_KEYS): {strays}"


def test_the_table_and_the_config_fields_agree():
    """Every field is an implemented or accepted key, and every implemented or
    accepted key (types aside) is a field."""
    paths = field_paths()
    for path in paths:
        assert path in KEYS and KEYS[path].status in (IMPLEMENTED, ACCEPTED), path
    for path, key in KEYS.items():
        if key.status in (IMPLEMENTED, ACCEPTED) and "=" not in path:
            assert path in paths, f"{path} is {key.status} in the table but no field of fastzero.config.Config"
        if key.status == REFUSED:
            assert key.note and path not in paths, path
        if key.status == ALIAS and path.rpartition(".")[2] in LEGACY_OFFLOAD:  # read by config._legacy_offload
            assert key.note.startswith("zero_optimization.offload_"), path
        elif key.status == ALIAS:  # another key of the same section
            assert key.note.rpartition(".")[0] == path.rpartition(".")[0] and key.note in KEYS, path


REFUSED_KEYS = sorted(k for k, v in KEYS.items() if v.status == REFUSED)


def refused_section(key: str) -> str:
    """The outermost refused key at or above `key`: the one its error names."""
    parts = key.split(".")
    above = (".".join(parts[:n]) for n in range(1, len(parts)))
    return next((k for k in above if k in KEYS and KEYS[k].status == REFUSED), key)


@pytest.mark.parametrize("key", REFUSED_KEYS)
def test_each_refused_key_says_why(key):
    outer = refused_section(key)
    with pytest.raises(ConfigNotSupported) as info:
        load_config({**BASE, **nested(key, {})})
    message, entry = str(info.value), KEYS[outer]
    name = outer.replace("=", " = ").replace("<torch.optim class>", "SGD")
    assert message.startswith(name + ":") and entry.note in message, message
    assert "does not support yet" not in message  # every refusal is final, with its reason


LEGACY_OFFLOAD = ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")
PLAIN_ALIASES = sorted(k for k, v in KEYS.items() if v.status == ALIAS and k.rpartition(".")[2] not in LEGACY_OFFLOAD)


@pytest.mark.parametrize("key", PLAIN_ALIASES)
def test_each_second_name_reads_as_its_key(key):
    target = KEYS[key].note
    value = {"enabled": True} if key == "bfloat16" else True if "weights_on_model_save" in key else 12345
    by_alias = to_dict(load_config({**BASE, **nested(key, value)}))
    assert by_alias == to_dict(load_config({**BASE, **nested(target, value)}))
    assert by_alias != to_dict(load_config(BASE))
    both = {**nested(key, value), **nested(target, value)}
    if "." in key:
        both = {"zero_optimization": {key.split(".")[-1]: value, target.split(".")[-1]: value}}
    with pytest.raises(ConfigError, match="both given"):
        load_config({**BASE, **both})


@pytest.mark.parametrize(
    "legacy, new",
    [
        ({"cpu_offload": True}, {"offload_optimizer": {"device": "cpu"}}),
        ({"cpu_offload": False}, {}),
        (
            {"cpu_offload": True, "offload_optimizer": {"pin_memory": True}},
            {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
        ),
        ({"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}, {"offload_optimizer": {"device": "cpu"}}),
        (
            {"cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True},
            {
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "cpu", "pin_memory": True},
            },
        ),
    ],
)
def test_deepspeeds_legacy_offload_switches_are_the_offload_sections(legacy, new):
    stage = 3 if "cpu_offload_param" in legacy else 2
    old = load_config({**BASE, "zero_optimization": {"stage": stage, **legacy}})
    assert old == load_config({**BASE, "zero_optimization": {"stage": stage, **new}})


@pytest.mark.parametrize(
    "zero, match",
    [
        (
            {"cpu_offload": True, "offload_optimizer": {"device": "none"}},
            r"cpu_offload = true and .*offload_optimizer.device = 'none' disagree",
        ),
        ({"cpu_offload": False, "offload_optimizer": {"device": "cpu"}}, r"cpu_offload = false and .* disagree"),
        ({"cpu_offload_param": True, "offload_param": {"device": "none"}}, r"cpu_offload_param = true and .* disagree"),
        (
            {"cpu_offload": True, "cpu_offload_use_pin_memory": False, "offload_optimizer": {"pin_memory": True}},
            r"cpu_offload_use_pin_memory = false and .*pin_memory = true disagree",
        ),
        ({"cpu_offload_use_pin_memory": True}, r"no offload is on"),
        ({"cpu_offload": "yes"}, r"zero_optimization.cpu_offload = 'yes': must be true or false"),
    ],
)
def test_legacy_offload_switches_that_disagree_are_errors(zero, match):
    with pytest.raises(ConfigError, match=match):
        load_config({**BASE, "zero_optimization": {"stage": 3, **zero}})


def test_the_checkpoint_section():
    c = load_config(BASE).checkpoint
    assert (c.tag_validation, c.load_universal, c.use_node_local_storage, c.checkpoint_serialization) == (
        "warn",
        False,
        False,
        True,
    )
    c = load_config({**BASE, "checkpoint": {"tag_validation": "Fail", "load_universal": True}}).checkpoint
    assert c.tag_validation == "fail" and c.load_universal
    with pytest.raises(ConfigError, match=r"checkpoint.tag_validation = 'Never': must be one of ignore, warn, fail"):
        load_config({**BASE, "checkpoint": {"tag_validation": "Never"}})
    assert load_config({**BASE, "checkpoint": {"use_node_local_storage": True}}).checkpoint.use_node_local_storage
    with pytest.raises(ConfigError, match=r"checkpoint.use_node_local_storage = 'yes': must be"):
        load_config({**BASE, "checkpoint": {"use_node_local_storage": "yes"}})
    with pytest.raises(ConfigNotSupported, match=r"checkpoint_serialization = false: fastzero always writes"):
        load_config({**BASE, "checkpoint": {"checkpoint_serialization": False}})
    with pytest.raises(ConfigNotSupported, match=r"checkpoint.parallel_write: .*every fastzero rank already writes"):
        load_config({**BASE, "checkpoint": {"parallel_write": {"pipeline_stage": True}}})
    assert not load_config({**BASE, "checkpoint": {"use_node_local_storage": False}}).checkpoint.use_node_local_storage


def test_accepted_zero_keys_load_and_are_checked():
    zero = load_config({**BASE, "zero_optimization": {"elastic_checkpoint": True, "round_robin_gradients": True}})
    assert zero.zero_optimization.elastic_checkpoint and zero.zero_optimization.round_robin_gradients
    assert load_config(BASE).zero_optimization.load_from_fp32_weights
    with pytest.raises(ConfigError, match=r"load_from_fp32_weights = 1: must be true or false"):
        load_config({**BASE, "zero_optimization": {"load_from_fp32_weights": 1}})


def test_a_refused_optimizer_type_says_why_and_a_made_up_one_is_unknown():
    with pytest.raises(ConfigNotSupported, match=r"optimizer.type = Lion: .*no Lion kernel"):
        load_config({**BASE, "optimizer": {"type": "Lion"}})
    assert load_config({**BASE, "optimizer": {"type": "ZeroOneAdam"}}).optimizer.type == "ZeroOneAdam"
    with pytest.raises(ConfigNotSupported, match=r"optimizer.type = SGD: .*builds torch.optim's class of that name"):
        load_config({**BASE, "optimizer": {"type": "SGD"}})
    with pytest.raises(ConfigError, match=r"no such optimizer; did you mean 'Adam'"):
        load_config({**BASE, "optimizer": {"type": "Adma"}})


def test_the_doc_is_generated_from_the_table():
    doc = (ROOT / "docs" / "config_keys.md").read_text()
    assert doc == config_keys.markdown(), "regenerate: python -m fastzero.config_keys > docs/config_keys.md"
    for path in KEYS:
        assert f"`{path}`" in doc
