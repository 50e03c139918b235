"""DeepSpeed's learning-rate schedules (ds_config.json ``scheduler``), with its
formulas and defaults (deepspeed/runtime/lr_schedules.py, 0.19), so a run
that switches keeps its learning-rate curve. Like DeepSpeed's, ``step()`` is
called once per optimizer step and sets every param group's ``lr``; the
constructor sets the lr used before the first ``step()``.

One deliberate difference: OneCycle cycles beta1 and keeps each group's own
beta2, where DeepSpeed's sets beta2 to 0.99 whatever it was.
"""

from __future__ import annotations

import math

import torch


class _Schedule:
    """What every schedule shares: ``step()`` advances the step index and
    writes ``get_lr()`` into the param groups; the state is that index."""

    optimizer: torch.optim.Optimizer
    last_batch_iteration: int

    def get_lr(self) -> list[float]:
        raise NotImplementedError

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


class WarmupLR(_Schedule):
    r"""From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    (at least 2), then constant. With t the step index:
    ``lr = min + (max - min) * gamma(t)``, ``gamma = log(t + 1) / log(n)``
    (log warm-up) or ``t / n`` (linear) for t < n, else 1. ``warmup_max_lr``
    None (WarmupLR's default, as DeepSpeed's): each param group's lr when
    the schedule is made."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if not isinstance(warmup_num_steps, int) or warmup_num_steps < 1:
            raise ValueError(f"warmup_num_steps = {warmup_num_steps!r}: must be a positive integer")
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type = {warmup_type!r}: must be 'log' or 'linear'")
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.min_lr = float(warmup_min_lr)
        self.max_lrs = [float(g["lr"] if warmup_max_lr is None else warmup_max_lr) for g in groups]
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

    def get_lr(self) -> list[float]:
        t = self.last_batch_iteration
        if t < 0:
            return [self.min_lr] * len(self.max_lrs)
        gamma = self._gamma(t)
        return [self.min_lr + (top - self.min_lr) * gamma for top in self.max_lrs]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``:
    ``gamma = max(0, (T - t) / max(1, T - n))`` for t >= n."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = 0.001,
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


class LRRangeTest(_Schedule):
    """The learning-rate range test: ``lr = min_lr * (1 + step_rate * k)``,
    k = (t + 1) / step_size (or its floor with ``staircase``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float = 0.001,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size < 1:
            raise ValueError(f"lr_range_test_step_size = {lr_range_test_step_size!r}: must be a positive integer")
        self.optimizer = optimizer
        self.min_lr, self.step_size = float(lr_range_test_min_lr), lr_range_test_step_size
        self.step_rate, self.staircase = float(lr_range_test_step_rate), lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._apply([self.min_lr] * len(optimizer.param_groups))

    def get_lr(self) -> list[float]:
        k = (self.last_batch_iteration + 1) / self.step_size
        k = math.floor(k) if self.staircase else k
        return [self.min_lr * (1 + self.step_rate * k)] * len(self.optimizer.param_groups)


class OneCycle(_Schedule):
    """1cycle: the lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and falls back over
    ``cycle_second_step_size`` (default: the same), in stairs when the stair
    counts are > 0; then it decays as ``min_lr / (1 + decay_lr_rate * d /
    decay_step_size)``, d the steps since the cycle (no decay when either is
    0). With ``cycle_momentum`` (optimizers with ``betas``), beta1 moves the
    other way between ``cycle_max_mom`` and ``cycle_min_mom``, then grows as
    ``max_mom * (1 + decay_mom_rate * d / decay_step_size)``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0 or second < 0:
            raise ValueError(
                f"cycle_first_step_size = {cycle_first_step_size!r} must be > 0 and cycle_second_step_size = "
                f"{cycle_second_step_size!r} >= 0"
            )
        self.optimizer = optimizer
        self.first, self.second, self.total = first, second, first + second
        second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.stairs = (cycle_first_stair_count, second_stairs)
        self.min_lr, self.max_lr = float(cycle_min_lr), float(cycle_max_lr)
        self.min_mom, self.max_mom = float(cycle_min_mom), float(cycle_max_mom)
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = float(decay_lr_rate) if decay_step_size else 0.0
        self.decay_mom_rate = float(decay_mom_rate) if decay_step_size else 0.0
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._apply([self.min_lr] * len(optimizer.param_groups))
            if self.cycle_momentum:
                self._apply_momentum(self.min_mom)

    def _scale(self) -> float:
        """Where step t + 1 stands in the cycle: 0 at its ends, 1 at its peak."""
        t = self.last_batch_iteration + 1
        x = 1.0 + t / self.total - math.floor(1 + t / self.total)
        ratio = self.first / self.total
        rising = x <= ratio
        scale = x / ratio if rising else (x - 1) / (ratio - 1)
        stairs = self.stairs[0 if rising else 1]
        if stairs > 0:
            into = t % self.total
            position = into * stairs / self.first if into <= self.first else (self.total - into) * stairs / self.second
            scale = math.floor(position) / stairs
        return scale

    def _decay(self) -> float:
        """Decay intervals since the cycle ended."""
        return (self.last_batch_iteration - self.total + 1) / self.decay_step_size if self.decay_step_size else 0.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self._scale()
        else:
            lr = self.min_lr / (1 + self.decay_lr_rate * self._decay())
        return [lr] * len(self.optimizer.param_groups)

    def get_momentum(self) -> float:
        if self.last_batch_iteration < self.total:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale()
        return self.max_mom * (1 + self.decay_mom_rate * self._decay())

    def get_mom(self) -> list[tuple[float, float]] | None:
        """DeepSpeed's ``OneCycle.get_mom``: each group's ``(beta1, beta2)`` at
        ``last_batch_iteration`` (beta1 from :meth:`get_momentum`, each
        group's own beta2), or None when momentum does not cycle."""
        if not self.cycle_momentum:
            return None
        beta1 = self.get_momentum()
        return [(beta1, group["betas"][1]) for group in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._apply_momentum(self.get_momentum())

    def _apply_momentum(self, beta1: float) -> None:
        for group in self.optimizer.param_groups:
            group["betas"] = (beta1, group["betas"][1])


SCHEDULES = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}

# DeepSpeed's names of the schedules (``deepspeed.runtime.lr_schedules``), which scripts and Hugging Face check
# a scheduler type against
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
)
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
assert set(VALID_LR_SCHEDULES) == set(SCHEDULES)
