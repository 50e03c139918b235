"""The quant benchmark's roofline for quantize: a probe of quantize's own
traffic (read fp32, write a code per value), checked element by element on
every ISA path, and the quantize cases measured against it."""

import pytest
import torch

from bench.kernels import quant as qb
from bench.kernels.common import STREAM_CODES_BYTES, narrow_codes, narrow_roofline


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_probe_writes_every_code(isa, bits):
    # tails that are not whole vector groups, odd counts (int4's last high nibble), and a size whose codes
    # reach the cache-bypassing stores
    sizes = [1000, 17, 2**16 + 3, 1, 0, 2 * STREAM_CODES_BYTES + 65]
    runner = narrow_roofline(sizes, bits)
    runner.check()


def test_probe_codes_follow_the_bit_patterns():
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, float("inf"), float("nan")])
    assert narrow_codes(x, 8).view(torch.int8).tolist() == [0, -127, 127, -127, 1, -127, 127, 127]
    # int4: pairs low nibble first, [-7, 7] two's complement
    assert narrow_codes(x[:3], 4).tolist() == [0x90, 0x07]


def test_quantize_cases_use_the_probe_of_their_traffic():
    cases = {c.name: c for c in qb.cases(quick=True)}
    n = 1 << 20
    roof = {name: c.providers[-1] for name, c in cases.items()}
    assert roof["quantize-int8-fp32-1M"].bytes == 5 * n and roof["quantize-sr-int4-fp32-1M"].bytes == 4.5 * n
    assert roof["dequantize-int8-1M"].bytes == 4 * n  # the write probe: dequantize mostly writes
    assert all(r.name == "roofline" for r in roof.values())
