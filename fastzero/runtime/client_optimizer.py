"""Any ``torch.optim.Optimizer`` the script passes that fastzero has no fused
kernel for (SGD, Adagrad, RMSprop, a custom one): rebuilt as
``type(client)(groups, **client.defaults)`` over the rank's fp32 masters of
what it updates (the shard's chunks at stages 1-3, the params at stage 0),
and stepped unfused.

A step, after the engine has folded the loss scale, the 1/(ranks x
micro-batches) average and the clipping factor into ``grad_scale``::

    master.grad = fp32(grad) / grad_scale      (in place on the grad in fp32 training)
    inner.step()                               (the client's own math)
    param = master                             (cast to bf16/fp16, or back from the CPU)

Masters: a fp32 copy of each tensor with bf16/fp16 training or with
``offload_optimizer`` (then in CPU memory); in fp32 training on the device
the tensor is its own master. With temporaries (fp32 grads of separate
masters) the step runs in sub-groups of whole tensors of at most
``sub_group_size`` elements (a larger tensor is a sub-group of its own), so
the fp32 grads alive at once are bounded; each sub-group is one
``inner.step()`` over the tensors that have a grad (so an optimizer that
counts its ``step()`` calls per group, not per param as torch's do, counts
each sub-group: keep ``sub_group_size`` above the shard for it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastzero.config import ConfigError
from fastzero.ops.optimizer_base import LossScaleViews


class LinkedGroup(dict):
    """A param group of the script's own optimizer after the engine replaced
    it: a key set on it (``group["lr"] = ...``, as lr schedulers do) is set
    on the engine optimizer's groups built from it too."""

    def __init__(self, group: dict, targets: list[dict]) -> None:
        super().__init__(group)
        self.targets = targets

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key != "params":
            for target in self.targets:
                target[key] = value


def link_client_groups(client: torch.optim.Optimizer, optimizer: torch.optim.Optimizer, params: list[list[Tensor]]):
    """The script's optimizer, which the engine rebuilt as `optimizer` (its
    groups over `params`, the model's params of each), keeps steering it:
    each of its param groups becomes a :class:`LinkedGroup` of the engine's
    groups built from it, so an lr scheduler built on it and stepped by the
    script (DeepSpeed runs the script's optimizer itself, so such a
    scheduler works there) sets the lrs the engine's steps use. Keys the
    engine's groups lack (a scheduler's ``initial_lr``) are copied over."""
    owner = {}
    for ci, group in enumerate(client.param_groups):
        for p in [group["params"]] if isinstance(group["params"], Tensor) else group["params"]:
            owner[id(p)] = ci
    targets: dict[int, list[dict]] = {}
    for own, group in zip(params, optimizer.param_groups, strict=True):
        targets.setdefault(owner[id(own[0])], []).append(group)
    for ci, group in enumerate(client.param_groups):
        for target in targets.get(ci, ()):
            target.update({k: v for k, v in group.items() if k != "params" and k not in target})
        if ci in targets:
            client.param_groups[ci] = LinkedGroup(group, targets[ci])
    # torch's schedulers warn on their first step() unless the optimizer's step() ran; the engine's steps stand
    # in for the script's optimizer's, which never runs
    client._opt_called = True


def sub_groups(tensors: list[Tensor], limit: int) -> list[list[Tensor]]:
    """`tensors`, in order, cut into runs of at most `limit` elements (a
    tensor larger than `limit` alone)."""
    out: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        if not out or size + t.numel() > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel()
    return out


class ClientOptimizer(LossScaleViews, torch.optim.Optimizer):
    """The engine's optimizer for a client optimizer of any class.
    ``param_groups`` and ``state`` are the rebuilt optimizer's (``inner``):
    the masters, keyed as torch keys them, so an lr scheduler and the
    checkpoints see the client's own hyperparameters and state names."""

    def __init__(
        self,
        client: torch.optim.Optimizer,
        groups: list[dict],
        *,
        master_weights: bool,
        offload: bool = False,
        pin_memory: bool = False,
        sub_group_size: int = 1_000_000_000,
    ) -> None:
        cls = type(client)
        self.state_kind = f"{cls.__module__}.{cls.__qualname__}"  # checkpoints load state of the same class only
        self.offloaded = offload
        self.target: dict[Tensor, Tensor] = {}  # master -> the tensor the engine updates (when they differ)
        pin = offload and pin_memory and torch.cuda.is_available()
        inner_groups = []
        for g in groups:
            masters = []
            for p in g["params"]:
                if offload or (master_weights and p.dtype != torch.float32):
                    device = torch.device("cpu") if offload else p.device
                    m = torch.empty(p.shape, dtype=torch.float32, device=device, pin_memory=pin)
                    m.copy_(p.detach())
                    self.target[m] = p
                else:
                    m = p
                masters.append(m)
            inner_groups.append({**g, "params": masters})
        try:
            self.inner = cls(inner_groups, **client.defaults)
        except TypeError as exc:
            raise ConfigError(
                f"optimizer={cls.__name__}: fastzero rebuilds it over each rank's shard as "
                f"{cls.__name__}(param_groups, **optimizer.defaults), which failed ({exc}); give its constructor "
                "keyword arguments named as its defaults"
            ) from exc
        super().__init__([{"params": []}], {})  # torch.optim's hooks; the groups and state are the inner's
        self._share()
        if offload:  # what Engine.memory_breakdown reports as offload_* (it looks for this attribute)
            self.offloaded_bytes = self._offloaded_bytes
        masters = [m for g in self.param_groups for m in g["params"]]
        # fp32 training on the device: the grads are scaled in place, nothing temporary to bound
        self.sub_groups = sub_groups(masters, sub_group_size) if self.target else [masters]

    def _share(self) -> None:
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults

    def __repr__(self) -> str:
        return f"ClientOptimizer({self.inner!r})"

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | Tensor | None = None, found_inf=None):
        """One step of the client's math over the masters, the grads divided
        by `grad_scale` first; nothing when `found_inf` is set."""
        if closure is not None:
            raise ValueError(
                "the engine's optimizer.step() takes no closure: the engine runs forward and backward itself"
            )
        if found_inf is not None and bool(found_inf):
            return None
        inv = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        for sub in self.sub_groups:
            for m in sub:
                src = self.target.get(m)
                if src is None:  # the tensor is its own master: its grad, scaled in place
                    if m.grad is not None and inv != 1.0:
                        m.grad.mul_(inv)
                    continue
                g = src.grad
                m.grad = None if g is None else g.to(device=m.device, dtype=torch.float32, copy=True).mul_(inv)
            self.inner.step()
            for m in sub:
                src = self.target.get(m)
                if src is not None:
                    m.grad = None  # the temporary goes
                    src.detach().copy_(m, non_blocking=False)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine zeroes the gradients after each step, and the
        masters' fp32 grads live only during one (a script's
        ``optimizer.zero_grad()`` must not detach the engine's gradient views)."""

    def init_state(self, p: Tensor) -> dict:
        """The live state of master `p` (empty before the first step for
        optimizers that create it lazily, as torch's do)."""
        return self.inner.state[p]

    def sync_device_params(self) -> None:
        """The engine's tensors from their masters (after a checkpoint load)."""
        with torch.no_grad():
            for m, p in self.target.items():
                p.detach().copy_(m)

    def master_bytes(self) -> int:
        """Bytes of the separate fp32 masters (0 in fp32 training on the device)."""
        return sum(m.numel() * m.element_size() for m in self.target)

    def _offloaded_bytes(self) -> dict[str, int]:
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        states = [t for s in self.state.values() for t in s.values() if isinstance(t, Tensor) and t.dim() > 0]
        return {"master": self.master_bytes(), "optimizer": nbytes(states), "staging": 0}

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        self._share()  # torch replaces its groups and state
        self.sync_device_params()
