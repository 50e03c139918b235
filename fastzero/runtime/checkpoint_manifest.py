"""The checkpoint's manifest (``manifest.json``): its format and version,
its schema and the check of a manifest against it, and reading a
checkpoint file after checking its size and CRC32 against the manifest.
The overview (layout and guarantees) is in :mod:`fastzero.runtime.checkpoint_io`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fastzero.checks import INT8_BLOCK_SIZES, STATE_FORMATS
from fastzero.runtime.checkpoint_files import RANK_FILE, CheckpointError, crc32

FORMAT, VERSION = "fastzero-checkpoint", 2
READABLE_VERSIONS = (1, 2)  # 1: the tag directory holds the files, no checksums or aliases
DTYPES = ("float32", "float16", "bfloat16")


def tp_piece_name(name: str, rank: int) -> str:
    """The name tensor rank `rank`'s pieces of a param split across the tensor group are saved under."""
    return f"{name}@tp{rank}"


def _is_int(v: Any, lo: int | None = None, hi: int | None = None) -> bool:
    return type(v) is int and (lo is None or v >= lo) and (hi is None or v <= hi)


def _validate(manifest: Any, where: Path) -> None:
    """The manifest against its schema: a CheckpointError naming the first
    field that is missing or of the wrong type."""

    def bad(field: str, expected: str, value: Any = None, missing: bool = False) -> CheckpointError:
        found = "it is missing" if missing else f"found {type(value).__name__} {value!r:.80}"
        return CheckpointError(f"{where}: field {field!r} must be {expected}; {found}")

    def need(field: str, expected: str, ok) -> Any:
        if field not in manifest:
            raise bad(field, expected, missing=True)
        if not ok(manifest[field]):
            raise bad(field, expected, manifest[field])
        return manifest[field]

    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: the manifest must be a JSON object; found {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where.parent} is not a fastzero checkpoint (format {manifest.get('format')!r})")
    version = manifest.get("version")
    if version not in READABLE_VERSIONS or type(version) is not int:
        raise CheckpointError(
            f"{where.parent} is a fastzero checkpoint of version {version!r}; this fastzero reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    need("world_size", "an int >= 1", lambda v: _is_int(v, 1))
    need("stage", "an int in 0..3", lambda v: _is_int(v, 0, 3))
    need("dtype", f"one of {DTYPES}", lambda v: v in DTYPES)
    if "master_dtype" in manifest:  # the pieces' "master" values: float32, or bf16 params without masters
        need("master_dtype", f"one of {DTYPES}", lambda v: v in DTYPES)
    for field in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
        need(field, "an int >= 0", lambda v: _is_int(v, 0))
    need("loss_scaler", "an object or null", lambda v: v is None or isinstance(v, dict))
    if "onebit_errors" in manifest:
        need("onebit_errors", "a bool", lambda v: isinstance(v, bool))
    if "state_format" in manifest:  # fastzero's Adam family (null: a client optimizer); absent before formats
        need(
            "state_format",
            f'null or an object {{"format": one of {STATE_FORMATS}, "seed": int in [0, 2**32) or null, '
            '"block_size": int or null}',
            lambda v: (
                v is None
                or isinstance(v, dict)
                and v.get("format") in STATE_FORMATS
                and (v.get("seed") is None or _is_int(v["seed"], 0, 2**32 - 1))
                and (v.get("block_size") is None or _is_int(v["block_size"], 1))
                and (v["format"] != "int8" or v.get("block_size") in INT8_BLOCK_SIZES)
            ),
        )
    shape_ok = lambda s: isinstance(s, list) and all(_is_int(d, 0) for d in s)
    params = need(
        "params",
        "an object of param name -> shape (a list of ints >= 0)",
        lambda v: isinstance(v, dict) and all(shape_ok(s) for s in v.values()),
    )
    need(
        "groups",
        'a list of objects {"step": int >= 0, "names": [param names], "hyper": object}',
        lambda v: (
            isinstance(v, list)
            and all(
                isinstance(g, dict)
                and _is_int(g.get("step"), 0)
                and isinstance(g.get("names"), list)
                and all(isinstance(n, str) and n in params for n in g["names"])
                and isinstance(g.get("hyper"), dict)
                for g in v
            )
        ),
    )
    numel = {n: int(torch.Size(s).numel()) for n, s in params.items()}
    if "tensor_parallel" in manifest:  # params split across tensor ranks: each rank's pieces under its own name
        tp = need(
            "tensor_parallel",
            'an object {"size": int >= 2, "splits": {param name: [dim, stride]}} whose dims split the params evenly',
            lambda v: (
                isinstance(v, dict)
                and _is_int(v.get("size"), 2)
                and isinstance(v.get("splits"), dict)
                and all(
                    n in params
                    and isinstance(d, list)
                    and len(d) == 2
                    and _is_int(d[0], 0, len(params[n]) - 1)
                    and _is_int(d[1], 1)
                    and params[n][d[0]] % (v["size"] * d[1]) == 0
                    for n, d in v["splits"].items()
                )
            ),
        )
        for name in tp["splits"]:
            whole = numel.pop(name)
            numel.update({tp_piece_name(name, r): whole // tp["size"] for r in range(tp["size"])})
    need(
        "files",
        "an object of rank file name (rankNNNNN.pt) -> list of [param name, lo, hi] with 0 <= lo <= hi <= numel",
        lambda v: (
            isinstance(v, dict)
            and all(
                isinstance(f, str)
                and RANK_FILE.fullmatch(f)
                and isinstance(index, list)
                and all(
                    isinstance(e, list)
                    and len(e) == 3
                    and isinstance(e[0], str)
                    and e[0] in numel
                    and _is_int(e[1], 0)
                    and _is_int(e[2], e[1], numel[e[0]])
                    for e in index
                )
                for f, index in v.items()
            )
        ),
    )
    if "node_local" in manifest:  # use_node_local_storage: the ranks of each node, whose files its directory holds
        world = manifest["world_size"]
        need(
            "node_local",
            'an object {"nodes": [[rank, ...], ...]} that splits the ranks 0..world_size-1 into nodes',
            lambda v: (
                isinstance(v, dict)
                and isinstance(v.get("nodes"), list)
                and all(isinstance(n, list) and n and all(_is_int(r, 0, world - 1) for r in n) for n in v["nodes"])
                and sorted(r for n in v["nodes"] for r in n) == list(range(world))
            ),
        )
    if "pipeline" in manifest:  # informational: the layout that saved it (a load matches params by name)
        need(
            "pipeline",
            'an object {"stages": int >= 1, "virtual_stages": int >= 1, "owners": {param name: [stage, ...]}}',
            lambda v: (
                isinstance(v, dict)
                and _is_int(v.get("stages"), 1)
                and _is_int(v.get("virtual_stages"), 1)
                and isinstance(v.get("owners"), dict)
                and all(
                    n in params and isinstance(s, list) and all(_is_int(x, 0, v["stages"] - 1) for x in s)
                    for n, s in v["owners"].items()
                )
            ),
        )
    if version >= 2:
        files = [*manifest["files"], "extra.pt"]
        sum_ok = lambda c: isinstance(c, dict) and _is_int(c.get("crc32"), 0, 2**32 - 1) and _is_int(c.get("bytes"), 0)
        need(
            "checksums",
            'an object of file name -> {"crc32": int, "bytes": int}, for every rank file and extra.pt',
            lambda v: isinstance(v, dict) and all(sum_ok(v.get(f)) for f in files),
        )
        need(
            "aliases",
            "an object of state_dict name -> the name of a param in 'params'",
            lambda v: isinstance(v, dict) and all(isinstance(a, str) and c in params for a, c in v.items()),
        )


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint files in `path`, validated."""
    where = Path(path) / "manifest.json"
    try:
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{where} is unreadable or corrupt: {exc}") from None
    _validate(manifest, where)
    return manifest


def read_checked(path: Path, fname: str, manifest: dict, weights_only: bool = True) -> Any:
    """``torch.load`` of checkpoint file `fname`, after checking its size and
    CRC32 against the manifest (version 2; version 1 has no checksums)."""
    file = path / fname
    want = manifest.get("checksums", {}).get(fname) if manifest["version"] >= 2 else None
    if want is not None:
        try:
            crc, size = crc32(file)
        except OSError as exc:
            hint = ""
            if "node_local" in manifest and not file.exists():
                hint = (
                    f"; {path} holds one node's part of a node-local checkpoint (use_node_local_storage): copy every "
                    "node's directory into one shared directory to load it at another layout or consolidate it"
                )
            raise CheckpointError(f"{file} is missing or unreadable: {exc}{hint}") from None
        if size != want["bytes"]:
            raise CheckpointError(
                f"{file} has {size} bytes; the manifest records {want['bytes']} (truncated or replaced)"
            )
        if crc != want["crc32"]:
            raise CheckpointError(
                f"{file}: checksum mismatch, expected CRC32 {want['crc32']:08x}, found {crc:08x}; the file is corrupt"
            )
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # torch raises many kinds for a truncated or foreign file
        raise CheckpointError(f"{file} is unreadable or corrupt ({type(exc).__name__}: {exc})") from None
