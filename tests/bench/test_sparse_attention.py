"""The block-sparse attention benchmark (python -m bench.run --kernel
sparse_attention): its layouts and FlexAttention block masks, the CPU cases on
tiny shapes through bench.run (well-formed rows, memory from a subprocess,
nothing gated), the memory-budget search, the GPU family's jobs on small CPU
tensors (Triton's interpreter, SDPA, FlexAttention eager), and the GPU case
list made without a GPU."""

import json
import warnings

import pytest
import torch

import fastzero.ops.sparse_attention.attention as sa
from bench import compare, run
from bench.family import Settings
from bench.harness import Unavailable
from bench.kernels import sparse_attention as bsa
from bench.kernels.sparse_attention import layouts, memory, providers


def _by(rows):
    out = {}
    for r in rows:
        out.setdefault(r["provider"], {})[r["metric"]] = r["value"]
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_layouts_hit_the_density_and_keep_window_and_global_column(causal):
    for nb in (8, 32, 64):
        for density in (0.05, 0.1, 0.2, 0.5, 1.0):
            lay = layouts.density_layout(3, nb, density, causal)
            assert lay.shape == (3, nb, nb) and lay.dtype == torch.bool
            total = nb * (nb + 1) // 2 if causal else nb * nb
            least = (2 * nb - 1) / total  # the diagonal and the first column
            # off by a stripe at most: ~1/nb, causal 2/nb
            assert abs(layouts.kept_fraction(lay, causal) - max(density, least)) <= 2 / nb
            assert lay[:, torch.arange(nb), torch.arange(nb)].all() and lay[:, :, 0].all()
            if causal:
                assert not lay.triu(1).any()
        assert layouts.density_layout(1, nb, 1.0, causal).sum() == (nb * (nb + 1) // 2 if causal else nb * nb)
    win = layouts.window_layout(1, 64, 1, 1)
    assert win[0].sum(-1).max() == 4  # a fixed window: kept blocks per row do not grow with seq


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_flex_block_mask_is_the_layout(causal, compiled):
    lay = layouts.density_layout(2, 8, 0.3, causal)
    mask = layouts.flex_block_mask(lay, 128, 8 * 128, causal, compiled=compiled)
    assert torch.equal(mask.to_dense()[0].bool(), lay)
    partial = mask.kv_num_blocks[0]  # kept diagonal blocks of a causal layout; none otherwise
    assert torch.equal(partial, lay.diagonal(dim1=1, dim2=2).int() if causal else torch.zeros_like(partial))


def test_check_catches_a_wrong_mask():
    spec = bsa.cpu_cases([512], fit=False)[0].spec
    inp = providers.make_inputs(spec)
    providers.check_slice(spec, "fastzero_cpu", providers.attention_fn(spec, "fastzero_cpu"), inp, grads=True)
    dense = providers.attention_fn(spec, "dense")  # attends to the blocks the layout drops
    with pytest.raises(AssertionError, match="normwise relative error"):
        providers.check_slice(spec, "fastzero_cpu", dense, inp, grads=True)


def test_cpu_tiny_run_rows_memory_and_report(tmp_path, monkeypatch):
    monkeypatch.setattr(sa, "DENSE_CPU_MAX_SEQ", 128)  # seq 256 takes the blocked path (the worker is told too)
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    args = [*"--kernel sparse_attention --quick --sizes 256 --repeats 2 --warmup 1".split(), "--json", str(js)]
    args += ["--report", str(md)]
    assert run.main(args) == 0
    res = json.loads(js.read_text())
    (case,) = res["cases"]
    assert case["name"] == "cpu-s256-p10" and "blocked CPU path" in case["description"] and not case["skipped"]
    got = _by(res["rows"])
    assert set(got) == {"fastzero_cpu", "fastzero_cpu_window", "dense", "sdpa"}
    inputs = 4 * 256 * bsa.CPU_HEADS * bsa.CPU_DIM * 4  # q, k, v, dO in fp32
    for prov, m in got.items():
        assert m["fwdbwd_ms"] > 0 and m["fwdbwd_tflops"] > 0 and 0 < m["density"] <= 1
        assert m["fwdbwd_peak_bytes"] >= inputs, prov
    for ours in ("fastzero_cpu", "fastzero_cpu_window"):
        for peer in ("dense", "sdpa"):
            assert got[ours][f"fwdbwd_speedup_vs_{peer}"] > 0 and got[ours][f"fwdbwd_mem_vs_{peer}"] > 0
    assert got["dense"]["density"] == 1.0 and got["fastzero_cpu"]["density"] < 0.5
    assert all(r["gated"] is False for r in res["rows"]) and not [r for r in res["rows"] if compare.gated(r)]
    text = md.read_text()
    assert "| fastzero_cpu |" in text and "vs dense fwd+bwd" in text and "peak resident set" in text


def test_dense_left_out_where_it_would_not_fit():
    (case,) = bsa.cpu_cases([8192], fit=False)
    why = bsa._unavailable_here(case.spec, "dense")
    assert why and "GiB" in why and bsa._unavailable_here(case.spec, "fastzero_cpu") is None


def test_fit_search_stops_at_the_budget(monkeypatch):
    monkeypatch.setattr(sa, "DENSE_CPU_MAX_SEQ", 128)  # the window layout takes the blocked path from 256
    case = bsa.cpu_cases([256], fit=True)[-1]
    assert case.name == "fit-2G" and case.spec.kind == "fit"
    with pytest.raises(Unavailable):  # harness users (calibrate, pytest-benchmark) skip it
        case.providers[0].make()
    case.providers = [p for p in case.providers if p.name in ("fastzero_cpu_window", "dense")]
    found = memory.fit_search(case, lambda _: None, budget=48 * memory.MiB, max_seq=1024, time_cap=60)
    # dense fwd+bwd holds ~28 B per score: 512 -> ~30 MiB fits, 1024 -> ~115 MiB does not
    assert [p["seq"] for p in found["dense"]["points"]] == [256, 512, 1024]
    assert found["dense"]["limited_by"] == "memory" and not found["dense"]["points"][-1]["fits"]
    assert found["fastzero_cpu_window"]["limited_by"] == "max_seq"
    got = _by(memory.fit_rows(case, found))
    assert got["dense"]["max_seq_fit"] == 512 and got["fastzero_cpu_window"]["max_seq_fit"] == 1024
    assert got["fastzero_cpu_window"]["fit_vs_dense"] == 2.0
    text = "\n".join(bsa.table({}, got))
    assert "| dense | 512 | memory |" in text and "over: " in text


def test_gpu_cases_listed_without_a_gpu(capsys):
    assert run.main(["--list", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "s4K-d64-p100" in out and "s64K-d128-p5" in out and "providers: fastzero, sdpa, flex" in out
    full, quick = bsa.cases(device="cuda"), bsa.cases(quick=True, device="cuda")
    assert len(full) == 3 * 2 * 5
    assert [c.name for c in quick] == ["s4K-d64-p100", "s4K-d64-p10", "s4K-d128-p100", "s4K-d128-p10"]
    spec = full[-1].spec
    shape = (spec.seq, spec.dim, spec.dtype, spec.heads, spec.layout_block, spec.kernel_block)
    assert shape == (65536, 128, "bf16", 16, 128, 64)
    assert not torch.cuda.is_initialized()


def test_gpu_jobs_on_cpu_tensors():
    """The GPU family's jobs, checks, rows and table on CPU tensors (what a GPU adds: CUDA events, the
    compiled FlexAttention, CUDA memory stats)."""
    pytest.importorskip("triton")
    (case,) = bsa.gpu_cases([256], [32], [0.5], dtype="fp32", device="cpu", heads=2)
    settings = Settings(warmup=1, repeats=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without")
        rows, skipped = bsa.measure(case, settings, lambda _: None)
    assert skipped == {"flex": "fwdbwd: FlexAttention has no backward on the CPU"}
    got = _by(rows)
    for mode in ("fwd", "fwdbwd"):
        assert got["fastzero"][f"{mode}_ms"] > 0 and got["fastzero"][f"{mode}_speedup_vs_sdpa"] > 0
        assert got["sdpa"][f"{mode}_tflops_done"] > got["sdpa"][f"{mode}_tflops"]  # it computes every block
    assert got["fastzero"]["fwd_speedup_vs_flex"] > 0 and "fwdbwd_ms" not in got["flex"]
    assert got["fastzero"]["density"] == got["flex"]["density"] == pytest.approx(0.75)
    text = "\n".join(bsa.table({"skipped": skipped}, got))
    assert "fwd+bwd TFLOP/s" in text and "vs flex fwd" in text
    (causal,) = bsa.gpu_cases([256], [32], [0.5], dtype="fp32", device="cpu", heads=2, causal=True)
    providers.make_runner(causal.spec, "fastzero", causal.data, "fwdbwd").check()
