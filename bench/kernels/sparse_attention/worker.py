"""The CPU memory subprocess of the sparse-attention benchmark (memory.py
runs it: python -m <bench>.kernels.sparse_attention.worker REQUEST): each
job's peak resident set from its own baseline, or the longest sequence whose
forward + backward fits a budget. Its result is the last line it prints,
after memory.MARK."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import resource
import sys
import time

import torch

from fastzero.ops.sparse_attention import attention as sa

from ...jobs import reset_peak_rss, rss_bytes
from .memory import MARK, MiB
from .providers import Spec, make_inputs, make_step


def _release() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _warm(spec: Spec, provider: str) -> None:
    """One small forward + backward on each CPU path (dense masked, blocked): the one-time set-up (thread
    pools, autograd's, oneDNN's) is paid before a baseline is taken, so it is not counted as the job's."""
    b = spec.layout_block
    for seq in sorted({min(spec.seq, 2 * b), (sa.DENSE_CPU_MAX_SEQ // b + 1) * b}):
        inp = make_inputs(dataclasses.replace(spec, seq=seq))
        make_step(dataclasses.replace(spec, seq=seq), provider, inp, "fwdbwd")[0]()
        del inp
    _release()


def _peak_one(spec: Spec, provider: str) -> dict:
    _warm(spec, provider)
    base = rss_bytes("VmRSS")
    inp = make_inputs(spec)
    step, _ = make_step(spec, provider, inp, "fwdbwd")
    step()  # a warm call at this size, then the measured one
    _release()
    reset_peak_rss()
    t0 = time.perf_counter()
    step()
    ms = (time.perf_counter() - t0) * 1e3
    peak = rss_bytes("VmHWM") - base
    del step, inp
    _release()
    return {"peak_bytes": peak, "ms": ms}


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "alloc" in str(exc).lower() or "memory" in str(exc).lower()


def fit_search_one(spec: Spec, provider: str, budget: int, max_seq: int, time_cap: float) -> dict:
    """In a worker: seq doublings from spec.seq while forward + backward fits `budget` (inputs included) under
    RLIMIT_DATA = what is mapped now + budget + 64 MiB (an allocation past it fails at once instead of taking
    the machine's memory), and the next doubling is estimated (4x: O(seq^2) time) under `time_cap`."""
    _warm(spec, provider)
    points, limited, seq = [], "max_seq", spec.seq
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    while seq <= max_seq:
        _release()
        base = rss_bytes("VmRSS")
        resource.setrlimit(resource.RLIMIT_DATA, (rss_bytes("VmData") + budget + 64 * MiB, hard))
        reset_peak_rss()
        point, inp, step = {"seq": seq}, None, None
        try:
            inp = make_inputs(dataclasses.replace(spec, seq=seq))
            step, _ = make_step(dataclasses.replace(spec, seq=seq), provider, inp, "fwdbwd")
            t0 = time.perf_counter()
            step()
            point["ms"] = (time.perf_counter() - t0) * 1e3
        except (RuntimeError, MemoryError) as exc:
            if not _out_of_memory(exc):
                raise
            point["error"] = str(exc).splitlines()[0][:200]
        finally:
            del inp, step  # freed before the limit is lifted
            _release()
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        point["peak_bytes"] = rss_bytes("VmHWM") - base
        point["fits"] = "error" not in point and point["peak_bytes"] <= budget
        points.append(point)
        if not point["fits"]:
            limited = "memory"
            break
        if point["ms"] / 1e3 * 4 > time_cap:
            limited = "time"
            break
        seq *= 2
    return {"points": points, "limited_by": limited}


def main(argv: list[str]) -> None:
    request = json.loads(argv[0])
    torch.set_num_threads(request["threads"])
    sa.DENSE_CPU_MAX_SEQ = request["dense_max_seq"]  # the parent's (the tests lower it)
    spec = Spec(**request["spec"])
    if request["job"] == "peak":
        result = {p: _peak_one(spec, p) for p in request["providers"]}
    else:
        args = (request["provider"], request["budget"], request["max_seq"], request["time_cap"])
        result = fit_search_one(spec, *args)
    print(MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
