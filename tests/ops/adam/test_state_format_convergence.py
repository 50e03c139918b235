"""Convergence with low-bit optimizer states: the GPT-like model of
bench/tiny_gpt.py trained on its synthetic Markov language (fixed seeds, 300
steps) ends with a held-out loss within 1% of fp32 states' for bf16 states
(stochastic rounding) and int8 block-wise states, and every format's loss
fell well below the start (a run that learned nothing would pass a 1% check
against another such run)."""

import pytest
import torch

from bench.tiny_gpt import lm_loss, make_model, sequences
from fastzero.ops import CPUAdam

STEPS, BATCH = 300, 32


def held_out_loss(state_format: str, **kw) -> tuple[float, float]:
    """(held-out loss before, after) STEPS steps of CPUAdam in `state_format`."""
    torch.manual_seed(0)
    model = make_model(hidden=64, layers=2)
    held = sequences(512, seed=999)
    with torch.no_grad():
        start = lm_loss(model(held[:, :-1]), held).item()
    opt = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.01, state_format=state_format, **kw)
    for step in range(1, STEPS + 1):
        ids = sequences(BATCH, seed=step)
        loss = lm_loss(model(ids[:, :-1]), ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return start, lm_loss(model(held[:, :-1]), held).item()


@pytest.fixture(scope="module")
def fp32_loss():
    return held_out_loss("fp32")


@pytest.mark.parametrize("state_format,kw", [("bf16", {"seed": 1}), ("int8", {}), ("int8", {"block_size": 2048})])
def test_low_bit_states_end_within_one_percent_of_fp32(fp32_loss, state_format, kw):
    start, base = fp32_loss
    _, loss = held_out_loss(state_format, **kw)
    assert base < 0.7 * start, (start, base)  # it learned: log(64) = 4.16 falls towards the chain's entropy
    assert abs(loss - base) <= 0.01 * base, (state_format, kw, loss, base)
