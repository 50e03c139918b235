"""Training metrics every ``steps_per_print`` steps: loss, lr, loss scale,
grad norm, skipped steps (non-finite gradients) so far, step time, samples/s, peak memory (and with
``wall_clock_breakdown`` the forward/backward/step split), to the log and,
when enabled, to TensorBoard (``torch.utils.tensorboard``, DeepSpeed's tag
names), to Weights & Biases (the same tags) and to one CSV file; with
``memory_breakdown`` the memory in use (:mod:`fastzero.runtime.memory_usage`).
The ``flops_profiler`` section's profile of one forward
(:mod:`fastzero.profiling`) is driven from here too. Rank 0 writes; other
ranks only count."""

from __future__ import annotations

import csv
import importlib.util
import logging
import resource
import time
from pathlib import Path

import torch

from fastzero.config import Config, ConfigError
from fastzero.runtime.memory_usage import memory_usage_lines

logger = logging.getLogger("fastzero")

TB_TAGS = {  # DeepSpeed's TensorBoard tags, so dashboards carry over
    "loss": "Train/Samples/train_loss",
    "lr": "Train/Samples/lr",
    "loss_scale": "Train/Samples/loss_scale",
    "grad_norm": "Train/Samples/grad_norm",
    "samples_per_sec": "Train/Samples/samples_per_sec",
    "step_ms": "Train/Samples/step_ms",
    "skipped_steps": "Train/Samples/skipped_steps",
}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on the GPU, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Monitor:
    def __init__(self, cfg: Config, rank: int = 0) -> None:
        self.every = cfg.steps_per_print
        self.breakdown = cfg.wall_clock_breakdown
        self.rank = rank
        self.tb = self.csv = self._csv_file = self.wandb = None
        self.memory = cfg.memory_breakdown
        self.flops_cfg = cfg.flops_profiler
        self.profiler = None  # the flops profiler, built at its step (rank 0)
        self._profiling = False
        self._timers_at_profile: dict[str, float] = {}
        self.history: list[dict] = []  # what was reported, for scripts and tests
        if rank == 0 and cfg.tensorboard.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError(
                    f"tensorboard.enabled needs the tensorboard package ({exc}); pip install tensorboard, or disable it"
                ) from None
            self.tb = SummaryWriter(log_dir=str(Path(cfg.tensorboard.output_path or "runs") / cfg.tensorboard.job_name))
        if cfg.wandb.enabled:
            self.wandb = self._start_wandb(cfg)
        if rank == 0 and cfg.csv_monitor.enabled:
            path = Path(cfg.csv_monitor.output_path or "csv_monitor") / cfg.csv_monitor.job_name / "metrics.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.csv_path = path
            self._csv_file = path.open("a", newline="")
        self._last = time.perf_counter()
        self._steps_since = 0

    def _start_wandb(self, cfg: Config):
        """DeepSpeed's WandbMonitor: ``wandb.init(project, group, entity=team)``
        on rank 0; every rank checks that wandb is installed, so all fail alike."""
        missing = "wandb.enabled needs the wandb package, which is not installed: pip install wandb, or disable it"
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(missing)
        if self.rank != 0:
            return None
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(f"{missing} ({exc})") from None
        return wandb.init(project=cfg.wandb.project, group=cfg.wandb.group, entity=cfg.wandb.team)

    def wants(self, step: int) -> bool:
        """Whether step `step` (1-based) is reported (the engine then computes its grad norm)."""
        return step % self.every == 0

    def log(self, message: str) -> None:
        if self.rank == 0:
            logger.info(message)

    # -- the flops profiler: one forward, at DeepSpeed's step ------------------------------------
    def _profiles(self, engine) -> bool:
        """Whether this forward is profiled: on rank 0, in the step that
        follows `profile_step` completed steps (DeepSpeed's count: the
        default, 1, leaves one step of warm-up). With gradient accumulation
        each micro-batch restarts it: the last one's is reported."""
        return self.flops_cfg.enabled and self.rank == 0 and engine.global_steps == self.flops_cfg.profile_step

    def forward_begin(self, engine) -> None:
        if not self._profiles(engine):
            return
        if self.profiler is None:
            from fastzero.profiling.flops_profiler import FlopsProfiler  # here: it imports the runtime

            self.profiler = FlopsProfiler(engine.module, engine, self.flops_cfg.recompute_fwd_factor)
        self.profiler.start_profile()
        self._profiling = True

    def forward_end(self, engine) -> None:
        if self._profiling:
            self.profiler.stop_profile()
            self._profiling = False
            self._timers_at_profile = dict(engine.timers)  # backward and step latency count from here

    def _report_profile(self, engine) -> None:
        prof = self.profiler
        prof.backward_latency = engine.timers["backward"] - self._timers_at_profile["backward"]
        prof.step_latency = engine.timers["step"] - self._timers_at_profile["step"]
        cfg = self.flops_cfg
        prof.print_model_profile(engine.global_steps, cfg.module_depth, cfg.top_modules, cfg.detailed, cfg.output_file)
        prof.end_profile()

    def step(self, engine) -> None:
        if self.profiler is not None and self.profiler.started and not self._profiling:
            self._report_profile(engine)  # before take_timers() below restarts the timers it reads
        self._steps_since += 1
        if not self.wants(engine.global_steps):
            return
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        row = dict(
            step=engine.global_steps,
            samples=engine.global_samples,
            loss=float(engine.last_loss) if engine.last_loss is not None else float("nan"),
            lr=engine.get_lr()[0],
            loss_scale=engine.loss_scale,
            grad_norm=engine.grad_norm if engine.grad_norm is not None else float("nan"),
            skipped_steps=engine.skipped_steps,
            step_ms=1e3 * elapsed / self._steps_since,
            samples_per_sec=engine.train_batch_size() * self._steps_since / elapsed,
            peak_memory_mb=peak_memory_bytes(engine.device) / 2**20,
        )
        if self.breakdown:
            for key, seconds in engine.take_timers(("forward", "backward", "step")).items():
                row[f"{key}_ms"] = 1e3 * seconds / self._steps_since
        self._steps_since = 0
        self.history.append(row)
        if self.rank != 0:
            return
        self.log(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        if self.tb is not None:
            for key, tag in TB_TAGS.items():
                self.tb.add_scalar(tag, row[key], engine.global_samples)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({tag: row[key] for key, tag in TB_TAGS.items()}, step=engine.global_samples)
        if self._csv_file is not None:
            if self.csv is None:
                self.csv = csv.DictWriter(self._csv_file, fieldnames=list(row))
                if self._csv_file.tell() == 0:
                    self.csv.writeheader()
            self.csv.writerow(row)
            self._csv_file.flush()
        if self.memory:
            for line in memory_usage_lines(engine, f"Engine after step {engine.global_steps}"):
                self.log(line)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self._csv_file is not None:
            self._csv_file.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
