"""FusedLamb: LAMB (DeepSpeed's FusedLamb math) on every device: CUDA or
Triton kernels for CUDA tensors, the SIMD CPU kernel for CPU tensors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fastzero.ops.lamb.backends import FAMILY
from fastzero.ops.lamb.hyperparams import LambHyperparams
from fastzero.ops.optimizer_base import AdamFamilyOptimizer, GroupLists


class FusedLamb(AdamFamilyOptimizer):
    r"""LAMB with fused multi-tensor kernels, wherever the params live.

    DeepSpeed's ``FusedLamb`` signature: ``FusedLamb(params, lr,
    bias_correction, betas, eps, eps_inside_sqrt, weight_decay,
    max_grad_norm, max_coeff, min_coeff, amsgrad)``, plus ``master_weights``
    and ``fp32_optimizer_states`` as in :class:`FusedAdam` (and any other
    field of :class:`LambHyperparams` as a keyword). Per tensor, in fp32
    (:func:`fastzero.ops.lamb.reference.lamb_step`):

    .. math::
        \hat g = g / s;\ m \leftarrow \beta_1 m + (1-\beta_1)\hat g;\
        v \leftarrow \beta_2 v + (1-\beta_2)\hat g^2;\
        u = \frac{m}{\sqrt v + \epsilon} + \text{wd}\,p;\
        r = \text{clamp}(\lVert p\rVert / \lVert u\rVert);\
        p \leftarrow p - \text{lr}\frac{\sqrt{bc_2}}{bc_1} r u

    where ``s`` clips the group's global grad norm to ``max_grad_norm`` (when
    > 0). :meth:`get_lamb_coeffs` returns the last trust ratios. Norms are
    computed on the device, with no host sync per tensor.
    """

    family, hyperparams = FAMILY, LambHyperparams

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        *,
        master_weights: bool = False,
        fp32_optimizer_states: bool = True,
        backend: str | None = None,
        **hyper: Any,
    ) -> None:
        if amsgrad:
            raise ValueError("FusedLamb does not implement amsgrad")
        hp = LambHyperparams.from_kwargs(
            lr=lr,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            **hyper,
        )
        super().__init__(
            params,
            hp,
            fp32_optimizer_states=fp32_optimizer_states,
            master_weights=master_weights,
            backend=backend,
        )
        self._coeffs: dict[int, list[float] | Tensor] = {}

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, group by group, one per param
        that had a grad (a host sync on the GPU path: call it when needed)."""
        out: list[float] = []
        for gi in sorted(self._coeffs):
            c = self._coeffs[gi]
            out += c.tolist() if isinstance(c, Tensor) else list(c)
        return out

    def _keep(self, gi: int, ratios) -> None:
        self._coeffs[gi] = ratios

    def _device_extra(self, gi: int, lists: GroupLists) -> dict:
        """The device tensor the kernels write the trust ratios into."""
        coeffs = self._coeffs.get(gi)
        if not isinstance(coeffs, Tensor) or coeffs.numel() != len(lists.params) or coeffs.device != lists.device:
            coeffs = torch.ones(len(lists.params), dtype=torch.float32, device=lists.device)
            self._coeffs[gi] = coeffs
        return {"coeffs_out": coeffs}
