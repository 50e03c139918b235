"""LAMB's hyperparameters (DeepSpeed's FusedLamb): the one list every LAMB
backend, the reference and FusedLamb take (see fastzero.ops.hyperparams)."""

from __future__ import annotations

from dataclasses import dataclass

from fastzero.ops.hyperparams import Hyperparams


@dataclass(frozen=True)
class LambHyperparams(Hyperparams):
    """``max_grad_norm`` > 0 clips the global grad norm first (0: off); the
    trust ratio is clamped to [min_coeff, max_coeff]. The C struct is
    ``fz_lamb_hyper`` (csrc/common/hyperparams.h)."""

    family = "LAMB"
    labels = {**Hyperparams.labels, "max_grad_norm": "max_grad_norm (0 disables clipping)"}

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    eps_inside_sqrt: bool = False
    weight_decay: float = 0.0
    bias_correction: bool = True
    max_grad_norm: float = 0.0
    max_coeff: float = 10.0
    min_coeff: float = 0.01

    @property
    def clips_grad_norm(self) -> bool:
        """Whether a step first takes the global grad norm (a pass of its
        own): the backends ask this to plan their passes, and pass the
        values themselves whole to the kernels."""
        return self.max_grad_norm > 0.0

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.min_coeff <= self.max_coeff:
            raise ValueError(
                f"LAMB: invalid trust ratio bounds: need 0 <= min_coeff ({self.min_coeff}) <= "
                f"max_coeff ({self.max_coeff})"
            )
