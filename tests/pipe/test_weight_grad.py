"""The zero-bubble schedules' split backward (fastzero/pipe/weight_grad.py):
B leaves linear layers' weight gradients to W, which gives the same
gradients as one plain backward, a stage's first layer on the raw batch
(an input that needs no gradient) included."""

import pytest
import torch
from torch import nn

from fastzero.pipe.weight_grad import DeferWeightGrads, WeightGradStore


class AddmmLinear(nn.Module):
    """Hugging Face's Conv1D: addmm with an [in, out] weight."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


def split_grads(model: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """B (the input's and the non-linear params' gradients) then W (the store's), as the pipeline engine runs them."""
    params = [p for p in model.parameters() if p.requires_grad]
    with DeferWeightGrads():
        out = model(x)
    inputs = [x] if x.requires_grad else []
    store = WeightGradStore()
    with store.filling():
        got = torch.autograd.grad([out], inputs + params, [dy], allow_unused=True)
    store.other.extend((p, g) for p, g in zip(params, got[len(inputs) :]) if g is not None)
    taken, grads = store.take()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g for p, g in zip(taken, grads)}


@pytest.mark.parametrize("first", [nn.Linear, AddmmLinear], ids=["linear", "conv1d"])
@pytest.mark.parametrize("input_grad", [False, True], ids=["raw_batch", "activation"])
def test_the_split_backward_gives_the_plain_backwards_gradients(first, input_grad):
    torch.manual_seed(0)
    model = nn.Sequential(first(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    x = torch.randn(5, 8, requires_grad=input_grad)
    dy = torch.randn(5, 3)
    model(x).backward(dy)
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    got = split_grads(model, x, dy)
    assert set(got) == set(want)  # the first layer's weight and bias included
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7, msg=n)
