"""PipelineModule, LayerSpec, TiedLayerSpec: partitions against the
boundaries DeepSpeed's partition_uniform / partition_balanced give
(numbers worked from their code, ties included); on 2 and 4 Gloo ranks,
only owned layers built, global state_dict names, chunks chained by hand
equal to the unpipelined model (outputs and every grad, tied grads summed),
tied weights identical after construction; in one process, virtual stages,
activation checkpointing (bit-equal grads, DeepSpeed's checkpointable
rule), tuples between layers, and bad input."""

import pytest
import torch
from torch import nn

from fastzero.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from fastzero.pipe.partition import partition_balanced, partition_uniform
from tests.dist import run_ranks
from tests.paths import WORKERS
from tests.workers.pipe_module import BUILT, Counted, D, inputs, loss_of, make_layers

WORKER = WORKERS / "pipe_module.py"
# Counted layers' trainable params: emb 6x6 (no bias), 6x8+8, GELU, 8x6+6, tanh, 6x6+6, 6x6+6, emb again
PARAMS = [36, 56, 0, 54, 0, 42, 42, 36]
OWNED_TAGS = {0, 1, 3, 5, 6, 7}  # the Counted layers (the tied ones carry their layer index as tag)


# -- partitions ------------------------------------------------------------------------------------------------------


def test_partition_uniform_deepspeed_boundaries():
    # chunk = n // m, the first n % m parts one larger; n <= m: trailing parts empty
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(7, 3) == [0, 3, 5, 7]
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(3, 5) == [0, 1, 2, 3, 3, 3]


@pytest.mark.parametrize(
    "weights, parts, expected",
    [
        ([10, 1, 1, 1, 10], 2, [0, 3, 5]),  # splits at 2 and 3 both cost 1: DeepSpeed's >= keeps the later
        ([0, 1, 0, 1, 1, 0], 3, [0, 3, 4, 6]),
        ([1, 4, 1, 1, 4, 1, 2], 3, [0, 3, 5, 7]),
        ([1, 1, 1, 1], 2, [0, 2, 4]),
        ([3] * 7, 3, [0, 3, 5, 7]),
        ([5, 5], 3, [0, 1, 2, 2]),  # fewer items than parts: partition_uniform
        (PARAMS, 2, [0, 5, 8]),  # 146 | 120 at 4 and at 5 (tanh has none): the later
        (PARAMS, 3, [0, 3, 6, 8]),
        (PARAMS, 4, [0, 3, 5, 6, 8]),
        ([1, 1, 0, 1, 0, 1, 1, 1], 2, [0, 5, 8]),  # type:counted's weights
    ],
)
def test_partition_balanced_deepspeed_boundaries(weights, parts, expected):
    assert partition_balanced(weights, parts) == expected


# -- one process: the plain model, virtual stages, checkpointing, tuples, errors -----------------------------------


def _grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_build_sequential_is_the_one_stage_model():
    plain = PipelineModule.build_sequential(make_layers(), seed_layers=True)
    one = PipelineModule(make_layers(), num_stages=1, seed_layers=True)
    keys = ["tied_modules.emb.weight", "1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"]
    assert list(plain.state_dict()) == keys + ["6.weight", "6.bias"]
    assert plain.state_dict().keys() == one.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, one.state_dict()[k]), k
    # seed_layers: layer i is built right after manual_seed(1234 + i)
    torch.manual_seed(1234 + 5)
    assert torch.equal(plain.state_dict()["5.weight"], nn.Linear(D, D).weight)
    assert plain.partitions() == [0, 8] and plain.num_stages == 1 and plain.stage_id == 0
    assert plain.is_first_stage() and plain.is_last_stage() and len(plain.chunks) == 1
    x = torch.randn(4, D)
    emb, layer = plain.tied_modules.emb, plain.get_submodule
    h = torch.tanh(layer("3")(nn.functional.gelu(layer("1")(x @ emb.weight.T))))
    by_hand = layer("6")(layer("5")(h)) @ emb.weight  # the tied module's second use: forward_fn
    torch.testing.assert_close(plain(x), by_hand, rtol=1e-6, atol=1e-6)


def test_virtual_stages_on_one_rank_chain_to_the_plain_model():
    plain = PipelineModule.build_sequential(make_layers(), seed_layers=True)
    model = PipelineModule(make_layers(), num_stages=1, virtual_stages=4, partition_method="uniform", seed_layers=True)
    assert model.partitions() == [0, 2, 4, 6, 8]
    assert [(c.index, c.part, c.start, c.stop) for c in model.chunks] == [(i, i, 2 * i, 2 * i + 2) for i in range(4)]
    assert [model.part_owner(i) for i in range(8)] == [(0, i // 2) for i in range(8)]
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert all(len(c.state_dict()) == 0 and not list(c.children()) for c in model.chunks)  # no duplicate keys
    assert sorted(n for c in model.chunks for n, _ in c.named_parameters()) == sorted(
        ["tied_modules.emb.weight"] * 2 + [n for n in plain.state_dict() if not n.startswith("tied")]
    )  # the tied module is in chunks 0 and 3
    x = torch.randn(5, D)
    y = x
    for chunk in model.chunks:
        y = chunk(y)
    loss_of(y).backward()
    loss_of(plain(x)).backward()
    assert torch.equal(y, plain(x))
    pg, mg = _grads(plain), _grads(model)
    assert pg.keys() == mg.keys()
    for k in pg:
        assert torch.equal(pg[k], mg[k]), k
    assert torch.equal(model(x), model.chunks[0](x))  # forward is chunk 0's


class Tagged(nn.Linear):
    """A Linear that counts its forward calls (a checkpointed one runs again in backward)."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


class Free(nn.Module):
    """No parameters: DeepSpeed's default rule does not checkpoint a block of these."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return torch.sin(x)


def _ckpt_layers():
    return [LayerSpec(Tagged, D, D), LayerSpec(Free), LayerSpec(Tagged, D, D), LayerSpec(Free), LayerSpec(Tagged, D, D)]


def _run(interval, checkpointable=None, dropout=False):
    layers = _ckpt_layers() + ([nn.Dropout(0.5)] if dropout else [])
    model = PipelineModule.build_sequential(
        layers, seed_layers=True, activation_checkpoint_interval=interval, checkpointable_layers=checkpointable
    )
    Tagged.calls = Free.calls = 0
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(7), requires_grad=True)
    torch.manual_seed(11)  # dropout's mask: the recompute must replay it
    out = model(x)
    loss_of(out).backward()
    return out.detach(), _grads(model), x.grad, (Tagged.calls, Free.calls)


@pytest.mark.parametrize("interval", [1, 2, 3, 5, 9])
def test_activation_checkpointing_gives_bit_equal_grads(interval):
    out0, g0, x0, calls0 = _run(0, dropout=True)
    out, g, xg, calls = _run(interval, dropout=True)
    assert calls0 == (3, 2)
    assert torch.equal(out, out0) and torch.equal(xg, x0)
    assert g.keys() == g0.keys()
    for k in g0:
        assert torch.equal(g[k], g0[k]), k
    # blocks with params are recomputed: each Tagged once more; a lone Free block (interval 1) is not
    assert calls == (6, 2 if interval == 1 else 4)


def test_checkpointable_layers_rule():
    # only blocks made entirely of listed classes are checkpointed (DeepSpeed's rule)
    *_, calls = _run(1, checkpointable=["Free"])
    assert calls == (3, 4)
    *_, calls = _run(2, checkpointable=["Free", "Tagged"])
    assert calls == (6, 4)
    *_, calls = _run(2, checkpointable=["Tagged"])  # blocks (T, F), (T, F), (T): only the last
    assert calls == (4, 2)
    model = PipelineModule.build_sequential(_ckpt_layers(), activation_checkpoint_interval=0)
    model.set_checkpoint_interval(1)
    assert model.activation_checkpoint_interval == 1
    with pytest.raises(ValueError, match="interval must be an integer >= 0"):
        model.set_checkpoint_interval(-1)


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x), x * 2


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, xs):
        a, b = xs
        return self.lin(a) * b


@pytest.mark.parametrize("interval", [0, 1, 2])
def test_tuples_pass_between_layers(interval):
    model = PipelineModule.build_sequential(
        [LayerSpec(Split), LayerSpec(Join), LayerSpec(Split)], seed_layers=True, activation_checkpoint_interval=interval
    )
    x = torch.randn(4, D, requires_grad=True)
    out = model(x)
    assert isinstance(out, tuple) and len(out) == 2
    s0, j, s2 = (model.get_submodule(str(i)) for i in range(3))
    a = j.lin(s0.lin(x)) * (x * 2)
    ref = (s2.lin(a), a * 2)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    (out[0].sum() + out[1].pow(2).sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


class MetaUnsafe(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.w.sum().item()  # cannot run on the meta device


def test_bad_input_raises_clear_errors():
    layers = make_layers()
    with pytest.raises(TypeError, match="nn.Module subclass"):
        LayerSpec(torch.tanh)
    with pytest.raises(TypeError, match=r"layers\[1\] = 3"):
        PipelineModule.build_sequential([torch.tanh, 3])
    with pytest.raises(ValueError, match="give num_stages or topology"):
        PipelineModule(layers)
    with pytest.raises(ValueError, match="virtual_stages must be an integer >= 1"):
        PipelineModule(layers, num_stages=1, virtual_stages=0)
    with pytest.raises(ValueError, match="activation_checkpoint_interval must be an integer >= 0"):
        PipelineModule(layers, num_stages=1, activation_checkpoint_interval=-2)
    with pytest.raises(TypeError, match="checkpointable_layers must be a list"):
        PipelineModule(layers, num_stages=1, checkpointable_layers="Counted")
    with pytest.raises(TypeError, match="leave out 'num_stages'"):
        PipelineModule.build_sequential(layers, num_stages=2)
    with pytest.raises(ValueError, match="8 layers cannot fill 1 stages x 9 virtual stages = 9 parts"):
        PipelineModule(layers, num_stages=1, virtual_stages=9)
    with pytest.raises(ValueError, match=r"leaves part\(s\) \[1\] without layers"):
        PipelineModule(layers, num_stages=1, virtual_stages=3, partition_method=[0, 3, 3, 8])
    with pytest.raises(ValueError, match="give 4 boundaries from 0 to 8"):
        PipelineModule(layers, num_stages=1, virtual_stages=3, partition_method=[0, 3, 7])
    with pytest.raises(ValueError, match="is not one of 'parameters', 'uniform', 'type:REGEX'"):
        PipelineModule(layers, num_stages=1, partition_method="profile")
    with pytest.raises(ValueError, match="matches 0 of the 8 layers"):
        PipelineModule(layers, num_stages=1, partition_method="type:Embedding")
    with pytest.raises(ValueError, match="meta device.*use partition_method='uniform'"):
        PipelineModule.build_sequential([LayerSpec(MetaUnsafe)])
    assert PipelineModule.build_sequential([LayerSpec(MetaUnsafe)], partition_method="uniform").partitions() == [0, 1]
    with pytest.raises(ValueError, match="give every spec of a key the same class and tied_weight_attr"):
        PipelineModule.build_sequential([TiedLayerSpec("e", nn.Linear, 2, 2), TiedLayerSpec("e", nn.Bilinear, 2, 2, 2)])
    with pytest.raises(ValueError, match="'scale' is not an attribute of its Linear"):
        PipelineModule.build_sequential([TiedLayerSpec("e", nn.Linear, 2, 2, tied_weight_attr="scale")])
    with pytest.raises(ValueError, match="key 'a.b'"):
        TiedLayerSpec("a.b", nn.Linear, 2, 2)
    with pytest.raises(ValueError, match=r"layer index 8 is outside 0..7"):
        PipelineModule.build_sequential(layers).stage_owner(8)


def test_parameters_partition_builds_specs_on_meta_only():
    BUILT.clear()
    PipelineModule(make_layers(), num_stages=1, partition_method="parameters")
    # counting builds every Counted on meta; the (only) stage then builds each for real once, the tied one
    # at its first use (layer 0) only
    assert sorted(t for t, dev in BUILT if dev == "meta") == sorted(OWNED_TAGS)
    assert sorted(t for t, dev in BUILT if dev == "cpu") == sorted(OWNED_TAGS - {7})


# -- distributed: 2 and 4 Gloo ranks ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("pipe_module") / "w2"
    run_ranks(WORKER, 2, [prefix])
    return [torch.load(f"{prefix}.rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("pipe_module") / "w4"
    run_ranks(WORKER, 4, [prefix])
    return [torch.load(f"{prefix}.rank{r}.pt", weights_only=False) for r in range(4)]


def _plain_run(data: int):
    """The unpipelined model's output and grads on replica `data`'s batch."""
    plain = PipelineModule.build_sequential(make_layers(), seed_layers=True)
    out = plain(inputs(data))
    loss_of(out).backward()
    return plain, out.detach(), _grads(plain)


def _check_layout(seen: list[dict], parts: list[int], p: int, v: int) -> None:
    """Every rank's view of one layout against the plain model and the partition."""
    owner = {i: (k % p, k // p) for k in range(p * v) for i in range(parts[k], parts[k + 1])}
    plain = {d: _plain_run(d) for d in {s["data"] for s in seen}}
    union: dict = {}
    for s in seen:
        stage = s["stage"]
        assert s["parts"] == parts
        assert s["owners"] == [owner[i] for i in range(8)]
        assert s["stage_owners"] == [owner[i][0] for i in range(8)]
        assert s["first_last"] == (stage == 0, stage == p - 1)
        mine = [i for i in range(8) if owner[i][0] == stage]
        assert s["chunk_ranges"] == [(stage + c * p, parts[stage + c * p], parts[stage + c * p + 1]) for c in range(v)]
        # only the owned Counted layers are built for real (a tied one is built once per stage holding it)
        assert sorted(t for t, dev in s["built"] if dev == "cpu") == [i for i in mine if i in OWNED_TAGS]
        names = {f"{i}.{w}" for i in mine if i in OWNED_TAGS - {0, 7} for w in ("weight", "bias")}
        names |= {"tied_modules.emb.weight"} if {0, 7} & set(mine) else set()
        assert set(s["state"]) == names
        model, out, grads = plain[s["data"]]
        ref_state = model.state_dict()
        for k, val in s["state"].items():
            assert torch.equal(val, ref_state[k]), k
            union.setdefault(k, val)
        assert s["grads"].keys() == s["state"].keys()
        for k, g in s["grads"].items():  # tied: the sum of both uses, as in the plain model
            torch.testing.assert_close(g, grads[k], rtol=1e-6, atol=1e-7, msg=k)
        if stage == p - 1:
            assert torch.equal(s["out"], out)
        else:
            assert s["out"] is None
        holders = sorted({owner[0][0], owner[7][0]})
        if len(holders) > 1 and stage in holders:  # the ranks are checked per layout
            assert s["tied"].keys() == {"emb"} and s["tied"]["emb"][0] == ["tied_modules.emb.weight"]
            assert s["replicated"]["tied_modules.emb.weight"] == (stage != holders[0])
        else:
            assert s["tied"] == {}
    assert union.keys() == ref_state.keys()  # the stages together hold the whole model


def test_two_stages(ranks2):
    _check_layout([r["p2"] for r in ranks2], [0, 5, 8], p=2, v=1)
    assert [r["p2"]["tied"]["emb"][1] for r in ranks2] == [[0, 1], [0, 1]]
    # "parameters" counted every Counted on the meta device, on every rank
    assert all(sorted(t for t, dev in r["p2"]["built"] if dev == "meta") == sorted(OWNED_TAGS) for r in ranks2)


def test_two_stages_two_virtual(ranks2):
    _check_layout([r["p2v2"] for r in ranks2], [0, 2, 4, 6, 8], p=2, v=2)
    assert all(not any(dev == "meta" for _, dev in r["p2v2"]["built"]) for r in ranks2)  # uniform counts nothing


def test_activation_checkpointing_across_stages_is_bit_equal(ranks2):
    for r in ranks2:
        a, b = r["p2"]["grads"], r["p2_ckpt"]["grads"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert r["p2"]["out"] is None or torch.equal(r["p2"]["out"], r["p2_ckpt"]["out"])


def test_tied_weights_identical_after_construction(ranks2):
    a, b = (r["tied_sync"]["emb.weight"] for r in ranks2)
    torch.manual_seed(100)  # rank 0's generator: the lowest stage's copy is the one broadcast
    assert torch.equal(a, Counted(0, D, D, bias=False).weight.detach()) and torch.equal(a, b)


ERRORS = [
    "8 layers cannot fill",
    r"leaves part\(s\) \[1\] without layers",
    "give 3 boundaries from 0 to 8",
    "'bogus' is not one of",
    "'type:Gelu' matches 1 of the 8 layers, fewer than",
    "have no 'pipe' axis",
    "tensor x data x pipe = .* but the world size is",
    "pipe = 3 does not divide the world size",
    "num_stages=1 but the topology's pipe axis has 2",
]


@pytest.mark.parametrize("world", [2, 4])
def test_errors_on_every_rank(world, ranks2, ranks4):
    import re

    for r in ranks2 if world == 2 else ranks4:
        assert len(r["errors"]) == len(ERRORS)
        for (case, kind, msg), pattern in zip(r["errors"], ERRORS):
            assert kind == "ValueError" and re.search(pattern, msg), (case, msg)


def test_pipe_by_data(ranks4):
    seen = [r["p2d2"] for r in ranks4]  # DeepSpeed's PipeDataParallelTopology: rank = 2 * pipe + data
    assert [(s["stage"], s["data"]) for s in seen] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check_layout(seen, [0, 5, 8], p=2, v=1)
    assert [s["tied"]["emb"][1] for s in seen] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # one group per data replica


def test_four_stages_two_virtual(ranks4):
    seen = [r["p4v2"] for r in ranks4]
    _check_layout(seen, list(range(9)), p=4, v=2)
    assert [s["tied"].get("emb", (None, None))[1] for s in seen] == [[0, 3], None, None, [0, 3]]


def test_pipe_by_tensor(ranks4):
    seen = [r["p2t2"] for r in ranks4]  # Topology(tensor=2, pipe=2): rank = 2 * pipe + tensor
    assert [s["stage"] for s in seen] == [0, 0, 1, 1]
    _check_layout(seen, [0, 4, 8], p=2, v=1)
    assert [s["tied"]["emb"][1] for s in seen] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # one group per tensor rank


def test_its_topology_is_current_while_layers_are_built_and_the_previous_one_after():
    from fastzero.parallel import Topology, current, set_current

    seen = []

    class Sees(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            seen.append(current())
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return self.lin(x)

    before = current()
    mine = Topology(pipe=1)
    other = object()
    set_current(other)
    try:
        model = PipelineModule([LayerSpec(Sees), LayerSpec(Sees)], topology=mine, partition_method="uniform")
        assert seen == [model.topology, model.topology] and current() is other
    finally:
        set_current(before)
