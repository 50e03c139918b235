"""The tensor-parallel benchmark (python -m bench.run --kernel tp): a tiny
GPT-2 runs through the real 2-process job (fastzero AutoTP and PyTorch's
parallelize_module, both checked against the unsharded model's losses
first) and yields well-formed rows: the split layers at 1/tp per rank, the
collectives at Megatron's formula; a missing DeepSpeed is a skipped row
with its reason; only the same-run ratio is gated."""

import importlib.util
import json

import pytest

from bench import compare, kernels, run, tp_worker
from bench.kernels import tp

pytest.importorskip("transformers")


def test_listed_but_not_in_all(capsys):
    assert run.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "\ntp: " in out and "gpt2-h768-L2-s128-v50257" in out and "providers: fastzero, torch_tp, deepspeed" in out
    assert kernels.load("tp").in_all is False  # a 2-process job: CI's quick gate leaves it out, as zero's


def test_megatron_formula():
    assert tp.megatron_bytes(layers=2, micro=2, seq=128, hidden=768) == 4 * 2 * 2 * 128 * 768 * 4


@pytest.fixture
def no_deepspeed(tmp_path, monkeypatch):
    fake = tmp_path / "fake" / "deepspeed"  # a deepspeed that fails to import, ahead of any real one
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed here')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))


def test_quick_run_rows_report_and_a_missing_peer(tmp_path, no_deepspeed):
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    args = ["--kernel", "tp", "--quick", *"--sizes 64 --repeats 2 --warmup 1".split(), "--json", str(js)]
    assert run.main([*args, "--report", str(md)]) == 0
    res = json.loads(js.read_text())
    (case,) = res["cases"]
    assert case["name"] == "gpt2-h64-L1-s32-v1024"
    assert set(case["skipped"]) == {"deepspeed"} and "not installed here" in case["skipped"]["deepspeed"]
    got = {(r["provider"], r["metric"]): r["value"] for r in res["rows"]}
    assert {p for p, _ in got} == {"fastzero", "torch_tp"}
    h, s, b, v = 64, 32, 2, 1024
    # one layer unsharded: c_attn 3h x h + 3h, c_proj h x h + h, c_fc 4h x h + 4h, mlp.c_proj h x 4h + h (fp32)
    layer = 4 * (12 * h * h + 9 * h)
    per_rank = 4 * (6 * h * h + 1.5 * h + h + 2 * h + h)  # the column layers' biases split, the row layers' whole
    whole = 4 * (v * h + s * h + 3 * 2 * h)  # embeddings (the LM head tied), the block's 2 LayerNorms and ln_f
    for prov in ("fastzero", "torch_tp"):
        assert got[(prov, "median_ms")] > 0 and got[(prov, "timed_steps")] == 2
        assert got[(prov, "unsharded_split_layer_bytes")] == layer
        assert got[(prov, "split_layer_bytes")] == per_rank
        assert got[(prov, "split_layers_of_1_over_tp")] == pytest.approx(2 * per_rank / layer)
        assert got[(prov, "split_target_met")] == 1.0
        # fp32 AdamW: params, grads, exp_avg, exp_avg_sq of this rank's params
        assert got[(prov, "model_state_bytes")] == pytest.approx(4 * (per_rank + whole), rel=0.01)
        assert got[(prov, "megatron_bytes")] == 4 * b * s * h * 4
        assert got[(prov, "allreduce_bytes")] == got[(prov, "comm_bytes")]  # no other collective
    # the activations' 4 all-reduces; fastzero one more of 2 fp64 scalars (the grad norm over the tensor group)
    assert got[("torch_tp", "comm_bytes")] == 4 * b * s * h * 4 and got[("torch_tp", "collectives")] == 4
    assert got[("fastzero", "comm_bytes")] == 4 * b * s * h * 4 + 16 and got[("fastzero", "collectives")] == 5
    assert got[("fastzero", "speedup_vs_torch_tp")] > 0
    gated = [r for r in res["rows"] if compare.gated(r)]
    assert [(r["provider"], r["metric"]) for r in gated] == [("fastzero", "speedup_vs_torch_tp")]
    text = md.read_text()
    assert "| fastzero |" in text and "| deepspeed | skipped: deepspeed not installed here" in text


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed (the peers extra)")
def test_deepspeed_autotp_rows(tmp_path, monkeypatch):
    """DeepSpeed's AutoTP (its partition_config on GPT-2 as nn.Linear) trains the unsharded model's losses, splits
    the same four projections in half and all-reduces what Megatron does."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    js = tmp_path / "r.json"
    args = "--kernel tp --quick --sizes 64 --repeats 2 --warmup 1 --skip fastzero --skip torch_tp --json".split()
    assert run.main([*args, str(js)]) == 0
    res = json.loads(js.read_text())
    (case,) = res["cases"]
    assert case["skipped"] == {}
    got = {r["metric"]: r["value"] for r in res["rows"] if r["provider"] == "deepspeed"}
    h, s, b, v = 64, 32, 2, 1024
    per_rank = 4 * (6 * h * h + 1.5 * h + h + 2 * h + h)
    whole = 4 * (v * h + s * h + 3 * 2 * h)
    assert got["split_layer_bytes"] == per_rank and got["split_target_met"] == 1.0
    # params, exp_avg, exp_avg_sq (and AdamW's step scalars): DeepSpeed drops its grads after the step
    assert got["model_state_bytes"] == pytest.approx(3 * (per_rank + whole), rel=0.01)
    assert got["comm_bytes"] == 4 * b * s * h * 4 and got["collectives"] == 4  # its flat-grad all-reduce: 1 rank


def test_a_wrong_loss_fails_before_timing():
    with pytest.raises(AssertionError, match="torch_tp rank 1 step 1: loss 2.5.*does not train the same function"):
        tp_worker.check_losses("torch_tp", [[3.0, 2.0], [3.0, 2.5]], [3.0, 2.0])
    tp_worker.check_losses("torch_tp", [[3.0, 2.0 + 1e-6]], [3.0, 2.0])  # rounding passes


def test_qkv_rows_give_each_rank_its_heads_of_q_k_v():
    got = tp_worker.qkv_rows(hidden=8, tp=2).tolist()
    assert got == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_conv1d_as_linear_computes_the_same():
    import torch
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(24, 8)
    torch.nn.init.normal_(conv.bias)
    x = torch.randn(3, 5, 8)
    rows = tp_worker.qkv_rows(hidden=8, tp=2)
    torch.testing.assert_close(tp_worker.to_linear(conv)(x), conv(x))
    torch.testing.assert_close(tp_worker.to_linear(conv, rows)(x), conv(x)[..., rows])
