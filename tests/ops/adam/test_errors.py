"""Bad input: a Python exception that names the problem, before any pointer
reaches native code."""

import pytest
import torch

from fastzero.ops import AdamHyperparams, CPUAdam, cpu_adam_step


def param(n=8, dtype=torch.float32, grad=True):
    p = torch.nn.Parameter(torch.randn(n).to(dtype))
    if grad:
        p.grad = torch.randn(n).to(dtype)
    return p


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1e-3), "learning rate"),
        (dict(lr=float("nan")), "learning rate"),
        (dict(betas=(1.0, 0.999)), "beta1"),
        (dict(betas=(0.9, -0.1)), "beta2"),
        (dict(betas=(0.9,)), "pair"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(amsgrad=True), "amsgrad"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPUAdam([param()], **kwargs)


def test_hyperparameter_changed_to_bad_value_is_caught_at_step():
    opt = CPUAdam([param()])
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="learning rate"):
        opt.step()


def test_param_on_another_device_points_to_fused_adam():
    p = torch.nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="FusedAdam"):
        CPUAdam([p])


def test_grad_with_other_shape():
    # torch forbids assigning a grad of another shape to a Parameter; the
    # functional API (what the ZeRO runtime calls) must check it itself.
    p2 = torch.nn.Parameter(torch.randn(2, 4))
    with pytest.raises(ValueError, match="elements"):
        cpu_adam_step(
            [p2.detach()],
            [torch.randn(9)],
            [torch.zeros(2, 4)],
            [torch.zeros(2, 4)],
            step=1,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
        )
    with pytest.raises(ValueError, match="shape"):
        cpu_adam_step(
            [p2.detach()],
            [torch.randn(4, 2)],
            [torch.zeros(2, 4)],
            [torch.zeros(2, 4)],
            step=1,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
        )


def test_sparse_grad():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    opt = CPUAdam(emb.parameters())
    with pytest.raises(ValueError, match="sparse"):
        opt.step()


def test_integer_param():
    with pytest.raises(TypeError, match="dtype"):
        cpu_adam_step(
            [torch.ones(3, dtype=torch.int32)],
            [torch.ones(3)],
            [torch.zeros(3)],
            [torch.zeros(3)],
            step=1,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
        )


def hyper(**kw):
    return dict(dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8), **kw)


def test_functional_list_lengths():
    with pytest.raises(ValueError, match="2 params but 1 grads"):
        cpu_adam_step([torch.ones(3)] * 2, [torch.ones(3)], [torch.zeros(3)] * 2, [torch.zeros(3)] * 2, **hyper())


def test_functional_non_contiguous_state():
    m = torch.zeros(6, 4).t()
    with pytest.raises(ValueError, match="contiguous"):
        cpu_adam_step([torch.ones(4, 6)], [torch.ones(4, 6)], [m], [torch.zeros(4, 6)], **hyper())


def test_functional_state_dtype():
    with pytest.raises(TypeError, match="optimizer states"):
        cpu_adam_step(
            [torch.ones(3)],
            [torch.ones(3)],
            [torch.zeros(3, dtype=torch.bfloat16)],
            [torch.zeros(3, dtype=torch.bfloat16)],
            **hyper(),
        )


def test_functional_copy_needs_fp32_master():
    with pytest.raises(TypeError, match="copies"):
        cpu_adam_step(
            [torch.ones(3, dtype=torch.bfloat16)],
            [torch.ones(3)],
            [torch.zeros(3)],
            [torch.zeros(3)],
            param_copies=[torch.zeros(3, dtype=torch.bfloat16)],
            **hyper(),
        )


@pytest.mark.parametrize("scale", [0.0, -2.0, float("inf")])
def test_functional_bad_grad_scale(scale):
    with pytest.raises(ValueError, match="grad_scale"):
        cpu_adam_step([torch.ones(3)], [torch.ones(3)], [torch.zeros(3)], [torch.zeros(3)], **hyper(grad_scale=scale))


def test_functional_step_zero():
    with pytest.raises(ValueError, match="step"):
        cpu_adam_step([torch.ones(3)], [torch.ones(3)], [torch.zeros(3)], [torch.zeros(3)], **hyper(step=0))


def test_unknown_backend(monkeypatch):
    monkeypatch.setenv("FASTZERO_BACKEND", "tpu")
    with pytest.raises(ValueError, match="FASTZERO_BACKEND"):
        CPUAdam([param()]).step()


def test_gpu_backend_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("FASTZERO_BACKEND", "cuda")
    with pytest.raises(ValueError, match="CPU tensors"):
        CPUAdam([param()]).step()


@pytest.mark.parametrize("value, match", [("sse9", "not one of"), ("avx1024", "not one of")])
def test_unknown_isa(monkeypatch, value, match):
    monkeypatch.setenv("FASTZERO_CPU_ISA", value)
    with pytest.raises(ValueError, match=match):
        CPUAdam([param()]).step()


def test_native_refuses_isa_the_cpu_lacks():
    from fastzero import native

    ops = native.cpu_ops()
    if ops is None:
        pytest.skip("no native kernels")
    hyper = bytes(AdamHyperparams().c_struct())
    with pytest.raises(ValueError, match="not supported"):
        ops.adam(7, [], [], [], [], [], [], 0, 0, 0, -1, hyper, 1, 1.0, 0, False, False, 1)
    with pytest.raises(ValueError, match="no kernel"):
        ops.adam(0, [0], [0], [0], [0], [], [1], 1, 0, 2, -1, hyper, 1, 1.0, 0, False, False, 1)


@pytest.mark.parametrize("what", ["param", "state"])
def test_a_tensor_replaced_after_a_step_is_refused_not_read_out_of_bounds(what):
    """The full checks run once per param set and again whenever a size no
    longer matches: a param resized through .data (its state now smaller) or a
    state tensor replaced by a smaller one raises instead of reaching the kernel."""
    p = param(64)
    opt = CPUAdam([p])
    opt.step()
    if what == "param":
        p.data = torch.randn(128)
        p.grad = torch.randn(128)
    else:
        opt.state[p]["exp_avg"] = torch.zeros(16)
    with pytest.raises(ValueError, match="exp_avgs\\[0\\] has shape"):
        opt.step()
