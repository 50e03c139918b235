"""Each optimizer family's hyperparameters cross into native code as one C
struct (csrc/common/hyperparams.h) laid out by the family's dataclass
(fastzero.ops.hyperparams): the header's structs are parsed here and checked
field for field (name, order, C type) against the dataclasses, and their
sizes against the compiled CPU extension's. A field added on one side alone
fails here. And the backends' Python wrappers and the pybind11 bindings pass
the struct whole: they name no field, so a new hyperparameter touches only
the dataclass, the reference and the kernels."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import re

import pytest

from fastzero.native import build, cpu_ops
from fastzero.ops.adam import AdamHyperparams
from fastzero.ops.hyperparams import Hyperparams
from fastzero.ops.lamb import LambHyperparams
from tests import paths

ROOT = paths.REPO
HEADER = build.common_source_dir() / "hyperparams.h"

# dataclass -> (its C struct in HEADER, its key in the extension's hyper_sizes())
FAMILIES: dict[type[Hyperparams], tuple[str, str]] = {
    AdamHyperparams: ("fz_adam_hyper", "adam"),
    LambHyperparams: ("fz_lamb_hyper", "lamb"),
}
# A dataclass field's Python type -> the C type of its struct member (Hyperparams.c_struct_type's rule).
C_TYPE_OF_FIELD = {"float": "double", "bool": "int32_t", "int": "int64_t"}
C_TYPE_OF_CTYPE = {ctypes.c_double: "double", ctypes.c_int32: "int32_t", ctypes.c_int64: "int64_t"}

# Files that must hand the hyperparameters over whole (no field named there).
PYTHON_WRAPPERS = (
    "fastzero/ops/adam/cpu.py",
    "fastzero/ops/adam/cuda.py",
    "fastzero/ops/lamb/cpu.py",
    "fastzero/ops/lamb/cuda.py",
)
BINDINGS = "csrc/cpu/bindings.cpp"


def _code(text: str) -> str:
    """C source without its comments."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_structs() -> dict[str, list[tuple[str, str]]]:
    """{struct name: [(member, C type), ...]} of every ``typedef struct X {...} X;``."""
    found = {}
    for tag, body, name in re.findall(
        r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", _code(HEADER.read_text()), re.S
    ):
        assert tag == name, f"{HEADER.name}: typedef struct {tag} {{...}} {name}: the tag and the name differ"
        members = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            match = re.fullmatch(r"(double|int32_t|int64_t)\s+(\w+)", decl)
            assert match, f"{HEADER.name}: {name}: {decl!r} is not one member of type double, int32_t or int64_t"
            members.append((match.group(2), match.group(1)))
        found[name] = members
    return found


def dataclass_members(cls: type[Hyperparams]) -> list[tuple[str, str]]:
    return [
        (f.name, C_TYPE_OF_FIELD[f.type if isinstance(f.type, str) else f.type.__name__])
        for f in dataclasses.fields(cls)
    ]


def test_the_header_declares_one_struct_per_family():
    hyper_structs = [name for name in header_structs() if name.endswith("_hyper")]  # the rest are derived values
    assert sorted(hyper_structs) == sorted(struct for struct, _ in FAMILIES.values())


@pytest.mark.parametrize("cls", list(FAMILIES), ids=lambda c: c.__name__)
def test_struct_matches_the_dataclass_field_for_field(cls):
    struct, _ = FAMILIES[cls]
    in_header, in_python = header_structs()[struct], dataclass_members(cls)
    assert in_header == in_python, (
        f"{struct} in {HEADER} and {cls.__name__} disagree (name, C type, in order):\n"
        f"  header:    {in_header}\n  dataclass: {in_python}"
    )
    ctypes_members = [(name, C_TYPE_OF_CTYPE[t]) for name, t in cls.c_struct_type()._fields_]
    assert ctypes_members == in_python


@pytest.mark.parametrize("cls", list(FAMILIES), ids=lambda c: c.__name__)
def test_struct_size_matches_the_compiled_extension(cls):
    ops = cpu_ops()
    if ops is None:
        pytest.skip("no native CPU kernels")
    struct, key = FAMILIES[cls]
    assert ctypes.sizeof(cls.c_struct_type()) == ops.hyper_sizes()[key], (
        f"sizeof({struct}) in the extension differs from {cls.__name__}'s ctypes struct: rebuild the extension, or "
        "the header and the dataclass disagree"
    )


def test_bindings_refuse_bytes_of_the_wrong_size():
    ops = cpu_ops()
    if ops is None:
        pytest.skip("no native CPU kernels")
    hyper = bytes(AdamHyperparams().c_struct())
    with pytest.raises(ValueError, match=rf"hyperparameters are {len(hyper) + 8} bytes.*fz_adam_hyper is {len(hyper)}"):
        ops.adam(0, [], [], [], [], [], [], 0, 0, 0, -1, hyper + bytes(8), 1, 1.0, 0, False, False, 1)
    lamb = bytes(LambHyperparams().c_struct())
    with pytest.raises(ValueError, match="fz_lamb_hyper"):
        ops.lamb_norms(0, lamb[:-1], [], [], [], [], [], 0, 0, 0, 1.0, 0.0, 1)
    with pytest.raises(ValueError, match="fz_lamb_hyper"):
        ops.lamb_apply(0, hyper, 1, [], [], [], [], [], 0, 0, -1, [], 1)


def test_both_builds_hash_the_shared_header(monkeypatch, tmp_path):
    """A changed struct rebuilds the just-in-time CPU and CUDA builds: their
    cache keys cover csrc/common."""
    common = tmp_path / "common"
    common.mkdir()
    (common / "hyperparams.h").write_text(HEADER.read_text())
    monkeypatch.setattr(build, "common_source_dir", lambda: common)
    monkeypatch.setattr(build, "nvcc_version", lambda nvcc: "13.0")
    before = build.cpu_build_key("c++", []), build.cuda_build_key("nvcc")
    (common / "hyperparams.h").write_text(HEADER.read_text().replace("double lr;", "double lr;\n  double extra;"))
    after = build.cpu_build_key("c++", []), build.cuda_build_key("nvcc")
    assert before[0] != after[0] and before[1] != after[1]


# ---------------------------------------------------------------------------
# The wrappers pass the struct whole

FIELD_NAMES = {f.name for cls in FAMILIES for f in dataclasses.fields(cls)}


def _python_identifiers(source: str) -> set[str]:
    """Every name, attribute, parameter and keyword of the Python source, and
    every string constant (a getattr(hp, "lr") would name a field too)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)
    return out


def _cpp_identifiers(source: str) -> set[str]:
    """Every identifier of the C++ source, outside comments and string literals."""
    code = re.sub(r'"(?:\\.|[^"\\])*"', '""', _code(source))
    return set(re.findall(r"\b[A-Za-z_]\w*\b", code))


@pytest.mark.parametrize("rel", PYTHON_WRAPPERS)
def test_python_wrappers_name_no_hyperparameter(rel):
    named = sorted(_python_identifiers((ROOT / rel).read_text()) & FIELD_NAMES)
    assert not named, f"{rel} names hyperparameter field(s) {named}: pass hp.c_struct() whole and derive in the kernels"


def test_bindings_name_no_hyperparameter():
    named = sorted(_cpp_identifiers((ROOT / BINDINGS).read_text()) & FIELD_NAMES)
    assert not named, f"{BINDINGS} names hyperparameter field(s) {named}: pass the struct through to the kernels"


def test_the_guards_can_fail():
    """What the guards above look for: a wrapper reading hp.lr, a keyword
    weight_decay=, getattr by name; a binding reading h.eps."""
    assert {"lr", "weight_decay", "max_coeff"} <= _python_identifiers(
        'x = hp.lr * 2\nf(weight_decay=1)\ngetattr(hp, "max_coeff")'
    )
    found = _cpp_identifiers('float e = float(h.eps); // beta1\nthrow f("lr");')
    assert "eps" in found and "beta1" not in found and "lr" not in found
