"""A DeepSpeed training script, written against DeepSpeed's public API; the
one line that differs is the import. ZeRO-3 with ``zero.Init`` and a weight
init under ``GatheredParameters``, the engine used as the module, a
checkpoint saved and loaded with DeepSpeed's arguments, ``deepspeed.comm``,
and the fp32 weights recovered with the ``zero_to_fp32`` helper.

    fastzero --num_gpus 2 gpt2_zero3.py --deepspeed --deepspeed_config ds.json --out result.pt
"""

import argparse

import torch
import transformers

import fastzero as deepspeed  # the only change from the DeepSpeed script

SEQ, VOCAB = 16, 96


def get_args():
    parser = argparse.ArgumentParser(description="GPT-2 under ZeRO-3")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_dir", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def gpt2_config():
    return transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def init_embeddings(weight: torch.Tensor) -> None:
    """The script's own init of the token embeddings (a seeded normal)."""
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)) * 0.05)


def init_weights(model) -> None:
    """The model's own init (Hugging Face's), then the token embeddings'."""
    torch.manual_seed(1)
    model.apply(model._init_weights)
    init_embeddings(model.transformer.wte.weight)


def global_batch(step: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    start = torch.randint(0, VOCAB, (rows, 1), generator=gen)
    stride = torch.randint(1, 5, (rows, 1), generator=gen)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(gpt2_config())
    # zero.Init partitioned each layer as it was built, before the model's own post-init could reach the weights
    # (as with DeepSpeed): run it on the gathered params, on rank 0, whose values every rank then keeps
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            init_weights(model)

    engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    assert engine.module.config.n_embd == 32, "the wrapped model's config"
    assert isinstance(engine.config, (dict, str)), "as DeepSpeed's engine: the config given to initialize"
    micro = engine.train_micro_batch_size_per_gpu()
    engine.train()

    def train(steps):
        losses = []
        for step in steps:
            tokens = global_batch(step, micro * world)[rank * micro : (rank + 1) * micro]
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            deepspeed.comm.all_reduce(mean)
            losses.append(mean.item() / world)
        return losses

    half = args.steps // 2
    losses = train(range(half))
    engine.save_checkpoint(args.save_dir, tag="half", client_state={"step": half})
    losses += train(range(half, args.steps))
    first_pass = {n: p.clone() for n, p in engine.state_dict().items()}  # stage 3: gathered on every rank

    # back to the middle, with DeepSpeed's arguments, and the second half again
    path, client = engine.load_checkpoint(
        args.save_dir, tag="half", load_optimizer_states=True, load_lr_scheduler_states=True
    )
    assert client["step"] == half and engine.global_steps == half, (client, engine.global_steps)
    again = train(range(client["step"], args.steps))
    engine.save_checkpoint(args.save_dir, tag="final")
    deepspeed.comm.barrier()
    if rank == 0:
        fp32 = deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(args.save_dir, tag="final")
        torch.save(
            dict(
                losses=losses,
                again=again,
                first_pass=first_pass,
                state=engine.state_dict(),
                fp32=fp32,
                lr=engine.get_lr(),
                world=world,
            ),
            args.out,
        )
    else:
        engine.state_dict()  # a collective at stage 3: every rank takes part
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
