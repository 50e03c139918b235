import pytest
import torch

from fastzero.ops import native


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
