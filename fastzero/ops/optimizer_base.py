"""The base of fastzero's Adam-family optimizers (CPUAdam, FusedAdam,
FusedLamb): gathering a group's tensors, the per-group step counter, loss
scaling inputs, fp32 master weights, torch.optim-compatible state dicts, and
the dispatch of one group's lists to the backend its family's registry picks
(fastzero.ops.backend). A subclass names its family, its hyperparameters and,
where it has them, the extra device arguments and results of a step."""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fastzero.checks import STATE_FORMATS, check_optimizer_lists, check_same_size, check_state_format, check_tensor
from fastzero.native import DTYPE_CODES
from fastzero.ops.adam import state_formats
from fastzero.ops.adam.int8_codes import DEFAULT_BLOCK
from fastzero.ops.backend import Family
from fastzero.ops.hyperparams import Hyperparams

_DTYPES = frozenset(DTYPE_CODES)
HOST_BACKENDS = ("cpu", "reference")  # step as an int, loss scale as a float; the others read device tensors
log = logging.getLogger(__name__)


def resolve_state_format(
    owner: str,
    supported: tuple[str, ...],
    state_format: str | None,
    fp32_optimizer_states: bool | None,
    seed: int | None,
    block_size: int | None = None,
    bf16_stochastic_round: bool = False,
) -> tuple[str, int | None, int | None]:
    """(state format, seed, block size) of an optimizer from its keywords.

    ``fp32_optimizer_states`` is DeepSpeed's yes/no: True (or not given) is
    ``"fp32"``, False is ``"param_dtype"`` (the param's dtype, rounded to
    nearest). ``state_format`` names the format; given both, they must agree
    on whether the states are fp32 (True only with ``"fp32"``, False only with
    another format). ``seed`` (default 0) only with ``"bf16"``, ``"int8"`` or
    ``bf16_stochastic_round``, which round stochastically; ``block_size``
    (default 256) only with ``"int8"``."""
    if fp32_optimizer_states is not None and not (
        isinstance(fp32_optimizer_states, bool) or fp32_optimizer_states in (0, 1)
    ):
        raise TypeError(f"{owner}: fp32_optimizer_states must be True or False, got {fp32_optimizer_states!r}")
    if state_format is None:
        fmt = "param_dtype" if fp32_optimizer_states is not None and not fp32_optimizer_states else "fp32"
    else:
        if state_format not in STATE_FORMATS:
            raise ValueError(f"{owner}: state_format={state_format!r}; known: {', '.join(map(repr, STATE_FORMATS))}")
        if fp32_optimizer_states is not None and bool(fp32_optimizer_states) != (state_format == "fp32"):
            raise ValueError(
                f"{owner}: fp32_optimizer_states={bool(fp32_optimizer_states)} contradicts "
                f"state_format={state_format!r}; pass one of them (fp32_optimizer_states=True is "
                "state_format='fp32', False is 'param_dtype')"
            )
        fmt = state_format
    if fmt not in supported:
        raise ValueError(
            f"{owner}: state_format={fmt!r} is not implemented here; it writes {', '.join(map(repr, supported))} "
            "(bf16 and int8 states are Adam's: CPUAdam, FusedAdam)"
        )
    check_state_format(owner, fmt, seed, block_size, bf16_stochastic_round)
    seed = (0 if seed is None else seed) if fmt in ("bf16", "int8") or bf16_stochastic_round else None
    return fmt, seed, ((DEFAULT_BLOCK if block_size is None else block_size) if fmt == "int8" else None)


@dataclass
class GroupLists:
    """One param group's tensors on one device, ready for a functional step.
    With master weights, ``params`` are the fp32 masters and ``param_copies``
    the model's low-precision params, written in the same pass."""

    device: torch.device
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    exp_avg_absmax: list[Tensor] = field(default_factory=list)  # int8 states: their block scales
    exp_avg_sq_absmax: list[Tensor] = field(default_factory=list)
    param_copies: list[Tensor] | None = None
    staged: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (param, contiguous copy) to write back
    resized: bool = False  # some tensor's size differs from its param's: the full checks name it


class LossScaleViews:
    """The fp16 loss scale where DeepSpeed scripts read it: on the optimizer
    (``cur_scale``, ``loss_scale``, ``dynamic_loss_scale``, ``cur_iter``,
    ``scale_window``, as DeepSpeed's fp16 and ZeRO optimizers have them),
    and ``overflow``, whether the engine skipped its last step.
    Views of the scaler the engine attaches as ``loss_scaler``; without one
    (fp32/bf16, or an optimizer used on its own) the scale is 1 and static.
    The scaler stays the source of truth: setting ``loss_scale`` sets it."""

    loss_scaler: Any = None  # fastzero.runtime.loss_scaler's, set by the engine under fp16
    overflow: bool = False  # the engine's last step was skipped for a non-finite gradient (DeepSpeed's name)

    @property
    def cur_scale(self) -> float:
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        if self.loss_scaler is None:
            raise AttributeError("there is no loss scaler to set (fp16 is not enabled): the scale stays 1")
        self.loss_scaler.loss_scale = float(value)

    loss_scale = cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaler is not None and hasattr(self.loss_scaler, "scale_window")

    def _dynamic(self, name: str) -> Any:
        if not self.dynamic_loss_scale:
            raise AttributeError(f"{name}: the loss scale is static here (only a dynamic fp16 loss scaler has one)")
        return getattr(self.loss_scaler, name)

    @property
    def cur_iter(self) -> int:
        return self._dynamic("cur_iter")

    @property
    def scale_window(self) -> int:
        return self._dynamic("scale_window")


class AdamFamilyOptimizer(LossScaleViews, torch.optim.Optimizer):
    """State: per param ``exp_avg``, ``exp_avg_sq`` in the optimizer's
    ``state_format`` (:func:`resolve_state_format`): ``"fp32"``;
    ``"param_dtype"`` (``fp32_optimizer_states=False``: the param's dtype, or
    fp32 where a master copy is kept); ``"bf16"`` (families that list it in
    ``state_formats``: bf16 whatever the param, written with stochastic
    rounding keyed by ``seed``, the step and the element's index); ``"int8"``
    (Adam: uint8 codes, with ``exp_avg_absmax`` and ``exp_avg_sq_absmax``, one
    fp32 scale per ``block_size`` elements; :mod:`fastzero.ops.adam.int8_codes`).
    With ``master_weights``, ``master_param`` (fp32) for bf16/fp16 params. The step
    ``t`` is counted per param group in ``group["step"]``: a Python int for
    CPU groups, a 0-d fp32 tensor on the device for GPU groups (so that a
    step skipped on ``found_inf`` is undone on the device, without a sync).
    ``state_dict()`` writes a per-param ``step`` as torch.optim does, so
    torch.optim.Adam/AdamW, CPUAdam, FusedAdam and FusedLamb load each other's.
    ``state[p]["step"]`` is there too, as torch.optim and DeepSpeedCPUAdam keep
    it, for every param that has state after a step or a load: a 0-d fp32
    tensor that *is* the group's counter (GPU groups) or is refreshed from it
    after each step (CPU groups: one tensor per group, shared by its params).
    The group's counter stays the source of truth.

    Loss scaling: ``step(grad_scale=..., found_inf=...)`` or, as
    ``torch.amp.GradScaler`` does for optimizers that declare
    ``_step_supports_amp_scaling``, the attributes ``grad_scale`` and
    ``found_inf``. Grads are divided by ``grad_scale`` inside the kernel; when
    ``found_inf`` is nonzero nothing changes and the step does not count.

    ``state_dict()`` also records ``"state_format"``: ``{"format", "seed"}``
    (and ``"block_size"`` for int8).
    :meth:`load_state_dict` converts states saved in another format (or by
    torch.optim) to this optimizer's, and logs that it did.
    """

    _step_supports_amp_scaling = True
    state_formats: tuple[str, ...] = ("fp32", "param_dtype")  # the formats the family's kernels write
    group_steps = True  # state[p]["step"] mirrors group["step"] (checkpoints keep the group's counter only)
    family: Family  # the kernel family's backends
    hyperparams: type[Hyperparams]
    _device_hint = ""
    _device_types = ("cpu", "cuda")  # the devices whose params it updates

    def __init__(
        self,
        params,
        hp: Hyperparams,
        *,
        fp32_optimizer_states: bool | None = None,
        master_weights: bool = False,
        backend: str | None = None,
        state_format: str | None = None,
        seed: int | None = None,
        block_size: int | None = None,
        bf16_stochastic_round: bool = False,
    ) -> None:
        owner = type(self).__name__
        if bf16_stochastic_round and master_weights:
            raise ValueError(
                f"{owner}: bf16_stochastic_round=True writes bf16 params without an fp32 master, and "
                "master_weights=True keeps one; pick one (the master keeps every bit, stochastic rounding "
                "saves its 4 bytes per param)"
            )
        if bf16_stochastic_round and "bf16" not in self.state_formats:
            raise ValueError(f"{owner}: bf16_stochastic_round is Adam's (CPUAdam, FusedAdam)")
        fmt, seed, block_size = resolve_state_format(
            owner, self.state_formats, state_format, fp32_optimizer_states, seed, block_size, bf16_stochastic_round
        )
        super().__init__(params, {**hp.group_defaults(), "amsgrad": False})
        self.state_format = fmt
        self.seed = seed  # stochastic rounding's (bf16 and int8 states, bf16_stochastic_round), else None
        self.block_size = block_size  # int8 states' scale blocks, else None
        self.bf16_stochastic_round = bool(bf16_stochastic_round)  # bf16 params written with stochastic rounding
        self.fp32_optimizer_states = fmt == "fp32"  # DeepSpeed's attribute
        self.master_weights = master_weights
        self.force_backend = backend  # None: FASTZERO_BACKEND, else the fastest here
        self.last_backend: str | None = None
        self._checked: dict[int, tuple] = {}  # per group: the param set whose lists passed the full checks
        self._host_steps: dict[int, Tensor] = {}  # per CPU group: the tensor its params' state["step"] is

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's, then this family's checks of the group's
        hyperparameters (a group dict with ``lr="1e-3"`` fails here, naming
        the group and the field, not at the first step)."""
        index = len(self.param_groups)
        super().add_param_group(param_group)
        try:
            self.hyperparams.from_group(self.param_groups[-1])
        except (TypeError, ValueError) as exc:
            self.param_groups.pop()
            raise type(exc)(f"param group {index}: {exc}") from None

    @property
    def backend(self) -> str:
        """The backend a step runs for the first param's device."""
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return "none" if first is None else self.family.choose(first.device.type, self.force_backend).backend

    # -- what subclasses may provide --------------------------------------------
    def _device_extra(self, gi: int, lists: GroupLists) -> dict:
        """Extra arguments of the device backends (FusedLamb's trust-ratio tensor)."""
        return {}

    def _keep(self, gi: int, result) -> None:
        """What to keep of a step's result (FusedLamb's trust ratios)."""

    # -- the step ---------------------------------------------------------------
    def _state_dtype(self, p: Tensor) -> torch.dtype:
        return state_formats.state_dtype(self.state_format, p, self._uses_master(p))

    def _format_args(self, lists: GroupLists) -> dict:
        """The state format's arguments of a functional step (bf16 and int8
        states, bf16 params written with stochastic rounding)."""
        args = {"bf16_stochastic_round": True, "seed": self.seed} if self.bf16_stochastic_round else {}
        if self.state_format == "bf16":
            args.update(state_format="bf16", seed=self.seed)
        elif self.state_format == "int8":
            args.update(
                state_format="int8",
                seed=self.seed,
                exp_avg_absmax=lists.exp_avg_absmax,
                exp_avg_sq_absmax=lists.exp_avg_sq_absmax,
                block_size=self.block_size,
            )
        return args

    def _uses_master(self, p: Tensor) -> bool:
        return self.master_weights and p.dtype != torch.float32

    def _step_inputs(self, closure, grad_scale, found_inf) -> tuple[Any, Any, Any]:
        """(the closure's loss, grad_scale, found_inf): the arguments, else
        what torch.amp.GradScaler set as attributes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        return loss, grad_scale, found_inf

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float | Tensor | None = None, found_inf: float | Tensor | None = None):
        loss, grad_scale, found_inf = self._step_inputs(closure, grad_scale, found_inf)
        if found_inf is not None and not isinstance(found_inf, Tensor):
            found_inf = torch.tensor(float(found_inf))
        for gi, group in enumerate(self.param_groups):
            if group.get("amsgrad", False):
                raise ValueError(f"param group {gi} sets amsgrad=True; {type(self).__name__} does not implement it")
            hp = self.hyperparams.from_group(group)  # read every step: a scheduler may change lr
            lists = self._gather(gi, group)
            if lists is None:
                continue
            if lists.device.type == "cpu":
                if found_inf is not None and bool(found_inf):
                    continue  # skipped: nothing changes, the step does not count
                group["step"] = int(group.get("step", 0)) + 1
                step = group["step"]
            else:
                step = self._device_step(group, lists.device)
                step.add_(1)
            self._update(gi, hp, lists, step, grad_scale, found_inf)
            if lists.device.type != "cpu" and found_inf is not None:
                step.sub_((found_inf.to(step.device) != 0).to(torch.float32))  # NaN counts as set, as in the kernels
            for p, data in lists.staged:
                p.detach().copy_(data)
            self._publish_step(gi, group)
        return loss

    def _publish_step(self, gi: int, group: dict) -> None:
        """``state[p]["step"]`` of the group's params: its counter (the
        device tensor itself, or the group's host tensor set to it)."""
        step = group.get("step", 0)
        if isinstance(step, Tensor):
            view = step
        else:
            view = self._host_steps.get(gi)
            if view is None:
                view = self._host_steps[gi] = torch.zeros((), dtype=torch.float32)
            view.fill_(float(step))
        for p in group["params"]:
            state = self.state.get(p)
            if state and state.get("step") is not view:
                state["step"] = view

    def sync_steps(self) -> None:
        """``state[p]["step"]`` from every group's counter (after the counter
        was set from outside, as a checkpoint load does)."""
        for gi, group in enumerate(self.param_groups):
            self._publish_step(gi, group)

    def _update(self, gi: int, hp: Hyperparams, lists: GroupLists, step, grad_scale, found_inf) -> None:
        """One step of one group on one device, on the backend the family
        picks. ``step`` is the int (CPU) or the device tensor (GPU) already
        advanced to this step's t."""
        self._check_lists(gi, lists)
        backend = self.family.choose(lists.device.type, self.force_backend).backend
        self.last_backend = backend
        run = self.family.impl(backend)
        tensors = (lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs)
        fmt = self._format_args(lists)
        if backend in HOST_BACKENDS:
            if found_inf is not None and lists.device.type != "cpu" and bool(found_inf):
                return  # the reference on a GPU: a host sync, the fallback's price
            scale = None if grad_scale is None else float(grad_scale)
            step = int(step)
            self._keep(gi, run(*tensors, step=step, hp=hp, grad_scale=scale, param_copies=lists.param_copies, **fmt))
            return
        device = lists.device
        run(
            *tensors,
            step=step if isinstance(step, Tensor) else torch.tensor(float(step), device=device),
            hp=hp,
            grad_scale=as_device_scalar(grad_scale, device),
            found_inf=as_device_scalar(found_inf, device),
            param_copies=lists.param_copies,
            **fmt,
            **self._device_extra(gi, lists),
        )

    def _check_lists(self, gi: int, lists: GroupLists) -> None:
        """The full checks of every tensor the kernels touch, once per param
        set: again when a param or a state tensor is replaced, or when
        :meth:`_gather`'s per-step size comparison finds a mismatch (a param
        resized through ``p.data``, a grad of another size: torch checks a
        grad's shape only when it is assigned)."""
        key = (
            tuple(map(id, lists.params)),
            tuple(map(id, lists.exp_avgs)),
            tuple(map(id, lists.exp_avg_sqs)),
            tuple(map(id, lists.exp_avg_absmax)),
            tuple(map(id, lists.exp_avg_sq_absmax)),
        )
        if not lists.resized and self._checked.get(gi) == key:
            return
        if lists.device.type not in self._device_types:
            raise ValueError(
                f"param group {gi} is on {lists.device}; {type(self).__name__} updates "
                f"{' and '.join(self._device_types)} tensors{self._device_hint}"
            )
        check_optimizer_lists(
            type(self).__name__,
            lists.params,
            lists.grads,
            lists.exp_avgs,
            lists.exp_avg_sqs,
            lists.param_copies,
            device_type=lists.device.type,
            hint=self._device_hint,
            state_format=self.state_format if self.state_format in ("bf16", "int8") else None,
            exp_avg_absmax=lists.exp_avg_absmax if self.state_format == "int8" else None,
            exp_avg_sq_absmax=lists.exp_avg_sq_absmax if self.state_format == "int8" else None,
            block_size=self.block_size,
        )
        self._checked[gi] = key

    def _device_step(self, group: dict, device: torch.device) -> Tensor:
        step = group.get("step", 0)
        if not isinstance(step, Tensor) or step.device != device:
            step = torch.tensor(float(step), dtype=torch.float32, device=device)
            group["step"] = step
        return step

    def _gather(self, gi: int, group: dict) -> GroupLists | None:
        """The group's params that have grads, with their states (created on
        first use). Only what torch does not already guarantee (a grad's shape
        and device match its param's) is checked per param; any doubt falls
        through to the full checks for a precise error. This loop is what a
        step with hundreds of tensors pays in Python: keep it lean."""
        lists = None
        for pi, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if lists is None:
                lists = GroupLists(p.device)
            if not (p.dtype in _DTYPES and g.dtype in _DTYPES and g.layout == torch.strided):
                what = f"param {pi} of group {gi}"
                check_tensor(p, what, device_type=p.device.type, hint=self._device_hint)
                check_tensor(g, f"the grad of {what}", device_type=p.device.type, hint=self._device_hint)
            if p.device != lists.device:
                raise ValueError(
                    f"param group {gi} mixes devices ({lists.device} and {p.device} at param {pi}); "
                    f"put each device's params in a group of its own"
                )
            state = self.state[p]
            if not state:
                self._init_state(p, state)
            if "master_param" in state:
                if lists.param_copies is None:
                    if lists.params:
                        raise ValueError(
                            f"param group {gi} mixes fp32 and low-precision params with master_weights=True; "
                            "put them in separate groups"
                        )
                    lists.param_copies = []
                lists.param_copies.append(p if p.is_contiguous() else self._stage(lists, p))
                params_entry = state["master_param"]
            else:
                if lists.param_copies is not None:
                    raise ValueError(
                        f"param group {gi} mixes fp32 and low-precision params with master_weights=True; "
                        "put them in separate groups"
                    )
                params_entry = p if p.is_contiguous() else self._stage(lists, p)
            m, n = state["exp_avg"], p.numel()
            if g.numel() != n or m.numel() != n:  # a param resized through .data, or a grad of another size
                lists.resized = True  # (a replaced state tensor changes _check_lists' key instead)
            lists.params.append(params_entry)
            lists.grads.append(g if g.is_contiguous() else g.contiguous())
            lists.exp_avgs.append(m)
            lists.exp_avg_sqs.append(state["exp_avg_sq"])
            if self.state_format == "int8":
                lists.exp_avg_absmax.append(state["exp_avg_absmax"])
                lists.exp_avg_sq_absmax.append(state["exp_avg_sq_absmax"])
        return lists

    @staticmethod
    def _stage(lists: GroupLists, p: Tensor) -> Tensor:
        data = p.detach().contiguous()
        lists.staged.append((p, data))
        return data

    def init_state(self, p: Tensor) -> dict:
        """The state of `p`, created now if it has none (zeros, and the fp32
        master copy where master weights are kept), as a step would create it."""
        state = self.state[p]
        if not state:
            self._init_state(p, state)
        return state

    def _init_state(self, p: Tensor, state: dict) -> None:
        state.update(state_formats.new_state(self.state_format, p, master=self._uses_master(p), block=self.block_size))
        if self._uses_master(p):
            state["master_param"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format).clone()

    # -- state dicts --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout: per-param ``step`` (a float32 tensor),
        ``exp_avg``, ``exp_avg_sq`` (and ``master_param``), so torch.optim.AdamW
        can load it (not int8 states: their codes are bytes, see
        :meth:`load_state_dict`); and ``"state_format"``: ``{"format": ...,
        "seed": ...}`` (int8: and ``"block_size"``; torch.optim ignores it)."""
        sd = super().state_dict()
        sd["state_format"] = {"format": self.state_format, "seed": self.seed}
        if self.state_format == "int8":
            sd["state_format"]["block_size"] = self.block_size
        for group in sd["param_groups"]:
            step = float(group.get("step", 0))
            group["step"] = step
            for pid in group["params"]:
                if pid in sd["state"]:
                    rest = {k: v for k, v in sd["state"][pid].items() if k != "step"}  # not the shared counter
                    sd["state"][pid] = {"step": torch.tensor(step), **rest}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of CPUAdam, FusedAdam, FusedLamb or
        torch.optim.Adam/AdamW. A state dict of another model is refused
        before anything changes.

        The states take this optimizer's format: saved in another one they
        are converted through fp32 (fp32 -> bf16 rounded to nearest, bf16 ->
        fp32 exactly, int8 decoded, to int8 encoded with fresh block scales,
        int8 of another block size decoded and encoded again) and the log
        says so (a warning where bits are lost, else info). An optimizer that
        rounds stochastically takes the saved seed of one that did, so that a
        resumed run rounds as the uninterrupted one would have; int8 states
        of the same block size are taken as they are (to the bit)."""
        saved_format = _saved_format(state_dict.get("state_format"))
        saved_fmt = saved_format["format"] if saved_format else None
        saved_block = saved_format.get("block_size") if saved_fmt == "int8" else None
        state_dict = {k: v for k, v in state_dict.items() if k != "state_format"}
        saved_state = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        pairs = []  # (group index, param, saved state)
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            for pi, (pid, p) in enumerate(zip(saved["params"], group["params"])):
                if pid not in saved_state:
                    continue
                src = saved_state[pid]
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in src:
                        raise ValueError(
                            f"the saved state of param {pi} of group {gi} has no {key!r} (it has {sorted(src)}); "
                            "it was not saved by an Adam-family optimizer"
                        )
                    check_same_size(src[key], p, f"saved {key} of param {pi} of group {gi}", "the param")
                if saved_fmt == "int8":
                    _check_saved_int8(src, p, saved_block, f"param {pi} of group {gi}")
                pairs.append((gi, p, src))
        super().load_state_dict(state_dict)  # checks group and param counts
        # torch.optim casts states to the param dtype; take them again from the
        # saved tensors in our state format (fp32 states of bf16 params stay fp32).
        steps: dict[int, list[float]] = defaultdict(list)
        converted: Counter = Counter()  # (saved, ours, exact) -> tensors
        for gi, p, src in pairs:
            state = self.state[p]
            master = self._uses_master(p)
            for key in state_formats.SCALE_KEYS:
                state.pop(key, None)
            if "int8" in (saved_fmt, self.state_format) and (saved_fmt, saved_block) != (
                self.state_format,
                self.block_size,
            ):
                m32, v32 = state_formats.to_fp32(saved_fmt or "fp32", src, saved_block)
                state.update(
                    state_formats.from_fp32(self.state_format, m32, v32, p, master=master, block=self.block_size)
                )
                saved_what = (
                    state_formats.describe("int8", saved_block) if saved_fmt == "int8" else _name(src["exp_avg"].dtype)
                )
                ours = state_formats.describe("int8", self.block_size)
                if self.state_format != "int8":
                    ours = _name(state["exp_avg"].dtype)
                converted[(saved_what, ours, self.state_format == "fp32")] += 2
            else:
                dtype = self._state_dtype(p)
                for key in ("exp_avg", "exp_avg_sq"):
                    if src[key].dtype != dtype:
                        converted[(_name(src[key].dtype), _name(dtype), dtype == torch.float32)] += 1
                    state[key] = src[key].detach().to(device=p.device, dtype=dtype).contiguous()
                if self.state_format == "int8":
                    for key in state_formats.SCALE_KEYS:
                        state[key] = src[key].detach().to(device=p.device, dtype=torch.float32).contiguous()
            if master:
                source = src.get("master_param", p.detach())
                state["master_param"] = source.detach().to(device=p.device, dtype=torch.float32).contiguous()
            else:
                state.pop("master_param", None)
            step = state.pop("step", 0)
            steps[gi].append(float(step))
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            for key, value in self.defaults.items():  # torch.optim's groups lack our keys
                group.setdefault(key, value)
            if "step" in saved:
                group["step"] = int(float(saved["step"]))
            elif steps[gi]:
                group["step"] = int(max(steps[gi]))
        saved_seed = saved_format.get("seed") if saved_format else None
        if saved_seed is not None and self.seed is not None:  # both round stochastically: go on with its bits
            check_state_format(type(self).__name__, "bf16", saved_seed)
            self.seed = saved_seed
        self.sync_steps()
        if converted:
            self._log_conversion(saved_format, converted)

    def _log_conversion(self, saved_format: dict | None, converted: Counter) -> None:
        """The log's note of a load that converted states: a warning where bits
        were lost (to a 16-bit or 8-bit format), else info (to fp32, exact)."""
        how = ", ".join(
            f"{n} {a} -> {b} ({'exact' if exact else 'rounded to nearest'})"
            for (a, b, exact), n in sorted(converted.items(), key=str)
        )
        saved = f"state_format={saved_format['format']!r}" if saved_format else "no recorded state format"
        lossy = any(not exact for _, _, exact in converted)
        log.log(
            logging.WARNING if lossy else logging.INFO,
            "%s: converted the state dict's optimizer states (%s) to state_format=%r: %s",
            type(self).__name__,
            saved,
            self.state_format,
            how,
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _saved_format(record: Any) -> dict | None:
    """A state dict's ``state_format`` record, checked (None: not recorded)."""
    if record is None:
        return None
    known = isinstance(record, dict) and record.get("format") in STATE_FORMATS
    if not known:
        raise ValueError(
            f"the state dict's 'state_format' is {record!r}; expected "
            "{'format': one of " + ", ".join(map(repr, STATE_FORMATS)) + ", 'seed': int or None}"
        )
    if record["format"] == "int8":
        check_state_format("the state dict's state_format", "int8", None, record.get("block_size"))
        if record.get("block_size") is None:
            raise ValueError(f"the state dict's 'state_format' is {record!r}: int8 states need their 'block_size'")
    return record


def _check_saved_int8(src: dict, p: Tensor, block: int, what: str) -> None:
    """A saved int8 state: uint8 codes and fp32 block scales of the right counts."""
    for key in ("exp_avg", "exp_avg_sq"):
        if src[key].dtype != torch.uint8:
            raise ValueError(f"the saved {key} of {what} is {src[key].dtype}; int8 states are uint8 codes")
    blocks = -(-p.numel() // block)
    for key in state_formats.SCALE_KEYS:
        t = src.get(key)
        if not isinstance(t, Tensor) or t.numel() != blocks:
            got = "missing" if not isinstance(t, Tensor) else f"{t.numel()} elements"
            raise ValueError(
                f"the saved {key} of {what} is {got}; int8 states of {p.numel()} elements in blocks of {block} "
                f"have {blocks} scales"
            )


def as_device_scalar(x: float | Tensor | None, device: torch.device) -> Tensor | None:
    """A 0-d fp32 tensor on `device` (a GradScaler's scale is one already)."""
    if x is None:
        return None
    if isinstance(x, Tensor):
        return x.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(x), dtype=torch.float32, device=device)
