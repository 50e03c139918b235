"""A DeepSpeed training script, written against DeepSpeed's public API; the
one line that differs is the import. fp16 with dynamic loss scaling under
ZeRO-2, a ``training_data`` loader wrapped in ``RepeatingLoader``, the
scheduler from the config file, the loss scale read off the optimizer, the
engine's state dict moved into a bare model and back, a 16-bit model saved,
the communication logger's summary (the config's ``comms_logger``).

    fastzero --num_gpus 2 --no_local_rank mlp_fp16_zero2.py --deepspeed_config ds.json --out result.pt
"""

import argparse

import torch

import fastzero as deepspeed  # the only change from the DeepSpeed script


def get_args():
    parser = argparse.ArgumentParser(description="an MLP in fp16 under ZeRO-2")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--client_optimizer", default="")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def dataset(rows=70):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 16, generator=gen)
    y = x[:, :4] * 0.5 - x[:, 4:8]  # learnable
    return torch.utils.data.TensorDataset(x, y)


def main():
    args = get_args()
    model = make_model()
    optimizer = None
    if args.client_optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model.parameters(), training_data=dataset()
    )
    rank = deepspeed.comm.get_rank()

    def evaluate() -> float:
        """The loss over the whole data set (the engine in eval mode, no grads)."""
        engine.eval()
        with torch.no_grad():
            x, y = dataset()[:]
            loss = torch.nn.functional.mse_loss(engine(x).float(), y).item()
        engine.train()
        return loss

    record = dict(scales=[], applied=[], norms=[], lrs=[], losses=[])
    record["eval_before"] = evaluate()
    data = iter(deepspeed.utils.RepeatingLoader(loader))
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x, y = next(data)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        if engine.micro_steps % engine.gradient_accumulation_steps() == 0:
            record["scales"].append(optimizer.cur_scale)
            record["applied"].append(engine.was_step_applied())
            record["norms"].append(engine.get_global_grad_norm())
            record["lrs"].append(scheduler.get_last_lr()[0] if scheduler is not None else None)
            record["losses"].append(loss.item())

    record["eval_after"] = evaluate()
    comms = deepspeed.comm.log_summary(return_dict=True)  # the config's comms_logger section turned it on
    record["comm_counts"] = {name: sum(s["count"] for s in sizes.values()) for name, sizes in comms["summary"].items()}
    state = engine.state_dict()
    bare = make_model().half()
    bare.load_state_dict(state)  # the engine's state dict is the model's
    x = dataset()[:8][0]
    record["same_output"] = bool(torch.equal(bare(x.half()), engine(x)))
    # scramble, then restore from the saved dict: the engine trains on from it
    engine.load_state_dict({k: torch.randn_like(v.float()).to(v.dtype) for k, v in state.items()})
    engine.load_state_dict(state)
    record["restored"] = all(torch.equal(a, state[k]) for k, a in engine.module.state_dict().items())
    engine.save_16bit_model(args.out + ".16bit", "model.bin")
    record["dynamic"] = optimizer.dynamic_loss_scale
    record["cur_iter"] = optimizer.cur_iter
    record["batches_per_epoch"] = len(loader)
    if rank == 0:
        torch.save(record, args.out)
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
