"""AutoTP for training: shards an unmodified model's Linear layers into
column- and row-parallel layers across the tensor group.

Known Hugging Face architectures carry a built-in plan (GPT-2, whose
projections are ``Conv1D`` with the fused q/k/v in ``c_attn``; LLaMA-style
models: q/k/v/o and gate/up/down). Any other model takes a plan from the
user: module-name regex -> ``"colwise"`` | ``"rowwise"`` | ``"replicate"``.
A Linear layer that no plan names is an error, never left replicated
silently. The output (LM head) stays replicated, so logits are
full-vocabulary and tied weights stay tied.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from fastzero.parallel import groups

STYLES = ("colwise", "rowwise", "replicate")

# model_type -> (module-name regex, style, partition stride); matched against the full module name.
_GPT2 = [
    (r"(^|\.)attn\.c_attn$", "colwise", 3),  # q, k, v fused: each split by heads (Megatron's stride 3)
    (r"(^|\.)attn\.c_proj$", "rowwise", 1),
    (r"(^|\.)mlp\.c_fc$", "colwise", 1),
    (r"(^|\.)mlp\.c_proj$", "rowwise", 1),
    (r"(^|\.)lm_head$", "replicate", 1),
]
_LLAMA = [
    (r"(^|\.)self_attn\.(q_proj|k_proj|v_proj)$", "colwise", 1),
    (r"(^|\.)self_attn\.o_proj$", "rowwise", 1),
    (r"(^|\.)mlp\.(gate_proj|up_proj)$", "colwise", 1),
    (r"(^|\.)mlp\.down_proj$", "rowwise", 1),
    (r"(^|\.)lm_head$", "replicate", 1),
]
PLANS: dict[str, list[tuple[str, str, int]]] = {
    "gpt2": _GPT2,
    **{t: _LLAMA for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "granite")},
}


def _shardable(module: nn.Module) -> bool:
    """An nn.Linear or Hugging Face's Conv1D (a Linear with its weight stored [in, out])."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def _plan_for(model: nn.Module, plan: dict[str, str] | None) -> list[tuple[str, str, int]]:
    if plan is not None:
        out = []
        for pattern, style in plan.items():
            if style not in STYLES:
                raise ValueError(f"AutoTP plan {pattern!r}: {style!r} is not one of {', '.join(STYLES)}")
            re.compile(pattern)
            out.append((pattern, style, 1))
        return out
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in PLANS:
        return PLANS[model_type]
    known = ", ".join(sorted(PLANS))
    raise ValueError(
        f"AutoTP has no built-in plan for this model (model_type {model_type!r}; known: {known}): pass "
        "plan={module-name regex: 'colwise' | 'rowwise' | 'replicate'} naming every Linear layer"
    )


def _check_heads(model: nn.Module, tp: int) -> None:
    """Attention heads, KV heads and the MLP width must split evenly across the tensor group."""
    cfg = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "n_inner", "hidden_size"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value % tp:
            raise ValueError(
                f"AutoTP at tensor-parallel size {tp}: the model's {key} = {value} is not divisible by {tp}; pick a "
                f"tensor-parallel size that divides it"
            )


def _shard(module: nn.Module, style: str, stride: int, group) -> nn.Module:
    """This rank's column or row slice of `module` (an nn.Linear or a Conv1D, whose [in, out] layout and names
    the parallel layer keeps)."""
    from fastzero.parallel.layers import ColumnParallelLinear, RowParallelLinear

    if style == "colwise":
        return ColumnParallelLinear.from_linear(module, gather_output=False, stride=stride, group=group)
    return RowParallelLinear.from_linear(module, input_is_parallel=True, group=group)


def _fix_attention(model: nn.Module, tp: int) -> None:
    """GPT-2's attention splits c_attn's output by its ``split_size`` (the
    hidden size): each rank holds hidden / tp of each of q, k, v."""
    for module in model.modules():
        if type(module).__name__ == "GPT2Attention" and hasattr(module, "split_size"):
            module.split_size //= tp
            module.num_heads //= tp
            module.embed_dim //= tp


def _tensor_group(tp_size: int, group: Any, topology: Any, mpu: Any):
    if group is None and topology is None and mpu is None and groups.current() is None:
        world = groups.group_size(None)
        if tp_size != world:
            from fastzero.parallel.topology import Topology

            Topology(tensor=tp_size).make_current()
    tensor = groups.tensor_group(group, topology=topology, mpu=mpu)
    size = groups.group_size(tensor)
    if size != tp_size:
        raise ValueError(
            f"tp_model_init(tp_size={tp_size}): the tensor-parallel group has {size} ranks; pass the topology's "
            f"tensor size, or a topology/mpu whose tensor group has {tp_size} ranks"
        )
    return tensor


def tp_model_init(
    model: nn.Module,
    tp_size: int,
    dtype: torch.dtype | None = None,
    *,
    plan: dict[str, str] | None = None,
    group: Any = None,
    topology: Any = None,
    mpu: Any = None,
) -> nn.Module:
    """Shards `model` in place for tensor parallelism of size `tp_size` and
    returns it (call after ``fastzero.init_distributed()``). Every rank must
    hold the same weights (build the model with the same seed, or load the
    same checkpoint). `dtype` casts the model afterwards. The tensor group
    is that of `group`/`topology`/`mpu`, else the current topology's, else
    a new ``Topology(tensor=tp_size)`` made current (the whole world when
    `tp_size` is the world size). Calling it again at the same size does
    nothing."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init(tp_size={tp_size!r}): must be an int >= 1")
    done = getattr(model, "_fastzero_tp_size", None)
    if done is not None:
        if done != tp_size:
            raise ValueError(f"the model is already sharded at tensor-parallel size {done}, not {tp_size}")
        return model if dtype is None else model.to(dtype)
    if tp_size > 1:
        entries = _plan_for(model, plan)
        tensor = _tensor_group(tp_size, group, topology, mpu)
        if plan is None:
            _check_heads(model, tp_size)
        chosen, unplanned = [], []
        for name, module in model.named_modules():
            if not _shardable(module):
                continue
            match = next(((style, stride) for pattern, style, stride in entries if re.search(pattern, name)), None)
            if match is None:
                unplanned.append(name)
            elif match[0] != "replicate":
                chosen.append((name, *match))
        if unplanned:
            shown = ", ".join(unplanned[:8]) + (" ..." if len(unplanned) > 8 else "")
            raise ValueError(
                f"AutoTP: no plan entry for the Linear layers {shown}; add them to plan= as 'colwise', 'rowwise' "
                "or 'replicate'"
            )
        for name, style, stride in chosen:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, _shard(getattr(parent, child), style, stride, tensor))
        if plan is None:
            _fix_attention(model, tp_size)
    model._fastzero_tp_size = tp_size
    return model if dtype is None else model.to(dtype)
