"""CPUAdam, the torch.optim optimizer, against torch.optim.AdamW / Adam."""

import copy

import pytest
import torch

from fastzero.ops import CPUAdam
from fastzero.ops.tolerances import assert_close
from tests.helpers import assert_models_close, make_model, train


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch_optim(isa, adamw_mode):
    ours, theirs = make_model(), make_model()
    opt = CPUAdam(ours.parameters(), lr=3e-3, weight_decay=0.1, adamw_mode=adamw_mode)
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = torch_cls(theirs.parameters(), lr=3e-3, weight_decay=0.1)
    train(ours, opt, 7)
    train(theirs, ref, 7)
    assert opt.backend == f"cpu:{isa}"
    assert_models_close(ours, theirs)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(opt.state[p][key], ref.state[q][key], msg=key)


def test_param_groups_with_their_own_hyperparameters(isa):
    ours, theirs = make_model(), make_model()

    def groups(model):
        layers = list(model)
        return [
            {"params": layers[0].parameters(), "lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.99)},
            {"params": layers[2].parameters(), "lr": 1e-3, "weight_decay": 0.3, "eps": 1e-6},
            {"params": layers[3].parameters()},
        ]

    opt = CPUAdam(groups(ours), lr=5e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(groups(theirs), lr=5e-3, weight_decay=0.01)
    train(ours, opt, 7)
    train(theirs, ref, 7)
    assert_models_close(ours, theirs)
    assert [g["step"] for g in opt.param_groups] == [7, 7, 7]


def test_changing_lr_between_steps_is_honoured(isa):
    ours, theirs = make_model(), make_model()
    opt, ref = CPUAdam(ours.parameters(), lr=1e-2), torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0)
    for lr in (1e-2, 3e-3, 1e-4):
        for o in (opt, ref):
            o.param_groups[0]["lr"] = lr
        train(ours, opt, 2)
        train(theirs, ref, 2)
    assert_models_close(ours, theirs)


@pytest.mark.parametrize("fp32_states", [True, False])
def test_bf16_params_track_fp32_training(isa, fp32_states):
    """bf16 params with fp32 (or bf16) states: torch's bf16 AdamW is the
    same-dtype peer; our error against fp32 training is at most twice its."""
    fp32, ours, theirs = make_model(), make_model(torch.bfloat16), make_model(torch.bfloat16)
    opt = CPUAdam(ours.parameters(), lr=1e-3, fp32_optimizer_states=fp32_states)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0)
    ideal = torch.optim.AdamW(fp32.parameters(), lr=1e-3, weight_decay=0)
    state_dtype = torch.float32 if fp32_states else torch.bfloat16
    # The same bf16 gradients for all three: set grads by hand.
    gen = torch.Generator().manual_seed(3)
    for _ in range(7):
        for ps in zip(fp32.parameters(), ours.parameters(), theirs.parameters()):
            g = torch.randn(ps[0].shape, generator=gen).bfloat16()
            for p in ps:
                p.grad = g.to(p.dtype)
        for o in (opt, ref, ideal):
            o.step()
    for p_ideal, p_ours, p_torch in zip(fp32.parameters(), ours.parameters(), theirs.parameters()):
        assert opt.state[p_ours]["exp_avg"].dtype == state_dtype
        err_ours = (p_ours.float() - p_ideal).abs().max()
        err_torch = (p_torch.float() - p_ideal).abs().max()
        assert err_ours <= 2 * err_torch + 1e-6


def test_mixed_dtypes_in_one_group(isa):
    """fp32, bf16 and fp16 params (with grads of other dtypes) in one group."""
    torch.manual_seed(0)
    shapes = [(31,), (4, 17), (1023,)]
    params = [
        torch.nn.Parameter(torch.randn(s).to(d)) for s, d in zip(shapes, (torch.float32, torch.bfloat16, torch.float16))
    ]
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    for p in params:
        if hasattr(p, "grad_dtype"):  # torch >= 2.10 checks grad dtypes unless told not to
            p.grad_dtype = None
    opt = CPUAdam(params, lr=1e-3)
    ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0)
    for _ in range(5):
        for p, q, gd in zip(params, ref_params, (torch.bfloat16, torch.float32, torch.float32)):
            g = torch.randn(p.shape).to(gd)
            p.grad, q.grad = g, g.float()
        opt.step()
        ref.step()
        with torch.no_grad():  # the low-precision params round every step: so must the reference
            for p, q in zip(params, ref_params):
                q.copy_(q.to(p.dtype))
    for p, q in zip(params, ref_params):
        assert_close(p.detach(), q.detach().to(p.dtype))


def test_params_without_grad_are_skipped(isa):
    model = make_model()
    frozen = model[0].weight
    before = frozen.detach().clone()
    opt = CPUAdam(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 33)).sum().backward()
        frozen.grad = None
        opt.step()
    assert torch.equal(frozen, before)
    assert frozen not in opt.state or not opt.state[frozen]


def test_closure_and_zero_grad(isa):
    model = make_model()
    opt = CPUAdam(model.parameters())
    x = torch.randn(4, 33)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.item() > 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_non_contiguous_param_is_updated_in_place(isa):
    torch.manual_seed(0)
    base = torch.randn(64, 48)
    p = torch.nn.Parameter(base.t())  # a transposed, non-contiguous view
    q = torch.nn.Parameter(base.t().contiguous())
    opt, ref = CPUAdam([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2, weight_decay=0)
    for _ in range(3):
        g = torch.randn(64, 48).t()  # a non-contiguous grad too
        p.grad, q.grad = g, g.contiguous()
        opt.step()
        ref.step()
    assert not p.is_contiguous()
    assert_close(p.detach(), q.detach())


def test_state_dict_moves_to_torch_adamw_and_back(isa):
    """Train 3 steps with one optimizer, continue 4 with the other: the same
    as 7 steps with torch alone."""
    a, b, ref_model = make_model(), make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.1)
    train(ref_model, ref, 7)

    # CPUAdam -> torch
    opt = CPUAdam(a.parameters(), lr=3e-3, weight_decay=0.1)
    train(a, opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and float(sd["state"][0]["step"]) == 3
    torch_opt = torch.optim.AdamW(a.parameters(), lr=3e-3, weight_decay=0.1)
    torch_opt.load_state_dict(sd)
    train(a, torch_opt, 4, seed=2)

    # torch -> CPUAdam
    torch_b = torch.optim.AdamW(b.parameters(), lr=3e-3, weight_decay=0.1)
    train(b, torch_b, 3)
    opt_b = CPUAdam(b.parameters(), lr=3e-3, weight_decay=0.1)
    opt_b.load_state_dict(copy.deepcopy(torch_b.state_dict()))
    assert opt_b.param_groups[0]["step"] == 3
    train(b, opt_b, 4, seed=2)

    ref_model2 = make_model()
    ref2 = torch.optim.AdamW(ref_model2.parameters(), lr=3e-3, weight_decay=0.1)
    train(ref_model2, ref2, 3)
    train(ref_model2, ref2, 4, seed=2)
    assert_models_close(a, ref_model2)
    assert_models_close(b, ref_model2)


def test_state_dict_round_trip_keeps_fp32_states_of_bf16_params(isa):
    model = make_model(torch.bfloat16)
    opt = CPUAdam(model.parameters(), lr=1e-3)
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    opt2 = CPUAdam(model.parameters(), lr=1e-3)
    opt2.load_state_dict(sd)
    for p in model.parameters():
        assert opt2.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(opt2.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    assert opt2.param_groups[0]["step"] == 2


def test_state_dict_of_another_model_is_refused():
    small, big = torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)
    opt = CPUAdam(small.parameters())
    small(torch.randn(2, 4)).sum().backward()
    opt.step()
    other = CPUAdam(big.parameters(), lr=0.5)
    big(torch.randn(2, 4)).sum().backward()
    other.step()
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match="shape"):
        other.load_state_dict(opt.state_dict())
    after = other.state_dict()  # nothing changed
    assert after["param_groups"] == before["param_groups"]
    for pid, st in before["state"].items():
        for key, value in st.items():
            assert torch.equal(after["state"][pid][key], value)


def test_state_dict_of_another_optimizer_is_refused():
    model = torch.nn.Linear(4, 4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    sgd.step()
    with pytest.raises(ValueError, match="not saved by an Adam-family optimizer"):
        CPUAdam(model.parameters()).load_state_dict(sgd.state_dict())


def test_reference_backend_when_forced(monkeypatch):
    monkeypatch.setenv("FASTZERO_BACKEND", "reference")
    ours, theirs = make_model(), make_model()
    opt = CPUAdam(ours.parameters(), lr=1e-3)
    assert opt.backend == "reference"
    train(ours, opt, 3)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0), 3)
    assert_models_close(ours, theirs)


def test_deepspeed_positional_signature():
    p = torch.nn.Parameter(torch.randn(3))
    # DeepSpeedCPUAdam(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode,
    #                  fp32_optimizer_states)
    opt = CPUAdam([p], 1e-3, False, (0.8, 0.9), 1e-6, 0.1, False, False, True)
    g = opt.param_groups[0]
    assert (g["lr"], g["bias_correction"], g["betas"], g["eps"], g["weight_decay"], g["adamw_mode"]) == (
        1e-3,
        False,
        (0.8, 0.9),
        1e-6,
        0.1,
        False,
    )
