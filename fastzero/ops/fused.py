"""The device dispatch FusedAdam and FusedLamb share: per param group, the
backend for its device (the fastest here, or the one forced), then one call of
that backend's functional step, with loss scaling passed the way it wants."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fastzero.ops.backend import device_backend
from fastzero.ops.optimizer import AdamFamilyOptimizer, GroupLists


def device_kernel(backend: str, name: str) -> Callable:
    """The function `name` ('adam_step' or 'lamb_step') of a device backend:
    fastzero.ops.cuda, or fastzero.triton_kernels.adam / .lamb."""
    if backend == "cuda":
        from fastzero.ops import cuda

        return getattr(cuda, name)
    return getattr(importlib.import_module(f"fastzero.triton_kernels.{name.removesuffix('_step')}"), name)


def as_device_scalar(x: float | Tensor | None, device: torch.device) -> Tensor | None:
    """A 0-d fp32 tensor on `device` (a GradScaler's scale is one already)."""
    if x is None:
        return None
    if isinstance(x, Tensor):
        return x.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(x), dtype=torch.float32, device=device)


class FusedOptimizer(AdamFamilyOptimizer):
    """Subclasses name their op and kernel and give the group's hyperparameters
    (``_hyper``), the CPU and reference steps, and optionally extra device
    arguments (``_device_extra``) and what to keep of a step's result
    (``_keep``)."""

    _op_name = ""
    _kernel_name = ""  # the device backends' function

    def __init__(self, params, defaults: dict, *, backend: str | None = None, **kwargs: Any) -> None:
        super().__init__(params, defaults, **kwargs)
        self.force_backend = backend  # None: the fastest here, or FASTZERO_BACKEND
        self.last_backend: str | None = None

    @property
    def backend(self) -> str:
        """The backend a step runs for the first param's device."""
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return "none" if first is None else device_backend(self._op_name, first.device.type, self.force_backend)

    def _hyper(self, group: dict) -> dict:
        raise NotImplementedError

    def _host_step(self, backend: str) -> Callable:
        """The functional step of the 'cpu' or 'reference' backend."""
        raise NotImplementedError

    def _device_extra(self, gi: int, lists: GroupLists) -> dict:
        return {}

    def _keep(self, gi: int, result) -> None:
        pass

    def _update(self, gi: int, group: dict, lists: GroupLists, step, grad_scale, found_inf) -> None:
        backend = device_backend(self._op_name, lists.device.type, self.force_backend)
        self.last_backend = backend
        tensors = (lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs)
        hyper = dict(self._hyper(group), param_copies=lists.param_copies)
        if backend in ("cpu", "reference"):
            if found_inf is not None and lists.device.type != "cpu" and bool(found_inf):
                return  # the reference on a GPU: a host sync, the fallback's price
            scale = None if grad_scale is None else float(grad_scale)
            self._keep(gi, self._host_step(backend)(*tensors, step=int(step), grad_scale=scale, **hyper))
            return
        device = lists.device
        device_kernel(backend, self._kernel_name)(
            *tensors,
            step=step if isinstance(step, Tensor) else torch.tensor(float(step), device=device),
            grad_scale=as_device_scalar(grad_scale, device),
            found_inf=as_device_scalar(found_inf, device),
            **self._device_extra(gi, lists),
            **hyper,
        )
