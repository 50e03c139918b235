"""One rank of the compressed all-reduce benchmark (bench/kernels/onebit_allreduce.py
launches WORLD of these with torchrun's variables over Gloo; argv[1] is a
JSON spec). Per size: the three providers are checked once against what
they must give (rank 0 recomputes every rank's input), then timed in
interleaved rounds, each call started on every rank together (a barrier)
and counted as the slowest rank's time; rank 0 writes the results as JSON.

Providers, each a call on this rank's fp32 tensor of `numel` elements:

* ``compressed``: ``fastzero.comm.compressed_allreduce`` (1-bit pack with
  error feedback, all-to-all of the sign bits, server re-pack, all-gather)
  into a preallocated ``out``; its pack and unpack time inside the call is
  measured too (``compute``);
* ``fp32``: ``dist.all_reduce`` of the fp32 tensor (through
  ``fastzero.comm.Comm``, which records its bytes);
* ``fp16``: ``dist.all_reduce`` of an fp16 copy made before the call (the
  casts a training step would add are not timed).

Bytes sent per rank are the comm layer's ``CommEvent.wire_bytes`` (what the
bandwidth-optimal ring algorithm sends; Gloo's own algorithm may differ).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from .harness import stretch
from .jobs import finish_rank

PROVIDERS = ("compressed", "fp32", "fp16")
SEED = 1000


def rank_input(numel: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s fp32 tensor: any rank can make every rank's (the check needs them all)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(SEED + rank))


def simulate_compressed(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The compressed all-reduce of `inputs` (one fp32 tensor per rank, a multiple of 8 * world elements, zero
    error buffers) worked out in one process: fastzero.comm.compressed's two phases (each rank's chunks to their
    servers, averaged, compressed again, gathered) over the reference's compression
    (fastzero.ops.onebit.reference, its scales correctly rounded: exact_compress). Returns (result, worker errors,
    server errors per rank)."""
    from fastzero.ops.onebit import reference as ref

    from .kernels.onebit import exact_compress

    world, numel = len(inputs), inputs[0].numel()
    packed = [exact_compress(x, world) for x in inputs]  # (bits, scales, worker error) per rank
    chunk_bytes = numel // 8 // world
    server = []
    for r in range(world):
        bits = torch.cat([b[r * chunk_bytes : (r + 1) * chunk_bytes] for b, _, _ in packed])
        scales = torch.stack([s[r] for _, s, _ in packed])
        average = ref.decompress(bits, scales).reshape(world, -1).mean(0)
        server.append(exact_compress(average, 1))
    result = ref.decompress(torch.cat([b for b, _, _ in server]), torch.cat([s for _, s, _ in server]))
    return result, [e for _, _, e in packed], [e for _, _, e in server]


def check(comm, numel: int) -> None:
    """Each provider's one call against what it must give, before anything is timed; raises AssertionError
    (on every rank: rank 0 decides and tells the others). compressed: every rank the same result, whose signs
    are the reference simulation's exactly (the kernels' scales differ from the reference's by rounding only)
    and values, and both error buffers, within that rounding; fp32 and fp16: the sums of every rank's input."""
    from fastzero.comm import compressed_allreduce, error_buffers, padded_numel

    from .kernels.onebit import FP32, close

    world, rank = comm.world_size, comm.rank
    if numel % (8 * world):
        raise ValueError(f"the check needs a multiple of {8 * world} elements, got {numel}")
    x = rank_input(numel, rank)
    we, se = error_buffers(numel, world)
    out = torch.empty(padded_numel(numel, world))
    got = compressed_allreduce(x, we, se, comm, tag="check", out=out)
    lo, hi = got.clone(), got.clone()
    if comm.distributed:
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    s32, s16 = x.clone(), x.half()
    comm.all_reduce(s32, "check").wait()
    comm.all_reduce(s16, "check").wait()
    errors = {"we": we, "se": se}
    gathered = {}
    if comm.distributed:  # rank 0 needs every rank's error buffers
        for name, t in errors.items():
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t)
            gathered[name] = parts
    else:
        gathered = {name: [t] for name, t in errors.items()}
    message = ""
    if rank == 0:
        try:
            inputs = [rank_input(numel, r) for r in range(world)]
            want, want_we, want_se = simulate_compressed(inputs)
            assert torch.equal(lo, hi), "compressed: the ranks' results differ"
            assert torch.equal(got > 0, want > 0), (
                f"compressed: {int(((got > 0) != (want > 0)).sum())} of {numel} signs differ from the reference's"
            )
            close(got, want, "compressed result", **FP32)
            for r in range(world):
                tol = 2e-5 * float(want.abs().max())
                close(gathered["we"][r], want_we[r], f"compressed worker error of rank {r}", 0, tol)
                close(gathered["se"][r], want_se[r], f"compressed server error of rank {r}", 0, tol)
            total = torch.stack(inputs).sum(0)
            close(s32, total, "fp32 all_reduce", 1e-5, 1e-5)
            total16 = torch.stack([t.half() for t in inputs]).float().sum(0)
            close(s16.float(), total16, "fp16 all_reduce", 1e-2, 1e-2)
        except AssertionError as exc:
            message = str(exc)
    flag = torch.tensor([1 if message else 0])
    if comm.distributed:
        dist.broadcast(flag, 0)
    if flag.item():
        raise AssertionError(message or "rank 0's check failed")


class TimedOnebit:
    """Stands in for fastzero.ops.onebit inside fastzero.comm.compressed: the same pack and unpack, with the
    seconds they take added up (the compute part of a compressed call)."""

    def __init__(self, module) -> None:
        self.module, self.seconds = module, 0.0

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def pack(self, *args, **kwargs):
        return self._timed(self.module.pack, *args, **kwargs)

    def unpack(self, *args, **kwargs):
        return self._timed(self.module.unpack, *args, **kwargs)


def make_calls(comm, numel: int, timed: TimedOnebit | None) -> dict:
    """provider -> (prepare, call): `prepare` (untimed) resets the input, `call` is timed."""
    from fastzero.comm import compressed_allreduce, error_buffers, padded_numel

    world = comm.world_size
    x = rank_input(numel, comm.rank)
    we, se = error_buffers(numel, world)
    out = torch.empty(padded_numel(numel, world))
    buf32, buf16 = torch.empty_like(x), torch.empty(numel, dtype=torch.float16)
    nothing = lambda: None  # noqa: E731

    def compressed():
        if timed is not None:
            timed.seconds = 0.0
        compressed_allreduce(x, we, se, comm, tag="compressed", out=out)

    return {
        "compressed": (nothing, compressed),
        "fp32": (lambda: buf32.copy_(x), lambda: comm.all_reduce(buf32, "fp32").wait()),
        "fp16": (lambda: buf16.copy_(x), lambda: comm.all_reduce(buf16, "fp16").wait()),
    }


def wire_bytes(comm, tag: str) -> dict:
    """Bytes this rank sent in the recorded collectives of `tag`: total, and for the compressed call the sign
    bits apart from the scales (collectives of at most 4 * world bytes)."""
    events = comm.events(tag=tag)
    total = sum(e.wire_bytes for e in events)
    scales = sum(e.wire_bytes for e in events if e.nbytes <= 4 * comm.world_size)
    return {"wire_bytes": total, "scale_bytes": scales, "collectives": len(events)}


def run_size(comm, numel: int, providers, warmup: int, calls: int, slowdown: float) -> dict:
    """Interleaved rounds (the order rotates), a barrier before every call; per provider and call the slowest
    rank's seconds (and the compressed call's pack + unpack seconds)."""
    from fastzero.comm import compressed as compressed_module

    timed = TimedOnebit(compressed_module.onebit)
    compressed_module.onebit = timed
    try:
        jobs = make_calls(comm, numel, timed)
        times = {p: [] for p in providers}
        compute = []
        sent = {}
        for r in range(warmup + calls):
            order = list(providers[r % len(providers) :]) + list(providers[: r % len(providers)])
            for p in order:
                prepare, call = jobs[p]
                prepare()
                comm.record.clear()
                comm.barrier()
                t0 = time.perf_counter()
                call()
                dt = stretch(t0, slowdown if p == "compressed" else 1.0)  # the gate's self-test: really slower calls
                if r == 0:
                    sent[p] = wire_bytes(comm, p)
                if r >= warmup:
                    times[p].append(dt)
                    if p == "compressed":
                        compute.append(timed.seconds)
    finally:
        compressed_module.onebit = timed.module
    flat = torch.tensor([t for p in providers for t in times[p]] + compute, dtype=torch.float64)
    if comm.distributed:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)  # after the timing: the slowest rank's figure per call
    values, out = flat.tolist(), {}
    for i, p in enumerate(providers):
        out[p] = dict(times=values[i * calls : (i + 1) * calls], **sent[p])
    if "compressed" in out:
        out["compressed"]["compute_times"] = values[len(providers) * calls :]
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    from fastzero.comm import Comm, init_distributed

    init_distributed(timeout_s=spec.get("timeout_s", 600))
    comm = Comm(record_limit=64)
    result = {"world": comm.world_size, "sizes": {}}
    try:
        if spec.get("check", True):
            check(comm, spec.get("check_numel") or min(spec["sizes"]))
        for numel in spec["sizes"]:
            calls = spec["calls"][str(numel)]
            res = run_size(comm, numel, spec["providers"], spec["warmup"], calls, spec.get("slowdown", 1.0))
            result["sizes"][str(numel)] = res
            if comm.rank == 0:
                times = ", ".join(f"{p} {statistics.median(r['times']) * 1e3:.2f} ms" for p, r in res.items())
                print(f"{numel}: {times}", flush=True)
    except AssertionError as exc:
        result = {"error": str(exc)}
    finish_rank(result, spec["out"], comm.rank, comm.barrier)


if __name__ == "__main__":
    main()
