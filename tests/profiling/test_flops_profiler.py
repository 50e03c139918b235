"""The flops profiler against hand-counted FLOPs (2 per multiply-accumulate),
on random awkward sizes: every module's count exactly, the breakdown adding
up to the total, params against sum(numel), the report's numbers and its
files, and bad input refused."""

import random

import pytest
import torch
from torch import nn

from fastzero.profiling import FlopsProfiler, get_model_profile, report


class Model(nn.Module):
    """A strided conv, an MLP, a ModuleList of batched matmuls, and a matmul in the model's own forward."""

    def __init__(self, s: dict) -> None:
        super().__init__()
        self.s = s
        self.conv = nn.Conv2d(s["cin"], s["cout"], s["k"], stride=s["stride"], padding=s["pad"])
        feat = s["cout"] * self.hw() ** 2
        self.mlp = nn.Sequential(nn.Linear(feat, s["hidden"]), nn.GELU(), nn.Linear(s["hidden"], s["out"], bias=False))
        self.heads = nn.ModuleList(BatchedMatmul(s["out"], s["dh"]) for _ in range(s["heads"]))
        self.w = nn.Parameter(torch.randn(s["dh"], s["last"]))

    def hw(self) -> int:
        s = self.s
        return (s["size"] + 2 * s["pad"] - s["k"]) // s["stride"] + 1

    def forward(self, x):
        h = self.mlp(self.conv(x).flatten(1))
        h = sum(head(h) for head in self.heads)
        return h @ self.w


class BatchedMatmul(nn.Module):
    def __init__(self, d: int, dh: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, dh)

    def forward(self, h):  # (b, d) -> (b, dh); plus a bmm of (b, dh, 1) x (b, 1, dh)
        p = self.proj(h)
        return torch.bmm(p.unsqueeze(2), p.unsqueeze(1)).sum(2)


def sizes(seed: int) -> dict:
    r = random.Random(seed)
    return dict(
        batch=r.randint(1, 5),
        cin=r.randint(1, 4),
        cout=r.randint(1, 6),
        k=r.choice([1, 2, 3]),
        stride=r.choice([1, 2]),
        pad=r.randint(0, 1),
        size=r.randint(4, 9),
        hidden=r.randint(1, 37),
        out=r.randint(1, 13),
        heads=r.randint(1, 3),
        dh=r.randint(1, 11),
        last=r.randint(1, 7),
    )


def hand_macs(model: Model) -> dict:
    """Multiply-accumulates per module, counted from the shapes."""
    s, b = model.s, model.s["batch"]
    conv = b * s["cout"] * model.hw() ** 2 * s["cin"] * s["k"] ** 2
    fc1 = b * model.mlp[0].in_features * s["hidden"]
    fc2 = b * s["hidden"] * s["out"]
    proj = b * s["out"] * s["dh"]
    bmm = b * s["dh"] * s["dh"]  # (dh x 1) @ (1 x dh) per row
    own = b * s["dh"] * s["last"]
    out = {"conv": conv, "mlp.0": fc1, "mlp.1": 0, "mlp.2": fc2, "mlp": fc1 + fc2}
    for i in range(s["heads"]):
        out[f"heads.{i}.proj"], out[f"heads.{i}"] = proj, proj + bmm
    out["heads"] = s["heads"] * (proj + bmm)
    out[""] = conv + fc1 + fc2 + out["heads"] + own
    return out


def profiled(seed: int):
    torch.manual_seed(seed)
    model = Model(sizes(seed))
    s = model.s
    x = torch.randn(s["batch"], s["cin"], s["size"], s["size"])
    prof = FlopsProfiler(model)
    prof.start_profile()
    out = model(x)
    prof.stop_profile()
    return model, prof, out, x


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_every_module_flops_are_the_hand_count(seed):
    model, prof, out, x = profiled(seed)
    expected = hand_macs(model)
    for name, module in model.named_modules():
        assert prof.module_macs(module) == expected[name], name
        assert prof.module_flops(module) == 2 * expected[name], name  # 2 * m * n * k
    assert prof.get_total_flops() == 2 * expected[""] and prof.get_total_macs() == expected[""]
    # profiling did not change the forward
    torch.testing.assert_close(model(x), out, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [5, 6])
def test_the_breakdown_adds_up_and_params_are_sum_numel(seed):
    model, prof, _, _ = profiled(seed)
    own = 2 * model.s["batch"] * model.s["dh"] * model.s["last"]  # the matmul in the model's own forward
    children = sum(prof.module_flops(c) for c in model.children())
    assert children + own == prof.get_total_flops()
    for module in model.modules():
        if not module._modules:
            continue
        kids = sum(prof.module_flops(c) for c in module.children())
        assert kids <= prof.module_flops(module)
        if module is not model and not isinstance(module, BatchedMatmul):  # containers run nothing of their own
            assert kids == prof.module_flops(module)
        assert prof.module_params(module) == sum(p.numel() for p in module.parameters())
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())
    # latency: every module called has one, and a parent's covers its children's
    for module in model.modules():
        kids = sum(prof.module_duration(c) for c in module.children())
        assert prof.module_duration(module) > 0 and prof.module_duration(module) >= kids


def test_no_hooks_or_counting_after_stop_and_end():
    model, prof, _, x = profiled(7)
    total = prof.get_total_flops()
    model(x)  # not profiled: the counts stay
    assert prof.get_total_flops() == total
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    prof.end_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.get_total_flops()
    with pytest.raises(RuntimeError, match="nothing was profiled"):
        prof.print_model_profile()
    prof.start_profile()  # a second profile starts from zero
    model(x)
    model(x)
    prof.stop_profile()
    assert prof.get_total_flops() == 2 * total


def test_ignored_modules_count_in_their_parent():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Sequential(nn.Linear(5, 3)))
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.Linear])
    model(torch.randn(2, 7))
    prof.stop_profile()
    assert prof.get_total_flops() == 2 * 2 * (7 * 5 + 5 * 3)
    assert prof.module_flops(model[0]) == 0 and prof.module_flops(model[1]) == 2 * 2 * 5 * 3


def test_report_numbers_tree_and_depths(tmp_path):
    model, prof, _, _ = profiled(8)
    path = tmp_path / "deep" / "profile.txt"
    prof.print_model_profile(profile_step=3, module_depth=1, top_modules=2, detailed=True, output_file=path)
    text = path.read_text()
    assert "Profile Summary at step 3:" in text
    value = lambda label: next(ln for ln in text.splitlines() if ln.startswith(label)).split(":", 1)[1].strip()  # noqa: E731
    assert value("fwd flops per GPU:") == report.number_to_string(prof.get_total_flops()).strip()
    assert value("fwd MACs per GPU:") == report.macs_to_string(prof.get_total_macs())
    assert value("params per GPU:") == report.params_to_string(prof.get_total_params())
    # aggregated: depths 0 and 1 only, at most 2 types each
    assert "depth 0:" in text and "depth 1:" in text and "depth 2:" not in text
    params_at_1 = eval(text.split("depth 1:")[1].splitlines()[1].split("-", 1)[1])  # noqa: S307 (our own dict repr)
    assert len(params_at_1) == 2
    # the tree stops at depth 1: the MLP's Linears are not listed, its own line is
    assert "(mlp): Sequential(" in text and "(conv): Conv2d(" in text and "(0): Linear" not in text
    assert report.module_line(prof, model.conv) in text
    # module_depth -1: every depth, every module
    full = prof.model_profile_text(module_depth=-1, detailed=True)
    assert "depth 3:" in full and "(proj): Linear(" in full and "in_features=" in full
    assert "Detailed Profile" not in prof.model_profile_text(detailed=False)


def test_get_model_profile_returns_and_prints(capsys, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(11, 6), nn.ReLU(), nn.Linear(6, 3))
    flops, macs, params = get_model_profile(model, input_shape=(4, 11), as_string=False, print_profile=False)
    assert (flops, macs, params) == (2 * 4 * (11 * 6 + 6 * 3), 4 * (11 * 6 + 6 * 3), 11 * 6 + 6 + 6 * 3 + 3)
    assert capsys.readouterr().out == ""
    x = torch.randn(2, 11)
    strings = get_model_profile(model, args=[x], warm_up=0, top_modules=3)
    assert strings == (report.number_to_string(2 * 2 * 84), report.macs_to_string(2 * 84), "93")
    out = capsys.readouterr().out
    assert "Profile Summary at step 0:" in out and "(0): Linear(" in out
    # kwargs, and an output file instead of stdout
    kw = nn.Module()
    kw.lin = nn.Linear(5, 2)
    kw.forward = lambda *, inp: kw.lin(inp)
    path = tmp_path / "p.txt"
    assert get_model_profile(kw, kwargs={"inp": torch.randn(3, 5)}, as_string=False, output_file=path)[0] == 60
    assert capsys.readouterr().out == "" and "fwd flops per GPU:" in path.read_text()
    assert not model.training  # eval mode, as DeepSpeed's


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(model="net", input_shape=(1, 2)), TypeError, "torch.nn.Module"),
        (dict(input_shape=[1, 3]), TypeError, "input_shape .* tuple"),
        (dict(), ValueError, "give input_shape, or args"),
        (dict(input_shape=(1, 3), mode="backward"), ValueError, "'forward' or 'generate'"),
        (dict(input_shape=(1, 3), mode="generate"), ValueError, "model.generate"),
        (dict(input_shape=(1, 3), warm_up=-1), ValueError, "warm_up"),
    ],
)
def test_get_model_profile_refuses_bad_input(kwargs, error, match):
    kwargs.setdefault("model", nn.Linear(3, 2))
    with pytest.raises(error, match=match):
        get_model_profile(**kwargs)


def test_bad_report_arguments_are_refused():
    model, prof, _, _ = profiled(9)
    with pytest.raises(ValueError, match="module_depth"):
        prof.model_profile_text(module_depth=-2)
    with pytest.raises(ValueError, match="top_modules"):
        prof.model_profile_text(top_modules=0)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        FlopsProfiler([model])


def test_numbers_are_written_as_deepspeed_writes_them():
    assert report.number_to_string(0) == "0 "
    assert report.number_to_string(1234567) == "1.23 M"
    assert report.number_to_string(2.5e12) == "2.5 T"
    assert report.number_to_string(999) == "999 "
    assert report.params_to_string(2.5e9) == "2.5 B"
    assert report.macs_to_string(4096) == "4.1 KMACs"
    assert report.duration_to_string(0.00125) == "1.25 ms"
    assert report.duration_to_string(3e-6) == "3 us"
    assert report.flops_to_string(3.2e9, units="G") == "3.2 GFLOPS"


def test_reached_as_deepspeed_scripts_reach_it():
    import fastzero as deepspeed

    assert deepspeed.profiling.flops_profiler.get_model_profile is get_model_profile
    assert deepspeed.profiling.flops_profiler.FlopsProfiler is FlopsProfiler
