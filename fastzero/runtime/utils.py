"""DeepSpeed's ``deepspeed.runtime.utils`` helpers that training scripts
call: :func:`see_memory_usage`."""

from __future__ import annotations

import gc
import os

import torch

from fastzero.runtime.memory_usage import GB, host_memory_used, process_peak_rss_bytes, process_rss_bytes

__all__ = ["see_memory_usage"]


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's: with `force`, on rank 0 (or without a process group),
    prints `message`, the accelerator's allocated / peak allocated /
    reserved / peak reserved memory in GB (on the CPU: this process's
    resident set and its peak, and nothing reserved), and the host's used
    memory; then resets the accelerator's peak counters (on the CPU the
    peak resident set cannot be reset: it is the process's). Without
    `force`, nothing: DeepSpeed's calls sit in code paths and print only
    when asked."""
    if not force:
        return
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()  # what Python still holds but no longer uses would count
    gb = lambda n: round(n / GB, 2)  # noqa: E731
    # the accelerator's choice (fastzero.accelerator, an entry point above this layer): CUDA unless told cpu
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    if cuda:
        allocated, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        reserved, max_reserved = torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()
    else:  # the process's resident set and its peak; the CPU reserves nothing apart
        allocated = process_rss_bytes() or 0
        peak = process_peak_rss_bytes()
        reserved = max_reserved = 0
    print(message)
    print(f"MA {gb(allocated)} GB Max_MA {gb(peak)} GB CA {gb(reserved)} GB Max_CA {gb(max_reserved)} GB")
    host = host_memory_used()
    if host is not None:
        print(f"CPU Virtual Memory:  used = {gb(host[0])} GB, percent = {host[1]}%")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
