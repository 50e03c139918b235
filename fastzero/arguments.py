"""DeepSpeed's command-line arguments (``deepspeed.add_config_arguments``)."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds, in an argument group, DeepSpeed's ``--deepspeed`` (a flag for the
    script's own use) and ``--deepspeed_config PATH``, their deprecated aliases
    ``--deepscale`` / ``--deepscale_config``, and fastzero's ``--fastzero`` /
    ``--fastzero_config``. ``fastzero.initialize(args=args)`` reads whichever
    config path was given. Returns `parser`."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed (fastzero) configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (a flag for the script; unused)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument(
        "--deepscale", default=False, action="store_true", help="Deprecated: --deepspeed (a flag for the script)"
    )
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: --deepspeed_config.")
    group.add_argument(
        "--fastzero", default=False, action="store_true", help="Enable fastzero (a flag for the script; unused)"
    )
    group.add_argument(
        "--fastzero_config", default=None, type=str, help="fastzero (DeepSpeed) json configuration file."
    )
    return parser
