"""Native optimizer steps never read out of bounds: a grad, a state tensor or
a param whose size no longer matches is refused by Python before the kernel
runs (CPUAdam, FusedAdam and FusedLamb, on every backend here)."""

import warnings

import pytest
import torch

from fastzero.ops import CPUAdam, FusedAdam, FusedLamb


@pytest.mark.parametrize("cls", [CPUAdam, FusedAdam, FusedLamb])
@pytest.mark.parametrize("what", ["grad", "state", "param"])
def test_a_tensor_that_no_longer_fits_its_param_is_refused(cls, what):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    p.grad = torch.randn(64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a reference fallback warns once where no native backend runs
        opt = cls([p])
        opt.step()
    before = p.detach().clone()
    if what == "grad":
        p.grad.data = torch.randn(16)  # .data: autograd's own size check would stop a plain assignment
        match = r"grads\[0\] has shape \(16,\)"
    elif what == "state":
        opt.state[p]["exp_avg"] = torch.zeros(16)
        match = r"exp_avgs\[0\] has shape \(16,\)"
    else:  # the param resized after its state was made
        p.data, p.grad = torch.randn(128), torch.randn(128)
        before = p.detach().clone()
        match = r"exp_avgs\[0\] has shape \(64,\)"
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p.detach(), before)  # nothing was written
