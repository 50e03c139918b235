"""1-bit Adam's compression: the pack and unpack kernels against the memory
roofline, and the compressed all-reduce against ``dist.all_reduce`` in fp32
and fp16 over Gloo. Two families share this module
(bench/kernels/__init__.py names them): ``onebit`` runs the kernel cases and
then, on the CPU, the all-reduce cases, whose rows carry the kernel name
``onebit_allreduce`` (``--kernel onebit_allreduce`` runs those alone).

Kernels (in process, the harness's checked, interleaved rounds), one tensor
of N elements:

* ``pack-fp32-N``: ``fastzero.ops.onebit.pack(x, error, chunks=4)`` (4 chunks:
  a world of 4). Every backend makes two sweeps (the chunk's scale must be
  known before any error is written): the sum of squares of x + e, then the
  signs and the new error. Its own bytes per fp32 element: read x and e twice
  (16) + write e (4) + write the bits (1/8) = 20.125 B, the basis of GB/s and
  of the fraction of the roofline that the 0.7 target applies to. The least
  any implementation must move (one sweep: read x, e once, write e, bits) is
  12.125 B; ``frac_roofline_min_bytes`` is the same time over those bytes.
  fp16 or bf16 x (``--dtype``): 16.125 and 10.125 B.
* ``unpack-avg4-N``: the bits of N elements as 4 rows (one scale each)
  averaged into N/4 fp32 values (the server's step of the all-reduce):
  read N/8 + write N bytes.
* ``unpack-rows4-N``: the same bits, each row times its scale, N fp32 values
  (the all-gathered result): read N/8 + write 4N bytes.

Providers: fastzero's CPU kernel (``cpu`` backend; with ``--device cuda`` the
``cuda`` and ``triton`` backends), the plain-PyTorch ``reference`` backend as
the peer, for unpack ``torch_fill`` (``out.fill_``: writing the output and
nothing else, the speed any kernel that writes it with ordinary stores can
reach), and the bandwidth probe measured in the same rounds over as many
elements as the case writes (N for pack and rows, N/4 for avg): on the CPU,
for pack the suite's streaming kernel of Adam's shape (read 4 arrays, write
3 in place: 28 B per element), for unpack, which writes 8 to 32 times what it
reads, the write probe (the output set, nothing read: 4 B per element, with
plain stores while it fits in cache and cache-bypassing ones from 8 MiB, as
unpack writes; the in-place probe's writes follow its reads of the same
lines, which overstates what a writing kernel can reach); on a GPU a copy of
that many fp32. Unpack writes into a
preallocated ``out``. Every provider is first checked against the reference
(sign bits equal; scales to 1e-5 of the fp64 sum of squares (the plain-PyTorch
reference itself to 1e-3: it sums in fp32), errors and unpacked values to
rounding).

All-reduce (CPU only; each case its own job of WORLD processes over Gloo,
bench/onebit_worker.py, one thread each): ``fastzero.comm.compressed_allreduce``
beside ``dist.all_reduce`` of the fp32 tensor and of an fp16 copy (cast
untimed), checked first. Per provider: median ms per call (the slowest rank's
time, each call started together after a barrier, interleaved rounds after a
warm-up), bytes sent per rank per call (the comm layer's ``wire_bytes``), the
compressed call's own pack + unpack time, and a model: wire bytes / link rate
at 10 and 100 Gb/s (no latency, no compute; the ``+compute`` figure adds the
compressed call's pack + unpack time measured here). World 4 runs 4 processes
on however many cores the machine has: on 2 cores they are oversubscribed.

Sizes: kernels 1M, 16M, 64M elements (GPU: and 256M); all-reduce 1M, 4M, 16M,
64M at world 2 and 4. ``--quick``: kernels 1M and 4M (GPU 1M and 16M),
all-reduce 1M at world 2 (about 10 s in all on 2 quiet cores). ``--sizes``
sets both.

Gated (explicit ``gated`` on every row): only fastzero's fraction of the
roofline (its own bytes), a same-run ratio. The all-reduce figures are not:
loopback times of several processes on shared cores are too noisy, and the
bytes are exact.
"""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..harness import Case, Provider, Runner, Timing, Unavailable, run_case
from ..harness import format_size as _fmt
from ..jobs import JobFailed, run_ranks

NAME = "onebit"
DESCRIPTION = (
    "1-bit Adam compression: pack and unpack (SIMD C++; CUDA and Triton with --device cuda) vs the reference and "
    "the bandwidth roofline, then (CPU) the compressed all-reduce vs dist.all_reduce fp32/fp16 over Gloo at world "
    "2 and 4 (rows: onebit_allreduce); not in --all (the all-reduce jobs take minutes)"
)
DEVICES = ("cpu", "cuda")
IN_ALL = False

M = 1 << 20
CHUNKS = 4  # pack's chunks: one per rank of a world of 4
ROWS = 4  # unpack's rows: what a world of 4 sends
SIZES = {"cpu": [1 * M, 16 * M, 64 * M], "cuda": [1 * M, 16 * M, 64 * M, 256 * M]}
QUICK_SIZES = {"cpu": [1 * M, 4 * M], "cuda": [1 * M, 16 * M]}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TARGET = 0.7  # fraction of the roofline (the kernel's own bytes) the kernels should reach

ALLREDUCE_SIZES, ALLREDUCE_QUICK_SIZES = [1 * M, 4 * M, 16 * M, 64 * M], [1 * M]
WORLDS, QUICK_WORLDS = [2, 4], [2]
ALLREDUCE_PROVIDERS = [("compressed", "ours"), ("fp32", "peer"), ("fp16", "peer")]
LINKS = {"10gbps": 10e9 / 8, "100gbps": 100e9 / 8}  # bytes per second
WORKER = "onebit_worker"  # a module of the bench package, run as each rank


def pack_bytes(numel: int, itemsize: int = 4, sweeps: int = 2) -> float:
    """Bytes a pack of `numel` elements moves: x and e read `sweeps` times, e and the bits written once."""
    return numel * (sweeps * (itemsize + 4) + 4 + 1 / 8)


def unpack_bytes(numel: int, rows: int = ROWS, average: bool = True) -> float:
    """Bytes an unpack of the bits of `numel` elements in `rows` rows moves: read the bits, write fp32."""
    return numel / 8 + 4 * (numel // rows if average else numel)


# --------------------------------------------------------------------------------------------------- kernel cases


def _available(backend: str, device: str) -> None:
    from fastzero import native
    from fastzero.ops.backend import cuda_status, triton_status

    if device == "cuda" and not torch.cuda.is_available():
        raise Unavailable("no CUDA device")
    if backend == "cpu" and native.cpu_ops() is None:
        raise Unavailable(f"native kernels unavailable: {native.cpu_ops_error()}")
    if backend in ("cuda", "triton"):
        ok, why = cuda_status() if backend == "cuda" else triton_status(device)
        if not ok:
            raise Unavailable(why)


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float, atol: float) -> None:
    """|got - want| <= atol + rtol |want| everywhere, or an AssertionError that says where and how far."""
    err = (got.float() - want.float()).abs()
    bad = err > atol + rtol * want.float().abs()
    if bool(bad.any()):
        worst = int(err.argmax())
        raise AssertionError(f"{what}: {int(bad.sum())} of {got.numel()} elements off (worst at {worst}: "
                             f"{float(got[worst]):.6g} vs {float(want[worst]):.6g})")  # fmt: skip


def exact_compress(y: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bits, scales, new error) of compressing fp32 `y` (x + error already added): the math of
    :func:`fastzero.ops.reference.onebit.compress` with the sum of squares in fp64, so the scales are the
    correctly rounded ones (the reference's fp32 sums drift: 6e-4 relative at 16M elements per chunk, more where
    the values repeat, as the server's averages of +-scales do)."""
    from fastzero.ops.reference import onebit as ref

    y = y.reshape(chunks, -1)
    scales = (y.double().square().sum(1) / y.shape[1]).sqrt().float()
    error = y - scales[:, None] * torch.where(y >= 0, 1.0, -1.0)
    return ref.pack_signs(y).reshape(-1), scales, error.reshape(-1)


class PackData:
    """A pack case's inputs (x and a nonzero starting error, so the feedback is exercised) and what one pack
    from them must give (exact_compress)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: str, seed: int = 0) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        # uniform_ is several times faster than randn at 64M elements, and as fresh
        self.x = torch.empty(numel, device=device).uniform_(-1, 1, generator=gen).to(dtype)
        self.error = torch.empty(numel, device=device).uniform_(-0.25, 0.25, generator=gen)

    @functools.cached_property
    def expected(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return exact_compress(self.x.float() + self.error, CHUNKS)

    def check(self, bits: torch.Tensor, scales: torch.Tensor, error: torch.Tensor, rtol: float) -> None:
        """Sign bits equal; scales within `rtol`, and so the errors within rtol of the largest scale."""
        want_bits, want_scales, want_error = self.expected
        if not torch.equal(bits, want_bits):
            wrong = int((bits != want_bits).sum())
            raise AssertionError(f"sign bits: {wrong} of {bits.numel()} bytes differ from the reference's")
        _close(scales, want_scales, "scales", rtol, 0.0)
        _close(error, want_error, "error", 0.0, 2 * rtol * float(want_scales.max()))


def pack_runner(data: Callable[[], PackData], backend: str, device: str) -> Runner:
    """`backend`'s pack over the case's data (made on first use, after the backend is found available)."""
    from fastzero.ops import onebit

    _available(backend, device)
    data = data()
    x, error = data.x, data.error.clone()

    def check():
        e = data.error.clone()
        bits, scales = onebit.pack(x, e, CHUNKS, backend=backend)
        data.check(bits, scales, e, rtol=1e-3 if backend == "reference" else 1e-5)

    return Runner(step=lambda: onebit.pack(x, error, CHUNKS, backend=backend), check=check, cuda=device == "cuda")


class UnpackData:
    """Random sign bits of `numel` elements in ROWS rows and their scales."""

    def __init__(self, numel: int, device: str, seed: int = 0) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.bits = torch.randint(0, 256, (numel // 8,), dtype=torch.uint8, device=device, generator=gen)
        self.scales = torch.rand(ROWS, device=device, generator=gen) + 0.1
        self._expected: dict[bool, torch.Tensor] = {}

    def expected(self, average: bool) -> torch.Tensor:
        """The reference's unpack (made once, shared by the case's providers)."""
        from fastzero.ops.reference import onebit as ref

        if average not in self._expected:
            values = ref.decompress(self.bits, self.scales)
            self._expected[average] = values.reshape(ROWS, -1).mean(0) if average else values
        return self._expected[average]


def unpack_runner(data: Callable[[], UnpackData], average: bool, backend: str, device: str) -> Runner:
    from fastzero.ops import onebit

    _available(backend, device)
    data = data()
    out = torch.empty(data.bits.numel() * 8 // (ROWS if average else 1), device=device)

    def step():
        onebit.unpack(data.bits, data.scales, average=average, out=out, backend=backend)

    def check():
        out.fill_(float("nan"))
        step()
        want = data.expected(average)
        if average:  # an fp32 mean of ROWS values: rounding only
            _close(out, want, "average", 1e-6, 1e-6)
        elif not torch.equal(out, want):
            wrong = int((out != want).sum())
            raise AssertionError(f"rows: {wrong} of {out.numel()} values differ from the reference's")

    return Runner(step=step, check=check, cuda=device == "cuda")


def fill_runner(numel: int, device: str) -> Runner:
    """torch's ``out.fill_``: only the unpack's output written, nothing read. What any kernel that writes that
    output with ordinary stores (each line read for ownership first, then written back) can reach."""
    if device == "cuda" and not torch.cuda.is_available():
        raise Unavailable("no CUDA device")
    out = torch.empty(numel, device=device)

    def check():
        out.fill_(0.5)
        assert bool((out == 0.5).all()), "fill_ left other values"

    return Runner(step=lambda: out.fill_(0.5), check=check, cuda=device == "cuda")


@dataclass
class KernelCase(Case):
    op: str = "pack"  # "pack", "unpack-avg", "unpack-rows"
    dtype: str = "fp32"
    min_bytes: float = 0.0  # what a one-sweep implementation must move (pack); the kernel's own bytes otherwise
    device: str = "cpu"


def _ours(device: str) -> list[tuple[str, str]]:
    """(provider, backend) of fastzero's kernels on `device`."""
    return [("fastzero", "cpu")] if device == "cpu" else [("fastzero_cuda", "cuda"), ("fastzero_triton", "triton")]


def _roofline(device: str, numel: int, writes: bool = False) -> Provider:
    """The bandwidth probe over `numel` elements (the elements the case writes): on the CPU the in-place stream,
    or for a kernel that mostly writes (`writes`: unpack) the write probe; on a GPU a copy."""
    from .optim_common import cuda_copy_roofline, stream_roofline, write_roofline

    if device == "cuda":
        return Provider("roofline", "roofline", lambda: cuda_copy_roofline(numel), bytes=8 * numel)
    if writes:
        return Provider("roofline", "roofline", lambda: write_roofline([numel]), bytes=4 * numel)
    return Provider("roofline", "roofline", lambda: stream_roofline([numel]), bytes=28 * numel)


def kernel_cases(sizes, dtypes=("fp32",), device: str = "cpu") -> list[KernelCase]:
    out = []
    for name in dtypes:
        if name not in DTYPES:
            continue
        dtype = DTYPES[name]
        size = torch.empty(0, dtype=dtype).element_size()
        for n in sizes:
            data = functools.cache(lambda n=n, dtype=dtype: PackData(n, dtype, device))
            provs = [Provider(p, "ours", functools.partial(pack_runner, data, b, device)) for p, b in _ours(device)]
            provs += [Provider("reference", "peer", functools.partial(pack_runner, data, "reference", device)),
                      _roofline(device, n)]  # fmt: skip
            own, least = pack_bytes(n, size), pack_bytes(n, size, sweeps=1)
            desc = (f"pack {_fmt(n)} {name} elements into sign bits, {CHUNKS} chunks (a world of {CHUNKS}), error "
                    f"feedback in place; {own / n:g} B/element in two sweeps (the least: {least / n:g})")  # fmt: skip
            out.append(KernelCase(NAME, f"pack-{name}-{_fmt(n)}", n, round(own), provs, desc, op="pack", dtype=name,
                                  min_bytes=least, device=device))  # fmt: skip
    for average in (True, False):
        for n in sizes:
            data = functools.cache(lambda n=n: UnpackData(n, device))
            make = functools.partial(unpack_runner, data, average)
            provs = [Provider(p, "ours", functools.partial(make, b, device)) for p, b in _ours(device)]
            written = n // ROWS if average else n
            provs += [Provider("reference", "peer", functools.partial(make, "reference", device)),
                      Provider("torch_fill", "peer", functools.partial(fill_runner, written, device)),
                      _roofline(device, written, writes=True)]  # fmt: skip
            what = f"the mean of the rows, {_fmt(n // ROWS)}" if average else f"each row times its scale, {_fmt(n)}"
            own = unpack_bytes(n, average=average)
            desc = (f"unpack the sign bits of {_fmt(n)} elements in {ROWS} rows: {what} fp32 into a preallocated out; "
                    f"{own / n:g} B per packed element")  # fmt: skip
            name = f"unpack-{'avg' if average else 'rows'}{ROWS}-{_fmt(n)}"
            out.append(KernelCase(NAME, name, n, round(own), provs, desc, op="unpack-avg" if average else "unpack-rows",
                                  min_bytes=own, device=device))  # fmt: skip
    return out


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    """``--sizes`` are element counts (of the kernels' tensors and the all-reduced tensor); ``--dtype`` picks
    pack's input dtypes (default fp32; the all-reduce always compares fp32 and fp16)."""
    kernel = kernel_cases(sizes or (QUICK_SIZES if quick else SIZES)[device], dtypes or ["fp32"], device)
    return kernel + (ALLREDUCE.cases(sizes, dtypes, quick, device) if device == "cpu" else [])


def measure(case: KernelCase, args, say) -> tuple[list[dict], dict]:
    """bench.run's hook for the kernel cases: the harness's rounds, then the extra figures (the fraction of the
    roofline over the least bytes) and each row's gate."""
    if case.device == "cuda" and not torch.cuda.is_available():  # the harness needs one provider that runs
        return [], {p.name: "no CUDA device" for p in case.providers}
    res = run_case(case, warmup=args.warmup, repeats=args.repeats, on_progress=say, slowdown=args.inject_slowdown)
    rows = res.rows()
    extra = []
    for r in rows:
        r["gated"] = r["metric"] == "frac_roofline" and res.timings[r["provider"]].kind == "ours"
        if r["metric"] in ("frac_roofline", "gb_per_s") and case.op == "pack" and r["provider"] != "roofline":
            extra.append(dict(r, metric=f"{r['metric']}_min_bytes", value=r["value"] * case.min_bytes / case.bytes,
                              gated=False))  # fmt: skip
    return rows + extra, res.skipped


# --------------------------------------------------------------------------------------------------- all-reduce


def run_job(spec: dict, world: int, timeout: float) -> dict:
    """Runs bench/onebit_worker.py as `world` ranks; rank 0's result (JobFailed with the failing rank's log, or
    the check's message)."""
    result = run_ranks(WORKER, spec, world, timeout)
    if "error" in result:
        raise JobFailed(f"the check before timing failed: {result['error']}")
    return result


@dataclass
class AllReduceCase(Case):
    world: int = 2


def _self_timed() -> Runner:
    raise Unavailable("a multi-process job: timed by python -m bench.run --kernel onebit (or onebit_allreduce)")


def _allreduce_cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    """One case per world size and tensor size (fp32 elements)."""
    out = []
    for world in QUICK_WORLDS if quick else WORLDS:
        for n in sizes or (ALLREDUCE_QUICK_SIZES if quick else ALLREDUCE_SIZES):
            provs = [Provider(p, kind, _self_timed) for p, kind in ALLREDUCE_PROVIDERS]
            cores = os.cpu_count() or 1
            desc = (f"all-reduce of {_fmt(n)} fp32 elements at world {world} over Gloo on this machine's loopback "
                    f"({world} processes, one thread each, on {cores} cores"
                    f"{': oversubscribed' if world > cores else ''}); compressed: 1-bit both ways with error "
                    f"feedback; fp32 and fp16: dist.all_reduce")  # fmt: skip
            out.append(AllReduceCase("onebit_allreduce", f"w{world}-{_fmt(n)}", n, 4 * n, provs, desc, world=world))
    return out


def _calls(numel: int, repeats: int) -> tuple[int, int]:
    """(warm-up, timed calls) per provider: fewer for the big tensors (a round of the 64M case takes about a
    second at world 4 on 2 cores; loopback times spread 10-50% there, so no fewer than 9)."""
    if numel >= 64 * M:
        return 1, min(repeats, 9)
    if numel >= 16 * M:
        return 2, min(repeats, 11)
    return 3, repeats


def _allreduce_measure(case: AllReduceCase, args, say) -> tuple[list[dict], dict]:
    """bench.run's hook for the all-reduce cases: one job of case.world processes."""
    providers = [p.name for p in case.providers]
    if not providers:
        return [], {}
    warmup, calls = _calls(case.numel, args.repeats)
    unit = 8 * case.world  # the check's tensor: at most 1M elements, whole bytes of bits per rank (no padding)
    spec = dict(sizes=[case.numel], providers=providers, warmup=min(args.warmup, warmup), calls={case.numel: calls},
                slowdown=args.inject_slowdown, check_numel=max(unit, min(case.numel, M) // unit * unit))  # fmt: skip
    say(f"{case.name}: {case.world} processes over Gloo")
    res = run_job(spec, case.world, timeout=300 if args.quick else 900)
    return allreduce_rows(case, res["sizes"][str(case.numel)]), {}


def allreduce_rows(case: AllReduceCase, res: dict) -> list[dict]:
    """Per provider: median ms, spread, bytes sent per rank per call, the link models; compressed: its pack +
    unpack ms, its bytes and speed relative to fp32 and fp16 (same rounds), and the modelled speedups."""
    out = []

    def row(provider, metric, value):
        out.append(dict(kernel=case.kernel, case=case.name, provider=provider, metric=metric, value=value,
                        gated=False))  # fmt: skip

    timings = {p: Timing(p, "ours" if p == "compressed" else "peer", r["times"]) for p, r in res.items()}
    compute = statistics.median(res["compressed"]["compute_times"]) if "compressed" in res else 0.0
    for p, r in res.items():
        t = timings[p]
        row(p, "median_ms", t.median * 1e3)
        row(p, "spread", t.spread)
        row(p, "timed_calls", len(t.times))
        row(p, "wire_bytes", r["wire_bytes"])
        row(p, "collectives", r["collectives"])
        for link, rate in LINKS.items():
            row(p, f"model_ms_{link}", r["wire_bytes"] / rate * 1e3)
        if p == "compressed":
            row(p, "compute_ms", compute * 1e3)
            row(p, "scale_bytes", r["scale_bytes"])
            for link, rate in LINKS.items():
                row(p, f"model_ms_{link}_with_compute", (r["wire_bytes"] / rate + compute) * 1e3)
    if "compressed" in res:
        ours = timings["compressed"]
        for peer in [p for p in res if p != "compressed"]:
            row("compressed", f"speedup_vs_{peer}",
                statistics.median(a / b for a, b in zip(timings[peer].times, ours.times)))  # fmt: skip
            row("compressed", f"bytes_vs_{peer}", res[peer]["wire_bytes"] / res["compressed"]["wire_bytes"])
            for link, rate in LINKS.items():  # the bytes alone: bytes_vs_{peer} at any rate
                row("compressed", f"model_speedup_vs_{peer}_{link}_with_compute",
                    res[peer]["wire_bytes"] / rate / (res["compressed"]["wire_bytes"] / rate + compute))  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------- tables


def _f(v, spec, scale=1.0) -> str:
    return "" if v is None else format(v / scale, spec)


def _mib(v) -> str:
    return "" if v is None else f"{v / M:.3f} MiB" if v < 10 * M else f"{v / M:.1f} MiB"


def table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    """The kernel cases' Markdown (bench.run's terminal output and report)."""
    pack = any("frac_roofline_min_bytes" in m for m in provs.values())
    head = ["provider", "median ms", "spread", "GB/s (own bytes)", "of roofline (own bytes)"]
    if pack:
        head += ["of roofline (least bytes)"]
    head += [f"target {TARGET:g}", "speedups (peer time / this)"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    for prov, m in provs.items():
        frac = m.get("frac_roofline")
        cells = [prov, _f(m.get("median_ms"), ".3f"), _f(m.get("spread"), ".1%"), _f(m.get("gb_per_s"), ".1f"),
                 _f(frac, ".2f")]  # fmt: skip
        if pack:
            cells.append(_f(m.get("frac_roofline_min_bytes"), ".2f"))
        ours = prov.startswith("fastzero")
        cells.append(("met" if frac >= TARGET else "below") if ours and frac is not None else "")
        cells.append(", ".join(f"{k.removeprefix('speedup_vs_')} {v:.2f}x" for k, v in m.items()
                               if k.startswith("speedup_vs_")))  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for prov, why in case_info.get("skipped", {}).items():
        lines.append(f"| {prov} | skipped: {why} |" + " |" * (len(head) - 2))
    legend = (
        "ms: median of interleaved rounds; GB/s: the kernel's own bytes (pack: two sweeps, 20.125 B per fp32 "
        "element; unpack: bits read + fp32 written) over the time; of roofline: that rate over the bandwidth probe's "
        "in the same rounds over the elements the case writes (CPU: for pack the suite's in-place stream of Adam's "
        "shape, 28 B per element; for unpack, which mostly writes, the write probe, 4 B per element, with "
        "cache-bypassing stores from 8 MiB as unpack's; GPU: a copy). "
        f"The {TARGET:g} target applies to the fraction over the kernel's own bytes."
    )
    if pack:
        legend += (
            " Least bytes: the same time over what a one-sweep pack must move (12.125 B per fp32 element: read x and "
            "e once, write e and the bits): how far the two-sweep design is from the floor."
        )
    if "torch_fill" in provs:
        legend += (
            " torch_fill: out.fill_ of the same output (its figures use the unpack's bytes, bits included, though it "
            "reads none): only writing the output, with the ordinary stores that read each line before writing it "
            "(so twice the counted bytes cross the memory bus, where the probe's cache-bypassing stores read nothing "
            "from 8 MiB); "
            "a speedup near 1 means the unpack is as fast as writing its output at all."
        )
    return lines + ["", legend]


def allreduce_table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    head = ["provider", "bytes sent/rank", "ms/call", "spread", "pack+unpack ms", "model 10 Gb/s ms",
            "model 100 Gb/s ms"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for prov, m in provs.items():
        cells = [prov, _mib(m.get("wire_bytes")), _f(m.get("median_ms"), ".2f"), _f(m.get("spread"), ".1%"),
                 _f(m.get("compute_ms"), ".2f"), _f(m.get("model_ms_10gbps"), ".2f"),
                 _f(m.get("model_ms_100gbps"), ".3f")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for prov, why in case_info.get("skipped", {}).items():
        lines.append(f"| {prov} | skipped: {why} |" + " |" * (len(head) - 2))
    c = provs.get("compressed", {})
    peers = [p for p in provs if p != "compressed" and f"speedup_vs_{p}" in c]
    if peers:
        lines += ["", "compressed against each peer (peer / compressed). Model + compute: the peer's modelled time "
                      "over the compressed call's modelled time plus its pack + unpack time measured here (the bytes "
                      "alone give the 'fewer bytes' ratio at any link rate):", "",
                  "| vs | fewer bytes | loopback speed | model + compute, 10 Gb/s | model + compute, 100 Gb/s |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        for p in peers:
            cells = [f"{c[f'bytes_vs_{p}']:.1f}x", f"{c[f'speedup_vs_{p}']:.2f}x"]
            cells += [f"{c[f'model_speedup_vs_{p}_{link}_with_compute']:.2f}x" for link in LINKS]
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return lines + ["", (
        "ms/call: median over the timed calls of the slowest rank's time, every call started on all ranks together "
        "(a barrier) in interleaved rounds after a warm-up. Bytes sent per rank per call: the comm layer's "
        "wire_bytes (what a bandwidth-optimal ring algorithm sends; Gloo's own algorithm may send otherwise). "
        "compressed: fastzero.comm.compressed_allreduce (fp32 in, the average out, error buffers updated); fp32 / "
        "fp16: dist.all_reduce of the tensor (fp16: a copy cast before the call, not timed). Model ms: bytes sent / "
        "link rate (10 Gb/s = 1.25 GB/s, 100 Gb/s = 12.5 GB/s), a model that ignores latency and compute."
    )]  # fmt: skip


ALLREDUCE = SimpleNamespace(
    NAME="onebit_allreduce",
    DESCRIPTION=("1-bit Adam's compressed all-reduce vs dist.all_reduce fp32/fp16 over Gloo at world 2 and 4 (also "
                 "run by --kernel onebit); bytes sent per rank, time per call, 10/100 Gb/s link model; not in --all"),
    DEVICES=("cpu",),
    IN_ALL=False,
    cases=_allreduce_cases,
    measure=_allreduce_measure,
    table=allreduce_table,
)  # fmt: skip
