"""The 1-bit compression benchmark (python -m bench.run --kernel onebit): a
tiny run through bench.run (the kernel cases in process, the all-reduce as
real Gloo jobs at world 2 and 4) yields well-formed rows, exact byte counts
and a report; the checks before timing catch a wrong pack, unpack or
compressed all-reduce; the GPU cases are listed without a GPU."""

import json

import pytest
import torch

from bench import compare, kernels, onebit_worker, run
from bench.harness import Unavailable, run_case
from bench.kernels import onebit as ob
from bench.kernels import onebit_allreduce as oa
from fastzero.comm import Comm
from fastzero.comm import compressed as compressed_module
from fastzero.ops import onebit as onebit_ops
from fastzero.ops.backend import triton_status

K = 1 << 10


def _by(rows, case=None):
    out = {}
    for r in rows:
        if case is None or r["case"] == case:
            out.setdefault(r["provider"], {})[r["metric"]] = r["value"]
    return out


def test_listed_but_not_in_all(capsys):
    assert run.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "pack-fp32-64M" in out and "unpack-avg4-16M" in out and "unpack-rows4-1M" in out and "w4-64M" in out
    assert "providers: fastzero, reference, roofline" in out and "providers: compressed, fp32, fp16" in out
    assert "providers: fastzero, reference, torch_fill, roofline" in out
    for name in ("onebit", "onebit_allreduce"):
        assert kernels.load(name).in_all is False  # minutes of multi-process jobs: --all (CI's quick gate) skips it
    quick = ob.cases(quick=True)
    assert [c.name for c in quick] == [
        "pack-fp32-1M",
        "pack-fp32-4M",
        "unpack-avg4-1M",
        "unpack-avg4-4M",
        "unpack-rows4-1M",
        "unpack-rows4-4M",
        "w2-1M",
    ]
    assert quick[-1].kernel == "onebit_allreduce"
    # pack against the in-place stream (28 B per element), unpack, which mostly writes, against the write probe
    roofs = {c.name: c.providers[-1] for c in quick[:-1]}
    assert roofs["pack-fp32-1M"].bytes == 28 * 2**20 and roofs["unpack-rows4-1M"].bytes == 4 * 2**20
    assert roofs["unpack-avg4-1M"].bytes == 4 * 2**20 // 4


def test_write_probe_writes_every_element():
    from bench.kernels.common import write_roofline

    runner = write_roofline([1000, 17, 2**16 + 3])  # tails and sizes that are not whole vectors
    runner.check()


def test_gpu_cases_listed_without_a_gpu(capsys):
    assert run.main(["--list", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "pack-fp32-256M" in out and "providers: fastzero_cuda, fastzero_triton, reference, roofline" in out
    assert "w2-" not in out  # the all-reduce runs over Gloo on the CPU only
    case = ob.cases(device="cuda")[0]
    roof = case.providers[-1]
    assert roof.name == "roofline" and roof.bytes == 8 * case.numel  # a copy: read + write
    if not torch.cuda.is_available():
        with pytest.raises(Unavailable, match="no CUDA device"):
            case.providers[0].make()
    assert not torch.cuda.is_initialized()


def test_byte_models():
    n = 1 << 20
    assert ob.pack_bytes(n) == 20.125 * n and ob.pack_bytes(n, sweeps=1) == 12.125 * n
    assert ob.pack_bytes(n, itemsize=2) == 16.125 * n
    assert ob.unpack_bytes(n) == n / 8 + n and ob.unpack_bytes(n, average=False) == n / 8 + 4 * n


def test_tiny_run_rows_bytes_and_report(tmp_path):
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    args = ["--kernel", "onebit", *"--sizes 64K --repeats 2 --warmup 1".split(), "--json", str(js), "--report", str(md)]
    assert run.main(args) == 0
    res = json.loads(js.read_text())
    names = [c["name"] for c in res["cases"]]
    assert names == ["pack-fp32-64K", "unpack-avg4-64K", "unpack-rows4-64K", "w2-64K", "w4-64K"]
    assert all(not c["skipped"] for c in res["cases"])
    n = 64 * K
    for case in names[:3]:
        got = _by(res["rows"], case)
        assert set(got) == {"fastzero", "reference", "roofline"} | ({"torch_fill"} if "unpack" in case else set())
        for prov in ("fastzero", "reference"):
            assert got[prov]["median_ms"] > 0 and got[prov]["gb_per_s"] > 0 and got[prov]["frac_roofline"] > 0
        assert got["fastzero"]["speedup_vs_reference"] > 0 and got["roofline"]["gb_per_s"] > 0
    pack = _by(res["rows"], "pack-fp32-64K")["fastzero"]
    assert pack["frac_roofline_min_bytes"] == pytest.approx(pack["frac_roofline"] * 12.125 / 20.125)
    cases = {c["name"]: c for c in res["cases"]}
    assert cases["pack-fp32-64K"]["bytes"] == 20.125 * n and cases["unpack-rows4-64K"]["bytes"] == n / 8 + 4 * n
    gated = [(r["case"], r["provider"], r["metric"]) for r in res["rows"] if compare.gated(r)]
    assert gated == [(c, "fastzero", "frac_roofline") for c in names[:3]]  # same-run ratios of the kernels only
    for world in (2, 4):
        got = _by(res["rows"], f"w{world}-64K")
        assert set(got) == {"compressed", "fp32", "fp16"}
        c = got["compressed"]
        # 1-bit both ways: all-to-all of (w-1)/w of the bits, all-gather of w-1 server chunks; and the scales
        signs = 2 * (world - 1) / world * n / 8
        scales = 4 * world * (world - 1) + 4 * (world - 1)
        assert c["wire_bytes"] == signs + scales and c["scale_bytes"] == scales and c["collectives"] == 4
        assert got["fp32"]["wire_bytes"] == 2 * (world - 1) / world * 4 * n == 2 * got["fp16"]["wire_bytes"]
        for m in got.values():
            assert m["median_ms"] > 0 and m["timed_calls"] == 2
            assert m["model_ms_10gbps"] == pytest.approx(m["wire_bytes"] / 1.25e9 * 1e3)
            assert m["model_ms_100gbps"] == pytest.approx(m["model_ms_10gbps"] / 10)
        assert 0 < c["compute_ms"] <= c["median_ms"]  # pack + unpack inside the call
        for peer, width in (("fp32", 32), ("fp16", 16)):  # 1/32 of fp32's bytes, and the scales
            assert c[f"bytes_vs_{peer}"] == got[peer]["wire_bytes"] / c["wire_bytes"] == pytest.approx(width, rel=1e-2)
        assert c["speedup_vs_fp32"] > 0 and c["model_speedup_vs_fp16_10gbps_with_compute"] > 0
    text = md.read_text()
    assert "## onebit / pack-fp32-64K" in text and "## onebit_allreduce / w4-64K" in text
    assert "of roofline (least bytes)" in text and "| torch_fill |" in text and "| compressed |" in text
    assert "model + compute, 10 Gb/s" in text
    assert (tmp_path / "r-onebit.png").exists() and not (tmp_path / "r-onebit_allreduce.png").exists()


def _flip_first_bit(pack):
    def wrong(x, error, chunks=1, *, backend=None):
        bits, scales = pack(x, error, chunks, backend=backend)
        bits[0] ^= 1
        return bits, scales

    return wrong


def test_check_catches_a_wrong_pack_and_unpack(monkeypatch):
    case = ob.kernel_cases([4 * K])[0]
    provider = case.providers[0]
    provider.make().check()  # the real kernel passes
    pack = onebit_ops.pack
    monkeypatch.setattr(onebit_ops, "pack", _flip_first_bit(pack))
    with pytest.raises(AssertionError, match="sign bits: 1 of 512 bytes differ"):
        provider.make().check()

    def wrong_scale(x, error, chunks=1, *, backend=None):
        bits, scales = pack(x, error, chunks, backend=backend)
        return bits, scales * (1 + 1e-4)

    monkeypatch.setattr(onebit_ops, "pack", wrong_scale)
    with pytest.raises(AssertionError, match="scales"):
        provider.make().check()
    with pytest.raises(AssertionError, match="fastzero disagrees with the reference"):
        run_case(ob.kernel_cases([4 * K])[0], warmup=0, repeats=1)  # the harness stops before timing
    monkeypatch.undo()

    unpack = onebit_ops.unpack

    def wrong_unpack(bits, scales, *, average=False, out=None, backend=None):
        result = unpack(bits, scales, average=average, out=out, backend=backend)
        result[-1] *= -1
        return result

    monkeypatch.setattr(onebit_ops, "unpack", wrong_unpack)
    avg, rows = ob.kernel_cases([4 * K])[1:3]
    with pytest.raises(AssertionError, match="average: 1 of 1024 elements off"):
        avg.providers[0].make().check()
    with pytest.raises(AssertionError, match="rows: 1 of 4096 values differ"):
        rows.providers[0].make().check()


def test_triton_runner_on_cpu_tensors():
    """The GPU family's Triton provider and its check, in Triton's interpreter (conftest sets it without a GPU)."""
    pytest.importorskip("triton")
    ok, why = triton_status("cpu")
    if not ok:
        pytest.skip(why)
    data = lambda: ob.PackData(2 * K, torch.float32, "cpu")  # noqa: E731
    ob.pack_runner(data, "triton", "cpu").check()
    ob.unpack_runner(lambda: ob.UnpackData(2 * K, "cpu"), True, "triton", "cpu").check()


def test_allreduce_check_catches_a_wrong_kernel(monkeypatch):
    """The worker's check before timing, in one process (world 1: the collectives are local copies)."""
    comm = Comm()
    onebit_worker.check(comm, 4 * K)
    pack, calls = onebit_ops.pack, []

    def wrong_first_pack(*args, **kwargs):  # the workers' pack wrong, the server's right
        calls.append(1)
        return (_flip_first_bit(pack) if len(calls) == 1 else pack)(*args, **kwargs)

    monkeypatch.setattr(compressed_module.onebit, "pack", wrong_first_pack)
    with pytest.raises(AssertionError, match="compressed: 1 of 4096 signs differ"):
        onebit_worker.check(comm, 4 * K)
    monkeypatch.undo()
    unpack = onebit_ops.unpack

    def wrong_scale(bits, scales, **kwargs):
        return unpack(bits, scales * 1.001, **kwargs)

    monkeypatch.setattr(compressed_module.onebit, "unpack", wrong_scale)
    with pytest.raises(AssertionError, match="compressed result: 4096 of 4096 elements off"):
        onebit_worker.check(comm, 4 * K)


def test_simulation_is_the_compressed_allreduce_at_world_1():
    x = onebit_worker.rank_input(1024, 0)
    want, (we,), (se,) = onebit_worker.simulate_compressed([x])
    from fastzero.comm import compressed_allreduce, error_buffers

    e1, e2 = error_buffers(1024, 1)
    torch.testing.assert_close(compressed_allreduce(x, e1, e2, Comm()), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(e1, we, rtol=0, atol=1e-6)
    torch.testing.assert_close(e2, se, rtol=0, atol=1e-6)


def test_allreduce_rows_and_table_from_times():
    (case,) = oa.cases(sizes=[1 << 20], quick=True)
    n = 1 << 20
    res = {
        "compressed": dict(
            times=[0.010, 0.012, 0.011],
            compute_times=[0.004, 0.004, 0.005],
            wire_bytes=n / 8 + 12,
            scale_bytes=12,
            collectives=4,
        ),
        "fp32": dict(times=[0.030, 0.036, 0.033], wire_bytes=4 * n, collectives=1),
        "fp16": dict(times=[0.020, 0.024, 0.022], wire_bytes=2 * n, collectives=1),
    }
    rows = oa.rows(case, res)
    assert all(r["gated"] is False for r in rows) and not [r for r in rows if compare.gated(r)]
    got = _by(rows)
    c = got["compressed"]
    assert c["speedup_vs_fp32"] == pytest.approx(3.0) and c["speedup_vs_fp16"] == pytest.approx(2.0)
    assert c["compute_ms"] == pytest.approx(4.0) and c["bytes_vs_fp32"] == pytest.approx(4 * n / (n / 8 + 12))
    link = 1.25e9  # 10 Gb/s
    want = (4 * n / link) / ((n / 8 + 12) / link + 0.004)
    assert c["model_speedup_vs_fp32_10gbps_with_compute"] == pytest.approx(want)
    assert got["fp16"]["model_ms_100gbps"] == pytest.approx(2 * n / 12.5e9 * 1e3)
    text = "\n".join(oa.table({}, got))
    assert "| fp32 | 4.000 MiB | 33.00 |" in text and "| fp32 | 32.0x | 3.00x |" in text
