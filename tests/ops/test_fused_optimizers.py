"""FusedAdam and FusedLamb on the CPU (the CUDA and Triton kernels have
their own tests): against the references and torch.optim, loss scaling,
master weights, checkpoints across optimizers, and bad input."""

import copy

import pytest
import torch

from fastzero.ops import CPUAdam, FusedAdam, FusedLamb, reference
from fastzero.ops.tolerances import assert_close
from tests.helpers import assert_models_close, make_model, train

LAMB = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)


def test_fused_adam_matches_torch_adamw(isa):
    ours, theirs = make_model(), make_model()
    opt = FusedAdam(ours.parameters(), lr=3e-3, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs.parameters(), lr=3e-3, weight_decay=0.1)
    train(ours, opt, 7)
    train(theirs, ref, 7)
    assert opt.last_backend == "cpu" and opt.backend == "cpu"
    assert_models_close(ours, theirs)


def test_fused_adam_l2_mode_matches_torch_adam(isa):
    ours, theirs = make_model(), make_model()
    opt = FusedAdam(ours.parameters(), lr=3e-3, weight_decay=0.1, adam_w_mode=False)
    train(ours, opt, 7)
    train(theirs, torch.optim.Adam(theirs.parameters(), lr=3e-3, weight_decay=0.1), 7)
    assert_models_close(ours, theirs)


def reference_lamb_run(model, steps, seed=1, groups=None, **hyper):
    """The reference LAMB driven like the optimizer: one group, seeded grads."""
    params = [p.detach() for p in model.parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    gen = torch.Generator().manual_seed(seed)
    beta1, beta2 = hyper.pop("betas")
    ratios = None
    for t in range(1, steps + 1):
        grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
        ratios = reference.lamb_step(params, grads, m, v, step=t, beta1=beta1, beta2=beta2, **hyper)
    return m, v, ratios


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_fused_lamb_matches_reference(isa, max_grad_norm, eps_inside_sqrt):
    ours, theirs = make_model(), make_model()
    hyper = dict(LAMB, max_grad_norm=max_grad_norm, eps_inside_sqrt=eps_inside_sqrt)
    opt = FusedLamb(ours.parameters(), **hyper)
    train(ours, opt, 7)
    m, v, ratios = reference_lamb_run(theirs, 7, **hyper)
    assert_models_close(ours, theirs)
    for p, mr, vr in zip(ours.parameters(), m, v):
        assert_close(opt.state[p]["exp_avg"], mr)
        assert_close(opt.state[p]["exp_avg_sq"], vr)
    assert opt.get_lamb_coeffs() == pytest.approx(ratios, rel=1e-5)
    assert any(r != 1.0 for r in ratios)


def test_fused_lamb_clips_ratios_to_bounds(isa):
    model = make_model()
    opt = FusedLamb(model.parameters(), lr=1e-3, max_coeff=0.5, min_coeff=0.3)
    train(model, opt, 2)
    assert all(0.3 <= r <= 0.5 for r in opt.get_lamb_coeffs())


@pytest.mark.parametrize("cls", [CPUAdam, FusedAdam, FusedLamb])
def test_grad_scale_is_fused_and_found_inf_skips(isa, cls):
    """grad_scale divides the grads inside the kernel; found_inf leaves every
    param and state untouched and the step uncounted."""
    scaled, plain = make_model(), make_model()
    o_scaled, o_plain = cls(scaled.parameters(), lr=1e-2), cls(plain.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(scaled.parameters(), plain.parameters()):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g * 1024.0, g.clone()
        o_scaled.step(grad_scale=torch.tensor(1024.0))
        o_plain.step()
    assert_models_close(scaled, plain)
    before = copy.deepcopy(o_scaled.state_dict())
    params_before = [p.detach().clone() for p in scaled.parameters()]
    o_scaled.step(grad_scale=1024.0, found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(params_before, scaled.parameters()))
    after = o_scaled.state_dict()
    assert after["param_groups"][0]["step"] == before["param_groups"][0]["step"] == 3
    for pid, st in before["state"].items():
        assert all(torch.equal(st[k], after["state"][pid][k]) for k in st)


@pytest.mark.parametrize("cls", [FusedAdam, FusedLamb])
def test_torch_grad_scaler_drives_the_fused_unscale(isa, cls):
    """torch.amp.GradScaler hands grad_scale and found_inf to optimizers that
    declare _step_supports_amp_scaling; training matches unscaled training."""
    scaled, plain = make_model(), make_model()
    o_scaled, o_plain = cls(scaled.parameters(), lr=1e-2), cls(plain.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(8, 33, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        o_scaled.zero_grad()
        o_plain.zero_grad()
        scaler.scale(scaled(x).pow(2).mean()).backward()
        plain(x).pow(2).mean().backward()
        scaler.step(o_scaled)
        scaler.update()
        o_plain.step()
    assert_models_close(scaled, plain)


def test_step_counts_once_per_step_whatever_dtypes_a_group_mixes(isa):
    params = [torch.nn.Parameter(torch.randn(5).to(d)) for d in (torch.float32, torch.bfloat16, torch.float16)]
    opt = FusedAdam(params, lr=1e-3)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(5).to(p.dtype)
        opt.step()
    assert opt.param_groups[0]["step"] == 4
    assert {float(s["step"]) for s in opt.state_dict()["state"].values()} == {4.0}


@pytest.mark.parametrize("cls", [FusedAdam, FusedLamb])
def test_master_weights_keep_small_updates_of_bf16_params(isa, cls):
    """bf16 params with master_weights track fp32 training far better than
    without: updates below bf16's resolution accumulate in the fp32 master."""
    # all three start from the same bf16-representable weights
    fp32, with_master, without = (
        make_model(torch.bfloat16).float(),
        make_model(torch.bfloat16),
        make_model(torch.bfloat16),
    )
    opts = [
        cls(fp32.parameters(), lr=1e-4),
        cls(with_master.parameters(), lr=1e-4, master_weights=True),
        cls(without.parameters(), lr=1e-4),
    ]
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        for ps in zip(fp32.parameters(), with_master.parameters(), without.parameters()):
            g = torch.randn(ps[0].shape, generator=gen).bfloat16()
            for p in ps:
                p.grad = g.to(p.dtype)
        for o in opts:
            o.step()
    masters = [opts[1].state[p]["master_param"] for p in with_master.parameters()]
    err_master = max((a - m).abs().max() for a, m in zip(fp32.parameters(), masters))
    err_plain = max((a - b.float()).abs().max() for a, b in zip(fp32.parameters(), without.parameters()))
    assert err_master < err_plain / 10
    for p in with_master.parameters():
        master = opts[1].state[p]["master_param"]
        assert master.dtype == torch.float32
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


def test_checkpoints_move_between_fused_adam_cpu_adam_and_torch(isa):
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.1)
    train(ref_model, ref, 3)
    train(ref_model, ref, 2, seed=2)
    train(ref_model, ref, 2, seed=3)

    model = make_model()
    fused = FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
    train(model, fused, 3)
    cpu = CPUAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
    cpu.load_state_dict(copy.deepcopy(fused.state_dict()))
    train(model, cpu, 2, seed=2)
    back = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    back.load_state_dict(copy.deepcopy(cpu.state_dict()))
    train(model, back, 2, seed=3)
    assert_models_close(model, ref_model)


def test_set_grad_none():
    model = make_model()
    for flag, expect_none in ((True, True), (False, False)):
        opt = FusedAdam(model.parameters(), set_grad_none=flag)
        train(model, opt, 1)
        opt.zero_grad()
        assert all((p.grad is None) == expect_none for p in model.parameters())


def test_deepspeed_positional_signatures():
    p = torch.nn.Parameter(torch.randn(3))
    # FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad, set_grad_none)
    g = FusedAdam([p], 2e-3, False, (0.8, 0.9), 1e-6, False, 0.1, False, False).param_groups[0]
    assert (g["lr"], g["bias_correction"], g["betas"], g["eps"], g["adamw_mode"], g["weight_decay"]) == (
        2e-3,
        False,
        (0.8, 0.9),
        1e-6,
        False,
        0.1,
    )
    # FusedLamb(params, lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay, max_grad_norm,
    #           max_coeff, min_coeff, amsgrad)
    g = FusedLamb([p], 2e-3, False, (0.8, 0.9), 1e-6, True, 0.1, 1.0, 5.0, 0.1, False).param_groups[0]
    assert (g["eps_inside_sqrt"], g["max_grad_norm"], g["max_coeff"], g["min_coeff"]) == (True, 1.0, 5.0, 0.1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
        (dict(max_coeff=0.1, min_coeff=0.5), "trust ratio"),
        (dict(amsgrad=True), "amsgrad"),
        (dict(lr=-1.0), "learning rate"),
    ],
)
def test_fused_lamb_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedLamb([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_a_group_that_mixes_devices_is_refused():
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.empty(3, device="meta"))
    a.grad, b.grad = torch.randn(3), torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="mixes devices"):
        FusedAdam([a, b]).step()


def test_cuda_backend_forced_on_cpu_tensors_is_refused(monkeypatch):
    monkeypatch.setenv("FASTZERO_BACKEND", "cuda")
    model = make_model()
    with pytest.raises(ValueError, match="CPU tensors"):
        train(model, FusedAdam(model.parameters()), 1)


@pytest.mark.parametrize("cls", [FusedAdam, FusedLamb])
def test_triton_backend_through_the_optimizer(cls):
    """The optimizer drives the Triton kernels (here in Triton's interpreter on
    CPU tensors) to the same result as its CPU path."""
    pytest.importorskip("triton")
    a, b = make_model(), make_model()

    def groups(model):  # param groups with their own hyperparameters
        layers = list(model)
        return [
            {"params": layers[0].parameters(), "lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.99)},
            {"params": [*layers[2].parameters(), *layers[3].parameters()], "lr": 3e-3, "eps": 1e-6},
        ]

    hyper = dict(lr=1e-2, weight_decay=0.01)
    opt_triton, opt_cpu = cls(groups(a), backend="triton", **hyper), cls(groups(b), **hyper)
    train(a, opt_triton, 20)
    train(b, opt_cpu, 20)
    assert opt_triton.last_backend == "triton"
    assert_models_close(a, b)
    if cls is FusedLamb:
        assert opt_triton.get_lamb_coeffs() == pytest.approx(opt_cpu.get_lamb_coeffs(), rel=1e-5)
