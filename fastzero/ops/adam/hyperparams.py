"""Adam/AdamW's hyperparameters: the one list every Adam backend, the
reference and the optimizer classes take (see fastzero.ops.hyperparams)."""

from __future__ import annotations

from dataclasses import dataclass

from fastzero.ops.hyperparams import Hyperparams, check_range


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

    def validate(self) -> None:
        check_range(self.family, self.labels["lr"], self.lr, 0.0)
        check_range(self.family, "beta1", self.beta1, 0.0, 1.0, open_high=True)
        check_range(self.family, "beta2", self.beta2, 0.0, 1.0, open_high=True)
        check_range(self.family, "eps", self.eps, 0.0)
        check_range(self.family, "weight_decay", self.weight_decay, 0.0)
