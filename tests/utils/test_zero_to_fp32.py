"""fastzero.utils.zero_to_fp32, DeepSpeed's helpers: a 2-step run at stages
2 and 3 (one process) with a tied head, a frozen layer and a buffer, saved;
each helper's result against ``consolidate``, sharding with its index,
safetensors, and a strict load into a fresh model."""

import json

import pytest
import torch

import fastzero
from fastzero.checkpoint import main as checkpoint_cli
from fastzero.runtime.checkpoint_io import CheckpointError, consolidate
from fastzero.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_safetensors_state_dict,
    load_state_dict_from_zero_checkpoint,
    parse_size,
)

safetensors = pytest.importorskip("safetensors.torch")


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(13, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 13, bias=False)
        self.head.weight = self.emb.weight  # tied: one param, two names
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, ids):
        h = self.emb(ids) * self.scale
        return self.head(torch.nn.functional.gelu(self.body(self.frozen(h))))


@pytest.fixture(scope="module", params=[2, 3])
def saved(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"stage{request.param}")
    model = Tied()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": request.param},
    }
    engine, *_ = fastzero.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 13, (4, 5), generator=gen)
        loss = torch.nn.functional.cross_entropy(engine(ids).reshape(-1, 13), ids.reshape(-1))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(root / "ckpt"), tag="step2")
    return root


def same(a: dict, b: dict):
    assert list(a) == list(b) or sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_get_fp32_state_dict_is_consolidate(saved):
    ref = consolidate(saved / "ckpt", "step2")
    sd = get_fp32_state_dict_from_zero_checkpoint(saved / "ckpt")  # tag from 'latest'
    same(sd, ref)
    assert sorted(sd) == sorted(Tied().state_dict())
    assert sd["head.weight"] is sd["emb.weight"]
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert not torch.equal(sd["body.weight"], Tied().body.weight)  # trained
    torch.testing.assert_close(sd["frozen.weight"], Tied().frozen.weight, rtol=0, atol=0)


def test_exclude_frozen_keeps_buffers(saved):
    sd = get_fp32_state_dict_from_zero_checkpoint(saved / "ckpt", exclude_frozen_parameters=True)
    assert sorted(sd) == sorted(set(Tied().state_dict()) - {"frozen.weight", "frozen.bias"})
    assert "scale" in sd


def test_exclude_frozen_refuses_a_checkpoint_that_cannot_tell(saved, monkeypatch):
    """A checkpoint from before extra.pt recorded the frozen names: refused, not guessed."""
    from fastzero.runtime import checkpoint_io

    read = checkpoint_io._read_extra
    monkeypatch.setattr(checkpoint_io, "_read_extra", lambda *a: {**read(*a), "frozen_params": None})
    with pytest.raises(CheckpointError, match="frozen params"):
        get_fp32_state_dict_from_zero_checkpoint(saved / "ckpt", exclude_frozen_parameters=True)
    assert "frozen.weight" in get_fp32_state_dict_from_zero_checkpoint(saved / "ckpt")


def test_load_into_a_fresh_model_strict(saved):
    model = load_state_dict_from_zero_checkpoint(Tied(), saved / "ckpt", tag="step2")
    same(model.state_dict(), consolidate(saved / "ckpt"))
    assert model.head.weight is model.emb.weight
    wrong = torch.nn.Sequential(torch.nn.Linear(8, 8))
    before = wrong[0].weight.detach().clone()
    with pytest.raises(CheckpointError, match="missing from the checkpoint .*0.weight"):
        load_state_dict_from_zero_checkpoint(wrong, saved / "ckpt")
    assert torch.equal(wrong[0].weight, before)  # left as it was


def test_torch_save_one_file_and_sharded(saved, tmp_path):
    ref = consolidate(saved / "ckpt")
    [one] = convert_zero_checkpoint_to_fp32_state_dict(saved / "ckpt", tmp_path / "one")
    assert one.name == "pytorch_model.bin"
    loaded = torch.load(one, weights_only=True)
    same(loaded, ref)
    assert loaded["head.weight"] is loaded["emb.weight"]  # still tied
    written = convert_zero_checkpoint_to_fp32_state_dict(saved / "ckpt", tmp_path / "sharded", max_shard_size=300)
    index = json.loads((tmp_path / "sharded" / "pytorch_model.bin.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) >= 3 and shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin"
    assert len(written) == len(shards) + 1
    back = {}
    for f in shards:
        back.update(torch.load(tmp_path / "sharded" / f, weights_only=True))
    same(back, ref)
    assert back["head.weight"] is back["emb.weight"]  # a tied group shares a shard
    unique = {id(t): t for t in ref.values()}.values()
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in unique)
    assert sorted(index["weight_map"]) == sorted(ref)


def test_safetensors_one_file_and_sharded(saved, tmp_path):
    ref = consolidate(saved / "ckpt")
    [one] = convert_zero_checkpoint_to_fp32_state_dict(saved / "ckpt", tmp_path / "one", safe_serialization=True)
    assert one.name == "model.safetensors"
    plain = safetensors.load_file(one)
    assert sorted(plain) == sorted(set(ref) - {"head.weight"})  # the alias is dropped, as Hugging Face does
    same(load_safetensors_state_dict(tmp_path / "one"), ref)
    fresh = Tied()
    missing, unexpected = fresh.load_state_dict(plain, strict=False)
    assert missing == ["head.weight"] and not unexpected
    same(fresh.state_dict(), ref)  # the model's own tie brings the head back

    convert_zero_checkpoint_to_fp32_state_dict(
        saved / "ckpt", tmp_path / "sharded", max_shard_size="0.3KB", safe_serialization=True
    )
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) >= 3 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["tied"] == {"head.weight": "emb.weight"}
    back = load_safetensors_state_dict(tmp_path / "sharded")
    same(back, ref)
    assert back["head.weight"] is back["emb.weight"]
    strict = load_state_dict_from_zero_checkpoint(Tied(), saved / "ckpt")
    fresh = Tied()
    fresh.load_state_dict(back, strict=True)
    same(fresh.state_dict(), strict.state_dict())


def test_a_file_path_is_one_file_and_the_cli(saved, tmp_path):
    ref = consolidate(saved / "ckpt")
    convert_zero_checkpoint_to_fp32_state_dict(
        saved / "ckpt", tmp_path / "w.safetensors", max_shard_size=10, safe_serialization=True
    )
    same(load_safetensors_state_dict(tmp_path / "w.safetensors"), ref)
    argv = ["consolidate", str(saved / "ckpt"), str(tmp_path / "cli"), "--safe_serialization", "--max_shard_size=300"]
    assert checkpoint_cli(argv) == 0
    same(load_safetensors_state_dict(tmp_path / "cli"), ref)
    assert (
        checkpoint_cli(["consolidate", str(saved / "ckpt"), str(tmp_path / "x.pt"), "--exclude_frozen_parameters"]) == 0
    )
    assert "frozen.weight" not in torch.load(tmp_path / "x.pt", weights_only=True)


@pytest.mark.parametrize("text, n", [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), (300, 300), ("1.5kb", 1500)])
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_parse_size_refuses_nonsense():
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("big")
