"""DeepSpeed's communication logger (``comms_logger`` config section,
``fastzero.comm.log_summary``): the bandwidth arithmetic and the table on
one process; on 2 Gloo ranks (tests/workers/comms_logger.py) every
functional collective logged once with its per-rank bytes, the prof_ops /
prof / log_name / debug settings, the engine's own collectives (counted
against its comm record), the summary, and the straggler breakdown's
refusal when ranks logged different ops."""

import json
from pathlib import Path

import pytest
import torch

import fastzero.comm as dist
from fastzero.comm import logger as comms
from fastzero.config import ConfigError, load_config
from tests.dist import run_ranks

WORKER = Path(__file__).resolve().parent.parent / "workers" / "comms_logger.py"


@pytest.fixture
def fresh():
    """The process-wide logger at DeepSpeed's defaults, put back after the test."""
    saved = vars(comms.comms_logger).copy()
    comms.comms_logger.__init__()
    yield comms.comms_logger
    comms.comms_logger.__dict__.update(saved)


def test_bandwidth_follows_nccl_tests():
    mb, ms = 1_000_000, 1.0  # 1 MB in 1 ms: 8 Gbit/s of data
    assert comms.bandwidth("all_reduce", mb, ms, 4) == pytest.approx((16.0, 12.0))  # 2x; 2 (n - 1) / n
    assert comms.bandwidth("all_gather_into_tensor", mb, ms, 4) == pytest.approx((32.0, 24.0))  # n x per-rank
    assert comms.bandwidth("reduce_scatter_tensor", mb, ms, 2) == pytest.approx((16.0, 8.0))
    assert comms.bandwidth("all_to_all_single", mb, ms, 4) == pytest.approx((8.0, 6.0))
    assert comms.bandwidth("isend", mb, 2.0, 2) == pytest.approx((4.0, 4.0))
    assert comms.bandwidth("all_gather_object", mb, ms, 2) == pytest.approx((8.0, 8.0))  # DeepSpeed exits here
    assert comms.bandwidth("all_reduce", mb, 0.0, 2) == (0.0, 0.0)
    assert comms.bandwidth("barrier", 0, 1.0, 2) == (0.0, 0.0)


def test_sizes_and_trimmed_means():
    assert comms.convert_size(0) == "0B"
    assert comms.convert_size(512) == "512.0 B"
    assert comms.convert_size(1536) == "1.5 KB"
    assert comms.convert_size(3 * 1024**2) == "3.0 MB"
    assert comms.trim_mean(list(range(1, 11)), 0.1) == pytest.approx(5.5)  # 1 and 10 dropped
    assert comms.trim_mean([1.0] * 9 + [100.0], 0.1) == pytest.approx(1.0)
    assert comms.trim_mean([3.0, 5.0], 0.5) == pytest.approx(4.0)  # trimming all keeps all
    assert comms.trim_mean([], 0.1) == 0.0
    with pytest.raises(ValueError, match="trim_percent"):
        comms.trim_mean([1.0], 1.5)


def test_the_table_and_the_dictionary(fresh, capsys):
    fresh.enabled = True
    for lat in (1.0, 2.0, 3.0):
        fresh.append("all_reduce", "all_reduce", lat, 1_000_000, 2)
    fresh.append("all_gather_into_tensor", "all_gather_into_tensor", 0.5, 2048, 2)
    raw = fresh.get_raw_data()
    assert raw["all_reduce"][1_000_000][0] == 3 and raw["all_reduce"][1_000_000][1] == [1.0, 2.0, 3.0]
    raw["all_reduce"][1_000_000][1].append(99.0)  # a copy: the logger's data is untouched
    assert fresh.get_raw_data()["all_reduce"][1_000_000][1] == [1.0, 2.0, 3.0]
    assert fresh.get_total_operations() == 4 and fresh.get_operation_names() == ["all_reduce", "all_gather_into_tensor"]
    assert fresh.get_operation_summary("broadcast") is None
    s = fresh.get_operation_summary("all_reduce")[1_000_000]
    assert s["count"] == 3 and s["total_latency_ms"] == pytest.approx(6.0) and s["avg_latency_ms"] == pytest.approx(2.0)
    assert s["tput_avg_gbps"] == pytest.approx((16 + 8 + 16 / 3) / 3) and s["msg_size_str"] == "976.56 KB"
    result = fresh.log_all(print_log=True, return_dict=True)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["Comm.", "Op", "Message", "Size", "Count", "Total", "Latency(ms)", "Avg"] + [
        "Latency(ms)",
        "tput_avg",
        "(Gbps)",
        "busbw_avg",
        "(Gbps)",
    ]
    assert printed[1] == "all_reduce" and printed[2].split()[:5] == ["976.56", "KB", "3", "6.00", "2.00"]
    assert printed[3] == "all_gather_into_tensor" and printed[4].split()[:3] == ["2.0", "KB", "1"]
    assert result["summary"]["all_reduce"][1_000_000] == s and result["straggler_analysis"] is None
    assert result["metadata"]["world_size"] == 1 and result["metadata"]["rank"] == 0
    # one process: the straggler breakdown is the latencies themselves, no wait
    alone = fresh.log_all(print_log=False, show_straggler=True, return_dict=True)["straggler_analysis"]
    assert alone["all_reduce"][1_000_000]["total_comm_lat_ms"] == pytest.approx(6.0)
    assert alone["all_reduce"][1_000_000]["total_straggler_ms"] == 0.0
    fresh.reset_data()
    assert not fresh.has_data() and fresh.log_all(print_log=False) is None


def test_settings_and_their_checks(fresh):
    assert (fresh.enabled, fresh.prof_all, fresh.prof_ops, fresh.verbose, fresh.debug) == (
        False,
        True,
        [],
        False,
        False,
    )
    assert not fresh.wants("all_reduce", prof=True)  # off: nothing, whatever the call asks
    dist.configure({"comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"], "debug": True}})
    assert fresh.enabled and not fresh.prof_all and fresh.prof_ops == ["all_reduce"] and fresh.debug
    assert fresh.wants("all_reduce") and not fresh.wants("broadcast") and fresh.wants("broadcast", prof=True)
    assert fresh.record_name("all_reduce", "train") == "all_reduce | [Caller Func: train]"
    fresh.start_profiling_op(["broadcast"])
    assert fresh.wants("broadcast")
    fresh.stop_profiling_op(["broadcast", "all_reduce"])
    assert fresh.prof_ops == [] and not fresh.wants("all_reduce")
    fresh.start_profiling_comms()
    assert fresh.wants("anything")
    fresh.stop_profiling_comms()
    dist.configure(prof_ops=["all_gather_into_tensor"], verbose=True)
    assert fresh.prof_ops == ["all_gather_into_tensor"] and fresh.verbose
    with pytest.raises(TypeError, match="enabled='yes'"):
        dist.configure(enabled="yes")
    with pytest.raises(TypeError, match="list of op names"):
        dist.configure(prof_ops="all_reduce")
    with pytest.raises(ConfigError, match="prof_ops.*list of strings"):
        dist.configure({"comms_logger": {"prof_ops": "all_reduce"}})
    with pytest.raises(ConfigError, match="did you mean 'prof_ops'"):
        dist.configure({"comms_logger": {"prof_op": ["all_reduce"]}})
    with pytest.raises(ConfigError, match="must be true or false"):
        load_config({"train_batch_size": 1, "comms_logger": {"enabled": 1}})
    cfg = load_config({"train_batch_size": 1, "comms_logger": {"enabled": True, "prof_ops": ["broadcast"]}})
    assert cfg.comms_logger.enabled and cfg.comms_logger.prof_ops == ("broadcast",)


def test_one_process_takes_deepspeeds_keywords_and_logs_nothing(fresh, monkeypatch):
    """DeepSpeed scripts pass prof / log_name / debug; alone, nothing crosses, so nothing is logged."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    dist.configure(enabled=True)
    t = torch.arange(4.0)
    assert dist.all_reduce(t, prof=True, log_name="grads", debug="caller") is None
    flat = torch.empty(4)
    dist.all_gather_into_tensor(flat, t, log_name="gather")
    assert torch.equal(flat, t)
    assert dist.all_reduce(t, async_op=True, prof=True).wait()
    assert dist.barrier(log_name="b") is None
    assert not dist.has_comm_data() and dist.get_comm_operation_count() == 0 and dist.get_logged_comm_ops() == []
    assert dist.log_summary(return_dict=True)["summary"] == {}
    for fn in (dist.all_reduce, dist.broadcast, dist.isend, dist.barrier, dist.all_gather_object):
        params = __import__("inspect").signature(fn).parameters
        assert {"prof", "log_name", "debug"} <= set(params) and params["log_name"].default == fn.__name__


@pytest.fixture(scope="module")
def ranks():
    outs = run_ranks(WORKER, 2, ["debug"], timeout=300)
    results, tables = [], []
    for text in outs:
        line = next(ln for ln in text.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
        tables.append(text.split("TABLE-START\n", 1)[1].split("TABLE-END", 1)[0])
    return results, tables


def test_every_functional_collective_is_logged_once_with_its_bytes(ranks):
    results, _ = ranks
    for r, out in enumerate(results):
        assert out["off"] == {}
        assert out["all_reduce_value"] == [4.0, 12.0, 20.0] and out["p2p_value"] == 1.0  # the values still cross
        assert out["all"] == {
            "all_reduce": {"4096": 3, "8192": 1},  # 3 sync, 1 async (logged by its future once done)
            "all_gather_into_tensor": {"1024": 1},  # the rank's input
            "reduce_scatter_tensor": {"1024": 1},  # the rank's output chunk
            "isend": {"256": 1},  # Gloo's sends have no future: logged when waited on
            "irecv": {"256": 1},
            "barrier": {"0": 1},
            "all_to_all": {"128": 1},  # a list's tensors together
            "all_reduce_coalesced": {"128": 1},
        }, r
        assert out["count"] == 11 and out["positive"]
        assert out["summary_4096"] == {"count": 3, "msg_size_bytes": 4096, "msg_size_str": "4.0 KB"}


def test_prof_ops_prof_log_name_and_debug(ranks):
    results, _ = ranks
    for out in results:
        assert out["after_reset"] is False
        assert out["filtered"] == {
            "all_reduce": {"16": 2},  # the all_reduce, and the all-gather whose log_name is in prof_ops
            "broadcast": {"16": 1},  # only the call with prof=True
            "all_reduce | [Caller Func: my_training_step]": {"16": 1},  # debug names the caller
        }


def test_the_engines_collectives_from_the_config_section(ranks):
    results, _ = ranks
    for out in results:
        assert out["enabled_by_config"]
        expected = out["engine_expected"]
        assert set(expected) == {"reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"}
        assert out["engine_logged"] == expected  # every finished collective of the engine's record, once
        assert all("[Caller Func: fastzero:" in name for name in out["engine_names"])  # debug: the record's tag
        assert out["engine_rs_sizes"] == [n // 2 for n in out["engine_rs_inputs"]]  # a reduce-scatter's chunk


def test_log_summary_prints_on_rank_0_and_returns_everywhere(ranks):
    results, tables = ranks
    assert "Comm. Op" in tables[0] and "Breakdown with straggler effect" in tables[0]
    assert tables[1].strip() == ""
    for r, out in enumerate(results):
        assert out["summary_keys"] == ["metadata", "straggler_analysis", "summary"]
        assert out["straggler_ops"] == sorted(out["engine_names"]) and out["straggler_nonnegative"]
        assert out["metadata"] == {"world_size": 2, "rank": r}


def test_the_straggler_breakdown_refuses_ranks_that_logged_other_ops(ranks):
    results, _ = ranks
    for r, out in enumerate(results):
        assert f"ranks [{1 - r}] logged other ops" in out["mismatch"] and "reset_log()" in out["mismatch"]


def test_the_tensor_parallel_layers_collectives(ranks):
    """2-way tensor parallelism over the world, one forward and backward each, every collective once with the
    bytes one rank puts in (fp32)."""
    results, _ = ranks
    for out in results:
        # the row layer's output all-reduce, the column layer's input-grad all-reduce: 4 x 8 values each
        assert out["tp"] == {"all_reduce": {"128": 2}}
        # sequence parallel, 3 x 2 x 8 values per rank: all-gathers in the column forward, the column backward (its
        # input again) and the row backward; reduce-scatters after the row forward and of the column's input grad
        assert out["tp_sequence"] == {"all_gather_into_tensor": {"192": 3}, "reduce_scatter_tensor": {"192": 2}}
        # vocab-parallel cross entropy over 5 rows: the row max, then three sums per row
        assert out["tp_cross_entropy"] == {"all_reduce": {"20": 1, "60": 1}}


def test_ops_logged_in_another_order_one_rank_groups_and_bad_calls(ranks):
    results, _ = ranks
    for out in results:
        # rank 0 sends first, rank 1 receives first: the straggler breakdown pairs the ops by name and size
        assert out["pingpong"] == {"send": [32], "recv": [32]}
        assert out["one_rank_group"] == {}  # rank 0 alone in its group, rank 1 outside it
        assert out["bad_call"].startswith("all_reduce(): too many positional arguments")


class _Work:
    """A device collective's work: its future completes when it is queued, wait() returns at once."""

    def __init__(self) -> None:
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future

    def wait(self) -> bool:
        return True


def test_a_device_collective_is_logged_at_its_wait_after_a_synchronize(fresh, monkeypatch):
    """NCCL completes a work's future when the work is queued: the logger synchronizes at the first wait (as
    DeepSpeed's does) and logs then; a CPU collective is logged by its future."""
    from fastzero.comm.collectives import CommEvent, Handle

    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    fresh.enabled = True
    event = CommEvent("all_reduce", "grad", 4096, __import__("time").perf_counter(), world_size=2, device="cuda")
    work = _Work()
    handle = Handle(work, event)
    work.future.set_result(None)  # queued
    assert event.done is not None and not fresh.has_data() and not syncs
    handle.wait()
    handle.wait()
    assert syncs == [1] and fresh.get_raw_data()["all_reduce"][4096][0] == 1
    cpu = CommEvent("reduce_scatter", "grad", 4096, __import__("time").perf_counter(), world_size=2)
    work = _Work()
    Handle(work, cpu)
    work.future.set_result(None)
    assert fresh.get_raw_data()["reduce_scatter_tensor"][2048][0] == 1 and syncs == [1]  # the chunk, no sync


def test_configure_from_files_dicts_and_configs(fresh, tmp_path):
    dist.configure({"train_batch_size": 2}, enabled=True)  # no section: the logger stays as it is
    assert fresh.enabled
    dist.configure(load_config({"train_batch_size": 1}))  # a Config at the defaults: the same
    assert fresh.enabled
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"comms_logger": {"enabled": False, "prof_ops": ["broadcast"]}}))
    dist.configure(str(path))
    assert not fresh.enabled and fresh.prof_ops == ["broadcast"]
    path.write_text(json.dumps({"comms_logger": {"verbose": "yes"}}))
    with pytest.raises(ConfigError, match=f"config file {path}: comms_logger.verbose"):
        dist.configure(path)
    dist.configure(prof_ops=iter(["all_reduce", "barrier"]))  # any iterable of names
    assert fresh.prof_ops == ["all_reduce", "barrier"]
