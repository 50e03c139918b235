"""Adam/AdamW's hyperparameters: the one list every Adam backend, the
reference and the optimizer classes take (see fastzero.ops.hyperparams)."""

from __future__ import annotations

from dataclasses import dataclass

from fastzero.ops.hyperparams import Hyperparams


@dataclass(frozen=True)
class AdamHyperparams(Hyperparams):
    """``adamw_mode``: decoupled weight decay (AdamW) when True, L2 added to
    the gradient (Adam) when False. The C struct is ``fz_adam_hyper``
    (csrc/common/hyperparams.h)."""

    family = "Adam"

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    bias_correction: bool = True
    adamw_mode: bool = True
