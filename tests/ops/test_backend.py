"""One rule picks every op's backend (fastzero.ops.backend): an explicit
``backend=`` argument beats FASTZERO_BACKEND, which beats the fastest
available; a named backend that cannot run is an error that says why."""

from __future__ import annotations

import pytest
import torch

from fastzero.native import loader
from fastzero.ops import CPUAdam, FusedAdam, FusedLamb, SparseAttention, backend, cpu_adam_step, onebit
from fastzero.ops.adam import FAMILY as ADAM
from fastzero.ops.adam import AdamHyperparams
from fastzero.ops.sparse_attention import FixedSparsityConfig


def _stepped(opt_cls, **kwargs):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(37))
    p.grad = torch.randn(37)
    opt = opt_cls([p], **kwargs)
    opt.step()
    return opt, p


@pytest.mark.parametrize("opt_cls", [FusedAdam, FusedLamb])
def test_argument_beats_environment(monkeypatch, opt_cls):
    """The defect this rule fixes: backend="cpu" lost to FASTZERO_BACKEND on CPU tensors."""
    monkeypatch.setenv("FASTZERO_BACKEND", "reference")
    calls = []
    family = opt_cls.family
    monkeypatch.setattr(family, "impl", lambda name, impl=family.impl: calls.append(name) or impl(name))
    opt, _ = _stepped(opt_cls, backend="cpu")
    assert opt.last_backend == "cpu" and opt.backend == "cpu" and calls == ["cpu"]


@pytest.mark.parametrize("opt_cls", [FusedAdam, FusedLamb, CPUAdam])
def test_environment_beats_fastest(monkeypatch, opt_cls):
    opt, _ = _stepped(opt_cls)
    assert opt.last_backend == "cpu"
    monkeypatch.setenv("FASTZERO_BACKEND", "reference")
    opt, _ = _stepped(opt_cls)
    assert opt.last_backend == "reference"


def test_backends_agree_whichever_rule_chose(monkeypatch):
    _, by_arg = _stepped(FusedAdam, backend="reference")
    monkeypatch.setenv("FASTZERO_BACKEND", "reference")
    _, by_env = _stepped(FusedAdam)
    monkeypatch.delenv("FASTZERO_BACKEND")
    _, fastest = _stepped(FusedAdam)
    assert torch.equal(by_arg, by_env)
    torch.testing.assert_close(fastest, by_arg, rtol=1e-5, atol=1e-6)


def test_functional_step_takes_the_argument_too(monkeypatch):
    monkeypatch.setenv("FASTZERO_BACKEND", "reference")
    t = [[torch.randn(9)], [torch.randn(9)], [torch.zeros(9)], [torch.zeros(9)]]
    assert cpu_adam_step(*t, step=1, lr=1e-2, backend="cpu").startswith("cpu:")
    assert cpu_adam_step(*t, step=2, lr=1e-2) == "reference"


def test_onebit_and_sparse_attention_follow_the_rule(monkeypatch):
    x, error = torch.randn(64), torch.zeros(64)
    calls = []
    real_impl = onebit.FAMILY.impl
    monkeypatch.setattr(onebit.FAMILY, "impl", lambda name: calls.append(name) or real_impl(name))
    monkeypatch.setenv("FASTZERO_BACKEND", "reference")
    onebit.pack(x, error.clone(), 2, backend="cpu")
    onebit.pack(x, error.clone(), 2)
    assert calls == ["cpu", "reference"]
    attn = SparseAttention(FixedSparsityConfig(num_heads=2, block=16), max_seq_length=64, backend="reference")
    q = torch.randn(1, 2, 64, 16)
    attn(q, q, q)
    assert attn.last_backend == "reference"
    monkeypatch.setenv("FASTZERO_BACKEND", "cpu")  # the family has no cpu backend: named, not ignored
    with pytest.raises(ValueError, match="has no 'cpu' backend.*triton, reference"):
        SparseAttention(FixedSparsityConfig(num_heads=2, block=16), max_seq_length=64)(q, q, q)


def test_named_backend_that_cannot_run_says_why(monkeypatch):
    with pytest.raises(ValueError, match="got CPU tensors.*use one of"):
        ADAM.choose("cpu", "cuda")
    with pytest.raises(ValueError, match="not one of"):
        ADAM.choose("cpu", "fast")
    monkeypatch.setenv("FASTZERO_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="FASTZERO_BACKEND='triton'.*interpreter"):
        ADAM.choose("cpu")
    monkeypatch.setenv("FASTZERO_BACKEND", "bogus")
    with pytest.raises(ValueError, match="FASTZERO_BACKEND='bogus' is not one of"):
        ADAM.choose("cpu")


def test_choice_carries_its_reason(monkeypatch):
    assert ADAM.choose("cpu").reason == "fastest available"
    assert ADAM.choose("cpu", "reference").reason == "backend= argument"
    monkeypatch.setenv("FASTZERO_BACKEND", "reference")
    assert ADAM.choose("cpu").reason == "FASTZERO_BACKEND"
    monkeypatch.delenv("FASTZERO_BACKEND")
    monkeypatch.setattr(loader, "_load_cpu", lambda: (None, "no C++ compiler found"))
    monkeypatch.setattr(backend, "_warned", set())
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
        choice = ADAM.choose("cpu")
    assert choice.backend == "reference" and "no C++ compiler found" in choice.reason


def test_cpu_adam_refuses_device_backends():
    with pytest.raises(ValueError, match="CPUAdam: backend='cuda'"):
        CPUAdam([torch.nn.Parameter(torch.randn(3))], backend="cuda")


# -- hyperparameters: one dataclass per family -------------------------------------------------
def test_every_hyperparameter_is_an_optimizer_keyword_and_a_group_key():
    values = {"lr": 0.5, "beta1": 0.5, "beta2": 0.5, "eps": 0.5, "weight_decay": 0.5}
    for name in AdamHyperparams.names():
        for opt_cls in (FusedAdam, CPUAdam):
            value = values.get(name, False)
            kwargs = {"betas": (value, 0.9) if name == "beta1" else (0.9, value)} if name.startswith("beta") else {}
            opt = opt_cls([torch.nn.Parameter(torch.randn(3))], **(kwargs or {name: value}))
            assert getattr(AdamHyperparams.from_group(opt.param_groups[0]), name) == value


def test_adamw_mode_has_one_spelling_inside_and_two_outside():
    for opt_cls in (FusedAdam, CPUAdam):
        for kw in ("adamw_mode", "adam_w_mode"):
            opt = opt_cls([torch.nn.Parameter(torch.randn(3))], **{kw: False})
            assert opt.param_groups[0]["adamw_mode"] is False and "adam_w_mode" not in opt.param_groups[0]
        with pytest.raises(ValueError, match="disagree"):
            opt_cls([torch.nn.Parameter(torch.randn(3))], adamw_mode=True, adam_w_mode=False)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(lr="1e-3"), TypeError, "learning rate \\(lr\\) must be a real number, got str"),
        (dict(eps=None), TypeError, "eps must be a real number"),
        (dict(bias_correction=0.5), TypeError, "bias_correction must be True or False"),
        (dict(lr=float("inf")), ValueError, "learning rate"),
        (dict(gamma=1.0), TypeError, "unknown hyperparameter\\(s\\) gamma; known: betas, lr"),
    ],
)
def test_bad_hyperparameters_name_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        FusedAdam([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_c_struct_follows_the_dataclass():
    hp = AdamHyperparams(lr=0.25, adamw_mode=False)
    struct = hp.c_struct()
    assert [name for name, _ in type(struct)._fields_] == list(AdamHyperparams.names())
    assert struct.lr == 0.25 and struct.adamw_mode == 0 and struct.beta2 == 0.999
