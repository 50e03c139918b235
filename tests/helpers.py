"""Small models and training loops shared by the optimizer tests."""

import torch

from fastzero.ops.tolerances import assert_close


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 17), torch.nn.LayerNorm(17)
    ).to(dtype)


def train(model, opt, steps, seed=1):
    """Steps with seeded random gradients: both optimizers of a comparison see
    the same grads, so their params differ only by rounding (a real forward
    would feed each one's rounding back into its grads and amplify it)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)  # CPU draws: the same on any device
        opt.step()


def assert_models_close(a, b, dtype=None):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert_close(pa.detach(), pb.detach(), dtype=dtype, msg=name)
