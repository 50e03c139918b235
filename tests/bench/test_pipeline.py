"""The pipeline benchmark (python -m bench.run --kernel pipeline): the quick
job really runs on 4 Gloo ranks at pipe=4 and pipe=2 x data=2, every
provider's first-step loss checked against the single-process model before
timing, and yields well-formed rows (ms/step, measured and simulated
bubble, peak saved activations per stage); a missing DeepSpeed is a skipped
row with its reason; nothing is gated; no timing asserts."""

import json

import pytest
import torch

from bench import compare, kernels, pipeline_worker, run
from bench.kernels import pipeline

OURS = ("fastzero-1f1b", "fastzero-interleaved", "fastzero-zb-h1")
TORCH = ("torch-gpipe", "torch-1f1b", "torch-interleaved", "torch-zb")


def test_listed_but_not_in_all(capsys):
    assert run.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "\npipeline: " in out
    for name in ("pipe4-m4-h128", "pipe4-m16-h128", "pipe2xdata2-m8-h128"):
        assert name in out
    assert "providers: " + ", ".join(pipeline.PROVIDERS) in out
    assert kernels.load("pipeline").in_all is False


@pytest.fixture
def no_deepspeed(tmp_path, monkeypatch):
    fake = tmp_path / "fake" / "deepspeed"  # a deepspeed that fails to import, ahead of any real one
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed here')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))


def test_quick_run_rows_checks_and_a_missing_peer(tmp_path, no_deepspeed):
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    args = ["--kernel", "pipeline", "--quick", *"--repeats 2 --warmup 0".split(), "--json", str(js)]
    assert run.main([*args, "--report", str(md)]) == 0  # a provider whose first loss is wrong fails the job
    res = json.loads(js.read_text())
    assert [c["name"] for c in res["cases"]] == ["pipe4-m4-h32", "pipe2xdata2-m4-h32"]
    for case in res["cases"]:
        assert set(case["skipped"]) == {"deepspeed-1f1b"} and "not installed here" in case["skipped"]["deepspeed-1f1b"]
    assert not [r for r in res["rows"] if compare.gated(r)]
    for case, stages in (("pipe4-m4-h32", 4), ("pipe2xdata2-m4-h32", 2)):
        got = {(r["provider"], r["metric"]): r["value"] for r in res["rows"] if r["case"] == case}
        assert {p for p, _ in got} == set(OURS + TORCH)
        for prov in OURS + TORCH:
            assert got[(prov, "median_ms")] > 0 and got[(prov, "timed_steps")] == 2
            assert 0 <= got[(prov, "bubble_mean")] <= got[(prov, "bubble_max")] < 1
            peaks = [got[(prov, f"peak_act_bytes_stage{s}")] for s in range(stages)]
            assert all(p > 0 for p in peaks), (prov, peaks)
            assert (prov, f"peak_act_bytes_stage{stages}") not in got
        want = {"1f1b": 3 / 7 if stages == 4 else 1 / 5}  # (p - 1) / (m + p - 1) at m = 4
        assert got[("fastzero-1f1b", "bubble_theory")] == pytest.approx(want["1f1b"])
        assert got[("torch-gpipe", "bubble_theory")] == pytest.approx(want["1f1b"])
        assert got[("fastzero-zb-h1", "bubble_theory")] < got[("fastzero-1f1b", "bubble_theory")]
        assert got[("fastzero-interleaved", "bubble_theory")] < got[("fastzero-1f1b", "bubble_theory")]
        assert ("torch-zb", "bubble_theory") not in got
        for prov in OURS:
            assert got[(prov, "speedup_vs_faster_peer")] > 0
            assert got[(prov, "speed_target_met")] in (0.0, 1.0)
    text = md.read_text()
    assert "| fastzero-zb-h1 |" in text and "| deepspeed-1f1b | skipped: deepspeed not importable here" in text
    assert "Targets: 1f1b speed " in text


def test_a_wrong_first_loss_fails_before_timing():
    with pytest.raises(AssertionError, match="torch-1f1b rank 3: first-step loss 2.5.*not compute the same function"):
        pipeline_worker.check_loss("torch-1f1b", [None, None, 2.0, 2.5], 2.0)
    with pytest.raises(AssertionError, match="no rank returned a loss"):
        pipeline_worker.check_loss("torch-1f1b", [None, None], 2.0)
    pipeline_worker.check_loss("torch-1f1b", [None, 2.0 + 1e-6], 2.0)  # rounding passes


def test_saved_bytes_counts_activations_once_and_not_params():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    with pipeline_worker.SavedBytes(lin.parameters()) as saved:
        y = lin(x)  # saves x (the weight, a param, left out)
        z = torch.tanh(y)  # saves its output z
        w = z * z  # saves z twice: counted once
    assert saved.peak == saved.now == 2 * 8 * 64 * 4
    w.sum().backward()
    del y, z, w
    assert saved.now == 0 and saved.peak == 2 * 8 * 64 * 4


def test_every_framework_builds_the_same_layers():
    spec = dict(pipeline.QUICK, data=1, m=2)
    a = [cls(*args) for cls, args in pipeline_worker.layers(spec)]
    b = [cls(*args) for cls, args in pipeline_worker.layers(spec)]
    for la, lb in zip(a, b):
        for (n, pa), pb in zip(la.named_parameters(), lb.parameters()):
            torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=n)
    assert not torch.equal(a[1].qkv.weight, a[2].qkv.weight)  # seeded by index: blocks differ
    assert pipeline_worker.bounds(spec, 8) == list(range(9))
