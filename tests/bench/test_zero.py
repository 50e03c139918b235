"""The ZeRO training benchmarks (python -m bench.run --kernel zero, zero3,
offload): a tiny model runs through the real 2-process jobs and yields
well-formed rows, a peer that cannot import is skipped with its reason, and
only the same-run ratio each family marks is gated."""

import json

import pytest

from bench import compare, kernels, run
from bench.kernels import zero


def test_listed_but_not_in_all(capsys):
    assert run.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "mlp4x1024" in out and "\nzero3: " in out and "\noffload: " in out
    for name in ("zero", "zero3", "offload"):
        assert kernels.load(name).in_all is False  # --all (CI's quick gate) leaves them out; the description says why
    assert kernels.load("zero3").name == "zero3" and kernels.load("offload").cases(quick=True)[0].kernel == "offload"


@pytest.fixture
def no_deepspeed(tmp_path, monkeypatch):
    fake = tmp_path / "fake" / "deepspeed"  # a deepspeed that fails to import, ahead of the real one
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed here')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))


def _run(tmp_path, kernel: str, *more: str) -> tuple[dict, dict, str]:
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    args = ["--kernel", kernel, *"--sizes 32 --repeats 2 --warmup 1".split(), *more, "--json", str(js)]
    args += ["--report", str(md)]
    assert run.main(args) == 0
    res = json.loads(js.read_text())
    (case,) = res["cases"]
    assert case["kernel"] == kernel and case["name"] == "mlp4x32" and case["numel"] == zero.params(32)
    got = {(r["provider"], r["metric"]): r["value"] for r in res["rows"]}
    for prov in {p for p, _ in got}:
        assert got[(prov, "median_ms")] > 0 and got[(prov, "samples_per_s")] > 0
        assert got[(prov, "model_state_bytes")] > 0 and got[(prov, "timed_steps")] == 2 * zero.STEPS_PER_REPEAT
    return res, got, md.read_text()


def test_tiny_run_rows_report_and_a_missing_peer(tmp_path, no_deepspeed):
    skip = ("fsdp2", "fastzero-s0", "fastzero-s1", "fastzero-s1-zeropp")
    res, got, text = _run(tmp_path, "zero", *(a for name in skip for a in ("--skip", name)))
    (case,) = res["cases"]
    assert set(case["skipped"]) == {"deepspeed-s1", "deepspeed-s2"}
    assert "not installed here" in case["skipped"]["deepspeed-s1"]
    assert {p for p, _ in got} == {"fastzero-s2", "fastzero-s2-zeropp", "ddp"}
    assert ("fastzero-s2-zeropp", "speedup_vs_ddp") in got and ("fastzero-s2-zeropp", "allgather_ms") in got
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
    assert "| fastzero-s2 |" in text and "| deepspeed-s1 | skipped: deepspeed not importable" in text


def _rows(s2_ms: float, ddp_ms: float = 10.0) -> dict:
    case = zero.ZERO.cases(sizes=[32])[0]
    res = lambda ms, **more: {"times": [ms / 1e3] * 3, "model_state_bytes": 1, **more}
    fz = res(s2_ms, grad_bucket_bytes=0, extra=dict(hidden_frac=0.5, step_ms=1.0, kernel_ms=0.5, allgather_ms=0.4))
    return {"rows": zero.ZERO_JOBS.rows(case, {"fastzero-s2": fz, "ddp": res(ddp_ms)})}


def test_gate_on_the_same_run_ratio():
    base = _rows(8.0)
    checks = compare.compare(_rows(8.0 * 1.25), base)  # fastzero 25% slower than it was, relative to DDP
    assert [c.metric for c in checks] == ["speedup_vs_fastest_torch"]
    assert compare.regressions(checks, compare.DEFAULT_TOLERANCE)
    both_slower = compare.compare(_rows(8.0 * 1.25, 10.0 * 1.25), base)  # a slower machine: no verdict
    assert not compare.regressions(both_slower, compare.DEFAULT_TOLERANCE)


def test_zero3_tiny_run(tmp_path, no_deepspeed):
    res, got, text = _run(tmp_path, "zero3")
    assert set(res["cases"][0]["skipped"]) == {"deepspeed-s3"}
    assert {p for p, _ in got} == {"fastzero-s3", "fastzero-s3-noprefetch", "fsdp2-reshard"}
    psi, w = zero.params(32), 32
    for prov in ("fastzero-s3", "fastzero-s3-noprefetch"):
        # 16 psi / 2 over the partitioned params' shards, the biases (under the threshold) whole on each rank
        assert got[(prov, "zero_formula_bytes")] == 8 * psi
        assert got[(prov, "persistent_bytes")] == zero.LAYERS * w * 4
        assert got[(prov, "of_zero_formula")] == pytest.approx(1.0, rel=0.05)
        assert 0 < got[(prov, "peak_gathered_bytes")] <= zero.LAYERS * w * w * 4  # never more than the weights
        assert got[(prov, "peak_rss_growth_bytes")] >= 0 and got[(prov, "kernel_ms")] > 0
        assert got[(prov, "speedup_vs_fastest_peer")] == pytest.approx(got[(prov, "speedup_vs_fsdp2-reshard")])
    assert got[("fsdp2-reshard", "model_state_bytes")] >= 8 * psi  # its shards of params, grads and Adam state
    gated = [r for r in res["rows"] if compare.gated(r)]
    assert [(r["provider"], r["metric"]) for r in gated] == [("fastzero-s3", "speedup_vs_fastest_peer")]
    assert "| fastzero-s3-noprefetch |" in text and "| deepspeed-s3 | skipped: deepspeed not importable" in text


def test_offload_tiny_run(tmp_path, no_deepspeed):
    res, got, text = _run(tmp_path, "offload", "--skip", "fsdp2")
    assert set(res["cases"][0]["skipped"]) == {"deepspeed-s2-offload", "deepspeed-s3-offload"}
    psi = zero.params(32)
    for prov in ("fastzero-s2-offload", "fastzero-s3-offload"):
        device, offloaded = got[(prov, "device_bytes")], got[(prov, "offloaded_bytes")]
        assert device + offloaded == got[(prov, "model_state_bytes")]
        # the CPU holds the fp32 master, exp_avg, exp_avg_sq and the grads' staging buffer of the rank's shard
        assert offloaded == pytest.approx(16 * psi / 2, rel=0.05)
        assert got[(prov, "staging_bytes")] == pytest.approx(4 * psi / 2, rel=0.05)
        assert got[(prov, "of_device_formula")] == pytest.approx(1.0, rel=0.05)
        assert 0 < got[(prov, "adam_in_step_ms")] <= got[(prov, "step_call_ms")]
        assert got[(prov, "kernel_gbps")] > 0 and got[(prov, "roofline_gbps")] > 0
        assert got[(prov, "kernel_of_roofline")] == pytest.approx(
            got[(prov, "kernel_gbps")] / got[(prov, "roofline_gbps")], rel=0.5
        )  # a median of per-round ratios, not the ratio of medians
    # the state formats: the CPU holds their master, states (4 and 2 bytes an element) and staging
    for prov, per_element in (("fastzero-s2-offload-bf16", 4 + 4 + 4), ("fastzero-s2-offload-int8", 4 + 2 + 4)):
        assert got[(prov, "offloaded_bytes")] == pytest.approx(per_element * psi / 2, rel=0.05)
    assert got[("fastzero-s2-offload", "device_formula_bytes")] == 4 * psi + 4 * psi / 2
    assert got[("fastzero-s3-offload", "device_formula_bytes")] == 8 * psi / 2
    assert not [r for r in res["rows"] if compare.gated(r)]  # no peer ran: nothing to compare with
    assert "| deepspeed-s2-offload | skipped: deepspeed not importable" in text


def _family_rows(jobs, ms: dict[str, float]) -> dict:
    case = jobs.cases(sizes=[32])[0]
    extra = dict(hidden_frac=0.5, step_ms=1.0, kernel_ms=0.5, allgather_ms=0.0, adam_in_step_ms=0.4)
    extra.update(roofline_ms=0.5, kernel_gbps=1.0, roofline_gbps=1.0, kernel_of_roofline=1.0)
    res = lambda t: {"times": [t / 1e3] * 3, "model_state_bytes": 2, "peak_rss_growth_bytes": 1}
    fz_bytes = dict(grad_bucket_bytes=0, persistent_bytes=0, peak_gathered_bytes=1, offloaded_bytes=1)
    fz = lambda t: dict(res(t), **fz_bytes, staging_bytes=0, extra=extra)
    return {"rows": jobs.rows(case, {n: (fz if n.startswith("fastzero") else res)(t) for n, t in ms.items()})}


def test_zero3_and_offload_compare_with_the_faster_peer_of_their_stage():
    got = lambda rows: {(r["provider"], r["metric"]): r["value"] for r in rows["rows"]}
    z3 = got(_family_rows(zero.ZERO3_JOBS, {"fastzero-s3": 8.0, "fsdp2-reshard": 10.0, "deepspeed-s3": 6.0}))
    assert z3[("fastzero-s3", "speedup_vs_fastest_peer")] == pytest.approx(6.0 / 8.0)
    off = got(
        _family_rows(
            zero.OFFLOAD_JOBS,
            {
                "fastzero-s2-offload": 5.0,
                "fastzero-s3-offload": 8.0,
                "fsdp2-offload": 10.0,
                "deepspeed-s2-offload": 4.0,
                "deepspeed-s3-offload": 12.0,
            },
        )
    )
    assert off[("fastzero-s2-offload", "speedup_vs_fastest_peer")] == pytest.approx(4.0 / 5.0)  # DeepSpeed s2
    assert off[("fastzero-s3-offload", "speedup_vs_fastest_peer")] == pytest.approx(10.0 / 8.0)  # FSDP2, not s2
    base = _family_rows(zero.ZERO3_JOBS, {"fastzero-s3": 8.0, "fsdp2-reshard": 10.0})
    checks = compare.compare(_family_rows(zero.ZERO3_JOBS, {"fastzero-s3": 10.0, "fsdp2-reshard": 10.0}), base)
    assert [(c.provider, c.metric) for c in checks] == [("fastzero-s3", "speedup_vs_fastest_peer")]
    assert compare.regressions(checks, compare.DEFAULT_TOLERANCE)
