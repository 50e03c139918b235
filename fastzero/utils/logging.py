"""DeepSpeed's ``deepspeed.utils.logger`` and ``log_dist``: the ``fastzero``
logger, and a message logged by chosen ranks only."""

from __future__ import annotations

import logging

logger = logging.getLogger("fastzero")


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Logs `message` on the ranks in `ranks` (``[-1]``: every rank), as
    DeepSpeed's does: without a process group it always logs; with one and
    no `ranks`, nowhere."""
    import torch.distributed as dist

    should = not dist.is_initialized()
    if ranks and not should:
        should = ranks[0] == -1 or dist.get_rank() in set(ranks)
    if should:
        rank = dist.get_rank() if dist.is_initialized() else -1
        logger.log(level, f"[Rank {rank}] {message}")
