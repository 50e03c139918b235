"""The ZeRO training benchmark (python -m bench.run --kernel zero): a tiny
model runs through the real 2-process jobs and yields well-formed rows, a
peer that cannot import is skipped with its reason, and only the same-run
ratio it marks is gated."""

import json

import pytest

from bench import compare, kernels, run
from bench.kernels import zero


def test_listed_but_not_in_all(capsys):
    assert run.main(["--list"]) == 0
    assert "mlp4x1024" in capsys.readouterr().out
    assert kernels.load("zero").IN_ALL is False  # --all (CI's quick gate) leaves it out; DESCRIPTION says why


def test_tiny_run_rows_report_and_a_missing_peer(tmp_path, monkeypatch):
    fake = tmp_path / "fake" / "deepspeed"  # a deepspeed that fails to import, ahead of the real one
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed here')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    args = ["--kernel", "zero", "--sizes", "32", "--repeats", "2", "--warmup", "1", "--skip", "fsdp2",
            "--skip", "fastzero-s0", "--skip", "fastzero-s1", "--json", str(js), "--report", str(md)]  # fmt: skip
    assert run.main(args) == 0
    res = json.loads(js.read_text())
    (case,) = res["cases"]
    assert case["name"] == "mlp4x32" and case["numel"] == zero.params(32)
    assert set(case["skipped"]) == {"deepspeed-s1", "deepspeed-s2"}
    assert "not installed here" in case["skipped"]["deepspeed-s1"]
    got = {(r["provider"], r["metric"]): r["value"] for r in res["rows"]}
    assert {p for p, _ in got} == {"fastzero-s2", "ddp"}
    for prov in ("fastzero-s2", "ddp"):
        assert got[(prov, "median_ms")] > 0 and got[(prov, "samples_per_s")] > 0
        assert got[(prov, "model_state_bytes")] > 0
    psi = zero.params(32)
    assert got[("ddp", "model_state_bytes")] >= 16 * psi  # params, grads, exp_avg, exp_avg_sq, all replicated
    # stage 2 on 2 ranks: 4 psi + 12 psi / 2 (layout padding aside), bucket buffers shown apart
    assert got[("fastzero-s2", "of_zero_formula")] == pytest.approx(1.0, rel=0.05)
    assert got[("fastzero-s2", "grad_bucket_bytes")] > 0
    assert 0.0 <= got[("fastzero-s2", "grad_comm_hidden")] <= 1.0
    assert got[("fastzero-s2", "kernel_ms")] > 0 and got[("fastzero-s2", "allgather_ms")] > 0
    assert ("fastzero-s2", "speedup_vs_ddp") in got
    gated = [r for r in res["rows"] if compare.gated(r)]
    assert [(r["provider"], r["metric"]) for r in gated] == [("fastzero-s2", "speedup_vs_fastest_torch")]
    text = md.read_text()
    assert "| fastzero-s2 |" in text and "| deepspeed-s1 | skipped: deepspeed not importable" in text


def _rows(s2_ms: float, ddp_ms: float = 10.0) -> dict:
    case = zero.cases(sizes=[32])[0]
    res = lambda ms, **more: {"times": [ms / 1e3] * 3, "model_state_bytes": 1, **more}
    fz = res(s2_ms, grad_bucket_bytes=0, extra=dict(hidden_frac=0.5, step_ms=1.0, kernel_ms=0.5, allgather_ms=0.4))
    return {"rows": zero.rows(case, {"fastzero-s2": fz, "ddp": res(ddp_ms)})}


def test_gate_on_the_same_run_ratio():
    base = _rows(8.0)
    checks = compare.compare(_rows(8.0 * 1.25), base)  # fastzero 25% slower than it was, relative to DDP
    assert [c.metric for c in checks] == ["speedup_vs_fastest_torch"]
    assert compare.regressions(checks, compare.DEFAULT_TOLERANCE)
    both_slower = compare.compare(_rows(8.0 * 1.25, 10.0 * 1.25), base)  # a slower machine: no verdict
    assert not compare.regressions(both_slower, compare.DEFAULT_TOLERANCE)
