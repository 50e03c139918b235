"""DeepSpeed's learning-rate schedules (ds_config.json ``scheduler``), with its
formulas and defaults (deepspeed/runtime/lr_schedules.py, 0.19), so a run
that switches keeps its learning-rate curve. Like DeepSpeed's, ``step()`` is
called once per optimizer step and sets every param group's ``lr``; the
constructor already sets the lr of iteration 0.

WarmupLR, WarmupDecayLR and WarmupCosineLR are here; OneCycle and
LRRangeTest are accepted by the config but not yet built (the engine refuses
them with ConfigNotSupported).
"""

from __future__ import annotations

import math

import torch


class WarmupLR:
    r"""From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    (at least 2), then constant. With t the step index:
    ``lr = min + (max - min) * gamma(t)``, ``gamma = log(t + 1) / log(n)``
    (log warm-up) or ``t / n`` (linear) for t < n, else 1."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if not isinstance(warmup_num_steps, int) or warmup_num_steps < 1:
            raise ValueError(f"warmup_num_steps = {warmup_num_steps!r}: must be a positive integer")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type = {warmup_type!r}: must be 'log' or 'linear'")
        self.optimizer = optimizer
        self.min_lr, self.max_lr = float(warmup_min_lr), float(warmup_max_lr)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:  # before the first step: the lr of "no step yet", as DeepSpeed
            self._apply(self.get_lr())

    def _warmup(self, t: int) -> float:
        """Progress of the warm-up at step t, in [0, 1)."""
        if self.warmup_type == "log":
            return math.log(t + 1) / math.log(self.warmup_num_steps)
        return t / self.warmup_num_steps

    def _gamma(self, t: int) -> float:
        return self._warmup(t) if t < self.warmup_num_steps else 1.0

    def _lr(self, t: int) -> float:
        return self.min_lr + (self.max_lr - self.min_lr) * self._gamma(t)

    def get_lr(self) -> list[float]:
        t = self.last_batch_iteration
        return [self.min_lr if t < 0 else self._lr(t)] * len(self.optimizer.param_groups)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._apply(self.get_lr())

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``:
    ``gamma = max(0, (T - t) / max(1, T - n))`` for t >= n."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps = {total_num_steps!r}: must be a positive integer")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return self._warmup(t)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(WarmupLR):
    """Each group's own lr times a ratio: from ``warmup_min_ratio`` to 1 over
    the warm-up, then a cosine from 1 to ``cos_min_ratio`` at
    ``total_num_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps = {total_num_steps!r}: must be a positive integer")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, 0.0, 1.0, warmup_num_steps, warmup_type, last_batch_iteration)

    def _ratio(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup(t) * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        return [lr * self._ratio(self.last_batch_iteration) for lr in self.org_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
