"""fastzero.checkpointing: activation checkpointing against the
un-checkpointed run (bit for bit on the CPU, dropout included), the RNG
tracker, the input treatments (partitioned across 2 ranks, contiguous,
CPU-held), the selective policy, placement under a budget, the config
section and initialize at ZeRO 0-3 (2 ranks)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastzero
from fastzero import checkpointing
from fastzero.config import ConfigError, load_config
from fastzero.parallel import checkpointing as impl
from fastzero.parallel import placement, selective
from tests.dist import run_ranks
from tests.paths import WORKERS

WORKER = WORKERS / "act_ckpt.py"


@pytest.fixture(autouse=True)
def fresh_settings():
    impl._unconfigure()
    checkpointing.get_cuda_rng_tracker().reset()
    selective.forget_plans()  # each test learns its own: a plan found from an earlier test changes what runs
    yield
    impl._unconfigure()
    checkpointing.get_cuda_rng_tracker().reset()


class Block(nn.Module):
    """Linear -> GELU -> dropout -> (dropout in a tracker fork) -> Linear, with a residual."""

    def __init__(self, width: int, mult: int = 2, fork: bool = True):
        super().__init__()
        self.a, self.b = nn.Linear(width, mult * width), nn.Linear(mult * width, width)
        self.fork = fork
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = F.dropout(F.gelu(self.a(x)), 0.3, self.training)
        if self.fork:
            with checkpointing.get_cuda_rng_tracker().fork():
                h = F.dropout(h, 0.2, self.training)
        return x + self.b(h)


class Net(nn.Module):
    def __init__(self, mults=(2, 2, 2), width: int = 7):
        super().__init__()
        checkpointing.model_parallel_cuda_manual_seed(0)
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width, m) for m in mults)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


HOW = {
    "none": lambda b, h: b(h),
    "full": checkpointing.checkpoint,
    "non_reentrant": checkpointing.non_reentrant_checkpoint,
    "selective": lambda b, h: checkpointing.checkpoint(b, h, policy="selective"),
    "selective_list": lambda b, h: checkpointing.selective_checkpoint(b, h, policy=[torch.ops.aten.addmm.default]),
    "selective_all": lambda b, h: checkpointing.checkpoint(b, h, policy=checkpointing.SelectivePolicy(math.inf)),
}


def run(blocks: nn.ModuleList, x: Tensor, how: str, seed: int = 5):
    """Forward and backward through the blocks; the outputs, grads, saved bytes and the RNG's next draws."""
    torch.manual_seed(seed)
    checkpointing.model_parallel_cuda_manual_seed(seed)
    for p in blocks.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    with checkpointing.SavedBytes(blocks.parameters()) as meter:
        h = x
        for b in blocks:
            h = HOW[how](b, h)
        saved = meter.live
        (h * h.detach().sin()).sum().backward()
    with checkpointing.get_cuda_rng_tracker().fork():
        tracker_next = torch.rand(3)
    return dict(
        out=h.detach(),
        grads=[p.grad for p in blocks.parameters()],
        x_grad=x.grad,
        saved=saved,
        next=torch.rand(3),
        tracker_next=tracker_next,
    )


Tensor = torch.Tensor


def assert_same(got: dict, want: dict) -> None:
    assert torch.equal(got["out"], want["out"])
    assert torch.equal(got["x_grad"], want["x_grad"])
    for g, w in zip(got["grads"], want["grads"], strict=True):
        assert torch.equal(g, w)
    assert torch.equal(got["next"], want["next"])  # the default generator ends where the plain run's does
    assert torch.equal(got["tracker_next"], want["tracker_next"])  # and the tracker's state too


def blocks_and_input(width: int = 11, n: int = 3, rows: int = 6):
    checkpointing.model_parallel_cuda_manual_seed(0)
    return nn.ModuleList(Block(width) for _ in range(n)), torch.randn(rows, width)


@pytest.mark.parametrize("how", ["full", "non_reentrant", "selective", "selective_list", "selective_all"])
def test_grads_equal_the_plain_run_bit_for_bit_with_dropout(how):
    blocks, x = blocks_and_input()
    want = run(blocks, x, "none")
    got = run(blocks, x, how)
    assert_same(got, want)
    assert got["saved"] < want["saved"]


def test_the_function_runs_once_in_forward_and_once_in_recompute():
    blocks, x = blocks_and_input(n=1)
    run(blocks, x, "full")
    assert blocks[0].calls == 2


def test_params_get_grads_when_no_input_needs_one():
    blocks, x = blocks_and_input(n=1)
    out = checkpointing.checkpoint(blocks[0], x)  # x needs no grad: the first layer, fed data
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in blocks[0].parameters())


def test_non_tensor_arguments_and_several_outputs():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def fn(x, scale, flag):
        y = lin(x) * scale
        return y, (y > 0).long(), flag

    x = torch.randn(3, 4, requires_grad=True)
    y, mask, flag = checkpointing.checkpoint(fn, x, 2.5, "tag")
    assert flag == "tag" and mask.dtype == torch.long and not mask.requires_grad
    y.sum().backward()
    want_x = x.detach().clone().requires_grad_(True)
    (lin(want_x) * 2.5).sum().backward()
    assert torch.equal(x.grad, want_x.grad)


def test_without_grad_the_function_just_runs():
    blocks, x = blocks_and_input(n=1)
    with torch.no_grad():
        out = checkpointing.checkpoint(blocks[0], x)
    assert not out.requires_grad and blocks[0].calls == 1


def test_cpu_and_contiguous_settings_keep_grads_and_fill_one_buffer():
    blocks, x = blocks_and_input()
    want = run(blocks, x, "none")
    checkpointing.configure(None, checkpoint_in_cpu=True)
    assert_same(run(blocks, x, "full"), want)
    checkpointing.configure(
        None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3, profile=True
    )
    got = run(blocks, x, "full")
    assert_same(got, want)
    assert got["saved"] == 3 * x.numel() * 4  # the one 3-slot buffer holds every block's input
    assert set(checkpointing.timings()) >= {"forward", "recompute"}
    checkpointing.configure(
        None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3, checkpoint_in_cpu=True
    )
    assert_same(run(blocks, x, "full"), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inputs_held_in_cpu_memory_come_back_with_equal_grads():
    torch.cuda.init()  # the RNG states live on the CUDA generator from here on
    blocks, x = blocks_and_input()
    blocks, x = blocks.cuda(), x.cuda()
    want = run(blocks, x, "none")
    checkpointing.configure(None, checkpoint_in_cpu=True, synchronize=True, profile=True)
    got = run(blocks, x, "full")
    assert_same(got, want)
    assert checkpointing.timings()["recompute"] > 0
    for cpu in (False, True):
        checkpointing.configure(
            None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3, checkpoint_in_cpu=cpu
        )
        assert_same(run(blocks, x, "full"), want)


def test_contiguous_buffer_overflow_names_the_fix_and_reset_clears_it():
    blocks, x = blocks_and_input(n=3)
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    x = x.requires_grad_(True)
    h = x
    with pytest.raises(RuntimeError, match="num_checkpoints=2"):
        for b in blocks:
            h = checkpointing.checkpoint(b, h)
    checkpointing.reset()
    h = checkpointing.checkpoint(blocks[0], x)  # a fresh buffer after reset()
    h.sum().backward()


def test_configure_reads_the_config_section_and_arguments_override():
    assert not checkpointing.is_configured()
    checkpointing.configure(None)
    assert checkpointing.is_configured() and checkpointing.settings() == impl.Settings()
    cfg = {
        "activation_checkpointing": {
            "partition_activations": True,
            "contiguous_memory_optimization": True,
            "number_checkpoints": 4,
            "cpu_checkpointing": True,
            "synchronize_checkpoint_boundary": True,
            "profile": True,
        }
    }
    checkpointing.configure(None, deepspeed_config=cfg, checkpoint_in_cpu=False)
    s = checkpointing.settings()
    assert (s.partition_activations, s.contiguous_checkpointing, s.num_checkpoints) == (True, True, 4)
    assert (s.checkpoint_in_cpu, s.synchronize, s.profile) == (False, True, True)
    parsed = load_config({"train_batch_size": 1, **cfg})
    checkpointing.configure(None, deepspeed_config=parsed)
    assert checkpointing.settings().checkpoint_in_cpu


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(contiguous_checkpointing=True, num_checkpoints=2), "needs partition_activations"),
        (dict(partition_activations=True, contiguous_checkpointing=True), "needs num_checkpoints"),
        (dict(num_checkpoints=0), "num_checkpoints = 0"),
        (dict(profile="yes"), "profile = 'yes'"),
    ],
)
def test_configure_refuses_what_cannot_work(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        checkpointing.configure(None, **kwargs)


def test_config_section_is_checked():
    with pytest.raises(ConfigError, match="did you mean 'partition_activations'"):
        load_config({"train_batch_size": 1, "activation_checkpointing": {"partition_activation": True}})
    with pytest.raises(ConfigError, match="number_checkpoints = 0"):
        load_config({"train_batch_size": 1, "activation_checkpointing": {"number_checkpoints": 0}})


def test_fastzero_checkpointing_is_the_deepspeed_surface():
    assert fastzero.checkpointing is checkpointing
    for name in ("configure", "checkpoint", "non_reentrant_checkpoint", "is_configured", "reset"):
        assert callable(getattr(fastzero.checkpointing, name))


# -- the RNG tracker -----------------------------------------------------------------------------------------------


def test_a_fork_neither_uses_nor_advances_the_default_generator():
    checkpointing.model_parallel_cuda_manual_seed(42)
    before = torch.get_rng_state()
    with checkpointing.get_cuda_rng_tracker().fork():
        inside = torch.rand(5)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(42 + 2718)  # DeepSpeed's model-parallel seed at tensor rank 0
    assert torch.equal(inside, torch.rand(5))
    with checkpointing.get_cuda_rng_tracker().fork():  # the fork's own state advanced
        assert not torch.equal(torch.rand(5), inside)


def test_model_parallel_seed_seeds_the_default_generator():
    checkpointing.model_parallel_cuda_manual_seed(9)
    got = torch.rand(4)
    torch.manual_seed(9)
    assert torch.equal(got, torch.rand(4))


def test_tracker_states_round_trip_and_bad_use_is_named():
    tracker = checkpointing.get_cuda_rng_tracker()
    tracker.add("a", 1)
    states = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(3)
    tracker.set_states(states)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), first)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"):
        with tracker.fork("missing"):
            pass


# -- the selective policy ------------------------------------------------------------------------------------------


def test_selective_keeps_matmuls_between_full_and_none():
    blocks, x = blocks_and_input()
    none, full, sel = (run(blocks, x, h)["saved"] for h in ("none", "full", "selective"))
    assert full < sel < none


class Chain(nn.Module):
    """x -> x @ A -> gelu -> @ B -> tanh -> @ C: three matmuls of known cost per byte (k / 2 FLOPs per fp32 byte):
    B's output 8 (120 bytes at 5 rows), A's 4 (320 bytes), C's 3 (80 bytes); the input is 160 bytes. C's output
    is the block's output, which is never kept (the caller may write it in place)."""

    def __init__(self):
        super().__init__()
        self.A, self.B, self.C = (nn.Parameter(torch.randn(*s) / 3) for s in ((8, 16), (16, 6), (6, 4)))

    def forward(self, x):
        return torch.tanh(F.gelu(x.mm(self.A)).mm(self.B)).mm(self.C)


class CountMM(torch.utils._python_dispatch.TorchDispatchMode):
    """The forward-shaped mm calls (no backward mm has these argument shapes): which matmuls ran."""

    FORWARD = {((5, 8), (8, 16)): "A", ((5, 16), (16, 6)): "B", ((5, 6), (6, 4)): "C"}

    def __init__(self):
        super().__init__()
        self.ran = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            name = self.FORWARD.get((tuple(args[0].shape), tuple(args[1].shape)))
            if name:
                self.ran.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "ratio, kept",
    [(0.0, ""), (0.5, ""), (1.0, "B"), (1.25, "B"), (2.75, "BA"), (3.25, "BA"), (math.inf, "BA")],
)
def test_selective_policy_keeps_the_costliest_per_byte_up_to_its_limit(ratio, kept):
    torch.manual_seed(0)
    net = Chain()
    x = torch.randn(5, 8, requires_grad=True)
    net(x).sin().sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in net.parameters()]
    x.grad = None
    net.zero_grad(set_to_none=True)
    nbytes = {"A": 320, "B": 120, "C": 80}
    with checkpointing.SavedBytes(net.parameters()) as meter:
        out = checkpointing.checkpoint(net, x, policy=checkpointing.SelectivePolicy(ratio))
        assert meter.live == 160 + sum(nbytes[k] for k in kept)  # the input and exactly the outputs it keeps
        with CountMM() as mm:
            out.sin().sum().backward()
    assert sorted(mm.ran) == sorted(set("ABC") - set(kept))  # the recompute ran every matmul but the kept ones
    got = [x.grad] + [p.grad for p in net.parameters()]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_selective_policy_does_not_keep_an_output_changed_in_place():
    torch.manual_seed(0)
    W = nn.Parameter(torch.randn(6, 6))
    x = torch.randn(4, 6)

    def block(h):
        y = h.mm(W)
        y.mul_(2)  # the mm's output no longer holds what the mm made
        return y.tanh()

    block(x).sum().backward()
    want, W.grad = W.grad, None
    with checkpointing.SavedBytes([W]) as meter:
        out = checkpointing.checkpoint(block, x, policy=checkpointing.SelectivePolicy(math.inf))
        assert meter.live == 4 * 6 * 4  # the input only
        out.sum().backward()
    assert torch.equal(W.grad, want)


class Pair(nn.Module):
    """tanh(x @ W1) @ W2, W1 [d, 2d], W2 [2d, d]: without a checkpoint it saves x and the tanh output."""

    def __init__(self, d):
        super().__init__()
        self.W1, self.W2 = nn.Parameter(torch.randn(d, 2 * d) / 3), nn.Parameter(torch.randn(2 * d, d) / 3)

    def forward(self, x):
        return torch.tanh(x.mm(self.W1)).mm(self.W2)


@pytest.mark.parametrize(
    "how, after_forward, peak",
    [
        ("none", 9, 9),  # per block x (1) and tanh's output (2), all alive at the end of the forward
        # the 3 inputs; the last block's recompute adds its tanh output (2) while the inputs are all alive
        ("full", 3, 5),
        ("torch", 3, 5),  # torch.utils.checkpoint's recompute, metered the same
        # keeps nothing: the W2 output is the block's output (never kept), the others (2) exceed 1.25x the input
        ("selective", 3, 5),
    ],
)
def test_peak_saved_bytes_over_forward_and_backward_equal_the_hand_count(how, after_forward, peak):
    torch.manual_seed(0)
    rows, d = 5, 4
    S = rows * d * 4  # bytes of one [rows, d] fp32 tensor
    blocks = nn.ModuleList(Pair(d) for _ in range(3))
    wrap = {
        "none": lambda b, h: b(h),
        "full": checkpointing.checkpoint,
        "torch": lambda b, h: torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False),
        "selective": lambda b, h: checkpointing.checkpoint(b, h, policy="selective"),
    }[how]
    x = torch.randn(rows, d, requires_grad=True)
    with checkpointing.SavedBytes(blocks.parameters()) as meter:
        h = x
        for b in blocks:
            h = wrap(b, h)
        assert meter.live == after_forward * S
        h.sum().backward()
    assert meter.peak == peak * S
    assert meter.live == 0


def test_a_bad_policy_is_named():
    with pytest.raises(ValueError, match="policy = 'some'"):
        checkpointing.checkpoint(lambda x: x, torch.ones(1), policy="some")
    with pytest.raises(TypeError, match="aten overloads"):
        checkpointing.selective_checkpoint(lambda x: x, torch.ones(1), policy=[torch.ops.aten.mm])
    for bad in (-1, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="max_kept_ratio"):
            checkpointing.SelectivePolicy(bad)


# -- placement under a budget --------------------------------------------------------------------------------------


def measured_peak(net: Net, x: Tensor, chosen, policy="full") -> int:
    placement.unapply(net)
    for i in chosen:
        placement._wrap(net.layers[i], policy)
    with checkpointing.SavedBytes(net.parameters()) as meter:
        net(x).sum().backward()
    placement.unapply(net)
    return meter.peak


def test_budget_placement_fits_with_the_fewest_blocks():
    torch.manual_seed(0)
    net, x = Net(mults=(1, 4, 2, 3), width=8), torch.randn(16, 8)
    subsets = [c for k in range(5) for c in itertools.combinations(range(4), k)]
    peaks = {c: measured_peak(net, x, c) for c in subsets}
    none = peaks[()]
    reachable = min(peaks.values())
    for budget in (none, (none + reachable) // 2, reachable + (none - reachable) // 5, reachable):
        report = checkpointing.apply(net, budget, sample_input=x)
        chosen = tuple(int(n.split(".")[1]) for n in report.chosen)
        fewest = min(len(c) for c in subsets if peaks[c] <= budget)
        assert len(chosen) == fewest, (budget, chosen)
        assert report.peak_bytes == peaks[chosen] <= budget  # the prediction is the measured peak
        assert measured_peak_of_applied(net, x) == peaks[chosen]
        assert "blocks checkpointed" in str(report)
    with pytest.raises(ValueError, match="no placement of checkpoints fits it"):
        checkpointing.apply(net, reachable - 1, sample_input=x)


def measured_peak_of_applied(net: Net, x: Tensor) -> int:
    with checkpointing.SavedBytes(net.parameters()) as meter:
        net(x).sum().backward()
    return meter.peak


def test_placement_leaves_rng_buffers_and_grads_alone_and_training_bit_exact():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(5, 7)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    report = checkpointing.apply(net, 10**9, sample_input=(x,), blocks=[net.layers[0], net.layers[2]])
    assert report.blocks == ["layers.0", "layers.2"] and report.chosen == []
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in net.parameters())
    tight = checkpointing.apply(net, report.peak_bytes_none - 1, sample_input=x, policy="selective")
    assert tight.chosen
    checkpointing.model_parallel_cuda_manual_seed(1)
    got = net(x)
    got.sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    checkpointing.unapply(net)
    net.zero_grad(set_to_none=True)
    checkpointing.model_parallel_cuda_manual_seed(1)
    want = net(x)
    want.sum().backward()
    assert torch.equal(got, want)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters(), strict=True))


def measured_modes(net: Net, x: Tensor, modes) -> tuple[int, int]:
    """The measured peak of one per-block assignment of none / selective / full, and its recompute FLOPs."""
    placement.unapply(net)
    for layer, mode in zip(net.layers, modes):
        if mode != "none":
            placement._wrap(layer, "full" if mode == "full" else checkpointing.SelectivePolicy())
    with checkpointing.SavedBytes(net.parameters()) as meter:
        net(x).sum().backward()
    placement.unapply(net)
    return meter.peak


def test_mixed_placement_fits_the_budget_with_the_least_recompute():
    torch.manual_seed(0)
    net, x = Net(mults=(1, 4, 2), width=8), torch.randn(16, 8)
    every = list(itertools.product(placement.MODES, repeat=3))
    peaks = {m: measured_modes(net, x, m) for m in every}
    none, reachable = peaks[("none",) * 3], min(peaks.values())
    report = checkpointing.apply(net, none, sample_input=x, policy="mixed")
    assert report.modes == ["none"] * 3 and report.recompute_flops == 0
    # a block's two Linears cost 2 * 16 rows * 8 * 8m each; the selective policy keeps the one of inner size 8m
    # (m = 1: a tie, the earlier), whose output is as large as the block's input: the default limit
    assert report.flops == [4 * 16 * 64 * m for m in (1, 4, 2)]
    assert report.kept_flops == [2 * 16 * 64 * m for m in (1, 4, 2)]
    seen = set()
    for budget in (none, (none + reachable) // 2, reachable + (none - reachable) // 5, reachable):
        report = checkpointing.apply(net, budget, sample_input=x, policy="mixed")
        modes = tuple(report.modes)
        seen.update(modes)
        assert report.peak_bytes == peaks[modes] <= budget  # the prediction is the measured peak
        assert measured_peak_of_applied(net, x) == peaks[modes]
        assert report.chosen == [f"layers.{i}" for i, m in enumerate(modes) if m != "none"]
        cost = {m: placement.recompute_flops(report.flops, report.kept_flops, m) for m in every}
        assert report.recompute_flops == cost[modes] == min(cost[m] for m in every if peaks[m] <= budget)
    assert seen == {"none", "selective", "full"}  # the budgets above need all three (e.g. selective, selective, none)
    assert report.modes[-1] == "none"  # the last block recomputed would peak with all else alive: never worth it
    # training under the mixed placement is bit for bit the plain run's, dropout included
    net.zero_grad(set_to_none=True)
    checkpointing.model_parallel_cuda_manual_seed(1)
    torch.manual_seed(2)
    got = net(x)
    got.sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    checkpointing.unapply(net)
    net.zero_grad(set_to_none=True)
    checkpointing.model_parallel_cuda_manual_seed(1)
    torch.manual_seed(2)
    want = net(x)
    want.sum().backward()
    assert torch.equal(got, want)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters(), strict=True))
    with pytest.raises(ValueError, match="no placement of checkpoints fits it"):
        checkpointing.apply(net, reachable - 1, sample_input=x, policy="mixed")


def test_placement_bad_input_is_named():
    net, x = Net(), torch.randn(5, 7)
    with pytest.raises(ValueError, match="budget_bytes = 0"):
        checkpointing.apply(net, 0, sample_input=x)
    with pytest.raises(TypeError, match="sample_input="):
        checkpointing.apply(net, 100)
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        checkpointing.apply(nn.Sequential(nn.Linear(7, 7)), 100, sample_input=x)
    with pytest.raises(ValueError, match="not a submodule"):
        checkpointing.apply(net, 100, sample_input=x, blocks=[nn.Linear(2, 2)])


# -- several ranks ----------------------------------------------------------------------------------------------


def ranks(tmp_path, mode: str) -> list[dict]:
    run_ranks(WORKER, 2, [mode, tmp_path / mode], timeout=300)
    return [torch.load(tmp_path / f"{mode}.rank{r}.pt", weights_only=False) for r in range(2)]


def test_under_the_engine_at_zero_0_to_3_losses_and_params_equal_the_plain_run(tmp_path):
    for res in ranks(tmp_path, "engine"):
        for stage in range(4):
            plain, ckpt = res[(stage, False)], res[(stage, True)]
            assert plain["losses"] == ckpt["losses"], stage
            for name, p in plain["params"].items():
                assert torch.equal(p, ckpt["params"][name]), (stage, name)
            assert ckpt["timings"]["recompute"] > 0  # profile: the recompute ran and was timed
        assert "pass topology= or mpu= to initialize" in res["partition_error"]
        # stage 3: the order recorded once includes the recompute's gathers (3 blocks x 2 Linears x weight and
        # bias) and is followed without recording again; each recompute's params are all-gathered ahead by the
        # prefetch, not on demand when its forward starts
        plain3, ckpt3 = res[(3, False)]["stage3"], res[(3, True)]["stage3"]
        assert plain3["retraced"] == ckpt3["retraced"] == 0
        assert ckpt3["trace"] == plain3["trace"] + 12
        backward = [(name, how) for phase, name, how in ckpt3["log"] if phase == "backward"]
        for i in range(3):
            assert (f"blocks.{i}.a.weight", "prefetch") in backward, backward
            assert (f"blocks.{i}.a.weight", "demand") not in backward, backward


def test_partitioned_inputs_keep_one_tp_th_per_rank_and_grads(tmp_path):
    for res in ranks(tmp_path, "partition"):
        plain = res["plain"]
        unpartitioned = res["full"][0]
        assert res["partition"][0] * 2 == unpartitioned  # 5 x 12 inputs: 30 elements per rank
        for name in ("full", "partition", "partition_cpu", "contiguous", "non_reentrant", "non_reentrant_plain"):
            got = res[name]
            assert torch.equal(got[2], plain[2]), name
            for g, w in zip(got[1], plain[1], strict=True):
                assert torch.equal(g, w), name
        assert res["partition_cpu"][0] == res["contiguous"][0] == res["non_reentrant"][0] == unpartitioned // 2


def test_tracker_forks_differ_across_ranks_and_replay_in_recompute(tmp_path):
    r0, r1 = ranks(tmp_path, "tracker")
    assert torch.equal(r0["outside"], r1["outside"])  # the default generator: seeded alike on every rank
    assert not torch.equal(r0["inside"], r1["inside"])  # the fork: seed + 2718 + tp_rank
    for res in (r0, r1):
        plain, full = res["runs"]["plain"], res["runs"]["full"]
        assert all(torch.equal(a, b) for a, b in zip(plain[1], full[1], strict=True))


def test_placement_passes_keyword_inputs_through_autograd():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x, *, scale):
            return torch.tanh(self.lin(x)) * scale

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Scaled() for _ in range(3))

        def forward(self, x, scale):
            for layer in self.layers:
                x = layer(x, scale=scale)
            return x

    torch.manual_seed(0)
    net, x = Stack(), torch.randn(4, 6)

    def grads():
        scale = torch.full((6,), 1.5, requires_grad=True)
        net.zero_grad(set_to_none=True)
        net(x, scale).square().sum().backward()
        return [p.grad.clone() for p in net.parameters()], scale.grad

    want, want_scale = grads()
    report = checkpointing.apply(net, 10**9, sample_input=(x, torch.ones(6)))
    assert report.chosen == []
    tight = checkpointing.apply(net, report.peak_bytes_none - 1, sample_input=(x, torch.ones(6)))
    assert tight.chosen
    got, got_scale = grads()
    assert torch.equal(got_scale, want_scale)  # the keyword tensor's grad flows through the checkpointed blocks
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_contiguous_slots_saved_outside_any_saved_tensor_hook_stay_valid():
    """Each checkpoint's piece is a slot of one shared buffer: writing the
    next slot must not mark the earlier ones as modified in place (views
    share their base's version counter). `run` measures through saved-tensor
    hooks, under which autograd checks no versions: here, none."""
    blocks, x = blocks_and_input()
    want = run(blocks, x, "none")
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3)
    torch.manual_seed(5)
    checkpointing.model_parallel_cuda_manual_seed(5)
    for p in blocks.parameters():
        p.grad = None
    h = x0 = x.clone().requires_grad_(True)
    for b in blocks:
        h = checkpointing.checkpoint(b, h)
    (h * h.detach().sin()).sum().backward()
    assert torch.equal(h.detach(), want["out"]) and torch.equal(x0.grad, want["x_grad"])
    for g, w in zip([p.grad for p in blocks.parameters()], want["grads"]):
        assert torch.equal(g, w)
