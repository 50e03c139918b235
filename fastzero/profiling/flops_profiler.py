"""DeepSpeed's flops profiler (``deepspeed.profiling.flops_profiler``, v0.16
API): FLOPs, MACs, params and forward latency of every module of a model.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` (a
``TorchDispatchMode``: it sees every aten op, also those called through
``torch.nn.functional`` or tensor methods). A forward pre-hook and hook on
each module read its running total at entry and exit, so a module's FLOPs are
those of every op run inside its forward, its submodules' included, and its
latency is the wall time of its forward (CUDA synchronized first). What it
counts is what ``FlopCounterMode`` counts: matmuls (``mm``, ``addmm``,
``bmm``, ``baddbmm``), convolutions and attention, at 2 FLOPs per
multiply-accumulate (a Linear of ``n`` inputs, ``m`` outputs on ``b`` rows is
``2 * b * n * m``; its bias is not counted). Elementwise ops, norms and
softmax count 0, where DeepSpeed estimates them. MACs = FLOPs / 2.

    prof = FlopsProfiler(model)
    prof.start_profile()
    model(batch)
    prof.stop_profile()
    flops, params = prof.get_total_flops(), prof.get_total_params()
    prof.print_model_profile(profile_step=1)
    prof.end_profile()
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from fastzero.profiling import report
from fastzero.runtime.stage3 import logical_shape


@dataclass
class ModuleProfile:
    """What one module's forwards did while profiling (summed over calls)."""

    params: int = 0
    flops: int = 0
    duration: float = 0.0
    calls: int = 0
    entered: list = field(default_factory=list)  # (flops, time) at each open call's entry


def _synchronize() -> None:
    # latency is the kernels' time, not their launch's (DeepSpeed synchronizes the accelerator too)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class FlopsProfiler:
    """Measures FLOPs, MACs, params and forward latency of each module of
    `model` (DeepSpeed's ``FlopsProfiler``). `ds_engine`, when given, is
    the engine whose world size and micro-batch size the report states;
    `recompute_fwd_factor` is the share of the forward that activation
    checkpointing runs again in backward (backward FLOPs are estimated as
    ``(2 + recompute_fwd_factor) x`` the forward's)."""

    def __init__(self, model: torch.nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"FlopsProfiler(model): model must be a torch.nn.Module, got {type(model).__name__}")
        if recompute_fwd_factor < 0:
            raise ValueError(f"recompute_fwd_factor = {recompute_fwd_factor!r}: must be >= 0")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.profiles: dict[torch.nn.Module, ModuleProfile] = {}
        self._counter: FlopCounterMode | None = None
        self._handles: list = []
        # measured by the caller (the engine's monitor) around the profiled forward; None: not reported
        self.backward_latency: float | None = None
        self.step_latency: float | None = None

    # -- profiling ---------------------------------------------------------------------------
    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        """Resets the counts, hooks every module (but those whose type is in
        `ignore_list`: their FLOPs count in their parent's) and starts
        counting. The forwards until :meth:`stop_profile` are profiled."""
        if self._counter is not None:
            self.stop_profile()
        ignore = tuple(ignore_list or ())
        self.reset_profile()
        for module in self.model.modules():
            if ignore and type(module) in ignore:
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter))
            # always_call: a forward that raises still closes its entry
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stops counting and removes the hooks; the counts stay readable."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset_profile(self) -> None:
        """Zeroes every module's counts (params are recounted)."""
        self.profiles = {}
        for module in self.model.modules():
            params = {id(p): logical_shape(p).numel() for p in module.parameters()}
            self.profiles[module] = ModuleProfile(params=sum(params.values()))

    def end_profile(self) -> None:
        """Stops profiling and drops the counts."""
        self.stop_profile()
        self.profiles = {}
        self.started = False

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        _synchronize()
        self.profiles[module].entered.append((self._counter.get_total_flops(), time.perf_counter()))

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        profile = self.profiles[module]
        if not profile.entered or self._counter is None:
            return
        _synchronize()
        flops, start = profile.entered.pop()
        if not profile.entered:  # a module called inside itself is counted once, at its outer call
            profile.duration += time.perf_counter() - start
            profile.flops += self._counter.get_total_flops() - flops
        profile.calls += 1

    # -- per module --------------------------------------------------------------------------
    def _profile(self, module: torch.nn.Module) -> ModuleProfile:
        if module not in self.profiles:
            raise RuntimeError(
                "no profile: call start_profile() and run the model's forward first (and end_profile() only after "
                "reading it)"
            )
        return self.profiles[module]

    def module_flops(self, module: torch.nn.Module) -> int:
        """FLOPs of `module`'s forwards, its submodules' included; a module
        never called itself (a ModuleList) sums its children."""
        profile = self._profile(module)
        if profile.calls:
            return profile.flops
        return sum(self.module_flops(child) for child in module.children())

    def module_macs(self, module: torch.nn.Module) -> int:
        return self.module_flops(module) // 2  # every op FlopCounterMode counts is 2 FLOPs per MAC

    def module_params(self, module: torch.nn.Module) -> int:
        """Parameters of `module` and its submodules, each counted once (at
        ZeRO stage 3, their whole shapes)."""
        return self._profile(module).params

    def module_duration(self, module: torch.nn.Module) -> float:
        """Seconds in `module`'s forwards; a module never called sums its children."""
        profile = self._profile(module)
        if profile.calls:
            return profile.duration
        return sum(self.module_duration(child) for child in module.children())

    # -- totals (DeepSpeed's names) ------------------------------------------------------------
    def get_total_flops(self, as_string: bool = False) -> int | str:
        flops = self.module_flops(self.model)
        return report.number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self.module_macs(self.model)
        return report.macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        duration = self.module_duration(self.model)
        return report.duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = self.module_params(self.model)
        return report.params_to_string(params) if as_string else params

    # -- the report --------------------------------------------------------------------------
    def model_profile_text(
        self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1, detailed: bool = True
    ) -> str:
        """The report :meth:`print_model_profile` prints, as a string."""
        if module_depth < -1:
            raise ValueError(f"module_depth = {module_depth}: must be >= 0, or -1 for every depth")
        if top_modules < 1:
            raise ValueError(f"top_modules = {top_modules}: must be >= 1")
        lines = report.summary(self, profile_step)
        lines += report.aggregated(self, module_depth, top_modules)
        if detailed:
            lines += report.detailed(self, module_depth)
        lines.append("-" * 78)
        return "\n".join(lines) + "\n"

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | os.PathLike | None = None,
    ) -> None:
        """Prints the summary, the top `top_modules` module types at each
        depth to `module_depth` (-1: every depth) and, when `detailed`, the
        module tree with each module's profile, to stdout or to
        `output_file` (overwritten; its folder is made)."""
        if not self.started:  # DeepSpeed returns silently here
            raise RuntimeError(
                "print_model_profile: nothing was profiled; call start_profile() and run a forward first "
                "(and end_profile() only after printing)"
            )
        text = self.model_profile_text(profile_step, module_depth, top_modules, detailed)
        if output_file:
            path = Path(output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        else:
            print(text, end="", flush=True)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Prints the top `top_modules` module types by params, MACs and
        latency at each depth to `module_depth`."""
        print("\n".join(report.aggregated(self, module_depth, top_modules)[1:]), flush=True)


def get_model_profile(
    model: torch.nn.Module,
    input_shape: tuple | None = None,
    args: list = [],  # noqa: B006 (DeepSpeed's signature; never mutated)
    kwargs: dict = {},  # noqa: B006
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | os.PathLike | None = None,
    ignore_modules: Iterable[type] | None = None,
    mode: str = "forward",
) -> tuple:
    """DeepSpeed's ``get_model_profile``: runs `warm_up` unprofiled calls,
    then one profiled call of `model` (in eval mode) on `args`/`kwargs`, or on
    one tensor of ones of `input_shape` (the model's dtype and device), with
    ``model(...)`` (`mode` ``"forward"``) or ``model.generate(...)``
    (``"generate"``). Returns ``(flops, macs, params)``, as strings such as
    ``"1.2 G"`` when `as_string`; prints the report (to `output_file` if
    given) when `print_profile`."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode = {mode!r}: must be 'forward' or 'generate'")
    if mode == "generate" and not callable(getattr(model, "generate", None)):
        raise ValueError(f"get_model_profile: mode 'generate' needs model.generate, which {type(model).__name__} lacks")
    if not isinstance(warm_up, int) or warm_up < 0:
        raise ValueError(f"get_model_profile: warm_up = {warm_up!r}: must be an integer >= 0")
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise TypeError(f"get_model_profile: input_shape = {input_shape!r}: must be a non-empty tuple")
        param = next(model.parameters(), None)
        where = dict(dtype=param.dtype, device=param.device) if param is not None else {}
        args = [torch.ones(input_shape, **where)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the model")
    call = model.generate if mode == "generate" else model
    model.eval()
    for _ in range(warm_up):
        call(*args, **kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        call(*args, **kwargs)
    finally:
        prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    prof.end_profile()
    if as_string:
        return report.number_to_string(flops), report.macs_to_string(macs), report.params_to_string(params)
    return flops, macs, params
