"""The flops profiler's report, in DeepSpeed's layout (v0.16's
``print_model_profile``): the summary, the top module types at each depth,
and the module tree with each module's profile. Numbers are written as
DeepSpeed writes them (``number_to_string``: 2 decimals, K/M/G/T units), so
tools that read its reports read these."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

PRECISION = 2  # DeepSpeed's DEFAULT_PRECISION
LINE = "{:<70}  {:<8}"  # DeepSpeed's summary line: label, value

NOTATIONS = """Notations:
data parallel size (dp_size), model parallel size(mp_size),
number of parameters (params), number of multiply-accumulate operations(MACs),
number of floating-point operations (flops), floating-point operations per second (FLOPS),
fwd latency (forward propagation latency), bwd latency (backward propagation latency),
step (weights update latency), iter latency (sum of fwd, bwd and step latency)
"""

DETAILED_NOTE = [
    "Each module profile is listed after its name in the following order: ",
    "params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd "
    "latency, fwd FLOPS",
    "",
    "Note: 1. Ops a module runs itself (not through a submodule) count in its own profile: they make up the "
    "difference between a parent's MACs (or latency) and the sum of its submodules'.",
    "2. Number of floating-point operations is a theoretical estimation (torch.utils.flop_counter: matmuls, "
    "convolutions and attention; elementwise ops count 0), thus FLOPS computed using that could be larger than the "
    "maximum system throughput.",
    "3. The fwd latency listed in the top module's profile is measured at the module's forward, thus it does not "
    "include the engine's input casting.",
    "",
]


def number_to_string(num: float, units: str | None = None, precision: int = PRECISION) -> str:
    """``1234567`` -> ``"1.23 M"`` (DeepSpeed's format: a space, then the unit, if any)."""
    scales = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}
    if units is None:
        if num >= 1 or num == 0:
            units = next(u for u in ("T", "G", "M", "K", "") if num >= scales[u] or u == "")
        else:
            units = "m" if num >= 1e-3 else "u"
    return f"{round(num / scales.get(units, 1.0), precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = PRECISION) -> str:
    """Params say B (billions), not G."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


def _per_second(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def summary(prof: Any, profile_step: int) -> list[str]:
    """The header and the totals; with an engine, its sizes, and with the
    backward and step latencies measured, DeepSpeed's fwd+bwd estimates:
    backward = ``(2 + recompute_fwd_factor) x`` the forward's FLOPs."""
    engine = prof.ds_engine
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    fwd = prof.get_total_duration()
    mp_size = getattr(engine, "mp_world_size", 1)  # the tensor-parallel size: each rank holds 1/mp of split layers
    out = ["", "-" * 26 + " fastzero Flops Profiler " + "-" * 26, f"Profile Summary at step {profile_step}:"]
    out += NOTATIONS.split("\n")
    if engine is not None:
        out.append(LINE.format("world size: ", engine.world_size))
        out.append(LINE.format("data parallel size: ", engine.dp_world_size))
        out.append(LINE.format("model parallel size: ", mp_size))
        out.append(LINE.format("batch size per GPU: ", engine.train_micro_batch_size_per_gpu()))
    out.append(LINE.format("params per GPU: ", params_to_string(params)))
    out.append(LINE.format("params of model = params per GPU * mp_size: ", params_to_string(params * mp_size)))
    out.append(LINE.format("fwd MACs per GPU: ", macs_to_string(macs)))
    out.append(LINE.format("fwd flops per GPU: ", number_to_string(flops)))
    out.append(LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp_size)))
    out.append(LINE.format("fwd latency: ", duration_to_string(fwd)))
    out.append(
        LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(_per_second(flops, fwd)))
    )
    bwd, step = prof.backward_latency, prof.step_latency
    if bwd is not None and step is not None:
        factor = 2 + prof.recompute_fwd_factor
        iteration = fwd + bwd + step
        out.append(LINE.format("bwd latency: ", duration_to_string(bwd)))
        out.append(
            LINE.format(
                f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                flops_to_string(_per_second(factor * flops, bwd)),
            )
        )
        out.append(
            LINE.format(
                f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                flops_to_string(_per_second((factor + 1) * flops, fwd + bwd)),
            )
        )
        out.append(LINE.format("step latency: ", duration_to_string(step)))
        out.append(LINE.format("iter latency: ", duration_to_string(iteration)))
        out.append(
            LINE.format(
                f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
                flops_to_string(_per_second((factor + 1) * flops, iteration)),
            )
        )
        if engine is not None:
            samples = engine.train_micro_batch_size_per_gpu() * engine.dp_world_size
            out.append(LINE.format("samples/second: ", round(_per_second(samples, iteration), PRECISION)))
    return out


def _depth_limit(prof: Any, module_depth: int) -> int:
    """The deepest depth shown (the model is depth 0): `module_depth`, or
    the model's deepest for -1. DeepSpeed's loop stops one depth short of
    the one it is given; this shows it."""

    def deepest(m: torch.nn.Module) -> int:
        return 1 + max((deepest(c) for c in m.children()), default=-1)

    most = deepest(prof.model)
    return most if module_depth == -1 else min(module_depth, most)


def aggregated(prof: Any, module_depth: int, top_modules: int) -> list[str]:
    """At each depth, the `top_modules` module types with the most params,
    MACs and forward latency (summed over the modules of that type there)."""
    per_depth: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))

    def walk(module: torch.nn.Module, depth: int) -> None:
        totals = per_depth[depth][type(module).__name__]
        totals[0] += prof.module_params(module)
        totals[1] += prof.module_macs(module)
        totals[2] += prof.module_duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(prof.model, 0)
    out = [
        "",
        "-" * 29 + " Aggregated Profile per GPU " + "-" * 29,
        f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:",
    ]
    for depth in range(_depth_limit(prof, module_depth) + 1):
        types = per_depth[depth]
        out.append(f"depth {depth}:")
        out.append(f"    params      - {_top(types, 0, top_modules, params_to_string)}")
        out.append(f"    MACs        - {_top(types, 1, top_modules, macs_to_string)}")
        out.append(f"    fwd latency - {_top(types, 2, top_modules, duration_to_string)}")
    return out


def _top(types: dict[str, list], i: int, k: int, fmt) -> dict[str, str]:
    """The `k` module types with the largest value `i`, largest first (DeepSpeed prints the dict)."""
    return {name: fmt(v[i]) for name, v in sorted(types.items(), key=lambda kv: kv[1][i], reverse=True)[:k]}


def module_line(prof: Any, module: torch.nn.Module) -> str:
    """One module's profile, as DeepSpeed writes it into the model's repr:
    params, % params, MACs, % MACs, latency, % latency, FLOPS."""
    total_params, total_macs = prof.get_total_params(), prof.get_total_macs()
    total_duration = prof.get_total_duration()
    params, macs, duration = prof.module_params(module), prof.module_macs(module), prof.module_duration(module)
    share = lambda part, whole: round(100 * part / whole, PRECISION) if whole else 0  # noqa: E731
    return ", ".join(
        [
            f"{params_to_string(params)} = {share(params, total_params):g}% Params",
            f"{macs_to_string(macs)} = {share(macs, total_macs):g}% MACs",
            f"{duration_to_string(duration)} = {share(duration, total_duration):g}% latency",
            flops_to_string(round(_per_second(prof.module_flops(module), duration), PRECISION)),
        ]
    )


def detailed(prof: Any, module_depth: int) -> list[str]:
    """The module tree to `module_depth`, laid out as ``print(model)``, with
    each module's profile before its own extra repr."""
    limit = _depth_limit(prof, module_depth)
    out = ["", "-" * 30 + " Detailed Profile per GPU " + "-" * 30]
    out += DETAILED_NOTE

    def walk(module: torch.nn.Module, name: str, depth: int) -> None:
        pad = "  " * depth
        head = f"{pad}({name}): " if name else pad
        body = ", ".join(s for s in (module_line(prof, module), module.extra_repr()) if s)
        children = list(module.named_children()) if depth < limit else []
        if not children:
            out.append(f"{head}{type(module).__name__}({body})")
            return
        out.append(f"{head}{type(module).__name__}(")
        out.append(f"{pad}  {body}")
        for child_name, child in children:
            walk(child, child_name, depth + 1)
        out.append(f"{pad})")

    walk(prof.model, "", 0)
    return out
