"""The DeepSpeed peer of ``python -m bench.run --kernel zeropp``
(bench/zeropp_deepspeed.py), in-process, no job: a variant DeepSpeed cannot
run here is a Skip that names why, raised before any process group exists;
the collectives it counts are told apart by their call sites."""

import sys
import traceback

import pytest

from bench import zeropp_deepspeed as zd
from bench.zeropp_worker import Skip, config

SPEC = dict(hidden=64, layers=2, micro=4, steps=1, warmup=0, bucket=16384, persist=512)


def test_sites_and_a_missing_deepspeed(monkeypatch):
    frame = lambda file, name: traceback.FrameSummary(f"/x/deepspeed/runtime/zero/{file}", 1, name)
    assert zd.site([frame("partitioned_param_coordinator.py", "fetch_sub_module")]) == "param"
    assert zd.site([frame("stage3.py", "__reduce_and_partition_ipg_grads")]) == "grad"
    assert zd.site([frame("engine.py", "backward"), frame("comm.py", "all_to_all_quant_reduce")]) == "grad"
    assert zd.site([frame("stage3.py", "_post_step"), frame("partition_parameters.py", "all_gather")]) == "other"
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    with pytest.raises(Skip, match="deepspeed not importable"):
        zd.deepspeed_job(dict(SPEC, variant={}), config(dict(SPEC, variant={})), Skip)


def test_quantized_variants_skip_on_the_cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import op_builder

    if get_accelerator().device_name() != "cpu":
        pytest.skip("deepspeed's accelerator here is not its CPU one")
    try:
        op_builder.QuantizerBuilder().load()
        pytest.skip("this DeepSpeed has a CPU QuantizerBuilder: qwZ and qgZ can run")
    except ValueError:
        pass
    for variant, named in [
        ({"zero_quantized_weights": True}, "qwZ"),
        ({"zero_quantized_gradients": True}, "qgZ"),
        ({"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2}, "qgZ"),
    ]:
        spec = dict(SPEC, variant=variant)
        with pytest.raises(Skip, match="QuantizerBuilder") as exc:
            zd.deepspeed_job(spec, config(spec), Skip)
        assert named in str(exc.value) and "not been implemented on CPU" in str(exc.value)
        assert not dist.is_initialized()  # decided before any process group: no rank can wait on another
