"""One rank of an AutoTP check (started by tests/dist.py). Arguments: the
architecture ("gpt2" or "llama") and an output path. Every rank builds the
same small Hugging Face model from a config (no downloads) and a twin,
shards the model with fastzero.tp_model_init over the whole world, runs one
forward and backward of both on the same batch, and saves the logits, the
loss and every param's gradient next to the twin's (the sharded params'
twin gradients cut to this rank's piece)."""

import sys

import torch

import fastzero
from fastzero.parallel import groups

VOCAB, SEQ, BATCH = 96, 12, 3


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=48,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def main(arch: str, out: str) -> None:
    fastzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, twin = build(arch).eval(), build(arch).eval()
    fastzero.tp_model_init(model, tp_size=world)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    results = {}
    for name, m in (("tp", model), ("twin", twin)):
        outputs = m(input_ids=ids, labels=ids)
        outputs.loss.backward()
        results[name] = dict(logits=outputs.logits.detach(), loss=outputs.loss.detach())
    grads = {}
    twin_params = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        ref = twin_params[name].grad
        if groups.is_tensor_parallel(p):  # this rank's pieces: `stride` of them, pieces rank, rank + world, ...
            pieces = ref.chunk(world * p.partition_stride, p.partition_dim)
            ref = torch.cat(pieces[rank::world], p.partition_dim)
        grads[name] = (p.grad.detach().clone(), ref.clone(), groups.is_tensor_parallel(p))
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight is model.get_input_embeddings().weight
    torch.save(dict(results=results, grads=grads, tied=tied), f"{out}.rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
