import pytest
import torch

from fastzero.ops import native

# One tolerance table for the whole suite (torch.testing's defaults for the
# low-precision dtypes; fp32 a little looser than its default to allow a few
# ulps between a fused multiply-add and PyTorch's separate ops over 7 steps).
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
}


def assert_close(actual, expected, dtype=None, msg=""):
    tol = TOL[dtype or actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), **tol, msg=lambda m: f"{msg}\n{m}")


@pytest.fixture(params=native.supported_isas() or ["none"])
def isa(request, monkeypatch):
    """Runs the test once per instruction-set path this CPU supports."""
    if request.param == "none":
        pytest.skip(f"native CPU kernels unavailable: {native.cpu_ops_error()}")
    monkeypatch.setenv("FASTZERO_CPU_ISA", request.param)
    return request.param


@pytest.fixture
def seeded():
    torch.manual_seed(1234)
