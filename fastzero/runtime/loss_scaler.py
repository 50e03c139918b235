"""Loss scaling for fp16 training, with DeepSpeed's semantics (the ``fp16``
section of ds_config.json), so a run that switches keeps its scale curve.

The scaler only keeps the scale; the fused optimizers divide the grads by it
inside their kernels and skip the step on ``found_inf``.
"""

from __future__ import annotations

from fastzero.config import FP16Config


class LossScaleAtMinimum(RuntimeError):
    """Overflow at the minimum loss scale: training cannot go on in fp16."""


class StaticLossScaler:
    """A fixed scale (``fp16.loss_scale > 0``); overflowed steps are still skipped."""

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"loss scale {scale}: must be > 0")
        self.loss_scale = float(scale)

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"loss_scale": self.loss_scale}

    def load_state_dict(self, sd: dict) -> None:
        self.loss_scale = float(sd["loss_scale"])


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler.

    On overflow the step is skipped and, once ``hysteresis`` overflows have
    been absorbed, the scale is halved (never below ``min_loss_scale``; an
    overflow at the minimum raises :class:`LossScaleAtMinimum`). After
    ``loss_scale_window`` clean steps since the last overflow the scale
    doubles and the hysteresis is restored (with ``consecutive_hysteresis`` it
    is restored by every clean step).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        raise_at_min: bool = True,
    ) -> None:
        if not init_scale > 0 or not min_scale > 0 or scale_window < 1 or hysteresis < 1:
            raise ValueError(
                f"DynamicLossScaler(init_scale={init_scale}, scale_window={scale_window}, min_scale={min_scale}, "
                f"hysteresis={hysteresis}): scales must be > 0, window and hysteresis >= 1"
            )
        self.loss_scale = float(init_scale)
        self.scale_window, self.min_scale = scale_window, float(min_scale)
        self.hysteresis, self.consecutive_hysteresis = hysteresis, consecutive_hysteresis
        self.raise_at_min = raise_at_min
        self.cur_hysteresis = hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        """Called once per step, with whether any rank's grads overflowed."""
        if overflow:
            if self.cur_hysteresis <= 1:
                if self.loss_scale == self.min_scale and self.raise_at_min:
                    raise LossScaleAtMinimum(
                        f"gradients overflowed at the minimum loss scale {self.min_scale}: lower "
                        "fp16.min_loss_scale, or train in bf16"
                    )
                self.loss_scale = max(self.loss_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            clean = self.cur_iter - self.last_overflow_iter - 1  # clean steps before this one
            if clean > 0 and clean % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.loss_scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("loss_scale", "cur_hysteresis", "cur_iter", "last_overflow_iter")}

    def load_state_dict(self, sd: dict) -> None:
        for key, value in sd.items():
            setattr(self, key, value)


def loss_scaler_from_config(fp16: FP16Config) -> StaticLossScaler | DynamicLossScaler:
    """The scaler that ds_config's ``fp16`` section asks for."""
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )
