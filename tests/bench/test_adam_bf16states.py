"""The benchmark cases of low-bit optimizer states (``--dtype bf16states``,
``int8states``): they run, check their first step against the reference to
the bit, count their bytes per param (20; 16 and the int8 block scales) and
report the fraction of the roofline and the same-round speedup over the
fp32-state step; the peers with low-bit states run or say why not; the
convergence script trains every fastzero format."""

import json

import pytest
import torch

from bench import run, state_formats_convergence
from bench.kernels import cpu_adam
from bench.kernels.optim_common import OptimData

N = 256 * 1024
BYTES = {"bf16states": 20 * N, "int8states": 16 * N + 16 * (N // 256)}
PEERS = {"int8states": {"torchao_adamw8bit", "bnb_adamw8bit"}, "offload-bf16-bf16states": {"torchao_adamw_bf16sr"}}


@pytest.mark.parametrize("dtype", ["bf16states", "int8states"])
def test_low_bit_state_cases_run_and_report_their_figures(tmp_path, dtype):
    js = tmp_path / "r.json"
    for kernel in ("cpu_adam", "fused_adam"):
        args = ["--kernel", kernel, "--sizes", "256K", "--dtype", dtype, "--repeats", "3", "--warmup", "1"]
        assert run.main([*args, "--json", str(js)]) == 0
        res = json.loads(js.read_text())
        cases = {c["name"]: c for c in res["cases"]}
        want = {f"{dtype}-256K", f"offload-bf16-{dtype}-256K"} if kernel == "cpu_adam" else {f"fp32-{dtype}-256K"}
        assert set(cases) == want
        assert all(c["bytes"] == BYTES[dtype] for c in cases.values())
        figures = {(r["case"], r["provider"], r["metric"]) for r in res["rows"]}
        for case in want:
            assert (case, "fastzero", "frac_roofline") in figures
        if kernel == "cpu_adam":
            for case in want:
                assert (case, "fastzero", "speedup_vs_fastzero_fp32_states") in figures
                # DeepSpeed and the low-bit peers: measured, or skipped with the reason
                peers = PEERS.get(case.removesuffix("-256K"), set())
                if case.startswith("offload"):
                    peers |= {"deepspeed", "deepspeed_step"}
                for peer in peers:
                    ran = (case, "fastzero", f"speedup_vs_{peer}") in figures
                    assert ran or cases[case]["skipped"][peer], (case, peer)


@pytest.mark.parametrize("lr_factor, ok", [(1.0, True), (3.0, False)])
def test_the_low_bit_peers_loose_check_tells_a_wrong_step(lr_factor, ok):
    """torch's AdamW passes as a peer; with 3x the case's lr it does not do the job, and fails."""
    data = OptimData([4096], cpu_adam.reference.adam_step, cpu_adam.HYPER)
    params = data.parameters()
    opt = torch.optim.AdamW(params, **dict(cpu_adam.HYPER, lr=cpu_adam.HYPER["lr"] * lr_factor))
    if ok:
        cpu_adam.lowbit_peer_check(opt.step, data, params)
    else:
        with pytest.raises(AssertionError, match="off the reference's step"):
            cpu_adam.lowbit_peer_check(opt.step, data, params)


def test_convergence_script_trains_every_fastzero_format(tmp_path):
    js, md = tmp_path / "c.json", tmp_path / "c.md"
    names = "fastzero-fp32,fastzero-bf16-sr,bf16-rtn,fastzero-int8,torchao-adamw8bit"
    args = ["--steps", "8", "--batch", "4", "--hidden", "32", "--held-out", "64", "--points", "2", "--only", names]
    assert state_formats_convergence.main([*args, "--json", str(js), "--report", str(md)]) == 0
    res = json.loads(js.read_text())
    runs = {r["name"]: r for r in res["runs"]}
    for name in ("fastzero-fp32", "fastzero-bf16-sr", "bf16-rtn", "fastzero-int8"):
        first, last = runs[name]["curve"][0][1], runs[name]["final_loss"]
        assert last < first < 4.3 and runs[name]["opt_ms"] > 0  # it trains (from log(64) = 4.16)
    assert "torchao-adamw8bit" in runs or res["skipped"]["torchao-adamw8bit"]
    assert "| fastzero-int8 |" in md.read_text()
