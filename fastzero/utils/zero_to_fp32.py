"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` over fastzero checkpoints:
a checkpoint of any world size and stage to a plain fp32 ``state_dict``, in
memory, loaded into a model, or written as files (``torch.save`` or
safetensors, sharded in Hugging Face's layout). All of it is
:func:`fastzero.runtime.checkpoint_io.consolidate`; every file read is
checked against its checksum.

Differences from DeepSpeed (0.16):

* :func:`load_state_dict_from_zero_checkpoint` loads with ``strict=True`` by
  default and, before changing the model, raises ``CheckpointError`` naming
  the missing and unexpected keys (DeepSpeed loads ``strict=False`` and
  says nothing); ``strict=False`` gives DeepSpeed's behaviour.
* No ``lazy_mode``: the state dict is built in memory.
* :func:`convert_zero_checkpoint_to_fp32_state_dict` shards without
  ``huggingface_hub`` (the same greedy split, in the state dict's order) and
  also takes a file path for ``output_dir`` (older DeepSpeed's
  ``output_file``): a path ending in ``.bin``, ``.pt``, ``.pth`` or
  ``.safetensors`` is written as that one file, unsharded.

Tied params (one tensor under several names, as a tied LM head): with
``torch.save`` every name is kept and the names of one tensor always share a
shard, so ``torch.load`` gives them back as one tensor. safetensors refuses
tensors that share memory, so, as Hugging Face's ``save_pretrained`` does,
only the first name of each tensor is written; the others are listed in the
file's metadata (``"fastzero_tied"``: JSON, dropped name -> kept name) and in
the index's ``metadata.tied``. A model with ``tie_weights`` (Hugging Face's)
re-ties them; for a plain ``load_state_dict``, load with ``strict=False`` or
add the names back (:func:`load_safetensors_state_dict` does).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from fastzero.runtime.checkpoint_io import CheckpointError, consolidate

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_safetensors_state_dict",
    "load_state_dict_from_zero_checkpoint",
    "parse_size",
]

_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """The checkpoint's model as a plain fp32 ``state_dict`` on the CPU
    (``tag``: default the one ``latest`` names). Tied params are one tensor
    under each name, as ``model.state_dict()`` has them."""
    return consolidate(checkpoint_dir, tag, exclude_frozen_parameters=exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None, strict=True):
    """Moves ``model`` to the CPU, loads the checkpoint's fp32 weights into
    it and returns it. ``strict`` (default, unlike DeepSpeed): the model's
    names must be exactly the checkpoint's, else ``CheckpointError`` names
    the difference and the model is left as it was."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    if strict:
        expected = set(model.state_dict().keys())
        missing, unexpected = sorted(expected - state_dict.keys()), sorted(state_dict.keys() - expected)
        if missing or unexpected:
            raise CheckpointError(
                f"{checkpoint_dir}: the model does not match the checkpoint: missing from the checkpoint "
                f"{missing}, not in the model {unexpected} (strict=False loads what matches)"
            )
    model = model.cpu()
    model.load_state_dict(state_dict, strict=strict)
    return model


def parse_size(size) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10**9) or
    ``"500MiB"`` (2**20), as Hugging Face's ``max_shard_size``."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"max_shard_size={size!r}: expected bytes as an int or a string such as '5GB' or '500MiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _storage_groups(state_dict: dict[str, torch.Tensor]) -> list[list[str]]:
    """The names in order, those of one tensor (same storage, offset, shape)
    together, first name first."""
    groups: dict[tuple, list[str]] = {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else (name,)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _split(state_dict, groups: list[list[str]], max_bytes: int | None) -> list[list[list[str]]]:
    """Shards of tied groups, filled in order until the next would pass
    ``max_bytes`` (a tensor larger than that gets a shard of its own)."""
    shards, size = [[]], 0
    for group in groups:
        t = state_dict[group[0]]
        nbytes = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(group)
        size += nbytes
    return shards


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size="5GB",
    safe_serialization=False,
    tag=None,
    exclude_frozen_parameters=False,
) -> list[Path]:
    """Writes the checkpoint's fp32 ``state_dict`` into ``output_dir``
    (DeepSpeed's argument order): ``pytorch_model.bin`` (``torch.save``) or,
    with ``safe_serialization``, ``model.safetensors``. Above
    ``max_shard_size`` (bytes, or ``"5GB"``; None: never shard) it is
    sharded as ``pytorch_model-00001-of-0000N.bin`` /
    ``model-00001-of-0000N.safetensors`` with an index,
    ``pytorch_model.bin.index.json`` / ``model.safetensors.index.json``:
    ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``.
    ``output_dir`` may instead be a file path (see the module's doc).
    Returns the files written. Tied params: see the module's doc."""
    if safe_serialization:
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            raise ImportError("safe_serialization needs safetensors: pip install safetensors") from exc
    max_bytes = None if max_shard_size is None else parse_size(max_shard_size)
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    groups = _storage_groups(state_dict)
    out = Path(output_dir)
    if out.suffix in _FILE_SUFFIXES:
        out.parent.mkdir(parents=True, exist_ok=True)
        shards, names = [groups], [out.name]
        out = out.parent
    else:
        out.mkdir(parents=True, exist_ok=True)
        shards = _split(state_dict, groups, max_bytes)
        stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
        n = len(shards)
        names = [f"{stem}.{ext}"] if n == 1 else [f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)]
    written, weight_map, tied = [], {}, {}
    for shard, fname in zip(shards, names):
        path = out / fname
        if safe_serialization:
            part = {g[0]: state_dict[g[0]].contiguous() for g in shard}
            shard_tied = {alias: g[0] for g in shard for alias in g[1:]}
            save_file(part, str(path), metadata={"format": "pt", "fastzero_tied": json.dumps(shard_tied)})
            tied.update(shard_tied)
        else:
            part = {name: state_dict[name] for g in shard for name in g}
            with open(path, "wb") as f:  # OSError, not torch's RuntimeError, for a bad path
                torch.save(part, f)
        weight_map.update({name: fname for g in shard for name in (g[:1] if safe_serialization else g)})
        written.append(path)
    if len(shards) > 1:
        total = sum(state_dict[g[0]].numel() * state_dict[g[0]].element_size() for g in groups)
        metadata = {"total_size": total, **({"tied": tied} if tied else {})}
        index_name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        index = out / index_name
        index.write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
        written.append(index)
    return written


def load_safetensors_state_dict(path) -> dict[str, torch.Tensor]:
    """A ``state_dict`` from what :func:`convert_zero_checkpoint_to_fp32_state_dict`
    wrote with ``safe_serialization``: one ``.safetensors`` file, or an
    index (``model.safetensors.index.json``) or the directory holding
    either; the tied names it dropped come back as the same tensor."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        path = index if index.exists() else path / "model.safetensors"
    files = [path]
    if path.name.endswith(".index.json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        files = [path.parent / f for f in dict.fromkeys(weight_map.values())]
    out, tied = {}, {}
    for f in files:
        out.update(load_file(str(f)))
        with safe_open(str(f), framework="pt") as handle:
            tied.update(json.loads((handle.metadata() or {}).get("fastzero_tied", "{}")))
    for alias, name in tied.items():
        out[alias] = out[name]
    return out


def main(argv: list[str] | None = None) -> int:
    """DeepSpeed's ``zero_to_fp32.py`` command line (the script that
    ``save_checkpoint`` writes beside the checkpoints runs it):
    ``CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
    [--max_shard_size 5GB] [--exclude_frozen_parameters] [-d]``."""
    import argparse

    parser = argparse.ArgumentParser(description="a fastzero checkpoint to a plain fp32 state dict")
    parser.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (holding 'latest')")
    parser.add_argument("output_dir", help="where pytorch_model.bin (or model.safetensors, or shards) go")
    parser.add_argument("--max_shard_size", default="5GB", help="shard above this size (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint's tag (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen params out")
    parser.add_argument("-d", "--debug", action="store_true", help="also list every tensor written")
    args = parser.parse_args(argv)
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"zero_to_fp32: {exc}")
        return 1
    print(f"wrote {', '.join(str(p) for p in written)}")
    if args.debug:
        sd = get_fp32_state_dict_from_zero_checkpoint(args.checkpoint_dir, args.tag, args.exclude_frozen_parameters)
        for name, t in sd.items():
            print(f"  {name}: {tuple(t.shape)} {t.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
