"""The benchmark cases of bf16 optimizer states (``--dtype bf16states``): they
run, check their first step against the reference to the bit, count 20 bytes
per param and report the fraction of the roofline and the same-round speedup
over the fp32-state step."""

import json

from bench import run


def test_bf16_state_cases_run_and_report_their_figures(tmp_path):
    js = tmp_path / "r.json"
    for kernel in ("cpu_adam", "fused_adam"):
        args = ["--kernel", kernel, "--sizes", "256K", "--dtype", "bf16states", "--repeats", "3", "--warmup", "1"]
        assert run.main([*args, "--json", str(js)]) == 0
        res = json.loads(js.read_text())
        cases = {c["name"]: c for c in res["cases"]}
        want = {"bf16states-256K", "offload-bf16-bf16states-256K"} if kernel == "cpu_adam" else {"fp32-bf16states-256K"}
        assert set(cases) == want
        assert all(c["bytes"] == 20 * c["numel"] for c in cases.values())
        figures = {(r["case"], r["provider"], r["metric"]) for r in res["rows"]}
        for case in want:
            assert (case, "fastzero", "frac_roofline") in figures
        if kernel == "cpu_adam":
            for case in want:
                assert (case, "fastzero", "speedup_vs_fastzero_fp32_states") in figures
