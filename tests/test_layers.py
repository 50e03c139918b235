"""Imports go down only (DESIGN.md, docs/architecture.md): native building
and loading < ops < config < comm < parallel < runtime < entry points and CLIs < bench;
inside the runtime, the checkpoint's files < its manifest < the rest (the
engine, and checkpoint_io, which needs it).
An AST walk over every module of the package (imports at any depth, and
module paths passed as strings to calls, such as backend registrations and
importlib.import_module) finds any import of a higher layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Module-name prefixes, lowest layer first; the longest matching prefix decides.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("native", ("fastzero.native", "fastzero.triton_kernels", "fastzero._csrc", "fastzero.checks")),
    ("ops", ("fastzero.ops",)),
    ("config", ("fastzero.config", "fastzero.config_keys")),
    ("comm", ("fastzero.comm",)),
    (
        "parallel",
        ("fastzero.parallel", "fastzero.pipe"),
    ),  # topology, tensor-parallel layers, activation checkpointing, pipeline stages
    # the checkpoint's layers with no engine knowledge: the layout on disk, then the manifest
    ("checkpoint files", ("fastzero.runtime.checkpoint_files",)),
    ("checkpoint manifest", ("fastzero.runtime.checkpoint_manifest",)),
    ("runtime", ("fastzero.runtime", "fastzero.profiling")),  # the engine's monitor drives the flops profiler
    (
        "entry points",
        (
            "fastzero",
            "fastzero.zero",
            "fastzero.checkpoint",
            "fastzero.launcher",
            "fastzero.utils",
            "fastzero.estimate",
            "fastzero.launch_agent",
            "fastzero.launch_hosts",
            "fastzero.launch_runners",
        ),
    ),
    ("bench", ("fastzero.bench",)),
]

# The one upward edge kept on purpose: `from fastzero.ops import OneBitAdam`
# keeps working although the optimizer lives with the runtime that owns the
# process groups. It is lazy (a module __getattr__), so importing fastzero.ops
# never loads the runtime.
ALLOWED = {("fastzero.ops", "fastzero.runtime.onebit_adam")}

# Where each source folder is installed (setup.py maps the last three into fastzero's namespace).
SOURCES = {"fastzero": "fastzero", "triton_kernels": "fastzero.triton_kernels", "bench": "fastzero.bench"}


def layer_of(module: str) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level is not None, f"{module} is in no layer: add it to LAYERS"
    return level


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = SOURCES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every fastzero module the source names: import statements at any depth
    (relative ones resolved) and "fastzero.x[:attr]" strings passed to calls."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)  # `from fastzero.ops import cuda` may be a module
        elif isinstance(node, ast.Call):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("fastzero."):
                    out.add(arg.value.partition(":")[0])
    return {m for m in out if m == "fastzero" or m.startswith("fastzero.")}


def violations_in(source: str, module: str, is_package: bool = False) -> list[str]:
    mine = layer_of(module)
    out, out_targets = [], []
    for target in sorted(imported(ast.parse(source), module, is_package)):
        if module == target or target.startswith(module + "."):
            continue
        if any(module == a and (target == b or target.startswith(b + ".")) for a, b in ALLOWED):
            continue
        if any(target.startswith(v + ".") for v in out_targets):
            continue  # `from fastzero.comm import Comm` is reported once, as fastzero.comm
        theirs = layer_of(target)
        if theirs > mine:
            out.append(f"{module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
            out_targets.append(target)
    return out


def package_files() -> list[Path]:
    return sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))


def test_no_module_imports_a_higher_layer():
    found = []
    for path in package_files():
        found += violations_in(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not found, "upward imports:\n" + "\n".join(found)


def test_the_allowed_edge_is_lazy():
    """Importing fastzero.ops must not import the runtime: the re-export sits in a function."""
    tree = ast.parse((ROOT / "fastzero" / "ops" / "__init__.py").read_text())
    top_level = ast.Module(body=[n for n in tree.body if not isinstance(n, ast.FunctionDef)], type_ignores=[])
    assert not any(t.startswith("fastzero.runtime") for t in imported(top_level, "fastzero.ops", True))


@pytest.mark.parametrize(
    "module, source",
    [
        ("fastzero.ops.adam.cpu", "from fastzero.runtime.engine import Engine"),
        ("fastzero.ops.adam.cpu", "def f():\n    from fastzero.comm import Comm"),  # lazy imports count
        ("fastzero.comm.buckets", "import fastzero.runtime.stage3"),
        ("fastzero.native.loader", "from fastzero.ops import backend"),
        ("fastzero.triton_kernels.adam", "from fastzero.ops.adam import AdamHyperparams"),
        ("fastzero.runtime.engine", "from fastzero import zero"),
        ("fastzero.ops.backend", "Backend('x', (), (), None, 'fastzero.runtime.engine:Engine')"),  # strings count
        ("fastzero.runtime.engine", "importlib.import_module('fastzero.bench.run')"),
        ("fastzero.runtime.checkpoint_files", "from fastzero.runtime.checkpoint_manifest import read_manifest"),
        ("fastzero.runtime.checkpoint_files", "from fastzero.runtime.groups import PieceState"),
        ("fastzero.runtime.checkpoint_manifest", "from fastzero.runtime import checkpoint_io"),
    ],
)
def test_an_upward_import_is_caught(module, source):
    assert violations_in(source, module), f"{source!r} in {module} should be refused"


def test_downward_and_sibling_imports_pass():
    assert not violations_in("from fastzero.ops import FusedAdam\nfrom fastzero.comm import Comm", "fastzero.runtime.x")
    assert not violations_in("from ._multi_tensor import work_list", "fastzero.triton_kernels.adam")
    assert not violations_in("from . import kernels", "fastzero.bench", is_package=True)
    assert not violations_in(
        "from fastzero.runtime import checkpoint_files\nfrom fastzero.runtime.checkpoint_manifest import read_manifest",
        "fastzero.runtime.checkpoint_io",
    )
    assert not violations_in(
        "from fastzero.runtime.checkpoint_files import crc32", "fastzero.runtime.checkpoint_manifest"
    )


def test_every_module_is_in_a_layer():
    for path in package_files():
        layer_of(module_name(path))
