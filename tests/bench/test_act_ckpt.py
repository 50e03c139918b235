"""bench --kernel act_ckpt: every provider checked bit for bit against the
un-checkpointed run, then measured; its memory figures are the ones the
tests of fastzero.checkpointing guarantee."""

from bench.family import Settings
from bench.kernels import act_ckpt


def test_quick_case_measures_every_provider_and_its_memory():
    (case,) = act_ckpt.cases(quick=True)
    rows, skipped = act_ckpt.measure(case, Settings(warmup=0, repeats=2, quick=True), lambda _: None)
    by = {}
    for r in rows:
        assert r["gated"] is False  # reported, never gated
        by.setdefault(r["provider"], {})[r["metric"]] = r["value"]
    assert set(by) | set(skipped) == {name for name, _ in act_ckpt.PROVIDERS}
    assert "deepspeed" in by or "not installed" in skipped["deepspeed"]
    peak = {name: m["peak_bytes"] for name, m in by.items()}
    after = {name: m["saved_bytes"] for name, m in by.items()}
    # torch's non-reentrant recompute is metered as fastzero's reentrant one: the same peak
    assert peak["fastzero_full"] == peak["torch_every_block"] < peak["fastzero_selective"] < peak["none"]
    assert after["fastzero_full"] == after["torch_every_block"] < after["fastzero_selective"] < after["none"]
    assert all(after[n] <= peak[n] for n in peak)
    if "deepspeed" in after:  # its checkpoint keeps each block's input, as torch's does
        assert after["deepspeed"] == after["torch_every_block"]
    assert peak["fastzero_budget"] <= by["fastzero_budget"]["budget_bytes"] == peak["torch_every_2nd"]
    assert peak["fastzero_mixed"] <= by["fastzero_mixed"]["budget_bytes"] == int(1.5 * peak["fastzero_full"])
    assert by["fastzero_mixed"]["memory_of_full"] <= 1.5
    assert all(len(m) >= 6 and m["median_ms"] > 0 for m in by.values())
    lines = act_ckpt.table({"skipped": skipped}, by)
    assert any("Budget placement" in line for line in lines) and any("Mixed placement" in line for line in lines)
