"""The benchmark suite itself: runs, writes results and reports, and its
regression gate flags a real slowdown but not a missing peer."""

import json

import pytest

from bench import compare, run

SMALL = ["--kernel", "cpu_adam", "--sizes", "256K", "--repeats", "3", "--warmup", "1", "--skip", "deepspeed"]


def test_list(capsys):
    assert run.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "cpu_adam" in out and "fp32-16M-x400" in out and "offload-bf16-16M" in out


def test_small_run_writes_json_and_report(tmp_path):
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    assert run.main([*SMALL, "--json", str(js), "--report", str(md)]) == 0
    res = json.loads(js.read_text())
    assert res["machine"]["isa"] and res["machine"]["cpu"]
    cases = {c["name"] for c in res["cases"]}
    assert cases == {"fp32-256K", "fp32-256K-x400", "offload-bf16-256K"}
    figures = {(r["case"], r["provider"], r["metric"]) for r in res["rows"]}
    for case in cases:
        assert (case, "fastzero", "frac_roofline") in figures
        assert (case, "roofline", "gb_per_s") in figures
    assert ("fp32-256K", "fastzero", "speedup_vs_torch_fused") in figures
    assert ("offload-bf16-256K", "fastzero", "speedup_vs_torch_pipeline") in figures
    text = md.read_text()
    assert "| fastzero |" in text and "roofline" in text
    assert (tmp_path / "r-cpu_adam.png").stat().st_size > 1000


def _results(fastzero_ms, peer_ms=10.0, roof_ms=8.0, peer="torch_fused"):
    """Result rows as the harness writes them, from times."""
    from bench.harness import Case, CaseResult, Provider, Timing

    case = Case("k", "c", 1000, 28000, [Provider("roofline", "roofline", None)])
    timings = {
        "fastzero": Timing("fastzero", "ours", [fastzero_ms / 1e3] * 5),
        peer: Timing(peer, "peer", [peer_ms / 1e3] * 5),
        "roofline": Timing("roofline", "roofline", [roof_ms / 1e3] * 5),
    }
    return {"rows": CaseResult(case, timings, {}).rows()}


def test_gate_flags_a_25_percent_slowdown_and_not_noise():
    base = _results(8.5)
    slow = _results(8.5 * 1.25)
    checks = compare.compare(slow, base)
    assert {c.metric for c in checks} == {"frac_roofline", "speedup_vs_torch_fused"}
    assert all(c.change == pytest.approx(1 / 1.25 - 1) for c in checks)
    assert len(compare.regressions(checks, compare.DEFAULT_TOLERANCE)) == 2
    noisy = _results(8.5 * 1.05)
    assert not compare.regressions(compare.compare(noisy, base), compare.DEFAULT_TOLERANCE)


def test_gate_reads_a_faster_roofline_probe_as_no_regression():
    """The probe alone running 35% faster (it is bimodal between processes) lowers fastzero's fraction of the
    roofline; fastzero's own time held, so it is no regression. A slower kernel beside the faster probe is."""
    base = _results(8.1, roof_ms=6.6)
    probe_faster = compare.compare(_results(8.1, roof_ms=4.3), base)
    (frac,) = [c for c in probe_faster if c.metric == "frac_roofline"]
    assert frac.change < -compare.DEFAULT_TOLERANCE and frac.baseline_ms == pytest.approx(8.1)
    assert frac.status(compare.DEFAULT_TOLERANCE).startswith("ok (the roofline probe ran faster")
    assert not compare.regressions(probe_faster, compare.DEFAULT_TOLERANCE)
    both = compare.compare(_results(8.1 * 1.25, roof_ms=4.3), base)
    assert [c.metric for c in compare.regressions(both, compare.DEFAULT_TOLERANCE)] == [
        "frac_roofline",
        "speedup_vs_torch_fused",
    ]


def test_gate_skips_a_peer_that_is_not_installed_here():
    base = _results(8.5, peer="deepspeed")
    now = _results(8.5, peer="torch_fused")
    checks = compare.compare(now, base)
    status = {c.metric: c.status(compare.DEFAULT_TOLERANCE) for c in checks}
    assert status == {"frac_roofline": "ok", "speedup_vs_deepspeed": "missing"}
    assert not compare.regressions(checks, compare.DEFAULT_TOLERANCE)


def test_end_to_end_gate_catches_an_injected_slowdown(tmp_path):
    """A real slowdown (a busy wait that makes fastzero's calls 1.25x longer)
    against a baseline measured moments before fails the run."""
    args = "--kernel cpu_adam --sizes 4M --dtype fp32 --repeats 9 --skip deepspeed --skip torch_foreach".split()
    base = tmp_path / "base.json"
    assert run.main([*args, "--json", str(base)]) == 0
    assert run.main([*args, "--baseline", str(base), "--inject-slowdown", "1.25"]) == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_family_is_its_declared_interface(device):
    """Each registry entry is a Family of that name; its cases (made, not run: no GPU needed) carry fastzero's
    providers, only the peers it declares, and the roofline exactly where it declares one; a case belongs to a
    known family."""
    from bench import kernels
    from bench.family import Family

    for family in kernels.families():
        assert isinstance(family, Family) and family.description
        if device not in family.devices:
            continue
        for case in family.cases(quick=True, device=device):
            owner = kernels.load(case.kernel)
            kinds = {p.name: p.kind for p in case.providers}
            assert "ours" in kinds.values(), (family.name, case.name)
            assert {n for n, k in kinds.items() if k == "peer"} <= set(owner.peers), (owner.name, case.name)
            assert (kinds.get("roofline") == "roofline") == (owner.roofline is not None), (owner.name, case.name)


def test_the_gate_takes_the_baseline_of_a_machine_like_this_one(tmp_path, capsys):
    """The fractions of the roofline move with the CPU: a baseline beside the given one, measured on this
    machine's CPU model, ISA path and core count (and the same settings), is the one compared with; with
    none, the given one, and a warning."""
    settings = {"quick": True, "repeats": 21, "runs": 8}
    amd = {"cpu": "AMD EPYC", "isa": "avx512", "cores": 2}
    intel = {"cpu": "Intel(R) Xeon(R) Processor", "isa": "avx512", "cores": 2}
    write = lambda name, machine, **more: (tmp_path / name).write_text(
        json.dumps({"machine": machine, "settings": {**settings, **more}, "rows": []})
    )
    write("cpu-quick.json", amd)
    write("cpu-quick-intel-other-settings.json", intel, repeats=5)  # another configuration: not taken
    write("cpu-quick-intel.json", intel)
    given = tmp_path / "cpu-quick.json"
    path, baseline = run.baseline_for(given, {**intel, "torch": "2.13.0"})
    assert path == tmp_path / "cpu-quick-intel.json" and baseline["machine"] == intel
    assert run.baseline_for(given, amd)[0] == given
    path, _ = run.baseline_for(given, {"cpu": "AMD EPYC", "isa": "avx2", "cores": 2})
    assert path == given and "no baseline" in capsys.readouterr().out
