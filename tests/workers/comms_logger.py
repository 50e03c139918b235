"""One rank of tests/comm/test_comms_logger.py: DeepSpeed's communication
logger on 2 Gloo ranks, through ``import fastzero.comm as dist``: the
functional collectives, the prof_ops / prof / debug settings, the engine's
own collectives from the ``comms_logger`` config section, log_summary, and
the straggler breakdown's agreement check. Prints one JSON line, prefixed
``RESULT ``."""

import datetime
import json
import sys
import time

import torch

import fastzero
import fastzero.comm as dist

dist.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
log = dist.comms_logger
out: dict = {"rank": rank}


def raw() -> dict:
    """The logged data as {name: {size: count}} (JSON keys are strings)."""
    return {
        name: {str(size): v[0] for size, v in sizes.items()} for name, sizes in dist.comms_logger.get_raw_data().items()
    }


# -- off: nothing is logged ---------------------------------------------------------------------------------
dist.all_reduce(torch.ones(8))
out["off"] = raw()

# -- every op, prof_all -------------------------------------------------------------------------------------
dist.configure(enabled=True, prof_all=True, prof_ops=[], verbose=False, debug=False)
t = torch.arange(1024, dtype=torch.float32) + rank
for _ in range(3):
    dist.all_reduce(t)
out["all_reduce_value"] = t[:3].tolist()
flat = torch.empty(256 * world)
dist.all_gather_into_tensor(flat, torch.full((256,), float(rank)))
shard = torch.empty(256)
dist.reduce_scatter_tensor(shard, torch.ones(256 * world))
work = dist.all_reduce(torch.ones(2048), async_op=True)
work.wait()
deadline = time.time() + 10
while "all_reduce" not in raw() or raw()["all_reduce"].get("8192") != 1:  # the future's callback: a backend thread
    if time.time() > deadline:
        break
    time.sleep(0.01)
dist.all_to_all([torch.empty(16) for _ in range(world)], [torch.ones(16) for _ in range(world)])  # 2 x 64 B in
dist.all_reduce_coalesced([torch.ones(8), torch.ones(24)])  # 128 B in one collective
peer = 1 - rank
buf = torch.full((64,), float(rank))
if rank == 0:
    dist.isend(buf, peer).wait()
    dist.irecv(buf, peer).wait()
else:
    got = torch.empty(64)
    dist.irecv(got, peer).wait()
    dist.isend(got + 1, peer).wait()
out["p2p_value"] = buf[0].item()
dist.barrier()
out["all"] = raw()
out["ops"] = dist.get_logged_comm_ops()
out["count"] = dist.get_comm_operation_count()
summary = dist.comms_logger.get_operation_summary("all_reduce")
out["summary_4096"] = {k: v for k, v in summary[4096].items() if k in ("count", "msg_size_bytes", "msg_size_str")}
out["positive"] = all(
    lat > 0 and alg > 0 and bus > 0
    for name, sizes in dist.comms_logger.get_raw_data().items()
    if name != "barrier"
    for size, (_, lats, algs, buses) in sizes.items()
    for lat, alg, bus in zip(lats, algs, buses, strict=True)
)

# -- prof_ops, prof=True, log_name, debug ---------------------------------------------------------------------
dist.reset_log()
out["after_reset"] = dist.has_comm_data()
dist.configure(prof_all=False, prof_ops=["all_reduce"])
dist.all_reduce(torch.ones(4))
dist.broadcast(torch.ones(4), src=0)  # not in prof_ops: not logged
dist.broadcast(torch.ones(4), src=0, prof=True)  # prof=True: logged
dist.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4), log_name="all_reduce")  # its log name is listed
dist.configure(debug=True)


def my_training_step() -> None:
    dist.all_reduce(torch.ones(4))


my_training_step()
out["filtered"] = raw()

# -- the engine's own collectives, from the config section -----------------------------------------------------
dist.configure(enabled=False, prof_all=True, prof_ops=[], debug=False)
dist.reset_log()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
cfg = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 256, "allgather_bucket_size": 256},
    "comms_logger": {"enabled": True, "prof_all": True, "debug": sys.argv[1] == "debug"},
}
engine, *_ = fastzero.initialize(model=model, config=cfg)
out["enabled_by_config"] = dist.comms_logger.enabled
dist.reset_log()
engine.comm.record.clear()
for step in range(3):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank * 100 + step))
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
engine.comm.barrier()
deadline = time.time() + 10
expected: dict = {}
names = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_into_tensor"}
while time.time() < deadline:
    expected = {}
    for e in engine.comm.record:
        if e.done is not None:
            expected[names.get(e.op, e.op)] = expected.get(names.get(e.op, e.op), 0) + 1
    logged = {name.split(" |")[0]: 0 for name in dist.get_logged_comm_ops()}
    for name, sizes in dist.comms_logger.get_raw_data().items():
        logged[name.split(" |")[0]] += sum(v[0] for v in sizes.values())
    if logged == expected:
        break
    time.sleep(0.01)
out["engine_expected"] = expected
out["engine_logged"] = logged
out["engine_names"] = dist.get_logged_comm_ops()
out["engine_rs_sizes"] = sorted(
    size
    for name, sizes in dist.comms_logger.get_raw_data().items()
    if name.startswith("reduce_scatter")
    for size in sizes
)
out["engine_rs_inputs"] = sorted({e.nbytes for e in engine.comm.record if e.op == "reduce_scatter"})

# -- log_summary ---------------------------------------------------------------------------------------------
print("TABLE-START", flush=True)
result = dist.log_summary(show_straggler=True, return_dict=True)
print("TABLE-END", flush=True)
out["summary_keys"] = sorted(result)
out["straggler_ops"] = sorted(result["straggler_analysis"])
out["straggler_nonnegative"] = all(
    s["total_straggler_ms"] >= -1e-9 and s["total_comm_lat_ms"] >= 0
    for sizes in result["straggler_analysis"].values()
    for s in sizes.values()
)
out["metadata"] = {k: result["metadata"][k] for k in ("world_size", "rank")}

# -- ranks that logged different ops: the straggler breakdown refuses on every rank ---------------------------------
dist.configure(enabled=True)
if rank == 0:
    dist.comms_logger.append("all_reduce", "only_rank_0", 1.0, 4, world)
try:
    dist.log_summary(show_straggler=True)
    out["mismatch"] = None
except RuntimeError as exc:
    out["mismatch"] = str(exc)

# -- the same ops logged in another order on each rank: the breakdown still pairs them ----------------------------
dist.configure(enabled=True, prof_all=True, prof_ops=[], debug=False)
dist.reset_log()
ping = torch.full((8,), float(rank))
if rank == 0:
    dist.send(ping, 1)
    dist.recv(ping, 1)
else:
    dist.recv(ping, 0)
    dist.send(ping, 0)
pingpong = dist.log_summary(show_straggler=True, return_dict=True)["straggler_analysis"]
out["pingpong"] = {name: sorted(sizes) for name, sizes in pingpong.items()}

# -- a group of one rank moves nothing; a rank outside a group takes no part: neither is logged ---------------------
only0 = dist.new_group([0])
dist.reset_log()
dist.all_reduce(torch.ones(4), group=only0)
out["one_rank_group"] = raw()
try:
    dist.all_reduce(torch.ones(4), 1, 2, 3, 4)
except TypeError as exc:
    out["bad_call"] = str(exc)

# -- the tensor-parallel layers' collectives (the whole world as the tensor group) -----------------------------------
from fastzero.parallel import ColumnParallelLinear, RowParallelLinear, vocab_parallel_cross_entropy  # noqa: E402

dist.configure(enabled=True, prof_all=True, prof_ops=[], debug=False)
torch.manual_seed(0)
col, row = ColumnParallelLinear(8, 16, gather_output=False), RowParallelLinear(16, 8, input_is_parallel=True)
dist.reset_log()
x = torch.randn(4, 8, requires_grad=True)
row(col(x)).sum().backward()  # forward: the row layer's all-reduce; backward: the column layer's input grad's
out["tp"] = raw()
col_sp = ColumnParallelLinear(8, 16, gather_output=False, sequence_parallel=True)
row_sp = RowParallelLinear(16, 8, input_is_parallel=True, sequence_parallel=True)
dist.reset_log()
xs = torch.randn(3, 2, 8, requires_grad=True)  # this rank's 3 of 6 positions (seq_dim 0), batch 2
row_sp(col_sp(xs)).sum().backward()  # all-gather before the column layer, reduce-scatter after the row layer
out["tp_sequence"] = raw()
dist.reset_log()
logits = torch.randn(5, 6, requires_grad=True)  # this rank's 6 of a 12-word vocabulary
vocab_parallel_cross_entropy(logits, torch.tensor([0, 3, 7, 11, 5])).backward()
out["tp_cross_entropy"] = raw()
dist.configure(enabled=False)
print("RESULT " + json.dumps(out), flush=True)
