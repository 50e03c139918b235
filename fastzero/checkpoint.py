"""``python -m fastzero.checkpoint consolidate DIR OUT [--tag TAG]``: a
fastzero checkpoint (any world size, any stage) to a plain fp32 model
``state_dict`` file, loadable with ``model.load_state_dict(torch.load(OUT))``
(what DeepSpeed's ``zero_to_fp32.py`` does). With ``--safe_serialization``
or ``--max_shard_size SIZE`` OUT is a directory (or a ``.safetensors`` /
``.bin`` file, unsharded) written as
:func:`fastzero.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict`
does: safetensors, and shards with a Hugging Face index above SIZE (default
5GB). ``--exclude_frozen_parameters`` leaves frozen params out.
``info DIR`` prints the manifest.
Every file is checked against its checksum; a problem is one line,
``error: ...``, and exit status 2."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fastzero.runtime.checkpoint_io import CheckpointError, CheckpointSaveError, consolidate, read_manifest, resolve
from fastzero.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

__all__ = ["CheckpointError", "CheckpointSaveError", "consolidate", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastzero.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cons = sub.add_parser("consolidate", help="write a plain fp32 state_dict")
    cons.add_argument("dir", help="the directory save_checkpoint wrote into")
    cons.add_argument("out", help="the .pt file to write")
    cons.add_argument("--tag", default=None, help="the checkpoint's tag (default: the one 'latest' names)")
    cons.add_argument("--safe_serialization", action="store_true", help="write safetensors (OUT: a directory)")
    cons.add_argument("--max_shard_size", default=None, help="shard above this size, e.g. 5GB (OUT: a directory)")
    cons.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen params out")
    info = sub.add_parser("info", help="print the checkpoint's manifest")
    info.add_argument("dir")
    info.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate" and (args.safe_serialization or args.max_shard_size is not None):
            written = convert_zero_checkpoint_to_fp32_state_dict(
                args.dir,
                args.out,
                max_shard_size=args.max_shard_size or "5GB",
                safe_serialization=args.safe_serialization,
                tag=args.tag,
                exclude_frozen_parameters=args.exclude_frozen_parameters,
            )
            print(f"wrote {len(written)} files: {', '.join(str(p) for p in written)}")
        elif args.command == "consolidate":
            sd = consolidate(args.dir, args.tag, exclude_frozen_parameters=args.exclude_frozen_parameters)
            with open(args.out, "wb") as f:  # OSError (not torch's RuntimeError) for a missing directory
                torch.save(sd, f)
            numel = sum(t.numel() for t in sd.values())
            print(f"wrote {args.out}: {len(sd)} tensors, {numel:,} elements")
        else:
            path = resolve(args.dir, args.tag)
            if path is None:
                raise CheckpointError(f"no 'latest' file in {args.dir}; pass --tag")
            manifest = read_manifest(path)
            manifest.pop("files")
            manifest.pop("checksums", None)
            print(json.dumps({"path": str(path), **manifest}, indent=1))
    except (CheckpointError, OSError, ValueError) as exc:  # ValueError: an invalid --tag
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
