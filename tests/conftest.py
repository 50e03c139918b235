import os

import pytest
import torch

# Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter; it
# must be chosen before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastzero import native


@pytest.fixture(params=native.supported_isas() or ["none"])
def isa(request, monkeypatch):
    """Runs the test once per instruction-set path this CPU supports."""
    if request.param == "none":
        if os.environ.get("CI") == "true":  # CI must test the kernels, not skip them
            pytest.fail(f"native CPU kernels unavailable in CI: {native.cpu_ops_error()}")
        pytest.skip(f"native CPU kernels unavailable: {native.cpu_ops_error()}")
    monkeypatch.setenv("FASTZERO_CPU_ISA", request.param)
    return request.param


@pytest.fixture
def seeded():
    torch.manual_seed(1234)
