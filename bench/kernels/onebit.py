"""1-bit Adam's compression: the pack and unpack kernels against the memory
roofline, and (bench/kernels/onebit_allreduce.py, its own family) the
compressed all-reduce against ``dist.all_reduce`` in fp32 and fp16 over
Gloo. ``onebit`` runs the kernel cases and then, on the CPU, the all-reduce
cases, whose rows carry the kernel name ``onebit_allreduce``
(``--kernel onebit_allreduce`` runs those alone).

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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastzero.ops import onebit
from fastzero.ops.onebit import reference as ref
from fastzero.ops.tolerances import TOLERANCES

from ..family import Family, Settings, measure_rounds
from ..harness import Case, Provider, Runner
from ..harness import format_size as _fmt
from ..tables import fmt, row, skipped_lines, speedups
from . import onebit_allreduce
from .common import backend_ready, our_backends, roofline

M = 1 << 20
CHUNKS = 4  # pack's chunks: one per rank of a world of 4
ROWS = 4  # unpack's rows: what a world of 4 sends
SIZES = {"cpu": [1 * M, 16 * M, 64 * M], "cuda": [1 * M, 16 * M, 64 * M, 256 * M]}
QUICK_SIZES = {"cpu": [1 * M, 4 * M], "cuda": [1 * M, 16 * M]}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TARGET = 0.7  # fraction of the roofline (the kernel's own bytes) the kernels should reach
FP32 = TOLERANCES[torch.float32]  # the kernels' scales and the compressed result: fp32 rounding only
# the plain-PyTorch reference's own scales sum in fp32: 6e-4 relative off the exact ones at 16M elements per chunk
REFERENCE_RTOL = 1e-3


def pack_bytes(numel: int, itemsize: int = 4, sweeps: int = 2) -> float:
    """Bytes a pack of `numel` elements moves: x and e read `sweeps` times, e and the bits written once."""
    return numel * (sweeps * (itemsize + 4) + 4 + 1 / 8)


def unpack_bytes(numel: int, rows: int = ROWS, average: bool = True) -> float:
    """Bytes an unpack of the bits of `numel` elements in `rows` rows moves: read the bits, write fp32."""
    return numel / 8 + 4 * (numel // rows if average else numel)


# --------------------------------------------------------------------------------------------------- checks


def close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float, atol: float) -> None:
    """|got - want| <= atol + rtol |want| everywhere, or an AssertionError that says how many are off, where the
    worst is and how far (a short message: torch.testing's is slow on 64M elements)."""
    err = (got.float() - want.float()).abs()
    bad = err > atol + rtol * want.float().abs()
    if bool(bad.any()):
        worst = int(err.argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.numel()} elements off (worst at {worst}: "
            f"{float(got[worst]):.6g} vs {float(want[worst]):.6g})"
        )


def exact_compress(y: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bits, scales, new error) of compressing fp32 `y` (x + error already added): the reference's
    (:func:`fastzero.ops.onebit.reference.compress`: its sign bits, its decompress) with the scales correctly
    rounded, summed in fp64. The reference's fp32 sums drift (6e-4 relative at 16M elements per chunk, more where
    the values repeat, as the server's averages of +-scales do), past what a kernel's scales are held to."""
    y = y.reshape(chunks, -1)
    bits = ref.pack_signs(y).reshape(-1)
    scales = (torch.linalg.vector_norm(y.double(), dim=1) / y.shape[1] ** 0.5).float()
    return bits, scales, y.reshape(-1) - ref.decompress(bits, scales)


# --------------------------------------------------------------------------------------------------- kernel cases


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
        close(scales, want_scales, "scales", rtol, 0.0)
        close(error, want_error, "error", 0.0, 2 * rtol * float(want_scales.max()))


def pack_runner(data: Callable[[], PackData], backend: str, device: str) -> Runner:
    """`backend`'s pack over the case's data (made on first use, after the backend is found available)."""
    backend_ready(backend, device)
    data = data()
    x, error = data.x, data.error.clone()

    def check():
        e = data.error.clone()
        bits, scales = onebit.pack(x, e, CHUNKS, backend=backend)
        data.check(bits, scales, e, rtol=REFERENCE_RTOL if backend == "reference" else FP32["rtol"])

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
        if average not in self._expected:
            values = ref.decompress(self.bits, self.scales)
            self._expected[average] = values.reshape(ROWS, -1).mean(0) if average else values
        return self._expected[average]


def unpack_runner(data: Callable[[], UnpackData], average: bool, backend: str, device: str) -> Runner:
    backend_ready(backend, device)
    data = data()
    out = torch.empty(data.bits.numel() * 8 // (ROWS if average else 1), device=device)

    def step():
        onebit.unpack(data.bits, data.scales, average=average, out=out, backend=backend)

    def check():
        out.fill_(float("nan"))
        step()
        want = data.expected(average)
        if average:  # an fp32 mean of ROWS values: rounding only
            close(out, want, "average", 1e-6, 1e-6)
        elif not torch.equal(out, want):
            wrong = int((out != want).sum())
            raise AssertionError(f"rows: {wrong} of {out.numel()} values differ from the reference's")

    return Runner(step=step, check=check, cuda=device == "cuda")


def fill_runner(numel: int, device: str) -> Runner:
    """torch's ``out.fill_``: only the unpack's output written, nothing read. What any kernel that writes that
    output with ordinary stores (each line read for ownership first, then written back) can reach."""
    backend_ready(None, device)
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
    """(provider, backend) of fastzero's kernels on `device` (the CPU's named: never the reference in its stead)."""
    return [(p, b or "cpu") for p, b in our_backends(device)]


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
            provs += [
                Provider("reference", "peer", functools.partial(pack_runner, data, "reference", device)),
                roofline(device, [n]),
            ]
            own, least = pack_bytes(n, size), pack_bytes(n, size, sweeps=1)
            desc = (
                f"pack {_fmt(n)} {name} elements into sign bits, {CHUNKS} chunks (a world of {CHUNKS}), error "
                f"feedback in place; {own / n:g} B/element in two sweeps (the least: {least / n:g})"
            )
            case_name = f"pack-{name}-{_fmt(n)}"
            out.append(KernelCase(ONEBIT.name, case_name, n, round(own), provs, desc, "pack", name, least, device))
    for average in (True, False):
        for n in sizes:
            data = functools.cache(lambda n=n: UnpackData(n, device))
            make = functools.partial(unpack_runner, data, average)
            provs = [Provider(p, "ours", functools.partial(make, b, device)) for p, b in _ours(device)]
            written = n // ROWS if average else n
            provs += [
                Provider("reference", "peer", functools.partial(make, "reference", device)),
                Provider("torch_fill", "peer", functools.partial(fill_runner, written, device)),
                roofline(device, [written], writes=True),
            ]
            what = f"the mean of the rows, {_fmt(n // ROWS)}" if average else f"each row times its scale, {_fmt(n)}"
            own = unpack_bytes(n, average=average)
            desc = (
                f"unpack the sign bits of {_fmt(n)} elements in {ROWS} rows: {what} fp32 into a preallocated out; "
                f"{own / n:g} B per packed element"
            )
            name = f"unpack-{'avg' if average else 'rows'}{ROWS}-{_fmt(n)}"
            op = "unpack-avg" if average else "unpack-rows"
            out.append(KernelCase(ONEBIT.name, name, n, round(own), provs, desc, op, "fp32", own, device))
    return out


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    """``--sizes`` are element counts (of the kernels' tensors and the all-reduced tensor); ``--dtype`` picks
    pack's input dtypes (default fp32; the all-reduce always compares fp32 and fp16)."""
    kernel = kernel_cases(sizes or (QUICK_SIZES if quick else SIZES)[device], dtypes or ["fp32"], device)
    return kernel + (onebit_allreduce.cases(sizes, dtypes, quick, device) if device == "cpu" else [])


def measure(case: KernelCase, settings: Settings, say) -> tuple[list[dict], dict]:
    """The kernel cases: the harness's rounds, then the extra figures (the fraction of the roofline over the least
    bytes) and each row's gate."""
    if case.device == "cuda" and not torch.cuda.is_available():  # the harness needs one provider that runs
        return [], {p.name: "no CUDA device" for p in case.providers}
    rows, skipped = measure_rounds(case, settings, say)
    kinds = {p.name: p.kind for p in case.providers}
    extra = []
    for r in rows:
        r["gated"] = r["metric"] == "frac_roofline" and kinds[r["provider"]] == "ours"
        if r["metric"] in ("frac_roofline", "gb_per_s") and case.op == "pack" and r["provider"] != "roofline":
            least = r["value"] * case.min_bytes / case.bytes
            extra.append(dict(r, metric=f"{r['metric']}_min_bytes", value=least, gated=False))
    return rows + extra, skipped


# --------------------------------------------------------------------------------------------------- tables


def table(case_info: dict, provs: dict[str, dict[str, float]]) -> list[str]:
    """The kernel cases' Markdown (bench.run's terminal output and report)."""
    pack = any("frac_roofline_min_bytes" in m for m in provs.values())
    head = ["provider", "median ms", "spread", "GB/s (own bytes)", "of roofline (own bytes)"]
    if pack:
        head += ["of roofline (least bytes)"]
    head += [f"target {TARGET:g}", "speedups (peer time / this)"]
    lines = [row(head), "|---|" + "---:|" * (len(head) - 2) + "---|"]
    for prov, m in provs.items():
        frac = m.get("frac_roofline")
        cells = [
            prov,
            fmt(m.get("median_ms"), ".3f"),
            fmt(m.get("spread"), ".1%"),
            fmt(m.get("gb_per_s"), ".1f"),
            fmt(frac, ".2f"),
        ]
        if pack:
            cells.append(fmt(m.get("frac_roofline_min_bytes"), ".2f"))
        ours = prov.startswith("fastzero")
        cells.append(("met" if frac >= TARGET else "below") if ours and frac is not None else "")
        cells.append(", ".join(f"{peer} {v:.2f}x" for peer, v in speedups(m)))
        lines.append(row(cells))
    lines += skipped_lines(case_info, len(head))
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


ONEBIT = Family(
    name="onebit",
    description=(
        "1-bit Adam compression: pack and unpack (SIMD C++; CUDA and Triton with --device cuda) vs the reference "
        "and the bandwidth roofline, then (CPU) the compressed all-reduce vs dist.all_reduce fp32/fp16 over Gloo at "
        "world 2 and 4 (rows: onebit_allreduce); not in --all (the all-reduce jobs take minutes)"
    ),
    cases=cases,
    peers=("reference", "torch_fill"),
    roofline=roofline,
    devices=("cpu", "cuda"),
    in_all=False,
    measure=measure,
    table=table,
)
