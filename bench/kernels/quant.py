"""Block-wise quantization (fastzero.ops.quant, ZeRO++'s qwZ / qgZ kernels):
quantize, dequantize and the dequantized sum over ranks against the memory
roofline and the plain-PyTorch reference.

Cases, one tensor of N values in blocks of 256 (DeepSpeed's ZeRO++ default
group size is 2048 for weights; 256 is the finer, harder case):

* ``quantize-int8-fp32-N`` / ``quantize-int4-fp32-N``: fp32 x to codes and
  one fp32 scale per block. Own bytes: read x once (4 N: the kernels' second
  read of a block hits the cache), write the codes (N or N / 2) and the
  scales (4 N / 256).
* ``quantize-sr-int8-fp32-N`` / ``quantize-sr-int4-fp32-N``: the same with
  stochastic rounding (qgZ's gradients), the same bytes. The reference is
  not timed beside them (its counter hash takes seconds at 4M values); it
  still checks them.
* ``dequantize-int8-N``: int8 codes and scales to fp32 values (the qwZ
  receiver): read N + 4 N / 256, write 4 N.
* ``dequantize_sum-int4-r4-N``: the int4 codes of 4 ranks for the same N
  values summed into fp32 (the qgZ owner): read 4 (N / 2 + 4 N / 256), write 4 N.

Providers: fastzero's CPU kernel (``--device cuda``: the ``cuda`` and ``triton``
backends), the ``reference`` backend as the peer, and the bandwidth probe of
bench/kernels/common.py over N elements. CPU: for quantize the probe of its
own traffic (read the fp32 values, write a code per value with the same
stores, no arithmetic), since a pass that mostly reads one stream per core
gets only about 0.6-0.7 of the in-place stream's bandwidth here; for the
dequantize cases, which mostly write, the write probe. GPU: a copy. Every
provider is first checked against the reference: codes, scales and values
equal to the bit.

Sizes: 1M, 16M, 64M (GPU: and 256M); ``--quick``: 1M and 4M (GPU 1M and 16M).
Gated rows: fastzero's fraction of the roofline (a same-run ratio). Not in
``--all``, as the onebit family: no baseline entries yet.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fastzero.ops import quant
from fastzero.ops.quant import reference as ref

from ..family import Family, Settings, measure_rounds
from ..harness import Case, Provider, Runner
from ..harness import format_size as _fmt
from .common import backend_ready, our_backends, roofline

M = 1 << 20
BLOCK = 256
RANKS = 4  # dequantize_sum's ranks: a world of 4
SIZES = {"cpu": [1 * M, 16 * M, 64 * M], "cuda": [1 * M, 16 * M, 64 * M, 256 * M]}
QUICK_SIZES = {"cpu": [1 * M, 4 * M], "cuda": [1 * M, 16 * M]}
TARGET = 0.7  # fraction of the roofline the kernels should reach
SEED = 1234  # stochastic rounding's seed


def quantize_bytes(n: int, bits: int) -> float:
    return 4 * n + n * bits / 8 + 4 * n / BLOCK


def dequantize_bytes(n: int, bits: int = 8, ranks: int = 1) -> float:
    return ranks * (n * bits / 8 + 4 * n / BLOCK) + 4 * n


class Data:
    """A case's x (uniform in [-1, 1)), its codes from RANKS ranks (fresh values each) and the reference's results."""

    def __init__(self, n: int, bits: int, device: str, seed: int = 0, stochastic: bool = False) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.xs = [torch.empty(n, device=device).uniform_(-1, 1, generator=gen) for _ in range(RANKS)]
        self.bits = bits
        self.n = n
        self.stochastic = stochastic

    def quantize(self, x: torch.Tensor, backend: str, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        return quant.quantize_blockwise(
            x, self.bits, BLOCK, stochastic=self.stochastic, seed=SEED, out=out, backend=backend
        )

    @functools.cached_property
    def coded(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.stochastic:  # only quantize's cases round stochastically: rank 0's codes are all they need
            return [self.quantize(self.xs[0], "reference")]
        return [self.quantize(x, "reference") for x in self.xs]

    @functools.cached_property
    def values(self) -> torch.Tensor:
        c, s = self.coded[0]
        return ref.dequantize(c, s, self.n, BLOCK)

    @functools.cached_property
    def summed(self) -> torch.Tensor:
        return ref.dequantize_sum([c for c, _ in self.coded], [s for _, s in self.coded], self.n, BLOCK)


def _equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got, want):
        raise AssertionError(f"{what}: {int((got != want).sum())} of {got.numel()} differ from the reference's")


def runner(data: Callable[[], Data], op: str, backend: str, device: str) -> Runner:
    backend_ready(backend, device)
    d = data()
    if op == "quantize":
        x = d.xs[0]
        want_c, want_s = d.coded[0]
        out = (torch.empty_like(want_c), torch.empty_like(want_s))

        def step():
            d.quantize(x, backend, out)

        def check():
            step()
            _equal(out[0], want_c, "codes")
            _equal(out[1], want_s, "scales")

    elif op == "dequantize":
        c, s = d.coded[0]
        out = torch.empty(d.n, device=device)

        def step():
            quant.dequantize_blockwise(c, s, out, block=BLOCK, backend=backend)

        def check():
            out.fill_(float("nan"))
            step()
            _equal(out, d.values, "values")

    else:
        codes = torch.stack([c for c, _ in d.coded])
        scales = torch.stack([s for _, s in d.coded])
        out = torch.empty(d.n, device=device)

        def step():
            quant.dequantize_sum(codes, scales, out, block=BLOCK, backend=backend)

        def check():
            out.fill_(float("nan"))
            step()
            _equal(out, d.summed, "sum")

    return Runner(step=step, check=check, cuda=device == "cuda")


def cases(sizes=None, dtypes=None, quick=False, device="cpu") -> list[Case]:
    """``--sizes``: values per tensor; ``--dtype`` is not used (x is fp32)."""
    out = []
    for n in sizes or (QUICK_SIZES if quick else SIZES)[device]:
        for op, bits, sr in (
            ("quantize", 8, False),
            ("quantize", 4, False),
            ("quantize", 8, True),
            ("quantize", 4, True),
            ("dequantize", 8, False),
            ("dequantize_sum", 4, False),
        ):
            data = functools.cache(lambda n=n, bits=bits, sr=sr: Data(n, bits, device, stochastic=sr))
            make = functools.partial(runner, data, op)
            provs = [Provider(p, "ours", functools.partial(make, b or "cpu", device)) for p, b in our_backends(device)]
            if not sr:
                provs.append(Provider("reference", "peer", functools.partial(make, "reference", device)))
            provs.append(roofline(device, [n], writes=op != "quantize", codes=bits if op == "quantize" else None))
            if op == "quantize":
                name, own = f"quantize-{'sr-' if sr else ''}int{bits}-fp32-{_fmt(n)}", quantize_bytes(n, bits)
                how = ", rounding stochastically" if sr else ""
                desc = f"quantize {_fmt(n)} fp32 values to int{bits} in blocks of {BLOCK}{how}"
            elif op == "dequantize":
                name, own = f"dequantize-int8-{_fmt(n)}", dequantize_bytes(n)
                desc = f"dequantize {_fmt(n)} int8 codes to fp32 in a preallocated out"
            else:
                name, own = f"dequantize_sum-int4-r{RANKS}-{_fmt(n)}", dequantize_bytes(n, 4, RANKS)
                desc = f"sum {RANKS} ranks' int4 codes of {_fmt(n)} values into fp32 (fp32 accumulation)"
            out.append(Case(QUANT.name, name, n, round(own), provs, f"{desc}; {own / n:g} B per value"))
    return out


def measure(case: Case, settings: Settings, say) -> tuple[list[dict], dict]:
    if "cuda" in {p.name.removeprefix("fastzero_") for p in case.providers} and not torch.cuda.is_available():
        return [], {p.name: "no CUDA device" for p in case.providers}
    rows, skipped = measure_rounds(case, settings, say)
    kinds = {p.name: p.kind for p in case.providers}
    for r in rows:
        r["gated"] = r["metric"] == "frac_roofline" and kinds[r["provider"]] == "ours"
    return rows, skipped


QUANT = Family(
    name="quant",
    description=(
        f"block-wise int8/int4 quantization (ZeRO++): quantize, dequantize, dequantize_sum of {RANKS} ranks "
        "(SIMD C++; CUDA and Triton with --device cuda) vs the reference and the bandwidth roofline"
    ),
    cases=cases,
    peers=("reference",),
    roofline=roofline,
    devices=("cpu", "cuda"),
    in_all=False,
    measure=measure,
)
