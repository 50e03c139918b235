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
    saved = {name: m["saved_bytes"] for name, m in by.items()}
    assert saved["fastzero_full"] == saved["torch_every_block"] < saved["fastzero_selective"] < saved["none"]
    if "deepspeed" in saved:  # its checkpoint keeps each block's input, as torch's does
        assert saved["deepspeed"] == saved["torch_every_block"]
    assert saved["fastzero_budget"] <= by["fastzero_budget"]["budget_bytes"] == saved["torch_every_2nd"]
    assert all(len(m) >= 5 and m["median_ms"] > 0 for m in by.values())
    assert any("Budget placement" in line for line in act_ckpt.table({"skipped": skipped}, by))
