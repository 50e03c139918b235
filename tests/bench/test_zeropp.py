"""The ZeRO++ benchmark (python -m bench.run --kernel zeropp): its
end-to-end case runs through the real 4-process jobs (2 simulated nodes)
and yields well-formed rows with the bytes of each variant; all three
parts cut the bytes across nodes by the issue's target; the quant kernel
cases are listed with it."""

from bench import kernels, run
from bench.family import Settings
from bench.kernels import zeropp


def test_listed_with_the_quant_cases_and_not_in_all(capsys):
    assert run.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "\nzeropp: " in out and "providers: fastzero, deepspeed" in out
    family = kernels.load("zeropp")
    assert family.in_all is False
    names = [c.name for c in family.cases(quick=True)]
    assert "gpt-h64" in names and any(n.startswith("quantize-int8") for n in names)


def test_quick_end_to_end_rows(tmp_path):
    """The baseline and all three (the single parts' bytes are tests/runtime/test_zeropp.py's)."""
    case = next(c for c in zeropp.cases(quick=True) if c.kernel == "zeropp")
    skip = ("deepspeed", "fastzero-qwz", "fastzero-qgz", "fastzero-hpz")
    rows, skipped = zeropp.measure(case, Settings(warmup=1, repeats=2, quick=True, skip=skip), print)
    assert skipped == {}
    got = {(r["provider"], r["metric"]): r["value"] for r in rows}
    parts = ["fastzero-base", "fastzero-all"]
    assert {p for p, _ in got} == set(parts)
    for p in parts:
        assert got[(p, "median_ms")] > 0 and got[(p, "wire_bytes")] > 0 and got[(p, "model_ms_10gbps")] > 0
        assert got[(p, "model_state_bytes")] > 0 and got[(p, "collectives")] > 0
    # fp32 here: the int8 forward gathers about 1/4 of fp32's bytes, backward's inside the node; int4 gradients 1/8
    assert got[("fastzero-all", "cross_param_bytes")] < 0.27 * got[("fastzero-base", "cross_param_bytes")]
    assert got[("fastzero-all", "wire_grad_bytes")] < 0.14 * got[("fastzero-base", "wire_grad_bytes")]
    assert got[("fastzero-all", "cross_bytes_vs_base")] >= zeropp.TARGET
    assert got[("fastzero-all", "model_ms_100gbps")] < got[("fastzero-base", "model_ms_100gbps")] / zeropp.TARGET
    assert all(r["gated"] is False for r in rows)
    by = {p: {m: v for (q, m), v in got.items() if q == p} for p in parts}
    lines = zeropp.table({"kernel": "zeropp", "skipped": {"deepspeed-qwz": "why"}}, by)
    assert any(line.startswith("| fastzero-all |") for line in lines)
    assert "| deepspeed-qwz | skipped: why |" in "\n".join(lines)
